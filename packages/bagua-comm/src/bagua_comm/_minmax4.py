"""MinMaxUInt4: 4-bit min-max quantisation, two codes per byte (exported by
:mod:`bagua_comm.compression`).

The 8-bit format's rules at 15 levels instead of 255.  The flat input is split into ``chunks``
equal chunks of an even number ``m`` of elements.  Per chunk, with ``eps = 1e-7`` and every
operation in float32::

    scale = 15 / (max - min + eps)
    upper = rint(max * scale);  lower = upper - 15
    q     = clamp(min(rint(x * scale), upper) - lower, 0, 15)     # rint: half to even
    x'    = (q + lower) / scale                                    # decoding

Record layout: ``[min, max]`` in the tensor's own dtype (``-0`` written as ``+0``),
zero-padded to 32 bytes, then ``m / 2`` code bytes (element ``2k`` in the low nibble, element
``2k + 1`` in the high nibble), zero-padded so the record is a multiple of 32 bytes.  A chunk
holding NaN or an infinity is written as ``[NaN, NaN]`` with codes 0 and decodes to NaN.

Error feedback (``error_feedback=True``) is :class:`~bagua_comm.compression.ErrorFeedback`
around the plain form, as for :class:`MinMaxUInt8`: the residual ``x - x'`` per ``key`` is
added to the next input compressed under that key; residuals are
``state_dict()["residuals"]`` (float32 by key), so bagua-algos checkpoints them.

On CPU the kernels are Cython (``_minmax.minmax_encode4`` / ``decode4``, without the GIL:
per chunk a min/max pass, then the encoding pass while the chunk is still in cache; float32
through SSE2 loops in ``_minmax_simd.h``, decoding through a table of each byte's two values);
on CUDA the CuPy kernels of ``_minmax_cupy`` shared with the 8-bit format (plain torch
operations where CuPy is missing).  The bytes are
defined by the formula above, so every implementation of it (the two paths, a numpy one)
produces the same payload.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from .compression import (
    _KINDS,
    HEADER_BYTES,
    RECORD_ALIGN,
    Compressor,
    ErrorFeedback,
    _as_numpy,
    _lut,
    _ResidualsByKey,
    _WithErrorFeedback,
    header_bytes,
)

LEVELS = 15
EPS = 1e-7


def record_bytes4(chunk_numel: int) -> int:
    """Bytes of one MinMaxUInt4 record holding ``chunk_numel`` (even) codes."""
    return HEADER_BYTES + -(-(chunk_numel // 2) // RECORD_ALIGN) * RECORD_ALIGN


def _params(mins: torch.Tensor, maxs: torch.Tensor):
    """scale, upper, lower per chunk, in float32 (division as a true division)."""
    scale = torch.div(torch.full_like(mins, float(LEVELS)), (maxs - mins) + EPS)
    upper = torch.round(maxs * scale)
    return scale, upper, upper - LEVELS


class MinMaxUInt4(_WithErrorFeedback, _ResidualsByKey, Compressor):
    """4-bit min-max quantisation in ``chunks`` chunks: about 1/8 of float32's bytes.

    Args:
        chunks: number of equal chunks; inputs must hold a multiple of ``2 * chunks``
            elements (``alignment``), since two codes share a byte.
        error_feedback: keep each ``key``'s quantisation residual and add it to the next
            input under that key (15 levels lose more than 255: use it for gradients or
            outer gradients that are summed over many steps).
    """

    def __init__(self, chunks: int = 1, *, error_feedback: bool = False):
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks must be a positive int, got {chunks!r}")
        self.chunks = chunks
        self.error_feedback = bool(error_feedback)
        self._ef = ErrorFeedback(MinMaxUInt4(chunks)) if error_feedback else None

    def __repr__(self) -> str:
        return f"MinMaxUInt4(chunks={self.chunks}, error_feedback={self.error_feedback})"

    def _chunks(self, chunks):
        if chunks is None:
            return self.chunks
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks must be a positive int, got {chunks!r}")
        return chunks

    def alignment(self, chunks: int) -> int:
        """Two codes per byte: chunks of an even number of elements."""
        return 2 * self._chunks(chunks)

    def payload_numel(self, numel: int, *, chunks: int | None = None) -> int:
        chunks = self._chunks(chunks)
        _check_numel(numel, chunks, "tensor")
        return chunks * record_bytes4(numel // chunks)

    # -- compress / decompress ----------------------------------------------------------------
    def compress(self, tensor: torch.Tensor, *, chunks: int | None = None,
                 key: str = "default", out: torch.Tensor | None = None) -> torch.Tensor:
        chunks = self._chunks(chunks)
        _check_float("tensor", tensor)
        _check_numel(tensor.numel(), chunks, "tensor")
        flat = tensor.detach().reshape(-1)
        size = chunks * record_bytes4(flat.numel() // chunks)
        if out is not None and (not isinstance(out, torch.Tensor) or out.dtype != torch.uint8
                                or out.numel() != size or not out.is_contiguous()
                                or out.device != flat.device):
            raise ValueError(f"out must be a contiguous uint8 tensor of {size} bytes on "
                             f"{flat.device}")
        if out is None:
            out = torch.empty(size, dtype=torch.uint8, device=flat.device)
        if self._ef is not None:
            return self._ef.compress(tensor, chunks=chunks, key=key, out=out)
        return _encode(flat, chunks, out.view(-1))

    def decompress(self, payload: torch.Tensor, out: torch.Tensor, *,
                   chunks: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        chunks = self._chunks(chunks)
        _check_float("out", out)
        dtype = out.dtype if dtype is None else dtype
        if dtype not in _KINDS:
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
        _check_numel(out.numel(), chunks, "out")
        if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8 \
                or not payload.is_contiguous():
            raise ValueError("payload must be a contiguous uint8 torch.Tensor (from compress())")
        expected = chunks * record_bytes4(out.numel() // chunks)
        if payload.numel() != expected:
            raise ValueError(f"payload has {payload.numel()} bytes, but {out.numel()} elements "
                             f"in {chunks} chunks need {expected}")
        if payload.device != out.device:
            raise ValueError(f"payload is on {payload.device} but out is on {out.device}")
        if out.dtype is torch.float32:
            _decode(payload.reshape(-1), out.view(-1), chunks, dtype)
        else:
            tmp = torch.empty(out.numel(), dtype=torch.float32, device=out.device)
            _decode(payload.reshape(-1), tmp, chunks, dtype)
            out.view(-1).copy_(tmp)
        return out


def _check_float(name, t):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _KINDS:
        raise ValueError(f"{name} must be float32, float16 or bfloat16 for MinMaxUInt4, "
                         f"got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")


def _check_numel(numel, chunks, name):
    if numel == 0 or numel % (2 * chunks):
        raise ValueError(f"{name}.numel() ({numel}) must be a positive multiple of 2 * chunks "
                         f"({2 * chunks}): two 4-bit codes share a byte; pad it first")


@functools.cache
def _cupy_kernels():
    """The CuPy kernels (``_minmax_cupy``), or None without CuPy (then torch operations);
    looked up once (a failed import searches the path again at every call)."""
    try:
        import cupy  # noqa: F401
    except ImportError:
        return None
    from . import _minmax_cupy

    return _minmax_cupy


def _encode(flat: torch.Tensor, chunks: int, payload: torch.Tensor) -> torch.Tensor:
    if flat.is_cuda:
        kernels = _cupy_kernels()
        if kernels is not None:
            return kernels.compress(flat, chunks, payload, bits=4)
        return _encode_torch(flat, chunks, payload)
    return _encode_cpu(flat, chunks, payload)


def _decode(payload: torch.Tensor, out: torch.Tensor, chunks: int, dtype: torch.dtype) -> None:
    if out.is_cuda:
        kernels = _cupy_kernels()
        if kernels is not None:
            kernels.decompress(payload, out, chunks, dtype, bits=4)
        else:
            _decode_torch(payload, out, chunks, dtype)
    else:
        _decode_cpu(payload, out, chunks, dtype)


def _encode_torch(flat: torch.Tensor, chunks: int, payload: torch.Tensor) -> torch.Tensor:
    """The format in torch operations (the CUDA path; any device)."""
    m = flat.numel() // chunks
    rec = record_bytes4(m)
    rows = flat.float().view(chunks, m)
    finite = torch.isfinite(rows).all(1)
    mins = rows.amin(1) + 0.0                       # + 0 turns -0 into +0
    maxs = rows.amax(1) + 0.0
    scale, upper, lower = _params(mins, maxs)
    q = torch.minimum(torch.round(rows * scale[:, None]), upper[:, None]) - lower[:, None]
    # masked fills of scalars: a boolean index or a tensor made from a host value would make
    # the host wait for the GPU
    q = q.clamp_(0, LEVELS).nan_to_num_(0.0).masked_fill_(~finite[:, None], 0).to(torch.uint8)
    mins = mins.masked_fill(~finite, float("nan"))
    maxs = maxs.masked_fill(~finite, float("nan"))
    out = payload.view(chunks, rec)
    isz = flat.element_size()
    out[:, :2 * isz] = header_bytes(mins, maxs, flat.dtype)
    out[:, 2 * isz:HEADER_BYTES] = 0
    out[:, HEADER_BYTES:HEADER_BYTES + m // 2] = q[:, 0::2] | (q[:, 1::2] << 4)
    out[:, HEADER_BYTES + m // 2:] = 0
    return payload


def _encode_cpu(flat: torch.Tensor, chunks: int, payload: torch.Tensor) -> torch.Tensor:
    """The Cython kernels of ``_minmax`` (per chunk: min/max, then encoding; no GIL)."""
    from . import _minmax

    m = flat.numel() // chunks
    rec = record_bytes4(m)
    rows = payload.view(chunks, rec)
    mins = np.empty(chunks, dtype=np.float32)
    maxs = np.empty(chunks, dtype=np.float32)
    src = _as_numpy(flat)
    kind, lut = _KINDS[flat.dtype], _lut(flat.dtype)
    _minmax.minmax_encode4(src, kind, lut, chunks, mins, maxs, payload.numpy(), rec,
                           HEADER_BYTES)
    isz = flat.element_size()
    rows[:, :2 * isz] = header_bytes(torch.from_numpy(mins), torch.from_numpy(maxs), flat.dtype)
    rows[:, 2 * isz:HEADER_BYTES] = 0
    rows[:, HEADER_BYTES + m // 2:] = 0
    return payload


def _decode_torch(payload: torch.Tensor, out: torch.Tensor, chunks: int,
                  dtype: torch.dtype) -> None:
    m = out.numel() // chunks
    rec = record_bytes4(m)
    rows = payload.view(chunks, rec)
    isz = torch.empty(0, dtype=dtype).element_size()
    header = rows[:, :2 * isz].contiguous().view(dtype).float()
    scale, _upper, lower = _params(header[:, 0].contiguous(), header[:, 1].contiguous())
    codes = rows[:, HEADER_BYTES:HEADER_BYTES + m // 2]
    q = out.view(chunks, m)
    q[:, 0::2] = (codes & 15).float()
    q[:, 1::2] = (codes >> 4).float()
    q.add_(lower[:, None]).div_(scale[:, None])


def _decode_cpu(payload: torch.Tensor, out: torch.Tensor, chunks: int,
                dtype: torch.dtype) -> None:
    from . import _minmax

    rec = record_bytes4(out.numel() // chunks)
    isz = torch.empty(0, dtype=dtype).element_size()
    header = payload.view(chunks, rec)[:, :2 * isz].contiguous().view(dtype).float()
    _minmax.decode4(payload.numpy(), rec, HEADER_BYTES, chunks,
                    header[:, 0].contiguous().numpy(), header[:, 1].contiguous().numpy(),
                    out.numpy())
