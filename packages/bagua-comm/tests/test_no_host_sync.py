"""The compression path never synchronises the host with the GPU, checked on CPU tensors.

bagua_comm.testing.no_host_sync raises on every aten operation that would make the host wait
for a CUDA tensor (item/bool, boolean masks, tensors made from host values).  The GPU glue of
MinMaxUInt8 (``_minmax_cupy``: headers, padding, error feedback) runs here over CPU tensors
with CuPy's kernels replaced by torch reference kernels, and must give the CPU kernels' bytes.
The GPU tests run the same code under ``torch.cuda.set_sync_debug_mode("error")``.
"""

import ctypes
import sys
import types

import cuda_emu
import pytest
import torch

from bagua_comm.compression import MinMaxUInt8, _minmax8, header_bytes
from bagua_comm.testing import HostSyncError, no_host_sync


def test_the_checker_catches_the_syncing_operations():
    x = torch.arange(4.0)
    for fn in (lambda: x.sum().item(), lambda: bool(x.any()), lambda: x[x > 1],
               lambda: torch.tensor(1.0, device=x.device), lambda: x.nonzero(),
               lambda: x.tolist()):
        with pytest.raises(HostSyncError), no_host_sync():
            fn()
    with no_host_sync():
        torch.where(x.isnan(), 0.0, x).masked_fill_(x > 2, 0)    # fine


def _input(dtype, chunks=4, m=40):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(chunks * m, generator=g) * 3).to(dtype)
    x[m + 5] = float("nan")          # chunk 1: non-finite
    x[2 * m + 1] = float("inf")      # chunk 2: non-finite
    return x


# -- the CUDA glue over CPU tensors ------------------------------------------------------------
_TORCH = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def _at(ptr, numel, dtype):
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(int(ptr)),
                            dtype=torch.uint8).view(dtype)


def _scale(mn, mx, levels):
    return levels / ((mx - mn) + 1e-7)


def _kernel(name):
    """A torch stand-in for one CUDA kernel of _minmax_cupy (same float32 formula):
    ``encode{8,4}_{f32,f16,bf16}`` and ``decode{8,4}``."""
    bits = 8 if name[6] == "8" else 4
    levels = 2 ** bits - 1

    def run(grid, block, args):
        if name.startswith("encode"):
            src, m, mins, maxs, payload, rec = args
            chunks, m, rec = grid[1], int(m), int(rec)
            x = _at(src, chunks * m, _TORCH[name.split("_")[-1]]).float().view(chunks, m)
            mn = _at(mins, chunks, torch.float32).unsqueeze(1)
            mx = _at(maxs, chunks, torch.float32).unsqueeze(1)
            scale = _scale(mn, mx, levels)
            upper = torch.round(mx * scale)
            q = (torch.minimum(torch.round(x * scale), upper) - (upper - levels))
            q = q.clamp(0, levels).masked_fill(mn.isnan(), 0).to(torch.uint8)
            if bits == 4:
                q = q[:, 0::2] | (q[:, 1::2] << 4)
            _at(payload, chunks * rec, torch.uint8).view(chunks, rec)[:, 32:32 + q.shape[1]] = q
        else:
            payload, rec, m, mins, maxs, out = args
            chunks, m, rec = grid[1], int(m), int(rec)
            nbytes = m if bits == 8 else m // 2
            codes = _at(payload, chunks * rec, torch.uint8).view(chunks, rec)[:, 32:32 + nbytes]
            if bits == 4:
                codes = torch.stack([codes & 15, codes >> 4], 2).view(chunks, m)
            mn = _at(mins, chunks, torch.float32).unsqueeze(1)
            mx = _at(maxs, chunks, torch.float32).unsqueeze(1)
            scale = _scale(mn, mx, levels)
            lower = torch.round(mx * scale) - levels
            _at(out, chunks * m, torch.float32).view(chunks, m).copy_((codes.float() + lower)
                                                                       / scale)
    return run


@pytest.fixture
def cupy_glue_on_cpu(monkeypatch):
    from bagua_comm.compression import _minmax_cupy as glue

    fake = types.ModuleType("cupy")
    fake.cuda = types.SimpleNamespace(ExternalStream=lambda ptr: _Null())
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda *a: types.SimpleNamespace(cuda_stream=0))
    emulated = cuda_emu.kernels()

    def get_function(name):
        if (name[:6] in ("encode", "decode") and name[6] == "4") or name in (
                "encode8_f32", "encode8_f16", "encode8_bf16"):
            return _kernel(name)
        if emulated is None:
            pytest.skip("the fused 8-bit kernels run here through cuda_emu (no C++20 compiler)")
        return emulated.get_function(name)

    monkeypatch.setattr(glue, "_module",
                        lambda device: types.SimpleNamespace(get_function=get_function))
    return glue


class _Null:
    ptr = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_glue_gives_the_cpu_bytes_without_syncing(cupy_glue_on_cpu, dtype):
    x = _input(dtype, chunks=3, m=50)       # 50 codes: a padded record
    want = _minmax8._compress(x, 3)
    with no_host_sync():
        got = cupy_glue_on_cpu.compress(x, 3)
        back = torch.empty(x.numel(), dtype=torch.float32)
        cupy_glue_on_cpu.decompress(got, back, 3, dtype)
    assert torch.equal(got, want)
    ref = torch.empty(x.numel(), dtype=torch.float32)
    _minmax8._decompress(want, ref, 3, dtype)
    assert torch.equal(back.isnan(), ref.isnan())
    assert torch.equal(back.nan_to_num(), ref.nan_to_num())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_error_feedback_on_the_cuda_path_does_not_sync(cupy_glue_on_cpu, monkeypatch, dtype):
    x = _input(dtype)
    ref = MinMaxUInt8(4, error_feedback=True)
    want = [ref.compress(x, key="k"), ref.compress(x, key="k")]     # the CPU kernels
    monkeypatch.setattr(_minmax8, "_compress", lambda flat, chunks, payload=None:
                        cupy_glue_on_cpu.compress(flat, chunks, payload))
    monkeypatch.setattr(_minmax8, "_decompress",
                        lambda p, o, c, d, rows=1, op=0: cupy_glue_on_cpu.decompress(
                            p, o, c, d, rows=rows, op=op))
    c = MinMaxUInt8(4, error_feedback=True)
    mins = torch.tensor([0.0, float("nan"), -1.5, 2.0])
    with no_host_sync():
        h = header_bytes(mins, mins + 1, dtype)
        got = [c.compress(x, key="k"), c.compress(x, key="k")]
    assert h.shape == (4, 2 * x.element_size())
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    res = c.residual("k").view(4, -1)
    assert torch.equal(res[1], torch.zeros_like(res[1]))          # reset: chunk 1 was NaN
    assert torch.equal(res[2], torch.zeros_like(res[2]))          # chunk 2 held an inf
    assert res[0].abs().sum() > 0 and res[3].abs().sum() > 0       # the others keep theirs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_4bit_cuda_glue_gives_the_cpu_bytes_without_syncing(cupy_glue_on_cpu, dtype):
    from bagua_comm.compression import _minmax4

    x = _input(dtype, chunks=3, m=50)       # 25 code bytes: a padded record
    want = _minmax4._encode_cpu(x, 3, torch.empty(3 * _minmax4.record_bytes4(50),
                                                  dtype=torch.uint8))
    with no_host_sync():
        got = cupy_glue_on_cpu.compress(x, 3, bits=4)
        back = torch.empty(x.numel(), dtype=torch.float32)
        cupy_glue_on_cpu.decompress(got, back, 3, dtype, bits=4)
    assert torch.equal(got, want)
    ref = torch.empty(x.numel(), dtype=torch.float32)
    _minmax4._decode_cpu(want, ref, 3, dtype)
    assert torch.equal(back.isnan(), ref.isnan())
    assert torch.equal(back.nan_to_num(), ref.nan_to_num())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_4bit_torch_path_gives_the_cpu_bytes_without_syncing(monkeypatch, dtype):
    """MinMaxUInt4's CUDA path is plain torch operations: run here on CPU tensors (with error
    feedback, non-finite chunks included) it must neither synchronise nor differ from the
    Cython kernels' bytes."""
    from bagua_comm.compression import MinMaxUInt4, _minmax4

    x = _input(dtype)
    ref = MinMaxUInt4(4, error_feedback=True)
    want = [ref.compress(x, key="k"), ref.compress(x, key="k")]      # the Cython kernels
    monkeypatch.setattr(_minmax4, "_encode", _minmax4._encode_torch)
    monkeypatch.setattr(_minmax4, "_decode", _minmax4._decode_torch)
    c = MinMaxUInt4(4, error_feedback=True)
    with no_host_sync():
        got = [c.compress(x, key="k"), c.compress(x, key="k")]
        back = c.decompress(got[1], torch.empty(x.numel(), dtype=dtype))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(back.isnan(), ref.decompress(want[1], torch.empty_like(back)).isnan())
    assert torch.equal(c.residual("k"), ref.residual("k"))
