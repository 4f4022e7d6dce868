"""gather_small / max_small: tiny collectives in one round, against torch.distributed's own
allgather and MAX allreduce on the same values."""

import math

import pytest
import torch

import bagua_comm as bc
from bagua_comm.testing import run_ranks


def _values(rank):
    # distinct per rank, with signs, an infinity and a NaN-free tie
    return [float(rank) - 1.5, -float(rank) ** 2, math.inf if rank == 1 else 3.0, 7.0]


def _both_ways():
    import torch.distributed as dist

    from bagua_algos._engine import small

    rank, size = bc.get_rank(), bc.get_world_size()
    calls = []
    real = {n: getattr(bc, n) for n in ("allgather", "allreduce_inplace", "batch_isend_irecv")}
    for name, fn in real.items():
        def counting(*a, _name=name, _fn=fn, **k):
            calls.append(_name)
            return _fn(*a, **k)
        setattr(bc, name, counting)
    try:
        words = torch.tensor([rank * 1000 + 7, -rank], dtype=torch.int64)
        rows = small.gather_small(words, bc.get_default_group())
        maxed = small.max_small(_values(rank), bc.get_default_group())
    finally:
        for name, fn in real.items():
            setattr(bc, name, fn)
    # torch's own collectives, the reference
    ref_rows = [torch.empty_like(words) for _ in range(size)]
    dist.all_gather(ref_rows, words)
    ref_max = torch.tensor(_values(rank), dtype=torch.float64)
    dist.all_reduce(ref_max, op=dist.ReduceOp.MAX)
    return {"rows": rows, "ref_rows": torch.stack(ref_rows), "max": maxed,
            "ref_max": ref_max.tolist(), "calls": calls}


@pytest.mark.parametrize("ranks", [2, 3])
def test_one_round_equals_torchs_allgather_and_max(ranks):
    for got in run_ranks(_both_ways, ranks, timeout=120):
        assert torch.equal(got["rows"], got["ref_rows"])
        assert got["max"] == got["ref_max"]
        # straight to every peer: one batch of point-to-point operations each, no ring
        assert got["calls"] == ["batch_isend_irecv", "batch_isend_irecv"], got["calls"]


def test_one_rank_needs_no_communication():
    from bagua_algos._engine.small import gather_small, max_small

    class One:
        size, rank, backend = 1, 0, "gloo"

    t = torch.tensor([3, 4])
    assert torch.equal(gather_small(t, One()), t.unsqueeze(0))
    assert max_small([1.0, -2.0], One()) == [1.0, -2.0]


def _broadcast_small(which):
    """broadcast_small of rank 1's object against bagua_comm's broadcast_object of the same,
    with bagua_comm's broadcasts counted."""
    from bagua_algos._engine import small

    group = bc.get_default_group()
    objs = {"small": {"step": 7, "t": torch.arange(5.0), "owed": [3, 1, 4]},
            "large": {"t": torch.arange(small.INLINE_BYTES // 4 + 3, dtype=torch.float32)},
            "unpicklable": {"f": lambda: 0}}
    obj = objs[which] if group.rank == 1 else None
    calls = []
    real = bc.broadcast

    def counting(t, *a, **kw):
        calls.append(t.numel())
        return real(t, *a, **kw)
    bc.broadcast = counting
    try:
        got = small.broadcast_small(obj, 1, group)
    except ValueError as err:
        return {"error": str(err)}
    finally:
        bc.broadcast = real
    ref = bc.broadcast_object(obj, 1, group=group)
    return {"got": got, "ref": ref, "calls": calls}


@pytest.mark.parametrize("ranks", [2, 3])
def test_broadcast_small_in_one_broadcast_equals_broadcast_object(ranks):
    from bagua_algos._engine.small import INLINE_BYTES

    for got in run_ranks(_broadcast_small, ranks, args=("small",), timeout=120):
        assert got["got"].keys() == got["ref"].keys()
        assert torch.equal(got["got"]["t"], got["ref"]["t"])
        assert (got["got"]["step"], got["got"]["owed"]) == (7, [3, 1, 4])
        # the size and the pickle in one buffer: one round, not two
        assert got["calls"] == [8 + INLINE_BYTES], got["calls"]


def test_broadcast_small_larger_than_its_buffer_takes_a_second_broadcast():
    from bagua_algos._engine.small import INLINE_BYTES

    for got in run_ranks(_broadcast_small, 2, args=("large",), timeout=120):
        assert torch.equal(got["got"]["t"], got["ref"]["t"])
        assert len(got["calls"]) == 2 and got["calls"][0] == 8 + INLINE_BYTES, got["calls"]


def test_broadcast_small_of_an_unpicklable_object_raises_on_every_rank():
    out = run_ranks(_broadcast_small, 2, args=("unpicklable",), timeout=120)
    assert all("cannot be pickled" in got.get("error", "") for got in out), out
