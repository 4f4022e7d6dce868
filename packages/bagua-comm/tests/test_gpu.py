"""CUDA: the NCCL backend on a one-rank communicator, and the CuPy MinMaxUInt8 kernels.

Marked ``gpu``: skipped without CUDA, failing instead when BAGUA_TEST_GPU=1 (``nox -s gpu``).
"""

import pytest
import torch

import bagua_comm as bc
from bagua_comm.compression import MinMaxUInt4, MinMaxUInt8, _minmax4
from bagua_comm.testing import cuda_sync_error, run_ranks

pytestmark = pytest.mark.gpu
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32,
          torch.int64, torch.uint8]


def _one_rank_every_primitive():
    assert bc.get_backend() == "nccl", bc.get_backend()
    dev = torch.device("cuda", torch.cuda.current_device())
    bad = []

    def same(name, got, ref):
        torch.cuda.synchronize()
        if not torch.equal(got.cpu(), ref.cpu()):
            bad.append(name)

    for dtype in DTYPES:
        x = (torch.arange(12, device=dev) % 7 + 1).to(dtype)
        ops = [bc.ReduceOp.SUM, bc.ReduceOp.PRODUCT, bc.ReduceOp.MIN, bc.ReduceOp.MAX]
        ops += [bc.ReduceOp.AVG] if dtype.is_floating_point else [bc.ReduceOp.BAND,
                                                                   bc.ReduceOp.BXOR]
        for op in ops:
            y = torch.empty_like(x)
            bc.allreduce(x, y, op=op)
            same(f"allreduce {dtype} {op.name}", y, x)
            z = x.clone()
            bc.allreduce_inplace(z, op=op, async_op=True).wait()
            same(f"allreduce_inplace {dtype} {op.name}", z, x)
            y = torch.empty_like(x)
            bc.reduce(x, y, dst=0, op=op)
            same(f"reduce {dtype} {op.name}", y, x)
            y = torch.empty_like(x)
            bc.reduce_scatter(x, y, op=op)
            same(f"reduce_scatter {dtype} {op.name}", y, x)
        z = x.clone()
        bc.broadcast(z, src=0)
        same(f"broadcast {dtype}", z, x)
        y = torch.empty_like(x)
        bc.allgather(x, y)
        same(f"allgather {dtype}", y, x)
        y = torch.empty_like(x)
        bc.gather(x, y, dst=0)
        same(f"gather {dtype}", y, x)
        y = torch.empty_like(x)
        bc.scatter(x, y, src=0)
        same(f"scatter {dtype}", y, x)
        y = torch.empty_like(x)
        bc.alltoall(x, y)
        same(f"alltoall {dtype}", y, x)
        y = torch.zeros_like(x)
        bc.alltoall_v(x, [5], [2], y, [5], [0])
        same(f"alltoall_v {dtype}", y[:5], x[2:7])
    x = torch.randn(1000, device=dev)
    y = torch.empty_like(x)
    bc.compressed_allreduce(x, y)
    c = MinMaxUInt8(1)
    once = c.decompress(c.compress(x), torch.empty_like(x))  # scatter phase (1 rank: itself)
    same("compressed_allreduce", y, c.decompress(c.compress(once), torch.empty_like(x)))
    work = bc.allreduce_inplace(x, async_op=True)
    work.wait()
    torch.cuda.synchronize()
    if not work.is_completed():
        bad.append("is_completed")
    bc.barrier()
    return bad


def test_one_rank_nccl_communicator_runs_every_primitive():
    assert run_ranks(_one_rank_every_primitive, 1, backend="nccl", timeout=300) == [[]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_decode_reduce_equals_cython(dtype):
    """The one-launch decode of several ranks' records reduced into one output (and added
    into one, op 4): the Cython kernel's float32 values."""
    g = torch.Generator().manual_seed(9)
    rows, k, m = 3, 2, 70_001
    c = MinMaxUInt8(rows * k)
    payload = torch.cat([MinMaxUInt8(k).compress(torch.randn(k * m, generator=g).to(dtype))
                         for _ in range(rows)])
    for op in (0, 1, 2, 3):
        cpu = c._decompress_reduce(payload, torch.empty(k * m), dtype=dtype, rows=rows, op=op)
        gpu = c._decompress_reduce(payload.cuda(), torch.empty(k * m, device="cuda"),
                                   dtype=dtype, rows=rows, op=op)
        assert torch.equal(gpu.cpu(), cpu), (dtype, op)
    one = payload[:MinMaxUInt8(k).payload_numel(k * m)]
    base = torch.randn(k * m, generator=g)
    cpu = MinMaxUInt8(k)._decompress_reduce(one, base.clone(), dtype=dtype, op=4)
    gpu = MinMaxUInt8(k)._decompress_reduce(one.cuda(), base.cuda(), dtype=dtype, op=4)
    assert torch.equal(gpu.cpu(), cpu), dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=lambda d: str(d)[6:])
def test_cupy_kernels_are_byte_identical_to_cython(dtype):
    g = torch.Generator().manual_seed(5)
    cases = [(torch.randn(1 << 16, generator=g) * 5, 16), (torch.randn(999, generator=g), 3),
             (torch.arange(-300, 300) / 2, 4), (torch.tensor([0.0, -0.0, 2.0, 2.0]), 2),
             (torch.randn(1 << 20, generator=g) + 100, 7 * 8),
             # chunks over _minmax_cupy.SMALL_M elements: the two-launch path
             (torch.randn(3 << 17, generator=g) * 3, 2), (torch.randn(1 << 21, generator=g), 1),
             # float32 subnormals: kept on both (torch's min/max; kernels built --ftz=false)
             (torch.tensor([1e-40, -3e-39, 0.0, 2e-45, 1e-38, -1e-41, 5e-39, 0.0]), 2)]
    for values in ({5: "nan"}, {0: "inf", 700: "-inf"}, {1: "nan", 2: "inf"}):  # non-finite
        x = torch.randn(1024, generator=g)
        for i, v in values.items():
            x[i] = float(v)
        cases.append((x, 4))
    for x, chunks in cases:
        n = x.numel() // chunks * chunks
        x = x[:n].to(dtype)
        c = MinMaxUInt8(chunks)
        cpu = c.compress(x)
        gpu = c.compress(x.cuda())
        assert torch.equal(gpu.cpu(), cpu), (dtype, n, chunks)
        out_cpu = c.decompress(cpu, torch.empty_like(x))
        out_gpu = c.decompress(cpu.cuda(), torch.empty_like(x, device="cuda"))
        assert torch.allclose(out_gpu.cpu(), out_cpu, rtol=0, atol=0, equal_nan=True)
        wide = c.decompress(cpu.cuda(), torch.empty(n, device="cuda"), dtype=dtype)
        assert torch.allclose(wide.cpu(), c.decompress(cpu, torch.empty(n), dtype=dtype),
                              rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=lambda d: str(d)[6:])
def test_4bit_cuda_path_is_byte_identical_to_cython(dtype):
    """MinMaxUInt4 on CUDA (the CuPy kernels, and the torch operations used without CuPy)
    against the Cython kernels: the same payload
    bytes, the same decoded values, with error feedback over two steps the same residuals."""
    g = torch.Generator().manual_seed(6)
    cases = [(torch.randn(1 << 16, generator=g) * 5, 16), (torch.randn(998, generator=g), 1),
             (torch.arange(-300, 300) / 2, 4), (torch.tensor([0.0, -0.0, 2.0, 2.0]), 2),
             (torch.randn(1 << 20, generator=g) + 100, 7 * 8),
             # chunks over _minmax_cupy.SMALL_M elements: the two-launch path
             (torch.randn(3 << 17, generator=g) * 3, 2), (torch.randn(1 << 21, generator=g), 1),
             (torch.tensor([1e-40, -3e-39, 0.0, 2e-45, 1e-38, -1e-41, 5e-39, 0.0]), 2)]
    for values in ({5: "nan"}, {0: "inf", 700: "-inf"}, {1: "nan", 2: "inf"}):
        x = torch.randn(1024, generator=g)
        for i, v in values.items():
            x[i] = float(v)
        cases.append((x, 4))
    for x, chunks in cases:
        n = x.numel() // (2 * chunks) * 2 * chunks
        x = x[:n].to(dtype)
        c = MinMaxUInt4(chunks)
        cpu = c.compress(x)
        assert torch.equal(c.compress(x.cuda()).cpu(), cpu), (dtype, n, chunks)   # CuPy
        torch_ops = _minmax4._encode_torch(x.cuda(), chunks, torch.empty_like(cpu, device="cuda"))
        assert torch.equal(torch_ops.cpu(), cpu), (dtype, n, chunks)   # without CuPy
        out_cpu = c.decompress(cpu, torch.empty(n))
        out_gpu = c.decompress(cpu.cuda(), torch.empty(n, device="cuda"))
        assert torch.allclose(out_gpu.cpu(), out_cpu, rtol=0, atol=0, equal_nan=True)
        ef_cpu, ef_gpu = (MinMaxUInt4(chunks, error_feedback=True) for _ in range(2))
        for _ in range(2):
            assert torch.equal(ef_gpu.compress(x.cuda(), key="k").cpu(),
                               ef_cpu.compress(x, key="k")), (dtype, n, chunks)
        assert torch.equal(ef_gpu.residual("k").cpu(), ef_cpu.residual("k"))


def _one_rank_no_host_sync():
    """Compression (with error feedback), compressed_allreduce and the primitives on CUDA
    under torch.cuda.set_sync_debug_mode("error"): any host synchronisation raises."""
    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(4096, device=dev)
    x[7] = float("nan")
    y = torch.empty_like(x)
    c = MinMaxUInt8(8, error_feedback=True)
    torch.cuda.synchronize()
    with cuda_sync_error():
        for _ in range(2):
            payload = c.compress(x, key="k")
            c.decompress(payload, y)
            bc.compressed_allreduce(x, y, compressor=MinMaxUInt8(8, error_feedback=True))
            c4 = MinMaxUInt4(8, error_feedback=True)
            c4.decompress(c4.compress(x, key="k"), y)
            bc.compressed_allreduce(x, y, compressor=MinMaxUInt4(8, error_feedback=True))
            bc.allreduce_inplace(y)
            bc.broadcast(y, 0)
            bc.allgather(x, torch.empty_like(x))
    torch.cuda.synchronize()
    return bool(torch.isnan(y).any()), c.residual("k").view(8, -1)[0].abs().sum().item()


def test_cuda_paths_never_synchronise_the_host():
    nan_seen, residual_chunk0 = run_ranks(_one_rank_no_host_sync, 1, backend="nccl",
                                          timeout=300)[0]
    assert nan_seen and residual_chunk0 == 0      # the NaN chunk's residual was reset
