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

from .. import _minmax
from . import _minmax_cupy
from ._error_feedback import _WithErrorFeedback
from ._format import (
    HEADER_BYTES,
    KINDS,
    as_numpy,
    check_dtype,
    check_float,
    check_out,
    check_payload_fits,
    lut,
    read_headers,
    record_bytes4,
    write_headers,
)

LEVELS = 15
EPS = 1e-7


def _params(mins: torch.Tensor, maxs: torch.Tensor):
    """scale, upper, lower per chunk, in float32 (division as a true division)."""
    scale = torch.div(torch.full_like(mins, float(LEVELS)), (maxs - mins) + EPS)
    upper = torch.round(maxs * scale)
    return scale, upper, upper - LEVELS


class MinMaxUInt4(_WithErrorFeedback):
    """4-bit min-max quantisation in ``chunks`` chunks: about 1/8 of float32's bytes.

    Args:
        chunks: number of equal chunks; inputs must hold a multiple of ``2 * chunks``
            elements (``alignment``), since two codes share a byte.
        error_feedback: keep each ``key``'s quantisation residual and add it to the next
            input under that key (15 levels lose more than 255: use it for gradients or
            outer gradients that are summed over many steps).
    """

    def __init__(self, chunks: int = 1, *, error_feedback: bool = False):
        self._setup(chunks, error_feedback, MinMaxUInt4)

    def __repr__(self) -> str:
        return f"MinMaxUInt4(chunks={self.chunks}, error_feedback={self.error_feedback})"

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
        check_float("tensor", tensor, "MinMaxUInt4")
        _check_numel(tensor.numel(), chunks, "tensor")
        flat = tensor.detach().reshape(-1)
        size = chunks * record_bytes4(flat.numel() // chunks)
        if out is not None:
            check_out(out, size, flat.device)
        else:
            out = torch.empty(size, dtype=torch.uint8, device=flat.device)
        if self._ef is not None:
            return self._ef.compress(tensor, chunks=chunks, key=key, out=out)
        return _encode(flat, chunks, out.view(-1))

    def decompress(self, payload: torch.Tensor, out: torch.Tensor, *,
                   chunks: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        chunks = self._chunks(chunks)
        check_float("out", out, "MinMaxUInt4")
        dtype = out.dtype if dtype is None else dtype
        check_dtype(dtype)
        _check_numel(out.numel(), chunks, "out")
        if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8 \
                or not payload.is_contiguous():
            raise ValueError("payload must be a contiguous uint8 torch.Tensor (from compress())")
        check_payload_fits(payload, out, chunks, chunks * record_bytes4(out.numel() // chunks))
        if out.dtype is torch.float32:
            _decode(payload.reshape(-1), out.view(-1), chunks, dtype)
        else:
            tmp = torch.empty(out.numel(), dtype=torch.float32, device=out.device)
            _decode(payload.reshape(-1), tmp, chunks, dtype)
            out.view(-1).copy_(tmp)
        return out


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
    write_headers(out, mins, maxs, flat.dtype, m // 2)
    out[:, HEADER_BYTES:HEADER_BYTES + m // 2] = q[:, 0::2] | (q[:, 1::2] << 4)
    return payload


def _encode_cpu(flat: torch.Tensor, chunks: int, payload: torch.Tensor) -> torch.Tensor:
    """The Cython kernels of ``_minmax`` (per chunk: min/max, then encoding; no GIL)."""
    m = flat.numel() // chunks
    rec = record_bytes4(m)
    mins = np.empty(chunks, dtype=np.float32)
    maxs = np.empty(chunks, dtype=np.float32)
    _minmax.minmax_encode4(as_numpy(flat), KINDS[flat.dtype], lut(flat.dtype), chunks, mins,
                           maxs, payload.numpy(), rec, HEADER_BYTES)
    write_headers(payload.view(chunks, rec), torch.from_numpy(mins), torch.from_numpy(maxs),
                  flat.dtype, m // 2)
    return payload


def _decode_torch(payload: torch.Tensor, out: torch.Tensor, chunks: int,
                  dtype: torch.dtype) -> None:
    m = out.numel() // chunks
    rec = record_bytes4(m)
    scale, _upper, lower = _params(*read_headers(payload, chunks, rec, dtype))
    codes = payload.view(chunks, rec)[:, HEADER_BYTES:HEADER_BYTES + m // 2]
    q = out.view(chunks, m)
    q[:, 0::2] = (codes & 15).float()
    q[:, 1::2] = (codes >> 4).float()
    q.add_(lower[:, None]).div_(scale[:, None])


def _decode_cpu(payload: torch.Tensor, out: torch.Tensor, chunks: int,
                dtype: torch.dtype) -> None:
    rec = record_bytes4(out.numel() // chunks)
    mins, maxs = read_headers(payload, chunks, rec, dtype)
    _minmax.decode4(payload.numpy(), rec, HEADER_BYTES, chunks, mins.numpy(), maxs.numpy(),
                    out.numpy())
