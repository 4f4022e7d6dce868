"""Every primitive, every dtype, every meaningful ReduceOp, on 2 gloo ranks, against numpy."""

import numpy as np
import torch

import bagua_comm as bc
from bagua_comm.testing import run_ranks

Op = bc.ReduceOp
N = 8  # elements per rank; divisible by the group size
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32,
          torch.int64, torch.uint8]
FLOAT_OPS = [Op.SUM, Op.PRODUCT, Op.MIN, Op.MAX, Op.AVG]
INT_OPS = [Op.SUM, Op.PRODUCT, Op.MIN, Op.MAX, Op.BAND, Op.BOR, Op.BXOR]
NP_REDUCE = {Op.SUM: np.sum, Op.PRODUCT: np.prod, Op.MIN: np.min, Op.MAX: np.max,
             Op.AVG: np.mean, Op.BAND: np.bitwise_and.reduce, Op.BOR: np.bitwise_or.reduce,
             Op.BXOR: np.bitwise_xor.reduce}


def _np(rank, n=N):
    """Small integers, so that every reduction is exact in every dtype (bf16 included)."""
    return (np.arange(n) * (rank + 1) + 3 * rank) % 5 + 1


def _t(rank, dtype, n=N):
    return torch.tensor(_np(rank, n), dtype=dtype)


class _Checker:
    def __init__(self):
        self.failures = []
        self.count = 0

    def __call__(self, name, got, expected):
        self.count += 1
        got = got.double().numpy() if isinstance(got, torch.Tensor) else np.asarray(got)
        if got.shape != np.shape(expected) or not np.array_equal(got, np.asarray(expected)):
            self.failures.append(f"{name}: got {got.tolist()}, expected {np.asarray(expected).tolist()}")


def _reductions(check, r, w, dtype):
    allx = np.stack([_np(i) for i in range(w)]).astype(np.int64)
    ops = FLOAT_OPS if dtype.is_floating_point else INT_OPS
    for op in ops:
        red = NP_REDUCE[op](allx, axis=0)
        tag = f"{dtype} {op.name}"
        y = torch.zeros(N, dtype=dtype)
        bc.allreduce(_t(r, dtype), y, op=op)
        check(f"allreduce {tag}", y, red)
        x = _t(r, dtype)
        work = bc.allreduce_inplace(x, op=op, async_op=True)
        work.wait()
        check(f"allreduce_inplace async {tag}", x, red)
        check(f"is_completed {tag}", work.is_completed(), True)
        y = torch.zeros(N, dtype=dtype)
        bc.reduce(_t(r, dtype), y if r == 1 else None, dst=1, op=op)
        if r == 1:
            check(f"reduce {tag}", y, red)
        x = _t(r, dtype)
        bc.reduce_inplace(x, dst=0, op=op)
        if r == 0:
            check(f"reduce_inplace {tag}", x, red)
        y = torch.zeros(N // w, dtype=dtype)
        bc.reduce_scatter(_t(r, dtype), y, op=op, async_op=True).wait()
        check(f"reduce_scatter {tag}", y, red.reshape(w, -1)[r])
        x = _t(r, dtype)
        bc.reduce_scatter_inplace(x, op=op)
        check(f"reduce_scatter_inplace {tag}", x.view(w, -1)[r], red.reshape(w, -1)[r])


def _movement(check, r, w, dtype):
    allx = np.stack([_np(i) for i in range(w)])
    tag = str(dtype)
    x = _t(r, dtype)
    bc.broadcast(x, src=1)
    check(f"broadcast {tag}", x, allx[1])
    y = torch.zeros(N * w, dtype=dtype)
    bc.allgather(_t(r, dtype), y, async_op=True).wait()
    check(f"allgather {tag}", y, allx.reshape(-1))
    x = torch.zeros(N * w, dtype=dtype)
    x[r * N:(r + 1) * N] = _t(r, dtype)
    bc.allgather_inplace(x)
    check(f"allgather_inplace {tag}", x, allx.reshape(-1))
    y = torch.zeros(N * w, dtype=dtype)
    bc.gather(_t(r, dtype), y if r == 0 else None, dst=0)
    if r == 0:
        check(f"gather {tag}", y, allx.reshape(-1))
    x = torch.zeros(N * w + 1, dtype=dtype)  # one spare element at the end
    x[r * N:(r + 1) * N] = _t(r, dtype)
    bc.gather_inplace(x, N, dst=1)
    if r == 1:
        check(f"gather_inplace {tag}", x[:N * w], allx.reshape(-1))
    y = torch.zeros(N // w, dtype=dtype)
    bc.scatter(_t(r, dtype) if r == 1 else None, y, src=1)
    check(f"scatter {tag}", y, allx[1].reshape(w, -1)[r])
    x = _t(r, dtype)
    bc.scatter_inplace(x, N // w, src=0)
    check(f"scatter_inplace {tag}", x.view(w, -1)[r], allx[0].reshape(w, -1)[r])
    y = torch.zeros(N, dtype=dtype)
    bc.alltoall(_t(r, dtype), y)
    expected = np.concatenate([allx[j].reshape(w, -1)[r] for j in range(w)])
    check(f"alltoall {tag}", y, expected)
    x = _t(r, dtype)
    bc.alltoall_inplace(x, async_op=True).wait()
    check(f"alltoall_inplace {tag}", x, expected)
    # alltoall_v: rank i sends j+1 elements to rank j, from offset 2 j; receives i+1 from each
    counts = [j + 1 for j in range(w)]
    displs = [2 * j for j in range(w)]
    rc, rd = [r + 1] * w, [(r + 1) * j for j in range(w)]
    y = torch.zeros((r + 1) * w, dtype=dtype)
    bc.alltoall_v(_t(r, dtype), counts, displs, y, rc, rd)
    check(f"alltoall_v {tag}", y, np.concatenate([allx[j][2 * r:2 * r + r + 1] for j in range(w)]))
    if r == 0:
        bc.send(_t(r, dtype), 1)
    else:
        y = torch.zeros(N, dtype=dtype)
        bc.recv(y, 0, async_op=True).wait()
        check(f"send/recv {tag}", y, allx[0])


def _every_primitive():
    r, w = bc.get_rank(), bc.get_world_size()
    check = _Checker()
    for dtype in DTYPES:
        _reductions(check, r, w, dtype)
        _movement(check, r, w, dtype)
    check("broadcast_object", bc.broadcast_object({"r": r}, src=1) == {"r": 1}, True)
    bc.barrier()
    bc.barrier(async_op=True).wait()
    return check.failures, check.count


def test_every_primitive_dtype_and_op_matches_numpy():
    for failures, count in run_ranks(_every_primitive, 2, timeout=240):
        assert count >= 300  # the checks really ran
        assert not failures, "\n".join(failures[:20])


def _hierarchy():
    r = bc.get_rank()
    g = bc.get_default_group()
    intra, inter = g.intra_node_group(), g.inter_node_group()
    x = torch.tensor([float(r + 1)])
    bc.allreduce_inplace(x, group=intra)
    out = {"intra": (intra.ranks, x.item())}
    if g.is_node_leader():
        y = torch.tensor([float(r + 1)])
        bc.allreduce_inplace(y, group=inter)
        out["inter"] = (inter.ranks, y.item())
    sub = bc.new_group([1, 3])
    if sub.is_member():
        z = torch.tensor([float(r)])
        bc.allreduce_inplace(z, op=bc.ReduceOp.AVG, group=sub)
        out["sub"] = (sub.rank, z.item())
    return out, bc.get_local_rank(), bc.get_node_rank(), bc.get_local_size()


def test_hierarchical_communicators_on_two_nodes_of_two():
    out = run_ranks(_hierarchy, 4, local_world_size=2, timeout=180)
    assert [o[1:] for o in out] == [(0, 0, 2), (1, 0, 2), (0, 1, 2), (1, 1, 2)]
    assert out[0][0]["intra"] == ([0, 1], 3.0) and out[1][0]["intra"] == ([0, 1], 3.0)
    assert out[2][0]["intra"] == ([2, 3], 7.0) and out[3][0]["intra"] == ([2, 3], 7.0)
    assert out[0][0]["inter"] == ([0, 2], 4.0) and out[2][0]["inter"] == ([0, 2], 4.0)
    assert "inter" not in out[1][0] and "inter" not in out[3][0]
    assert out[1][0]["sub"] == (0, 2.0) and out[3][0]["sub"] == (1, 2.0)
    assert "sub" not in out[0][0]


def _without_16bit_gloo_reductions():
    """Emulate a torch whose gloo lacks float16/bfloat16 reductions: bagua upcasts."""
    half = (torch.float16, torch.bfloat16)

    class Refusing:
        """The default group's torch process group, refusing 16-bit reductions."""

        def __init__(self, pg):
            self._pg = pg

        def __getattr__(self, name):
            return getattr(self._pg, name)

        def allreduce(self, tensors, opts):
            if tensors[0].dtype in half:
                raise RuntimeError("Unsupported ScalarType BFloat16 / Half for this op")
            return self._pg.allreduce(tensors, opts)

        def _reduce_scatter_base(self, out, inp, opts):
            if inp.dtype in half:
                raise RuntimeError("Unsupported ScalarType BFloat16 / Half for this op")
            return self._pg._reduce_scatter_base(out, inp, opts)

    backend = bc.get_default_group()._gloo
    backend.pg = Refusing(backend.pg)
    r = bc.get_rank()
    out = []
    for dtype in (torch.float16, torch.bfloat16):
        x = _t(r, dtype)
        bc.allreduce_inplace(x, op=Op.AVG)
        y = torch.empty(N // 2, dtype=dtype)
        bc.reduce_scatter(_t(r, dtype), y, op=Op.MAX)
        out.append((x.dtype, x.double().numpy(), y.double().numpy()))
    return out


def test_16bit_reductions_upcast_when_gloo_lacks_them():
    allx = np.stack([_np(i) for i in range(2)])
    for r, out in enumerate(run_ranks(_without_16bit_gloo_reductions, 2)):
        for dtype, x, y in out:
            assert dtype in (torch.float16, torch.bfloat16)
            assert np.array_equal(x, allx.mean(0))
            assert np.array_equal(y, allx.max(0).reshape(2, -1)[r])
