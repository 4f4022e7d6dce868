"""Bad input fails on the calling rank, before communicating, naming the argument; the group
stays usable afterwards."""

import subprocess
import sys

import pytest
import torch

import bagua_comm as bc
from bagua_comm.testing import run_ranks

Op = bc.ReduceOp


def _cases():
    f, i = torch.ones(4), torch.ones(4, dtype=torch.int32)
    meta = torch.ones(4, device="meta")
    strided = torch.ones(4, 2).t()
    return [
        # (call, substring of the message)
        (lambda: bc.allreduce(f, torch.ones(5)), "recv.numel() (5) must be the same numel"),
        (lambda: bc.allreduce(f, torch.ones(4, dtype=torch.float64)), "same dtype"),
        (lambda: bc.allreduce_inplace(strided), "tensor must be contiguous"),
        (lambda: bc.allreduce_inplace(meta), "tensor is on meta"),
        (lambda: bc.allreduce_inplace([1.0]), "tensor must be a torch.Tensor"),
        (lambda: bc.allreduce_inplace(i, op=Op.AVG), "AVG needs a floating-point"),
        (lambda: bc.allreduce_inplace(f, op=Op.BXOR), "BXOR needs an integer"),
        (lambda: bc.allreduce_inplace(f, op=42), "op must be a bagua_comm.ReduceOp"),
        # numbers and bools once became the operator of that value (True: PRODUCT)
        (lambda: bc.allreduce_inplace(f, op=True), "op must be a bagua_comm.ReduceOp"),
        (lambda: bc.allreduce_inplace(f, op=1.0), "op must be a bagua_comm.ReduceOp"),
        (lambda: bc.allreduce_inplace(f, op=1), "op must be a bagua_comm.ReduceOp"),
        (lambda: bc.compressed_allreduce(f, f, op=0.0), "op must be a bagua_comm.ReduceOp"),
        (lambda: bc.allgather(f, torch.ones(4)), "2 x send.numel()"),
        (lambda: bc.reduce_scatter(f, torch.ones(4)), "send.numel() / 2"),
        (lambda: bc.reduce_scatter_inplace(torch.ones(3)), "divisible by the group size"),
        (lambda: bc.alltoall(torch.ones(3), torch.ones(3)), "send.numel() (3) must be divisible"),
        (lambda: bc.broadcast(f, src=2), "src must be a rank in [0, 2)"),
        (lambda: bc.broadcast(f, src=-1), "src must be a rank in [0, 2)"),
        (lambda: bc.broadcast(f, src="0"), "src must be an int rank"),
        (lambda: bc.reduce(f, torch.ones(4), dst=5), "dst must be a rank in [0, 2)"),
        (lambda: bc.send(f, bc.get_rank()), "dst must be another rank"),
        (lambda: bc.recv(f, 7), "src must be a rank"),
        (lambda: bc.gather_inplace(f, 3, dst=0), "count must be an int >= 0"),
        (lambda: bc.scatter_inplace(f, -1, src=0), "count must be an int >= 0"),
        (lambda: bc.gather(f, torch.ones(4), dst=bc.get_rank()), "2 x send.numel()"),
        (lambda: bc.alltoall_v(f, [1], [0], f, [1, 1], [0, 1]), "one entry per rank (2)"),
        (lambda: bc.alltoall_v(f, [2, 3], [0, 2], f, [1, 1], [0, 1]), "reach outside send"),
        (lambda: bc.allreduce_inplace(f, group="world"), "group must be a bagua_comm.ProcessGroup"),
        (lambda: bc.allreduce_inplace(f, group=_OTHERS[0]), "not a member of group"),
        # every rank, not only the root, checks the buffers it was given (issue 13.2)
        (lambda: bc.gather(f, torch.ones(5), dst=0), "2 x send.numel()"),
        (lambda: bc.gather(f, torch.ones(8, dtype=torch.float64), dst=1), "same dtype"),
        (lambda: bc.scatter(torch.ones(5), f, src=0), "send.numel() / 2"),
        (lambda: bc.scatter(torch.ones(8, dtype=torch.int32), f, src=1), "same dtype"),
        # dtypes no backend carries, counts that are not ints, a self-count mismatch (13.9)
        (lambda: bc.allreduce_inplace(torch.ones(4, dtype=torch.int16)),
         "tensor has dtype torch.int16: bagua_comm carries float32"),
        (lambda: bc.broadcast(torch.zeros(4, dtype=torch.float8_e4m3fn)),
         "tensor has dtype torch.float8_e4m3fn: bagua_comm carries"),
        (lambda: bc.allgather(torch.ones(2, dtype=torch.uint16), torch.ones(4, dtype=torch.uint16)),
         "send has dtype torch.uint16"),
        (lambda: bc.alltoall_v(f, [2.0, 2.0], [0, 2], f, [2, 2], [0, 2]),
         "must be sequences of ints"),
        (lambda: bc.alltoall_v(f, [1.5, 2], [0, 2], f, [2, 2], [0, 2]),
         "must be sequences of ints"),
        (lambda: bc.alltoall_v(f, [1, 1], [0, 1], f, [2, 2], [0, 2]), "must equal recv_counts"),
        (lambda: bc.allreduce_inplace(f, group=_DESTROYED[0]), "was destroyed"),
        # a fractional, bool or string rank used to become int(r): another rank, silently
        (lambda: bc.new_group([1.5]), "ranks must be ints"),
        (lambda: bc.new_group([True]), "ranks must be ints"),
        (lambda: bc.new_group(["1"]), "ranks must be ints"),
        (lambda: bc.new_group("01"), "ranks must be None or an iterable"),
        (lambda: bc.new_group([0, 0]), "ranks must be distinct"),
        (lambda: bc.new_group([0, 2]), "ranks must be in [0, world_size=2)"),
    ]


_OTHERS = []
_DESTROYED = []


def _bad_calls():
    # A group this rank is not in (collective creation: both ranks create both groups).
    groups = [bc.new_group([0]), bc.new_group([1])]
    _OTHERS[:] = [groups[1 - bc.get_rank()]]
    both = bc.new_group([0, 1])
    bc.allreduce_inplace(torch.ones(2), group=both)
    both.destroy()
    _DESTROYED[:] = [both]
    results = []
    for call, needle in _cases():
        try:
            call()
        except (ValueError, RuntimeError) as err:
            results.append((needle, str(err)))
        else:
            results.append((needle, "<no error>"))
    # Nothing was sent: the group still works, on every primitive family.
    x = torch.tensor([1.0, 2.0]) * (bc.get_rank() + 1)
    bc.allreduce_inplace(x)
    y = torch.empty(4)
    bc.allgather(x, y)
    return results, x.tolist(), y.tolist()


def test_bad_input_names_the_argument_and_leaves_the_group_usable():
    for results, x, y in run_ranks(_bad_calls, 2):
        for needle, msg in results:
            assert needle in msg, f"expected {needle!r} in {msg!r}"
        assert x == [3.0, 6.0] and y == [3.0, 6.0, 3.0, 6.0]


def _torch_ops():
    import torch.distributed as dist

    out = {}
    for name in ("SUM", "AVG", "PRODUCT", "MIN", "MAX"):
        x = torch.tensor([2.0, 3.0, 6.0]) if bc.get_rank() == 0 else torch.tensor([5.0, 3.0, 4.0])
        bc.allreduce_inplace(x, op=getattr(dist.ReduceOp, name))
        out[name] = x.tolist()
    return out


def test_torch_distributed_ops_mean_the_op_of_the_same_name():
    """torch numbers its ops differently (its AVG is 1, our PRODUCT): dist.ReduceOp.AVG once
    reduced with PRODUCT, MIN with MAX."""
    for out in run_ranks(_torch_ops, 2):
        assert out == {"SUM": [7, 6, 10], "AVG": [3.5, 3, 5], "PRODUCT": [10, 9, 24],
                       "MIN": [2, 3, 4], "MAX": [5, 3, 6]}


def test_use_before_init_is_a_runtime_error():
    assert not bc.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        bc.allreduce_inplace(torch.ones(2))
    with pytest.raises(RuntimeError, match="init_process_group"):
        bc.get_rank()
    with pytest.raises(RuntimeError, match="init_process_group"):
        bc.compressed_allreduce(torch.ones(2), torch.ones(2))


def test_init_arguments_are_checked():
    with pytest.raises(ValueError, match="backend must be one of"):
        bc.init_process_group("mpi")
    code = ("import torch.distributed as dist, bagua_comm as bc, tempfile, os\n"
            "s = dist.FileStore(os.path.join(tempfile.mkdtemp(), 's'), 1)\n"
            "for kw, needle in [(dict(rank=1, world_size=1), 'rank must be in'),\n"
            "                   (dict(rank=0, world_size=4, local_world_size=3), 'divide')]:\n"
            "    try:\n        bc.init_process_group('gloo', store=s, **kw)\n"
            "    except ValueError as e:\n        assert needle in str(e), e\n"
            "    else:\n        raise SystemExit('no error')\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _objects():
    import threading

    rank = bc.get_rank()
    got = bc.broadcast_object({"from": rank}, src=1, async_op=True)
    out = {"async": (got.is_completed(), got.wait())}
    try:       # an unpicklable object on the source: every rank raises, nobody waits
        bc.broadcast_object(threading.Lock() if rank == 0 else None, src=0)
    except ValueError as err:
        out["unpicklable"] = str(err)
    out["after"] = bc.broadcast_object(rank + 10, src=0)      # the group still works
    return out


def test_broadcast_object_async_handle_and_unpicklable_source():
    for out in run_ranks(_objects, 2):
        assert out["async"] == (True, {"from": 1})
        assert "obj on rank 0 cannot be pickled" in out["unpicklable"]
        assert out["after"] == 10


@pytest.mark.parametrize("kw, needle", [
    (dict(rank=0.0, world_size=1), "rank must be an int, got 0.0"),
    (dict(rank="0", world_size=1), "rank must be an int"),
    (dict(rank=0, world_size=1.0), "world_size must be an int"),
    (dict(rank=0, world_size=1, local_world_size=True), "local_world_size must be an int"),
    (dict(rank=0, world_size=1, store="x"), "store must be a torch.distributed.Store"),
])
def test_init_argument_types_are_checked_before_joining(kw, needle, tmp_path):
    """Floats and bools were accepted (get_local_size() then returned 1.0 or True) or failed
    inside torch's store constructor with a pybind TypeError."""
    import torch.distributed as dist

    kw.setdefault("store", dist.FileStore(str(tmp_path / "s"), 1))
    with pytest.raises(ValueError, match=needle):
        bc.init_process_group("gloo", **kw)
    assert not bc.is_initialized() and not dist.is_initialized()


def test_a_malformed_launcher_variable_is_named(monkeypatch, tmp_path):
    import torch.distributed as dist

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "abc")
    with pytest.raises(ValueError, match="environment variable LOCAL_WORLD_SIZE must be an "
                                         "integer"):
        bc.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "s"), 1), rank=0,
                              world_size=1)
    assert not bc.is_initialized() and not dist.is_initialized()
