"""ErrorFeedback: one error-feedback wrapper for any compressor.  MinMaxUInt8/MinMaxUInt4 with
error_feedback=True go through it and give, bit for bit, the payloads and residuals of the
previous per-compressor implementations (digests saved from that code); around a compressor
of one's own it follows a float reference of EF-SGD."""

import hashlib

import numpy as np
import pytest
import torch

from bagua_comm.compression import Compressor, ErrorFeedback, MinMaxUInt4, MinMaxUInt8

# sha256 (first 16 hex digits) of every step's payload and residual bytes, computed with
# main's compression.py / _minmax4.py before ErrorFeedback existed (commit 1c48665).
SAVED = {
    ("MinMaxUInt8", "float32", 1): "588e8593f8af6119",
    ("MinMaxUInt8", "float32", 4): "1438e0b15869b99a",
    ("MinMaxUInt8", "float16", 1): "d59bb20d60f77410",
    ("MinMaxUInt8", "float16", 4): "d3430cbb228b1ef4",
    ("MinMaxUInt8", "bfloat16", 1): "19fa5311a8e0db45",
    ("MinMaxUInt8", "bfloat16", 4): "cb0565f2c775d69e",
    ("MinMaxUInt4", "float32", 1): "9f3240990c0da540",
    ("MinMaxUInt4", "float32", 4): "a5c9d7c48ff65c09",
    ("MinMaxUInt4", "float16", 1): "f71aab17a4dee829",
    ("MinMaxUInt4", "float16", 4): "14b034ab8214ce59",
    ("MinMaxUInt4", "bfloat16", 1): "c145fb92fcf5c8e9",
    ("MinMaxUInt4", "bfloat16", 4): "7e5e15dcdedd4636",
}
CLASSES = {"MinMaxUInt8": MinMaxUInt8, "MinMaxUInt4": MinMaxUInt4}


def _steps(dtype, chunks):
    """Five inputs of growing scale; step 3 holds a NaN (one non-finite chunk)."""
    g = torch.Generator().manual_seed(27 + chunks)
    out = []
    for s in range(5):
        x = torch.randn(256, generator=g) * (1 + 3 * s)
        if s == 3:
            x[70] = float("nan")
        out.append(x.to(dtype))
    return out


def _run(c, dtype, chunks):
    """Two keys, alternating; every step's (payload, residual)."""
    return [(c.compress(x, key="ab"[s % 2]).clone(), c.residual("ab"[s % 2]))
            for s, x in enumerate(_steps(dtype, chunks))]


@pytest.mark.parametrize("name, dtype, chunks", list(SAVED))
def test_builtin_error_feedback_is_bit_for_bit_the_old_path(name, dtype, chunks):
    cls, dt = CLASSES[name], getattr(torch, dtype)
    h = hashlib.sha256()
    for payload, residual in _run(cls(chunks, error_feedback=True), dt, chunks):
        h.update(payload.numpy().tobytes())
        h.update(residual.numpy().tobytes())
    assert h.hexdigest()[:16] == SAVED[(name, dtype, chunks)]
    # ... and the wrapper around the plain form is the same computation
    for (p1, r1), (p2, r2) in zip(_run(cls(chunks, error_feedback=True), dt, chunks),
                                  _run(ErrorFeedback(cls(chunks)), dt, chunks)):
        assert torch.equal(p1, p2) and torch.equal(r1, r2)


class Round(Compressor):
    """A compressor of one's own: each value rounded to a multiple of 0.5, as int8."""

    chunks = 1

    def payload_numel(self, numel, *, chunks=None):
        return numel

    def compress(self, tensor, *, chunks=None, key="default", out=None):
        q = torch.round(tensor.float() * 2).clamp(-127, 127).to(torch.int8).view(torch.uint8)
        return q if out is None else out.copy_(q)

    def decompress(self, payload, out, *, chunks=None, dtype=None):
        return out.copy_(payload.view(torch.int8).float() / 2)


def test_wraps_any_compressor_as_ef_sgd():
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(64, generator=g) * 3 for _ in range(6)]
    ef = ErrorFeedback(Round())
    residual = np.zeros(64, dtype=np.float32)
    for x in xs:
        corrected = x.numpy() + residual
        sent = np.clip(np.round(corrected * 2), -127, 127) / 2
        payload = ef.compress(x, key="w")
        decoded = ef.decompress(payload, torch.empty(64))
        np.testing.assert_array_equal(decoded.numpy(), sent.astype(np.float32))
        residual = (corrected - sent).astype(np.float32)
        np.testing.assert_array_equal(ef.residual("w").numpy(), residual)
    assert ef.payload_numel(64) == 64 and ef.chunks == 1 and ef.error_feedback
    # the sum of what was sent tracks the sum of the inputs up to one residual
    state = ef.state_dict()
    again = ErrorFeedback(Round())
    again.load_state_dict(state)
    assert torch.equal(again.residual("w"), ef.residual("w"))
    ef.reset_residuals()
    assert ef.residual("w") is None


class HalfInf(Round):
    """Round in two chunks, except that element 3 (in chunk 0) decodes to infinity."""

    chunks = 2

    def decompress(self, payload, out, *, chunks=None, dtype=None):
        super().decompress(payload, out)
        out[3] = float("inf")
        return out


def test_a_chunk_whose_decoding_is_not_finite_restarts_its_whole_residual_at_zero():
    """One non-finite decoded value resets its chunk's residual (every element, +0.0), never
    the other chunk's, and the next compression is the plain one there (checked against
    numpy)."""
    x = torch.linspace(-3.3, 3.1, 16)
    ef = ErrorFeedback(HalfInf())
    ef.compress(x, key="k")
    r = ef.residual("k").numpy()
    want = (x.numpy() - np.clip(np.round(x.numpy() * 2), -127, 127) / 2).astype(np.float32)
    assert np.array_equal(r[:8], np.zeros(8, np.float32)) and not np.signbit(r[:8]).any()
    np.testing.assert_array_equal(r[8:], want[8:])
    # a NaN in the input: that chunk (here chunk 1) too, the other keeps its residual
    y = x.clone()
    y[12] = float("nan")
    ef2 = ErrorFeedback(Round())
    ef2.compress(torch.ones(16) * 0.3, key="k")               # residual 0.3 - 0.5 = -0.2
    ef2.compress(y, key="k")
    assert torch.equal(ef2.residual("k"), torch.zeros(16))    # one chunk: all of it restarts


def test_bad_wrapping_raises_naming_the_argument():
    with pytest.raises(ValueError, match="compressor"):
        ErrorFeedback(object())
    with pytest.raises(ValueError, match="error feedback"):
        ErrorFeedback(MinMaxUInt8(2, error_feedback=True))
    ef = ErrorFeedback(MinMaxUInt8(1))
    ef.compress(torch.randn(8), key="k")
    with pytest.raises(ValueError, match="key 'k'"):
        ef.compress(torch.randn(16), key="k")
