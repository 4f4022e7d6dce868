"""The compressor interface: :class:`Compressor` (subclass it to write your own) and the
:class:`Context` that :meth:`Compressor.pack` adds to a payload."""

from __future__ import annotations

from typing import NamedTuple

import torch


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
