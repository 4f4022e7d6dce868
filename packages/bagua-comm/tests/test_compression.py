"""MinMaxUInt8: byte-for-byte against the numpy formula, decoding, error feedback, bad input."""

import minmax_ref as ref
import numpy as np
import pytest
import torch

from bagua_comm.compression import Compressor, Context, MinMaxUInt8, record_bytes

NP_NAME = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
DTYPES = list(NP_NAME)


def _with(x, values):
    for i, v in values.items():
        x[i] = float(v)
    return x


def _inputs(dtype):
    g = torch.Generator().manual_seed(7)
    ties = torch.arange(-300, 300, dtype=torch.float32) / 2  # many exact .5 products
    edge = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 3.0, 3.0, 3.0, 3.0])
    cases = [
        ("normal", torch.randn(4096, generator=g) * 3, 8),
        ("odd chunk length", torch.randn(37 * 3, generator=g), 3),
        ("one chunk", torch.rand(1000, generator=g) * 100 - 7, 1),
        ("single element chunks", torch.randn(5, generator=g), 5),
        ("ties", ties, 4),
        ("constant and signed zeros", edge, 2),
        ("large magnitudes", torch.randn(256, generator=g) * 1e4 + 3e4, 2),
        ("negative only", -torch.rand(320, generator=g) - 1, 5),
        # |upper| just under and over 2**22, where the kernel switches rounding paths
        ("near the fast-path bound", torch.rand(512, generator=g) + 16000, 2),
        ("just past the bound", torch.rand(512, generator=g) * 0.5 + 16440, 2),
        # non-finite chunks: [NaN, NaN] header, codes 0; the other chunks as usual
        ("nan", _with(torch.randn(200, generator=g), {3: "nan", 0: "nan"}), 4),
        ("+-inf", _with(torch.randn(200, generator=g), {60: "inf", 199: "-inf"}), 4),
        ("inf and nan in one chunk", _with(torch.randn(77, generator=g), {9: "inf", 10: "nan"}), 7),
    ]
    return [(name, x.to(dtype), chunks) for name, x, chunks in cases]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_payload_is_byte_identical_to_the_numpy_formula(dtype):
    for name, x, chunks in _inputs(dtype):
        payload = MinMaxUInt8(chunks).compress(x)
        expected = ref.compress(x.float().numpy(), NP_NAME[dtype], chunks)
        assert payload.dtype == torch.uint8 and payload.numel() == expected.size, name
        mismatch = np.flatnonzero(payload.numpy() != expected)
        assert mismatch.size == 0, f"{name}: bytes differ at {mismatch[:10]}"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_decompress_matches_the_numpy_decoder(dtype):
    for name, x, chunks in _inputs(dtype):
        c = MinMaxUInt8(chunks)
        payload = c.compress(x)
        out = torch.empty_like(x)
        assert c.decompress(payload, out) is out
        expected = torch.from_numpy(ref.decompress(payload.numpy(), NP_NAME[dtype],
                                                   x.numel(), chunks))
        assert torch.allclose(out, expected.to(dtype), rtol=0, atol=0, equal_nan=True), name
        wide = torch.empty(x.numel())
        c.decompress(payload, wide, dtype=dtype)  # float16/bfloat16 headers into float32
        assert torch.allclose(wide, expected, rtol=0, atol=0, equal_nan=True), name


def test_layout_header_then_codes_in_32_byte_records():
    x = torch.tensor([-1.0, 0.0, 1.0, 2.0, 10.0, 20.0, 30.0, 40.0])
    p = MinMaxUInt8(2).compress(x)
    assert record_bytes(4) == 64 and p.numel() == 128
    rows = p.view(2, 64)
    assert rows[:, :8].contiguous().view(torch.float32).tolist() == [[-1.0, 2.0], [10.0, 40.0]]
    assert rows[:, 8:32].eq(0).all() and rows[:, 36:].eq(0).all()
    assert rows[0, 32:36].tolist()[0] == 0 and rows[0, 32:36].tolist()[-1] == 255
    assert MinMaxUInt8(2).payload_numel(8) == 128
    assert MinMaxUInt8(1).payload_numel(33) == 32 + 64


def test_reconstruction_error_is_within_one_step_per_chunk():
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(1))
    c = MinMaxUInt8(10)
    y = c.unpack(*c.pack(x))
    for xs, ys in zip(x.view(10, -1), y.view(10, -1)):
        step = (xs.max() - xs.min()) / 255
        assert (xs - ys).abs().max() <= step * 0.5 + 1e-6


def test_pack_unpack_carries_dtype_shape_and_device():
    x = torch.randn(4, 6).to(torch.bfloat16)
    payload, ctx = MinMaxUInt8(3).pack(x)
    assert ctx == Context(torch.bfloat16, torch.Size([4, 6]), torch.device("cpu"))
    y = MinMaxUInt8(3).unpack(payload, ctx)
    assert y.shape == (4, 6) and y.dtype == torch.bfloat16
    assert isinstance(MinMaxUInt8(1), Compressor)


def test_compress_into_a_given_buffer_and_from_a_shaped_tensor():
    x = torch.randn(8, 16)
    c = MinMaxUInt8(4)
    buf = torch.full((c.payload_numel(128),), 7, dtype=torch.uint8)
    assert c.compress(x, out=buf).data_ptr() == buf.data_ptr()
    assert torch.equal(buf, c.compress(x.view(-1)))  # padding bytes rewritten to zero
    w = torch.nn.Parameter(torch.randn(64))
    assert torch.equal(c.compress(w), c.compress(w.detach()))


def test_error_feedback_carries_the_residual_into_the_next_step():
    x = torch.randn(512, generator=torch.Generator().manual_seed(3))
    plain, ef = MinMaxUInt8(4), MinMaxUInt8(4, error_feedback=True)
    first = ef.compress(x, key="w")
    assert torch.equal(first, plain.compress(x))  # nothing stored yet: same bytes
    decoded = plain.decompress(first, torch.empty(512))
    assert torch.equal(ef.residual("w"), x - decoded)
    second = ef.compress(x, key="w")
    assert torch.equal(second, plain.compress(x + (x - decoded)))
    # Over many steps the decoded sum tracks the true sum within one quantisation error.
    ef.reset_residuals()
    total, true = torch.zeros(512), torch.zeros(512)
    for step in range(50):
        g = torch.randn(512, generator=torch.Generator().manual_seed(100 + step))
        total += ef.decompress(ef.compress(g, key="g"), torch.empty(512))
        true += g
    assert (total - true).abs().max() <= ef.residual("g").abs().max() + 1e-5
    assert (total - true).abs().max() < 0.1


@pytest.mark.parametrize("dtype", DTYPES)
def test_error_feedback_reuses_its_two_buffers_step_after_step(dtype):
    """Each step's bytes and residual equal the plain compressor's on ``g + residual``, and
    the residual and the corrected input live in the same two buffers every step."""
    ef, plain = MinMaxUInt8(4, error_feedback=True), MinMaxUInt8(4)
    gen = torch.Generator().manual_seed(5)
    res = torch.zeros(256)
    buffers = set()
    for _ in range(3):
        g = torch.randn(256, generator=gen).to(dtype)
        corrected = g.float() + res
        want = plain.compress(corrected.to(dtype))
        assert torch.equal(ef.compress(g, key="w"), want)
        res = corrected - plain.decompress(want, torch.empty(256), dtype=dtype)
        assert torch.equal(ef.residual("w"), res)
        buffers.add((ef._residuals["w"].data_ptr(), ef._ef._corrected["w"].data_ptr()))
    assert len(buffers) == 1, "error feedback allocated full-size buffers again"


def test_error_feedback_state_round_trips_through_state_dict():
    x = torch.randn(256)
    a = MinMaxUInt8(2, error_feedback=True)
    a.compress(x, key="k1")
    a.compress(x * 2, key="k2")
    b = MinMaxUInt8(2, error_feedback=True)
    b.load_state_dict(a.state_dict())
    assert sorted(b.state_dict()["residuals"]) == ["k1", "k2"]
    assert torch.equal(b.compress(x, key="k1"), a.compress(x, key="k1"))
    with pytest.raises(ValueError, match="chunks=2"):
        MinMaxUInt8(3, error_feedback=True).load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="error_feedback=False"):
        MinMaxUInt8(2).load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="key 'k1'"):
        a.compress(torch.randn(128), key="k1")


def test_bad_input_names_the_argument():
    c = MinMaxUInt8(4)
    with pytest.raises(ValueError, match="chunks"):
        MinMaxUInt8(0)
    with pytest.raises(ValueError, match=r"tensor.numel\(\) \(10\).*chunks \(4\)"):
        c.compress(torch.randn(10))
    with pytest.raises(ValueError, match="tensor must be float32, float16 or bfloat16"):
        c.compress(torch.arange(8))
    with pytest.raises(ValueError, match="tensor must be float32, float16 or bfloat16"):
        c.compress(torch.randn(8, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous"):
        c.compress(torch.randn(8, 2).t())
    with pytest.raises(ValueError, match="out must be a contiguous uint8"):
        c.compress(torch.randn(8), out=torch.empty(3, dtype=torch.uint8))
    payload = c.compress(torch.randn(8))
    with pytest.raises(ValueError, match="payload has 256 bytes"):
        c.decompress(payload, torch.empty(200))
    with pytest.raises(ValueError, match="payload must be a uint8"):
        c.decompress(payload.float(), torch.empty(8))
    with pytest.raises(ValueError, match="out must be float32"):
        c.decompress(payload, torch.empty(8, dtype=torch.int32))


def test_a_returned_residual_is_a_snapshot():
    """residual() hands out a copy: the stored residual is updated in place by later calls."""
    ef = MinMaxUInt8(2, error_feedback=True)
    gen = torch.Generator().manual_seed(9)
    ef.compress(torch.randn(64, generator=gen), key="k")
    first = ef.residual("k")
    kept = first.clone()
    ef.compress(torch.randn(64, generator=gen), key="k")
    assert torch.equal(first, kept)
    assert not torch.equal(ef.residual("k"), kept)
