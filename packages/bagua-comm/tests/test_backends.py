"""The backend contract (bagua_comm._backends), run against each backend's object directly.

Every rank's input is a known function of its rank, so each result is checked against the
same computation done locally with torch.  gloo runs on 2 CPU ranks; NCCL (marked ``gpu``)
on one rank per visible GPU.
"""

import pytest
import torch

import bagua_comm as bc
from bagua_comm.ops import ReduceOp
from bagua_comm.testing import run_ranks
from bagua_comm.work import Work

N = 12


def _x(rank, device, dtype=torch.float32):
    return (torch.arange(N, dtype=torch.float64) * (rank + 1) + rank).to(dtype).to(device)


def _contract(device):
    g = bc.get_default_group()
    be = g.backend_for(torch.empty(0, device=device))
    dev = torch.device(device, torch.cuda.current_device()) if device == "cuda" else "cpu"
    n, r = g.size, g.rank
    xs = [_x(i, dev) for i in range(n)]
    stack = torch.stack(xs)
    bad = []

    def check(name, got, want):
        if device == "cuda":
            torch.cuda.synchronize()
        if not torch.equal(got.cpu(), want.cpu()):
            bad.append(f"{name}: {got.tolist()} != {want.tolist()}")

    # allreduce: out of place, in place, each op kind, async handle
    for op, want in [(ReduceOp.SUM, stack.sum(0)), (ReduceOp.AVG, stack.sum(0) / n),
                     (ReduceOp.MAX, stack.amax(0)), (ReduceOp.MIN, stack.amin(0))]:
        y = torch.empty_like(xs[r])
        check(f"allreduce {op.name}", y if be.allreduce(xs[r], y, op, False) is None
              else torch.full_like(y, -1), want)
        z = xs[r].clone()
        work = be.allreduce(z, z, op, True)
        if not isinstance(work, Work):
            bad.append(f"allreduce async_op=True returned {type(work).__name__}")
        work.wait()
        check(f"allreduce_inplace async {op.name}", z, want)
        if not work.is_completed():
            bad.append("is_completed() after wait() is False")
    ints = [_x(i, dev, torch.int64) for i in range(n)]
    y = ints[r].clone()
    be.allreduce(y, y, ReduceOp.BXOR, False)
    want = ints[0].clone()
    for t in ints[1:]:
        want ^= t
    check("allreduce BXOR", y, want)
    # rooted collectives, from the last rank
    root = n - 1
    t = xs[r].clone()
    be.broadcast(t, root, False)
    check("broadcast", t, xs[root])
    t = xs[r].clone()
    be.reduce(t, root, ReduceOp.SUM, False)
    if r == root:
        check("reduce", t, stack.sum(0))
    out = torch.empty(n * N, device=dev) if r == root else None
    be.gather(xs[r], out, root, False)
    if r == root:
        check("gather", out, torch.cat(xs))
    send = torch.cat(xs) if r == root else None
    part = torch.empty(N, device=dev)
    be.scatter(send, part, root, False)
    check("scatter", part, xs[r])
    # all-to-all families
    out = torch.empty(n * N, device=dev)
    be.allgather(xs[r], out, False)
    check("allgather", out, torch.cat(xs))
    part = torch.empty(N // n, device=dev)
    be.reduce_scatter(xs[r], part, ReduceOp.SUM, False)
    check("reduce_scatter", part, stack.sum(0).chunk(n)[r])
    out = torch.empty(N, device=dev)
    be.alltoall(xs[r], out, False)
    check("alltoall", out, torch.cat([x.chunk(n)[r] for x in xs]))
    # alltoall_v: rank i sends j + 1 elements to rank j, from offset j
    counts = [j + 1 for j in range(n)]
    out = torch.zeros(n * N, device=dev)
    be.alltoall_v(xs[r], counts, list(range(n)), out, [r + 1] * n,
                  [i * N for i in range(n)], False)
    want = torch.zeros(n * N, device=dev)
    for i in range(n):
        want[i * N:i * N + r + 1] = xs[i][r:2 * r + 1]
    check("alltoall_v", out, want)
    # point to point along a ring
    if n > 1:
        got = torch.empty(N, device=dev)
        works = [be.recv(got, (r - 1) % n, True), be.send(xs[r], (r + 1) % n, True)]
        for w in works:
            w.wait()
        check("send/recv", got, xs[(r - 1) % n])
    be.barrier(False)
    # multi-phase: run() + exchange() + scratch()
    rows = torch.stack([xs[r] + j for j in range(n)])
    got = torch.empty(n, N, device=dev)
    firsts = []

    def phase():
        buf = be.scratch("contract", N, torch.float32, rows.device)
        firsts.append(buf.data_ptr())
        be.exchange(got, rows)

    be.run(phase, (rows, got), False)
    check("exchange (alltoall of rows)", got, torch.stack([xs[j] + r for j in range(n)]))
    be.run(phase, (rows, got), True).wait()
    if firsts[0] != firsts[1]:
        bad.append("scratch() gave a new buffer for the same tag and shape")
    return bad


def test_gloo_backend_meets_the_contract():
    assert run_ranks(_contract, 2, args=("cpu",)) == [[], []]


def test_every_group_has_its_backends():
    from bagua_comm._backends.gloo import GlooBackend

    res = run_ranks(_backend_kinds, 2)
    assert res == [("gloo", True, True)] * 2, res
    assert GlooBackend.name == "gloo"


def _backend_kinds():
    g = bc.new_group([1, 0])
    return (g._gloo.name, g.backend_for(torch.empty(0)) is g._gloo, g.ranks == [0, 1])


@pytest.mark.gpu
def test_nccl_backend_meets_the_contract():
    n = torch.cuda.device_count()
    assert run_ranks(_contract, n, args=("cuda",), backend="nccl", timeout=300) == [[]] * n


def test_the_scratch_pool_keeps_a_working_set_of_many_shapes():
    """A model whose buckets need 40 distinct scratch shapes gets the same 40 buffers back
    on every step (the pool once dropped everything at 32 and reallocated each step), and the
    pool stays bounded, dropping the least recently used buffer first."""
    from bagua_comm._backends import SCRATCH_BUFFERS, Backend

    be = Backend(group=None)
    sizes = range(1, 41)
    first = {n: be.scratch("payload", n, torch.float32).data_ptr() for n in sizes}
    for _step in range(3):
        again = {n: be.scratch("payload", n, torch.float32).data_ptr() for n in sizes}
        assert again == first
    for n in range(1000, 1000 + SCRATCH_BUFFERS):   # a flood of new shapes
        be.scratch("other", n, torch.uint8)
    assert len(be._scratch) == SCRATCH_BUFFERS
    keep = be.scratch("other", 1000 + SCRATCH_BUFFERS - 1, torch.uint8)  # most recent: kept
    assert ("payload", 1, torch.float32, None) not in be._scratch         # oldest: dropped
    assert be.scratch("other", 1000 + SCRATCH_BUFFERS - 1, torch.uint8) is keep
