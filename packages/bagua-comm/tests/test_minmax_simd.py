"""The float32 fast paths of the CPU kernels (``_minmax_simd.h``: 16 values per min/max step,
32 per 4-bit encoding step, streaming stores when decoding large outputs) against the numpy
references, at lengths around the vector widths and with non-finite values in every lane."""

import minmax_ref as ref8
import numpy as np
import pytest
import torch
from test_compression4 import ref_compress as ref4
from test_compression4 import ref_decompress as ref4_decompress

from bagua_comm.compression import MinMaxUInt4, MinMaxUInt8

F = np.float32
# chunk lengths: below, at and past one and two vector steps (all even, for 4 bits)
LENGTHS = [2, 14, 16, 18, 30, 32, 34, 48, 62, 64, 66, 96, 130, 1000]


def _check(x, chunks):
    flat = x.numpy()
    p8 = MinMaxUInt8(chunks).compress(x)
    want8 = ref8.compress(flat, "float32", chunks)
    assert np.array_equal(p8.numpy(), want8), f"8-bit bytes differ at {np.flatnonzero(p8.numpy() != want8)[:8]}"
    p4 = MinMaxUInt4(chunks).compress(x)
    want4 = ref4(flat, "float32", chunks)
    assert np.array_equal(p4.numpy(), want4), f"4-bit bytes differ at {np.flatnonzero(p4.numpy() != want4)[:8]}"
    out = torch.empty(x.numel())
    MinMaxUInt4(chunks).decompress(p4, out)
    assert np.array_equal(out.numpy(), ref4_decompress(want4, "float32", x.numel(), chunks),
                          equal_nan=True)


@pytest.mark.parametrize("m", LENGTHS)
def test_lengths_around_the_vector_widths(m):
    g = torch.Generator().manual_seed(m)
    for chunks in (1, 3):
        _check(torch.randn(m * chunks, generator=g) * 5 - 1, chunks)
        # exact ties: products that land on .5 after scaling (scale is 15/(max-min+eps))
        _check(torch.arange(m * chunks, dtype=torch.float32) / 2 - m / 3, chunks)
    # -0 and +0 as the extremes, somewhere inside the vector part
    x = torch.rand(m, generator=g) + 1
    x[m // 2], x[m - 1] = -0.0, 0.0
    _check(x, 1)


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
def test_a_non_finite_value_in_any_lane_marks_its_chunk(bad):
    m = 64
    for pos in range(m):
        x = torch.randn(2 * m, generator=torch.Generator().manual_seed(pos))
        x[pos] = float(bad)              # chunk 0 is non-finite, chunk 1 is not
        _check(x, 2)


def test_extremes_in_the_last_vector_lane_and_the_tail():
    m = 66                               # 64 through the vector loops, 2 in the scalar tail
    for pos in (0, 15, 31, 47, 63, 64, 65):
        for sign in (1, -1):
            x = torch.rand(m, generator=torch.Generator().manual_seed(pos))
            x[pos] = sign * 40.0
            _check(x, 1)


def test_large_decode_with_streaming_stores_matches_the_reference():
    # >= 2**22 floats: decode4 writes with non-temporal stores; odd chunk starts (8-byte
    # aligned only) exercise the alignment step
    n, chunks = 10 * 419431, 5          # 4194310 floats, chunks of 838862 (3355448 bytes)
    x = torch.randn(n, generator=torch.Generator().manual_seed(3))
    c = MinMaxUInt4(chunks)
    payload = c.compress(x)
    assert np.array_equal(payload.numpy(), ref4(x.numpy(), "float32", chunks))
    out = torch.empty(n)
    c.decompress(payload, out)
    assert np.array_equal(out.numpy(), ref4_decompress(payload.numpy(), "float32", n, chunks))
