"""The exact tail of the compiled compressed allreduce (issue #46: bagua-algos' "got a
gradient" flags ride in ByteGrad's and QAdam's own exchange): each rank's float32 ``tail``
travels uncompressed at the end of its gathered row and is summed (averaged) in rank order,
in place, while the compressed part's result stays bit for bit that of a call without a tail;
2 and 3 ranks, padded and not; what cannot carry a tail gets no launcher."""

import pytest
import torch

import bagua_comm as bc
from bagua_comm._compressed import _inplace_launcher
from bagua_comm.compression import MinMaxUInt8
from bagua_comm.testing import run_ranks


def _tails(numel, live, op_name, calls):
    rank, world = bc.get_rank(), bc.get_world_size()
    op = getattr(bc.ReduceOp, op_name)
    comp = MinMaxUInt8(world)
    with_tail, without = torch.zeros(numel), torch.zeros(numel)
    tail = torch.zeros(5)
    fast = _inplace_launcher(with_tail, op, comp, None, live, tail)
    plain = _inplace_launcher(without, op, comp, None, live)
    bc.traffic.reset()
    got = []
    for call in range(calls):
        g = torch.Generator().manual_seed(31 * rank + call)
        x = torch.randn(numel, generator=g)
        with_tail.copy_(x)
        without.copy_(x)
        tail.copy_(torch.tensor([rank == 0, rank == 1, 1, 0, rank + call], dtype=torch.float32))
        fast().wait()
        plain().wait()
        got.append((with_tail.clone(), without.clone(), tail.clone()))
    return got, bc.traffic.bytes_sent("compressed_allreduce")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("numel, live", [(96, 96), (100, 97)])
@pytest.mark.parametrize("op_name", ["SUM", "AVG"])
def test_the_tail_is_reduced_exactly_and_changes_nothing_else(world, numel, live, op_name):
    results = run_ranks(_tails, world, args=(numel, live, op_name, 2), timeout=120)
    for call in range(2):
        want = torch.zeros(5)
        for r in range(world):              # every rank's tail, summed in rank order
            want += torch.tensor([r == 0, r == 1, 1, 0, r + call], dtype=torch.float32)
        if op_name == "AVG":
            want /= world
        for got, _ in results:
            with_tail, without, tail = got[call]
            assert torch.equal(with_tail, without)
            assert torch.equal(tail, want), (tail, want)
            assert torch.equal(tail, results[0][0][call][2])     # the same on every rank
    sent = [s for _, s in results]
    assert len(set(sent)) == 1 and sent[0] > 0


def _refused():
    world = bc.get_world_size()
    comp = MinMaxUInt8(world)
    t = torch.zeros(16)

    def fast(tail, op=bc.ReduceOp.AVG):
        return _inplace_launcher(t, op, comp, None, 16, tail) is not None

    return {"float32": fast(torch.zeros(3)),
            "float16": fast(torch.zeros(3, dtype=torch.float16)),
            "strided": fast(torch.zeros(6)[::2]),
            "empty": fast(torch.zeros(0)),
            "max": fast(torch.zeros(3), bc.ReduceOp.MAX)}


def test_a_tail_it_cannot_sum_exactly_gets_no_launcher():
    for got in run_ranks(_refused, 2, timeout=60):
        assert got == {"float32": True, "float16": False, "strided": False, "empty": False,
                       "max": False}
