"""MinMaxUInt4: byte for byte against an independent numpy implementation of the documented
format, decoding, error feedback, and a compressed allreduce through it on 2 gloo ranks."""

import numpy as np
import pytest
import torch

import bagua_comm as bc
from bagua_comm.compression import Compressor, MinMaxUInt4, record_bytes4
from bagua_comm.testing import run_ranks

F = np.float32
NP_NAME = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _header(mn, mx, dtype):
    pair = np.array([mn, mx], dtype=np.float32)
    if dtype == "bfloat16":        # exact for values that came from bfloat16
        raw = (pair.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    else:
        raw = pair.astype(dtype).tobytes()
    return raw + bytes(32 - len(raw))


def ref_compress(x32, dtype, chunks):
    """The docstring's formula, element by element in float32 numpy."""
    x32 = np.asarray(x32, dtype=np.float32)
    m = x32.size // chunks
    out = bytearray()
    for c in range(chunks):
        seg = x32[c * m:(c + 1) * m]
        if not np.isfinite(seg).all():
            mn = mx = np.array([0x7FC00000], dtype=np.uint32).view(np.float32)[0]
            q = np.zeros(m, dtype=np.uint8)
        else:
            mn, mx = seg.min() + F(0), seg.max() + F(0)
            scale = F(15) / (mx - mn + F(1e-7))
            upper = np.rint(mx * scale)
            lower = upper - F(15)
            q = np.clip(np.minimum(np.rint(seg * scale), upper) - lower, 0, 15).astype(np.uint8)
        codes = (q[0::2] | (q[1::2] << 4)).astype(np.uint8).tobytes()
        rec = _header(mn, mx, dtype) + codes
        out += rec + bytes(32 + -(-(m // 2) // 32) * 32 - len(rec))
    return np.frombuffer(bytes(out), dtype=np.uint8)


def ref_decompress(payload, dtype, numel, chunks):
    m = numel // chunks
    rec = 32 + -(-(m // 2) // 32) * 32
    out = np.empty(numel, dtype=np.float32)
    for c in range(chunks):
        r = payload[c * rec:(c + 1) * rec]
        if dtype == "bfloat16":
            mn, mx = (r[:4].view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            mn, mx = r[:2 * np.dtype(dtype).itemsize].view(dtype).astype(np.float32)
        with np.errstate(invalid="ignore"):
            scale = F(15) / (mx - mn + F(1e-7))
            lower = np.rint(mx * scale) - F(15)
            codes = r[32:32 + m // 2]
            q = np.empty(m, dtype=np.float32)
            q[0::2], q[1::2] = codes & 15, codes >> 4
            out[c * m:(c + 1) * m] = (q + lower) / scale
    return out


def _inputs(dtype):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(300, generator=g)
    x[5], x[170] = float("nan"), float("inf")
    cases = [("normal", torch.randn(4096, generator=g) * 3, 8),
             ("odd records", torch.randn(2 * 37 * 3, generator=g), 3),
             ("ties", torch.arange(-300, 300, dtype=torch.float32) / 4, 4),
             ("constant and signed zeros", torch.tensor([0.0, -0.0, 3.0, 3.0] * 4), 2),
             ("large", torch.randn(256, generator=g) * 1e4 + 3e4, 2),
             ("non-finite chunks", x, 6),
             # constant chunks: bounds far beyond 2**22, the kernels' general path
             ("constant chunks", torch.tensor([1000.0] * 8 + [-2.5] * 8 + [0.0] * 8), 3)]
    return [(n, t.to(dtype), c) for n, t, c in cases]


@pytest.mark.parametrize("dtype", list(NP_NAME), ids=lambda d: str(d)[6:])
def test_payload_and_decoding_match_the_numpy_formula(dtype):
    for name, x, chunks in _inputs(dtype):
        c = MinMaxUInt4(chunks)
        payload = c.compress(x)
        expected = ref_compress(x.float().numpy(), NP_NAME[dtype], chunks)
        assert payload.numel() == expected.size == c.payload_numel(x.numel()), name
        mismatch = np.flatnonzero(payload.numpy() != expected)
        assert mismatch.size == 0, f"{name}: bytes differ at {mismatch[:10]}"
        wide = torch.empty(x.numel())
        c.decompress(payload, wide, dtype=dtype)
        want = ref_decompress(expected, NP_NAME[dtype], x.numel(), chunks)
        assert torch.equal(wide.isnan(), torch.from_numpy(np.isnan(want))), name
        assert np.array_equal(wide.numpy(), want, equal_nan=True), name


@pytest.mark.parametrize("dtype", list(NP_NAME), ids=lambda d: str(d)[6:])
def test_cpu_kernels_and_torch_ops_path_write_the_same_bytes(dtype):
    """The CUDA path (torch operations) run on CPU tensors against the Cython kernels."""
    from bagua_comm.compression import _minmax4

    g = torch.Generator().manual_seed(5)
    for name, x, chunks in _inputs(dtype) + [("big", torch.randn(1 << 16, generator=g)
                                                       .to(dtype), 16)]:
        flat = x.reshape(-1)
        size = MinMaxUInt4(chunks).payload_numel(flat.numel())
        a = _minmax4._encode_cpu(flat, chunks, torch.full((size,), 7, dtype=torch.uint8))
        b = _minmax4._encode_torch(flat, chunks, torch.full((size,), 9, dtype=torch.uint8))
        assert torch.equal(a, b), name
        da, db = torch.empty(flat.numel()), torch.empty(flat.numel())
        _minmax4._decode_cpu(a, da, chunks, dtype)
        _minmax4._decode_torch(a, db, chunks, dtype)
        assert torch.equal(da.isnan(), db.isnan()), name
        assert torch.equal(da.nan_to_num(), db.nan_to_num()), name


def test_sizes_error_bound_and_bad_input():
    assert record_bytes4(64) == 64 and record_bytes4(66) == 96
    c = MinMaxUInt4(4)
    assert isinstance(c, Compressor) and c.alignment(4) == 8
    x = torch.randn(8000, generator=torch.Generator().manual_seed(2))
    y = c.decompress(c.compress(x), torch.empty(8000))
    for xs, ys in zip(x.view(4, -1), y.view(4, -1)):
        assert (xs - ys).abs().max() <= (xs.max() - xs.min()) / 15 * 0.5 + 1e-5
    assert c.payload_numel(8000) * 7 < 8000 * 4      # about 1/8 of float32
    for bad in (torch.randn(12), torch.arange(16)):   # odd chunk length; integer tensor
        with pytest.raises(ValueError):
            c.compress(bad)
    with pytest.raises(ValueError, match="chunks"):
        MinMaxUInt4(0)


def test_error_feedback_carries_the_residual():
    g = torch.Generator().manual_seed(3)
    ef, plain = MinMaxUInt4(2, error_feedback=True), MinMaxUInt4(2)
    total, true = torch.zeros(512), torch.zeros(512)
    x0 = torch.randn(512, generator=g)
    first = ef.compress(x0, key="w")
    assert torch.equal(first, plain.compress(x0))
    dec = plain.decompress(first, torch.empty(512))
    assert torch.equal(ef.residual("w"), x0 - dec)
    assert torch.equal(ef.compress(x0, key="w"), plain.compress(x0 + (x0 - dec)))
    ef.reset_residuals()
    for _ in range(200):
        x = torch.randn(512, generator=g)
        total += ef.decompress(ef.compress(x, key="w"), torch.empty(512))
        true += x
    assert (total - true).abs().max() <= ef.residual("w").abs().max() + 1e-4
    state = ef.state_dict()
    again = MinMaxUInt4(2, error_feedback=True)
    again.load_state_dict(state)
    assert torch.equal(again.residual("w"), ef.residual("w"))


def _allreduce_main():
    r = bc.get_rank()
    x = torch.randn(1000, generator=torch.Generator().manual_seed(r))
    y = torch.empty_like(x)
    bc.compressed_allreduce(x, y, compressor=MinMaxUInt4(bc.get_world_size()), key="k")
    return x, y


def test_compressed_allreduce_through_4_bits_on_two_ranks():
    (x0, y0), (x1, y1) = run_ranks(_allreduce_main, world_size=2, timeout=120)
    assert torch.equal(y0, y1)                       # every rank decodes the same bytes
    mean = (x0 + x1) / 2
    spread = max(x0.max() - x0.min(), x1.max() - x1.min())
    assert (y0 - mean).abs().max() <= spread / 15 * 1.01   # one level per stage, two stages
    assert (y0 - mean).abs().mean() < spread / 60
