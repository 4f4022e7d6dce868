"""Compressors: the MinMaxUInt8 format of ByteGrad (byte-compatible with Bagua), and
:class:`MinMaxUInt4`, the same min-max rule at 4 bits (see ``_minmax4``).

A compressor turns a flat float tensor into a ``uint8`` payload and back::

    c = MinMaxUInt8(chunks=4)
    payload = c.compress(x)                 # uint8 tensor, c.payload_numel(x.numel()) bytes
    c.decompress(payload, out)              # out: same dtype and numel as x
    payload, ctx = c.pack(x)                # compress with a context ...
    y = c.unpack(payload, ctx)              # ... that knows dtype, shape and device

Format.  The tensor is split into ``chunks`` equal chunks.  Per chunk,
with ``eps = 1e-7`` and every operation in float32::

    scale = 255 / (max - min + eps)
    upper = rint(max * scale);  lower = upper - 255
    q     = uint8(min(rint(x * scale), upper) - lower)      # saturating; rint: half to even
    x'    = (q + lower) / scale                              # decoding

Each chunk is one record: ``[min, max]`` in the tensor's own dtype, zero-padded to 32 bytes,
then the chunk's codes, zero-padded so the record is a multiple of 32 bytes.  ``-0`` is
written as ``+0``.

Non-finite input never comes out finite: a chunk holding a NaN or an infinity (of either
sign) is written as the header ``[NaN, NaN]`` with all codes 0, and decodes to NaN in every
element of the chunk (CPU and CUDA kernels alike).  Through :func:`bagua_comm.
compressed_allreduce` that NaN reaches every rank, so ``torch.isfinite`` checks and
``GradScaler`` see the overflow; the chunk's other elements are lost for that call.  Input
without NaN/inf is encoded exactly as the formula says.

Error feedback (``error_feedback=True``, or :class:`ErrorFeedback` around any compressor)
keeps, per ``key``, the residual ``x - x'`` of the last compression and adds it to the next
input before compressing it (EF-SGD), so that the quantisation error is not lost but delayed (a non-finite chunk's residual is reset to 0, so
one overflowing step does not poison the next ones).  The residuals are the compressor's state:
:meth:`~Compressor.state_dict` / :meth:`~Compressor.load_state_dict` checkpoint them.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

HEADER_BYTES = 32
RECORD_ALIGN = 32

_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_f16_lut: np.ndarray | None = None
_NO_LUT = np.empty(0, dtype=np.float32)


class Context(NamedTuple):
    """What :meth:`Compressor.unpack` needs to rebuild the tensor."""

    dtype: torch.dtype
    shape: torch.Size
    device: torch.device


class Compressor:
    """Base class of compressors; subclass it to write your own.

    The contract :func:`bagua_comm.compressed_allreduce` and bagua-algos' ``compressor=``
    (ByteGrad, LowPrecisionDecentralized, QAdam) rely on:

    * ``chunks`` (attribute, int): the default number of equal chunks an input is split into.
      ``compressed_allreduce`` needs it to be a multiple of the group size; it compresses each
      rank's whole input with ``chunks=self.chunks`` and each rank's reduced segment with
      ``chunks=self.chunks // group_size``.
    * ``payload_numel(numel, *, chunks=None) -> int``: the number of ``uint8`` payload bytes
      for an input of ``numel`` elements in ``chunks`` chunks (``None``: ``self.chunks``).
      Chunk ``i``'s bytes must be the ``i``-th of ``chunks`` equal, contiguous slices of the
      payload: ``compressed_allreduce`` sends slice ``j`` to rank ``j`` and decodes
      concatenated slices from several ranks as one payload.
    * ``alignment(chunks) -> int``: the element multiple an input compressed in ``chunks``
      chunks must have (a multiple of ``chunks``; default ``chunks``).  ``compressed_allreduce``
      zero-pads its input to it; bagua-algos sizes its buckets to it so no padding copy is made.
    * ``compress(tensor, *, chunks=None, key="default", out=None) -> payload``: a contiguous
      flat ``uint8`` tensor on ``tensor``'s device, written into ``out`` (a contiguous uint8
      tensor of ``payload_numel`` bytes) when given, and returned.  ``key`` names the tensor
      for error feedback (one key per tensor); it must not modify ``tensor``.
    * ``decompress(payload, out, *, chunks=None, dtype=None) -> out``: decodes into ``out``
      (a contiguous float tensor of the input's numel, possibly float32 when the input was
      16-bit) and returns it; ``dtype`` is the dtype the payload was compressed from
      (default ``out.dtype``).
    * ``state_dict()`` / ``load_state_dict(state)``: the compressor's state (error-feedback
      residuals) for checkpoints.  Keep residuals as ``state_dict()["residuals"]``, a dict of
      float32 tensors by ``key``, and bagua-algos carries them across re-bucketing and
      resumes at another bucket size; stateless compressors keep the default (``{}``).

    :meth:`pack`/:meth:`unpack` add the context (dtype, shape, device) so the receiver of a
    payload needs nothing else.
    """

    def alignment(self, chunks: int) -> int:
        """The element multiple an input compressed in ``chunks`` chunks must have."""
        return chunks

    def compress(self, tensor: torch.Tensor, **kwargs) -> torch.Tensor:
        raise NotImplementedError

    def decompress(self, payload: torch.Tensor, out: torch.Tensor, **kwargs) -> torch.Tensor:
        raise NotImplementedError

    def payload_numel(self, numel: int, **kwargs) -> int:
        raise NotImplementedError

    def pack(self, tensor: torch.Tensor, **kwargs) -> tuple[torch.Tensor, Context]:
        return self.compress(tensor, **kwargs), Context(tensor.dtype, tensor.shape,
                                                        tensor.device)

    def unpack(self, payload: torch.Tensor, ctx: Context, **kwargs) -> torch.Tensor:
        out = torch.empty(ctx.shape, dtype=ctx.dtype, device=ctx.device)
        return self.decompress(payload, out, **kwargs)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} has no state, got keys {sorted(state)}")


def record_bytes(chunk_numel: int) -> int:
    """Bytes of one MinMaxUInt8 record holding ``chunk_numel`` codes."""
    return HEADER_BYTES + -(-chunk_numel // RECORD_ALIGN) * RECORD_ALIGN


class _ResidualsByKey:
    """Error-feedback residuals kept per key (``self._residuals``: float32 tensors), with the
    state-dict format both min-max compressors share."""

    chunks: int
    error_feedback: bool
    _residuals: dict

    def residual(self, key: str = "default") -> torch.Tensor | None:
        """A copy of the float32 residual stored under ``key`` (None before the first
        compression).  A copy, because the stored residual is updated in place by every later
        ``compress`` with the same key."""
        r = self._residuals.get(key)
        return None if r is None else r.clone()

    def reset_residuals(self) -> None:
        self._residuals.clear()

    def state_dict(self) -> dict:
        return {"chunks": self.chunks, "error_feedback": self.error_feedback,
                "residuals": {k: v.clone() for k, v in self._residuals.items()}}

    def load_state_dict(self, state: dict) -> None:
        if state.get("chunks", self.chunks) != self.chunks:
            raise ValueError(f"state was saved with chunks={state['chunks']}, this compressor "
                             f"has chunks={self.chunks}")
        residuals = state.get("residuals", {})
        if residuals and not self.error_feedback:
            raise ValueError("state holds error-feedback residuals but this compressor was "
                             "made with error_feedback=False")
        self._residuals = {str(k): v.detach().float().clone() for k, v in residuals.items()}


class ErrorFeedback(_ResidualsByKey, Compressor):
    """Error feedback (EF-SGD) around any :class:`Compressor` without its own.

    Per ``key``, the residual of the last compression is added to the input, that corrected
    input is compressed with ``compressor``, and ``corrected - decoded`` becomes the new
    residual, so the compression error is delayed rather than lost.  A chunk whose decoding
    is not finite (a NaN or an infinity in the input) gets a zero residual, so one
    overflowing step does not poison the next ones.  Sizes, alignment and decompression are
    the wrapped compressor's; the residuals are ``state_dict()["residuals"]`` (float32 by key,
    as bagua-algos carries them).  ``MinMaxUInt8(c, error_feedback=True)`` and
    ``MinMaxUInt4(c, error_feedback=True)`` are this wrapper around their plain form.

    Each key holds two float32 buffers of the input's size, reused call after call: the
    residual (updated in place) and the corrected input.
    """

    error_feedback = True

    def __init__(self, compressor: Compressor):
        if not isinstance(compressor, Compressor):
            raise ValueError(f"compressor must be a bagua_comm.compression.Compressor, got "
                             f"{type(compressor).__name__}")
        if getattr(compressor, "error_feedback", False):
            raise ValueError("compressor already keeps its own error feedback: wrap its "
                             "error_feedback=False form")
        self.compressor = compressor
        self._residuals: dict[str, torch.Tensor] = {}
        self._corrected: dict[str, torch.Tensor] = {}

    def __repr__(self) -> str:
        return f"ErrorFeedback({self.compressor!r})"

    @property
    def chunks(self) -> int:
        return self.compressor.chunks

    def alignment(self, chunks: int) -> int:
        return self.compressor.alignment(chunks)

    def payload_numel(self, numel: int, **kwargs) -> int:
        return self.compressor.payload_numel(numel, **kwargs)

    def decompress(self, payload: torch.Tensor, out: torch.Tensor, **kwargs) -> torch.Tensor:
        return self.compressor.decompress(payload, out, **kwargs)

    def compress(self, tensor: torch.Tensor, *, chunks: int | None = None,
                 key: str = "default", out: torch.Tensor | None = None) -> torch.Tensor:
        """The wrapped compressor's payload of ``tensor`` plus the residual under ``key``;
        the new residual is stored in its place."""
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
        chunks = self.compressor.chunks if chunks is None else chunks
        flat = tensor.detach().reshape(-1)
        res = self._residuals.get(key)
        if res is not None and (res.shape != flat.shape or res.device != flat.device):
            raise ValueError(f"error-feedback residual for key {key!r} has "
                             f"{res.numel()} elements on {res.device}; this tensor has "
                             f"{flat.numel()} on {flat.device}: use one key "
                             "per tensor (or reset_residuals())")
        # corrected = float32(tensor) + residual, in this key's reused buffer (never in the
        # caller's tensor); the decoding then lands in the residual's buffer, which becomes
        # corrected - decoded in place: no full-size allocation after a key's first call.
        corrected = self._corrected.get(key)
        if corrected is None or corrected.shape != flat.shape or corrected.device != flat.device:
            corrected = torch.empty(flat.shape, dtype=torch.float32, device=flat.device)
            self._corrected[key] = corrected
        if res is None:
            corrected.copy_(flat)
            res = torch.empty_like(corrected)
        else:
            torch.add(flat, res, out=corrected)
        payload = self.compressor.compress(corrected.to(tensor.dtype), chunks=chunks, out=out)
        self.compressor.decompress(payload, res, chunks=chunks, dtype=tensor.dtype)
        torch.sub(corrected, res, out=res)                       # the residual
        # a non-finite chunk's residual restarts at 0 (a masked fill: no host synchronisation
        # on CUDA, unlike testing the mask first)
        rows = res.view(chunks, -1)
        rows.masked_fill_(~torch.isfinite(rows).all(1, keepdim=True), 0)
        self._residuals[key] = res
        return payload

    def reset_residuals(self) -> None:
        super().reset_residuals()
        self._corrected.clear()


class _WithErrorFeedback:
    """``error_feedback=True`` of a built-in compressor: an :class:`ErrorFeedback` around its
    plain form does the compression and holds the residuals (``self._ef``)."""

    _ef: ErrorFeedback | None

    @property
    def _residuals(self) -> dict:
        return self._ef._residuals if self._ef is not None else {}

    @_residuals.setter
    def _residuals(self, value: dict) -> None:
        if self._ef is not None:
            self._ef._residuals = value
            self._ef._corrected.clear()
        elif value:
            raise ValueError("no error feedback to hold residuals")

    def reset_residuals(self) -> None:
        if self._ef is not None:
            self._ef.reset_residuals()


class MinMaxUInt8(_WithErrorFeedback, _ResidualsByKey, Compressor):
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
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks must be a positive int, got {chunks!r}")
        self.chunks = chunks
        self.error_feedback = bool(error_feedback)
        self._ef = ErrorFeedback(MinMaxUInt8(chunks)) if error_feedback else None

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
        _check_float("tensor", tensor)
        _check_divisible(tensor.numel(), chunks, "tensor")
        flat = tensor.detach().reshape(-1)
        if out is not None:
            expected = chunks * record_bytes(flat.numel() // chunks)
            if (not isinstance(out, torch.Tensor) or out.dtype != torch.uint8
                    or out.numel() != expected or not out.is_contiguous()
                    or out.device != flat.device):
                raise ValueError(f"out must be a contiguous uint8 tensor of {expected} bytes "
                                 f"on {flat.device}")
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
        _check_float("out", out)
        dtype = out.dtype if dtype is None else dtype
        if dtype not in _KINDS:
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
        _check_divisible(out.numel(), chunks, "out")
        if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8:
            raise ValueError("payload must be a uint8 torch.Tensor (from compress())")
        if not payload.is_contiguous():
            raise ValueError("payload must be contiguous")
        expected = chunks * record_bytes(out.numel() // chunks)
        if payload.numel() != expected:
            raise ValueError(f"payload has {payload.numel()} bytes, but {out.numel()} elements "
                             f"in {chunks} chunks need {expected}")
        if payload.device != out.device:
            raise ValueError(f"payload is on {payload.device} but out is on {out.device}")
        _decompress(payload.reshape(-1), out.detach().view(-1), chunks, dtype)
        return out

    # -- error-feedback state: _ResidualsByKey's, held by self._ef (_WithErrorFeedback) -----
    def _chunks(self, chunks):
        if chunks is None:
            return self.chunks
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks must be a positive int, got {chunks!r}")
        return chunks


# -- kernels ----------------------------------------------------------------------------------
_CANONICAL_NAN = {torch.float32: (torch.int32, 0x7FC00000), torch.float16: (torch.int16, 0x7E00),
                  torch.bfloat16: (torch.int16, 0x7FC0)}


def header_bytes(mins: torch.Tensor, maxs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The ``[min, max]`` headers (float32 in) as ``dtype`` bytes, one row per chunk.

    A NaN (a non-finite chunk) is written as the dtype's canonical quiet NaN on every device
    (torch's own float-to-16-bit conversions of NaN differ between CPU and CUDA).
    """
    pair = torch.stack([mins, maxs], dim=1)
    bits_dtype, canonical = _CANONICAL_NAN[dtype]
    bits = pair.to(dtype).view(bits_dtype)
    # a Python scalar fill: no tensor made from host values (a blocking copy on CUDA)
    return bits.masked_fill(pair.isnan(), canonical).view(torch.uint8)


def _check_float(name, t):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _KINDS:
        raise ValueError(f"{name} must be float32, float16 or bfloat16 for MinMaxUInt8, "
                         f"got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")


def _check_divisible(numel, chunks, name="tensor"):
    if numel == 0 or numel % chunks:
        raise ValueError(f"{name}.numel() ({numel}) must be a positive multiple of chunks "
                         f"({chunks}); pad it first")


def _lut(dtype):
    global _f16_lut
    if dtype is not torch.float16:
        return _NO_LUT
    if _f16_lut is None:
        _f16_lut = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16) \
            .astype(np.float32)
    return _f16_lut


def _as_numpy(flat):
    if flat.dtype is torch.float32:
        return flat.numpy()
    return flat.view(torch.int16).numpy().view(np.uint16)


def _gpu():
    try:
        import cupy  # noqa: F401
    except ImportError as err:
        raise RuntimeError("MinMaxUInt8 on CUDA tensors needs CuPy: "
                           "pip install 'bagua-comm[cu12]' or 'bagua-comm[cu13]'  (or: pip install "
                           "cupy-cuda12x / cupy-cuda13x)"
                           ) from err
    from . import _minmax_cupy

    return _minmax_cupy


def _compress(flat, chunks, payload=None):
    if flat.is_cuda:
        return _gpu().compress(flat, chunks, payload)
    from . import _minmax

    m = flat.numel() // chunks
    rec = record_bytes(m)
    isz = flat.element_size()
    if payload is None:
        payload = torch.empty(chunks * rec, dtype=torch.uint8)
    payload = payload.view(-1)
    rows = payload.view(chunks, rec)
    mins = np.empty(chunks, dtype=np.float32)
    maxs = np.empty(chunks, dtype=np.float32)
    src = _as_numpy(flat)
    kind, lut = _KINDS[flat.dtype], _lut(flat.dtype)
    _minmax.minmax_encode(src, kind, lut, chunks, mins, maxs, payload.numpy(), rec,
                          HEADER_BYTES)
    rows[:, :2 * isz] = header_bytes(torch.from_numpy(mins), torch.from_numpy(maxs), flat.dtype)
    rows[:, 2 * isz:HEADER_BYTES] = 0
    rows[:, HEADER_BYTES + m:] = 0
    return payload


def _decompress(payload, out, chunks, dtype):
    if out.is_cuda:
        _gpu().decompress(payload, out, chunks, dtype)
        return
    from . import _minmax

    m = out.numel() // chunks
    rec = record_bytes(m)
    isz = torch.empty(0, dtype=dtype).element_size()
    header = payload.view(chunks, rec)[:, :2 * isz].contiguous().view(dtype).float()
    mins = header[:, 0].contiguous().numpy()
    maxs = header[:, 1].contiguous().numpy()
    target = out if out.dtype is torch.float32 else torch.empty(out.numel(), dtype=torch.float32)
    _minmax.decode(payload.numpy(), rec, HEADER_BYTES, chunks, mins, maxs, target.numpy())
    if target is not out:
        out.copy_(target)


# The 4-bit format lives in its own module (it reuses this one's header writer).
from ._minmax4 import MinMaxUInt4, record_bytes4  # noqa: E402

__all__ = ["Compressor", "Context", "ErrorFeedback", "MinMaxUInt4", "MinMaxUInt8",
           "record_bytes", "record_bytes4"]
