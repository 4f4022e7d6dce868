"""The CUDA kernels of MinMaxUInt8 (``_minmax_cupy``), their own source run on the CPU by
``cuda_emu`` (real threads per block, a barrier for ``__syncthreads``), through the same glue
the GPU runs: the payload of one launch (small chunks) or two (large chunks), headers and
padding included, must be the Cython kernels' bytes, and the decode-and-reduce launch their
values; without any torch operation that would synchronise a GPU."""

import sys
import types

import cuda_emu
import numpy as np
import pytest
import torch

from bagua_comm import compression
from bagua_comm.compression import _minmax8
from bagua_comm.compression._format import KINDS
from bagua_comm.testing import no_host_sync

EMU = cuda_emu.kernels()
pytestmark = pytest.mark.skipif(EMU is None, reason="no C++20 compiler to emulate CUDA with")


class _Stream:
    ptr = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.fixture
def glue(monkeypatch):
    from bagua_comm.compression import _minmax_cupy as glue

    fake = types.ModuleType("cupy")
    fake.cuda = types.SimpleNamespace(ExternalStream=lambda ptr: _Stream())
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(glue, "_STREAMS", {})
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda *a: types.SimpleNamespace(cuda_stream=0))
    module = cuda_emu.kernels()
    monkeypatch.setattr(glue, "_module", lambda device: module)
    glue.emulated = module
    return glue


def _input(dtype, chunks, m, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(chunks * m, generator=g) * 3
    x[min(7, x.numel() - 1)] = -0.0
    if chunks >= 3:
        x[m + 1] = float("nan")                       # chunk 1: NaN
        x[2 * m + m // 2] = float("-inf")             # chunk 2: an infinity
    if chunks >= 4:
        x[3 * m:4 * m] = -0.0                         # chunk 3: constant, -0
    x = x.to(dtype)
    if chunks >= 5 and dtype is torch.float16:        # chunk 4: subnormal min and max
        x[4 * m:5 * m] = torch.tensor(6e-8).half()
        x[4 * m + 2] = -torch.tensor(1.2e-7).half()
    return x


def _launched(glue):
    return [(name, fn.launches) for name, fn in glue.emulated.calls if fn.launches]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("chunks,m", [(1, 1), (3, 50), (5, 67), (2, 256)])
def test_one_launch_writes_the_cpu_payload(glue, dtype, chunks, m):
    x = _input(dtype, chunks, m)
    want = _minmax8._compress(x, chunks)
    payload = torch.full((want.numel(),), 0xAB, dtype=torch.uint8)    # stale bytes
    with no_host_sync():
        got = glue.compress(x, chunks, payload)
    assert torch.equal(got, want)
    names = [n for n, _ in _launched(glue)]
    assert names == [f"compress8_one_{glue._NAMES[KINDS[dtype]]}"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_two_launches_for_large_chunks_write_the_cpu_payload(glue, monkeypatch, dtype):
    monkeypatch.setattr(glue, "SMALL_M", 16)           # large chunks, small enough to emulate
    monkeypatch.setattr(glue, "_PART_ELEMS", 24)       # several slices per chunk, one empty
    monkeypatch.setattr(glue, "_PARTS", {})
    chunks, m = 5, 99
    x = _input(dtype, chunks, m, seed=1)
    want = _minmax8._compress(x, chunks)
    payload = torch.full((want.numel(),), 0xCD, dtype=torch.uint8)
    with no_host_sync():
        got = glue.compress(x, chunks, payload)
        again = glue.compress(x, chunks, torch.full_like(payload, 7))   # buffers reused
    assert torch.equal(got, want) and torch.equal(again, want)
    launched = _launched(glue)
    assert [n.split("_")[0] for n, _ in launched] == ["minmax8", "encode8"] * 2
    assert launched[0][1][0] == (5, chunks)            # ceil(99 / 24) slices per chunk
    assert len(glue._PARTS) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("op", [0, 1, 2, 3])
def test_decode_reduce_launch_gives_the_cpu_values(glue, dtype, rows, op):
    k, m = 2, 37
    payloads = []
    for r in range(rows):
        x = (torch.randn(k * m, generator=torch.Generator().manual_seed(r)) * (r + 1))
        if r == 1:
            x[m + 3] = float("nan")
        payloads.append(_minmax8._compress(x.to(dtype), k))
    payload = torch.cat(payloads)
    want = torch.empty(k * m)
    _minmax8._decompress(payload, want, rows * k, dtype, rows, op)     # Cython
    got = torch.full((k * m,), 5.0)
    with no_host_sync():
        glue.decompress(payload, got, rows * k, dtype, rows=rows, op=op)
    np.testing.assert_array_equal(got.numpy(), want.numpy())
    assert [n for n, _ in _launched(glue)] == ["decode_reduce8"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_decode_add_launch_gives_the_cpu_values(glue, dtype):
    x = _input(dtype, 3, 40, seed=2)
    payload = _minmax8._compress(x, 3)
    base = torch.randn(120)
    want = base.clone()
    _minmax8._decompress(payload, want, 3, dtype, 1, 4)                # Cython
    got = base.clone()
    with no_host_sync():
        glue.decompress(payload, got, 3, dtype, rows=1, op=4)
    np.testing.assert_array_equal(got.numpy(), want.numpy())
    assert not torch.equal(got[:40], base[:40])


def test_the_compressor_runs_through_the_emulated_kernels(glue, monkeypatch):
    """MinMaxUInt8.compress / decompress routed to the CUDA glue: the reference bytes, and the
    Cython decoder's values."""
    import minmax_ref

    x = _input(torch.float32, 4, 64)
    want = torch.empty(256)
    compression.MinMaxUInt8(4).decompress(compression.MinMaxUInt8(4).compress(x), want)
    monkeypatch.setattr(_minmax8, "_compress",
                        lambda flat, chunks, payload=None: glue.compress(flat, chunks, payload))
    monkeypatch.setattr(_minmax8, "_decompress",
                        lambda p, o, c, d, rows=1, op=0: glue.decompress(p, o, c, d, rows=rows,
                                                                          op=op))
    c = compression.MinMaxUInt8(4)
    payload = c.compress(x)
    out = c.decompress(payload, torch.empty(256))
    np.testing.assert_array_equal(payload.numpy(), minmax_ref.compress(x.numpy(), "float32", 4))
    np.testing.assert_array_equal(out.numpy(), want.numpy())
    assert len(_launched(glue)) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("large", [False, True], ids=["one-launch", "two-launches"])
def test_subnormal_min_max_survive_a_gpu_that_flushes_them(glue, monkeypatch, dtype, large):
    # The H200 run of 2026-11-28: chunks of float32/bfloat16 subnormals got the header [0, 0]
    # where the CPU writes their bits (the min/max was compared and normalised with float
    # arithmetic, which a flushing GPU reads as 0).  The emulator flushes like such a GPU.
    if large:
        monkeypatch.setattr(glue, "SMALL_M", 2)
        monkeypatch.setattr(glue, "_PART_ELEMS", 3)
        monkeypatch.setattr(glue, "_PARTS", {})
    x = torch.tensor([1e-40, -3e-39, 0.0, 2e-45, 1e-38, -1e-41, 5e-39, -0.0]).to(dtype)
    want = _minmax8._compress(x, 2)
    assert want[:8].any()                              # the CPU keeps the subnormal bits
    try:
        cuda_emu.flush_subnormals(True)
    except NotImplementedError as err:
        pytest.skip(str(err))
    try:
        got = glue.compress(x, 2, torch.empty_like(want))
    finally:
        cuda_emu.flush_subnormals(False)
    assert torch.equal(got, want)
