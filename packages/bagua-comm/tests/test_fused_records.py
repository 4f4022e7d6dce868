"""The fused whole-bucket kernels (``_minmax.compress_records`` / ``decode_reduce``): one call
writes headers, codes and padding, or decodes and reduces several ranks' records, with the
bytes and values of the numpy reference (``minmax_ref``)."""

import minmax_ref as ref
import numpy as np
import pytest
import torch

from bagua_comm import _minmax
from bagua_comm.compression import MinMaxUInt8
from bagua_comm.compression._format import KINDS as _KINDS
from bagua_comm.compression._format import as_numpy as _as_numpy
from bagua_comm.compression._format import lut as _lut
from bagua_comm.compression._format import record_bytes

DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _input(dtype, chunks, m, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(chunks * m, generator=g) * 3
    x[min(5, x.numel() - 1)] = -0.0
    x = x.to(dtype)
    if chunks >= 4:
        x[m:2 * m] = float("nan")                   # a NaN chunk
        x[2 * m + 3] = float("-inf")                # an infinite one
        x[3 * m:4 * m] = 0.0                        # a constant chunk
    if chunks >= 5 and dtype is torch.float16:
        x[4 * m:5 * m] = torch.tensor(6e-8).half()  # subnormal min and max
        x[4 * m] = -torch.tensor(1.2e-7).half()
    return x


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("chunks,m", [(1, 1), (3, 33), (6, 64), (5, 257)])
def test_compress_records_is_the_reference_payload_headers_and_padding_included(dtype, chunks,
                                                                                  m):
    x = _input(dtype, chunks, m)
    rec = record_bytes(m)
    payload = np.full(chunks * rec, 0xAB, dtype=np.uint8)   # stale bytes: all overwritten
    _minmax.compress_records(_as_numpy(x), _KINDS[dtype], _lut(dtype), chunks, payload, rec)
    want = ref.compress(x.float().numpy(), DTYPES[dtype], chunks)
    np.testing.assert_array_equal(payload, want)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("op", [0, 1, 2, 3])
def test_decode_reduce_equals_decoding_every_row_then_reducing(dtype, rows, op):
    k, m = 2, 40
    inputs = []
    for r in range(rows):
        x = torch.randn(k * m, generator=torch.Generator().manual_seed(r)) * (r + 1)
        if r == 2:
            x[m + 1] = float("nan")     # row 2's second chunk decodes to NaN
        inputs.append(x.to(dtype))
    payloads = [ref.compress(x.float().numpy(), DTYPES[dtype], k) for x in inputs]
    payload = np.concatenate(payloads)
    decoded = torch.stack([torch.from_numpy(ref.decompress(p, DTYPES[dtype], k * m, k))
                           for p in payloads])
    want = {0: lambda t: t.sum(0), 1: lambda t: t.sum(0) / rows,
            2: lambda t: t.amin(0), 3: lambda t: t.amax(0)}[op](decoded)
    out = np.full(k * m, 7.0, dtype=np.float32)
    _minmax.decode_reduce(payload, record_bytes(m), rows * k, rows, _KINDS[dtype], _lut(dtype),
                          out, op)
    assert np.isfinite(out[:m]).all()
    np.testing.assert_array_equal(out, want.numpy())


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_decode_add_accumulates_the_decoding_into_out(dtype):
    x = torch.randn(96, generator=torch.Generator().manual_seed(4)).to(dtype)
    payload = ref.compress(x.float().numpy(), DTYPES[dtype], 3).copy()
    base = torch.randn(96, generator=torch.Generator().manual_seed(5))
    want = base + torch.from_numpy(ref.decompress(payload, DTYPES[dtype], 96, 3))
    out = base.clone()
    MinMaxUInt8(3)._decompress_reduce(torch.from_numpy(payload), out, dtype=dtype, op=4)
    assert torch.equal(out, want)
    with pytest.raises(ValueError, match="op"):
        MinMaxUInt8(3)._decompress_reduce(torch.from_numpy(payload), out.half(), dtype=dtype,
                                          op=4)


def test_decode_reduce_refuses_sizes_that_disagree():
    with pytest.raises(ValueError, match="disagree"):
        _minmax.decode_reduce(np.zeros(64, np.uint8), 64, 2, 2, 0, np.empty(0, np.float32),
                              np.zeros(3, np.float32), 0)


def test_compressor_reduces_rows_in_one_call_like_decompress_then_sum():
    c = MinMaxUInt8(4)
    parts = [c.compress(torch.randn(64, generator=torch.Generator().manual_seed(s)), chunks=2)
             for s in range(2)]
    payload = torch.cat(parts)
    out = torch.empty(64)
    c._decompress_reduce(payload, out, chunks=4, rows=2, op=1)
    rows = torch.stack([c.decompress(p, torch.empty(64), chunks=2) for p in parts])
    torch.testing.assert_close(out, rows.sum(0) / 2, rtol=0, atol=0)


class _CountOps:
    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        box = self
        self.ops = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                box.ops.append(str(func))
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_a_bucket_is_compressed_and_decoded_without_any_torch_op(dtype):
    """The per-bucket calls dispatch nothing on CPU: no header, padding or cast op around the
    kernel (each one costs host time at every bucket of every step)."""
    c = MinMaxUInt8(2)
    x = torch.randn(128).to(dtype)
    payload = torch.empty(c.payload_numel(128), dtype=torch.uint8)
    out, half = torch.empty(128), torch.empty(64)
    with _CountOps() as counted:
        c.compress(x, out=payload)
        c.decompress(payload, out, dtype=dtype)
        c._decompress_reduce(payload, half, dtype=dtype, rows=2, op=1)
    assert counted.ops == []
    np.testing.assert_array_equal(payload.numpy(), ref.compress(x.float().numpy(),
                                                                DTYPES[dtype], 2))
