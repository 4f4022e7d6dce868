"""MinMaxUInt8: 8-bit min-max quantisation, Bagua's ByteGrad format (the format is described
in :mod:`bagua_comm.compression`).

On CPU the kernels are Cython (``bagua_comm._minmax``: ``minmax_encode`` / ``decode``, without
the GIL); on CUDA the CuPy kernels of ``_minmax_cupy`` (which imports CuPy at its first call).
"""

from __future__ import annotations

import numpy as np
import torch

from .. import _minmax
from . import _format, _minmax_cupy
from ._error_feedback import _WithErrorFeedback
from ._format import HEADER_BYTES, KINDS, as_numpy, lut, read_headers, record_bytes, write_headers


class MinMaxUInt8(_WithErrorFeedback):
    """8-bit min-max quantisation in ``chunks`` chunks (Bagua's ByteGrad format).

    Args:
        chunks: number of equal chunks the flat input is split into (each gets its own
            min/max); the input's numel must be a multiple of it.
        error_feedback: keep the quantisation residual per ``key`` and add it to the next
            input compressed under that key.  Each key holds two float32 buffers of the
            input's size, reused call after call: the residual (updated in place, so a
            tensor from :meth:`residual` follows it) and the corrected input.
    """

    def __init__(self, chunks: int = 1, *, error_feedback: bool = False):
        self._setup(chunks, error_feedback, MinMaxUInt8)

    def __repr__(self) -> str:
        return f"MinMaxUInt8(chunks={self.chunks}, error_feedback={self.error_feedback})"

    # -- sizes --------------------------------------------------------------------------------
    def payload_numel(self, numel: int, *, chunks: int | None = None) -> int:
        """Payload bytes for a tensor of ``numel`` elements."""
        chunks = self._chunks(chunks)
        _check_divisible(numel, chunks)
        return chunks * record_bytes(numel // chunks)

    def alignment(self, chunks: int) -> int:
        """Inputs split into ``chunks`` equal chunks: a multiple of ``chunks``."""
        return self._chunks(chunks)

    # -- compress / decompress ----------------------------------------------------------------
    def compress(self, tensor: torch.Tensor, *, chunks: int | None = None,
                 key: str = "default", out: torch.Tensor | None = None) -> torch.Tensor:
        """The payload of ``tensor`` (float32/float16/bfloat16, contiguous, CPU or CUDA).

        ``out`` (optional) is a uint8 tensor of :meth:`payload_numel` bytes to write into
        instead of a new one.  With error feedback, the residual stored under ``key`` is
        added first and the new residual is stored in its place.
        """
        chunks = self._chunks(chunks)
        _format.check_float("tensor", tensor, "MinMaxUInt8")
        _check_divisible(tensor.numel(), chunks, "tensor")
        flat = tensor.detach().reshape(-1)
        if out is not None:
            _format.check_out(out, chunks * record_bytes(flat.numel() // chunks), flat.device)
        if self._ef is not None:
            return self._ef.compress(tensor, chunks=chunks, key=key, out=out)
        return _compress(flat, chunks, out)

    def decompress(self, payload: torch.Tensor, out: torch.Tensor, *,
                   chunks: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Decode ``payload`` into ``out`` (returned).

        ``dtype`` is the type the headers were written in (default ``out.dtype``); decoding
        float16/bfloat16 payloads straight into a float32 ``out`` avoids a rounding step.
        """
        chunks = self._chunks(chunks)
        _format.check_float("out", out, "MinMaxUInt8")
        dtype = out.dtype if dtype is None else dtype
        _format.check_dtype(dtype)
        _check_divisible(out.numel(), chunks, "out")
        if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8:
            raise ValueError("payload must be a uint8 torch.Tensor (from compress())")
        if not payload.is_contiguous():
            raise ValueError("payload must be contiguous")
        _format.check_payload_fits(payload, out, chunks,
                                   chunks * record_bytes(out.numel() // chunks))
        _decompress(payload.reshape(-1), out.detach().view(-1), chunks, dtype)
        return out


def _check_divisible(numel, chunks, name="tensor"):
    if numel == 0 or numel % chunks:
        raise ValueError(f"{name}.numel() ({numel}) must be a positive multiple of chunks "
                         f"({chunks}); pad it first")


# -- kernels -----------------------------------------------------------------------------------

def _gpu():
    try:
        import cupy  # noqa: F401
    except ImportError as err:
        raise RuntimeError("MinMaxUInt8 on CUDA tensors needs CuPy: "
                           "pip install 'bagua-comm[cu12]' or 'bagua-comm[cu13]'  (or: pip install "
                           "cupy-cuda12x / cupy-cuda13x)"
                           ) from err
    return _minmax_cupy


def _compress(flat, chunks, payload=None):
    if flat.is_cuda:
        return _gpu().compress(flat, chunks, payload)
    m = flat.numel() // chunks
    rec = record_bytes(m)
    if payload is None:
        payload = torch.empty(chunks * rec, dtype=torch.uint8)
    payload = payload.view(-1)
    mins = np.empty(chunks, dtype=np.float32)
    maxs = np.empty(chunks, dtype=np.float32)
    _minmax.minmax_encode(as_numpy(flat), KINDS[flat.dtype], lut(flat.dtype), chunks, mins,
                          maxs, payload.numpy(), rec, HEADER_BYTES)
    write_headers(payload.view(chunks, rec), torch.from_numpy(mins), torch.from_numpy(maxs),
                  flat.dtype, m)
    return payload


def _decompress(payload, out, chunks, dtype):
    if out.is_cuda:
        _gpu().decompress(payload, out, chunks, dtype)
        return
    rec = record_bytes(out.numel() // chunks)
    mins, maxs = read_headers(payload, chunks, rec, dtype)
    target = out if out.dtype is torch.float32 else torch.empty(out.numel(), dtype=torch.float32)
    _minmax.decode(payload.numpy(), rec, HEADER_BYTES, chunks, mins.numpy(), maxs.numpy(),
                   target.numpy())
    if target is not out:
        out.copy_(target)
