"""MinMaxUInt8: 8-bit min-max quantisation, Bagua's ByteGrad format (the format is described
in :mod:`bagua_comm.compression`).

On CPU the kernels are Cython (``bagua_comm._minmax``: ``compress_records`` /
``decode_reduce_at``, without the GIL); on CUDA the CuPy kernels of ``_minmax_cupy`` (which
imports CuPy at its first call).  Either way one kernel call writes a tensor's whole payload
(min/max, headers, codes, padding) and one decodes it (several ranks' payloads reduced into one
output: ``compressed_allreduce``'s reduce), with no torch operation around them.
"""

from __future__ import annotations

import torch

from .. import _minmax
from . import _format, _minmax_cupy
from ._error_feedback import _WithErrorFeedback
from ._format import KINDS, lut, record_bytes


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
        flat = _flat(tensor)
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
        return self._decompress_reduce(payload, out, chunks=chunks, dtype=dtype)

    @staticmethod
    def _kernel_args(dtype: torch.dtype) -> tuple:
        """(kind, float16 table) of the CPU kernels for inputs of ``dtype``: what
        ``bagua_comm._worker``'s compiled collective passes them."""
        return KINDS[dtype], lut(dtype)

    def _decompress_reduce(self, payload: torch.Tensor, out: torch.Tensor, *,
                           chunks: int | None = None, dtype: torch.dtype | None = None,
                           rows: int = 1, op: int = 0) -> torch.Tensor:
        """:meth:`decompress` of ``rows`` payloads of ``chunks / rows`` records each,
        concatenated, reduced element by element into ``out`` (one row's elements) in the
        same kernel call: ``op`` 0 sum, 1 average, 2 min, 3 max, in float32 (bagua_comm's
        ``compressed_allreduce`` reduces its segment this way); ``op`` 4, one row into a
        float32 ``out``: ``out += `` the decoding (``out.add_(decompress(...))`` in one
        pass, as LowPrecisionDecentralized updates its replicas)."""
        chunks = self._chunks(chunks)
        _format.check_float("out", out, "MinMaxUInt8")
        dtype = out.dtype if dtype is None else dtype
        _format.check_dtype(dtype)
        if rows < 1 or chunks % rows:
            raise ValueError(f"rows ({rows}) must divide chunks ({chunks})")
        if op not in (0, 1, 2, 3, 4) or (op == 4 and (rows != 1 or out.dtype != torch.float32)):
            raise ValueError(f"op must be 0-3, or 4 with rows=1 and a float32 out; got op={op}")
        _check_divisible(out.numel(), chunks // rows, "out")
        if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8:
            raise ValueError("payload must be a uint8 torch.Tensor (from compress())")
        if not payload.is_contiguous():
            raise ValueError("payload must be contiguous")
        _format.check_payload_fits(payload, out, chunks,
                                   chunks * record_bytes(out.numel() * rows // chunks))
        _decompress(_flat(payload), _flat(out), chunks, dtype, rows, op)
        return out


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached and flat, without dispatching anything when it already is."""
    if t.requires_grad:
        t = t.detach()
    return t if t.dim() == 1 else t.reshape(-1)


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
    rec = record_bytes(flat.numel() // chunks)
    if payload is None:
        payload = torch.empty(chunks * rec, dtype=torch.uint8)
    elif payload.dim() != 1:
        payload = payload.view(-1)
    # one call: min/max, headers, codes and padding of every chunk (by address: no numpy
    # view, whose making dispatches a detach per tensor)
    _minmax.compress_records_at(flat.data_ptr(), flat.numel(), KINDS[flat.dtype],
                                lut(flat.dtype), chunks, payload.data_ptr(), payload.numel(),
                                rec)
    return payload


def _decompress(payload, out, chunks, dtype, rows=1, op=0):
    """Decode ``payload`` (``rows`` payloads of ``chunks / rows`` records, concatenated) into
    ``out``, reducing the rows with ``op`` (0 sum, 1 average, 2 min, 3 max; 4: add into
    ``out``, one row)."""
    if out.is_cuda:
        _gpu().decompress(payload, out, chunks, dtype, rows=rows, op=op)
        return
    rec = record_bytes(out.numel() * rows // chunks)
    target = out if out.dtype is torch.float32 else torch.empty(out.numel(), dtype=torch.float32)
    _minmax.decode_reduce_at(payload.data_ptr(), payload.numel(), rec, chunks, rows,
                             KINDS[dtype], lut(dtype), target.data_ptr(), target.numel(), op)
    if target is not out:
        out.copy_(target)
