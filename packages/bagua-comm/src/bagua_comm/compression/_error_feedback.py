"""Error feedback (EF-SGD): :class:`ErrorFeedback` around any compressor, and the residual
state both min-max compressors keep with ``error_feedback=True``."""

from __future__ import annotations

import torch

from ._base import Compressor
from ._format import check_chunks


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
        # a non-finite chunk's residual restarts at 0, without a host synchronisation on
        # CUDA (no test of the mask first) and in three cheap passes: per chunk the sum (a NaN
        # or an inf in it makes it non-finite; so would a sum past float32's range, of
        # residuals near 1e38 / chunk size, and such a chunk restarts too), the bad chunks
        # multiplied by 0 plus +0.0 (the good ones by 1 plus -0.0: x exactly, signed zeros
        # too), then what that leaves non-finite (NaN, inf x 0) set to 0: a bad chunk is all
        # +0.0.  A full-size isfinite().all() and a broadcast masked fill took 3.7 of 5.9 ms
        # for 1.44M floats on one core, 2.5x the codec itself.
        rows = res.view(chunks, -1)
        ok = torch.isfinite(rows.sum(1, keepdim=True))
        # (mul_ then add_: addcmul with a per-chunk input took 4x as long on one core)
        rows.mul_(ok.to(rows.dtype)).add_(torch.where(ok, -0.0, 0.0)).nan_to_num_(0.0, 0.0,
                                                                                   0.0)
        self._residuals[key] = res
        return payload

    def reset_residuals(self) -> None:
        super().reset_residuals()
        self._corrected.clear()


class _WithErrorFeedback(_ResidualsByKey, Compressor):
    """A built-in compressor (MinMaxUInt8, MinMaxUInt4): ``chunks`` equal chunks, and
    ``error_feedback=True`` as an :class:`ErrorFeedback` around its plain form, which does
    the compression and holds the residuals (``self._ef``)."""

    _ef: ErrorFeedback | None

    def _setup(self, chunks: int, error_feedback: bool, plain: type) -> None:
        self.chunks = check_chunks(chunks)
        self.error_feedback = bool(error_feedback)
        self._ef = ErrorFeedback(plain(chunks)) if error_feedback else None

    def _chunks(self, chunks) -> int:
        """``chunks`` of a call: the compressor's own when None."""
        return self.chunks if chunks is None else check_chunks(chunks)

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
