"""Buckets: tensors flattened into one contiguous buffer, each re-pointed to be a view of it.

A collective on ``bucket.buffer`` then reduces every tensor of the bucket at once, and
anything that updates the tensors in place (an optimizer, autograd's gradient accumulation)
updates the buffer::

    grads = [p.grad for p in params]
    b = Bucket(grads, alignment=world_size)   # b.buffer: one flat tensor, padded with zeros
    bc.allreduce_inplace(b.buffer, op=bc.ReduceOp.AVG)   # every p.grad is now averaged
"""

from __future__ import annotations

import torch


class Bucket:
    """One contiguous 1-D buffer holding ``tensors`` back to back.

    The values of ``tensors`` are copied into :attr:`buffer` (``numel`` rounded up to a
    multiple of ``alignment`` elements, the tail zero-filled) and every tensor is re-pointed
    with ``Tensor.set_`` to its slice of the buffer, keeping its shape (with contiguous
    strides).  The tensor objects stay the same, so references held elsewhere (optimizer
    state, ``param.grad``) see the buffer.

    Args:
        tensors: tensors of one dtype on one device, e.g. parameters or their ``.grad``.
        alignment: the buffer's length is a multiple of this many elements.
        name: a label for logs and errors.
    """

    def __init__(self, tensors, alignment: int = 1, name: str | None = None):
        tensors = list(tensors)
        if not tensors:
            raise ValueError("tensors must be a non-empty list of tensors")
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"tensors[{i}] must be a torch.Tensor, got {type(t).__name__}")
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1:
            raise ValueError(f"alignment must be a positive int, got {alignment!r}")
        first = tensors[0]
        for i, t in enumerate(tensors):
            if t.dtype != first.dtype:
                raise ValueError(f"all tensors of a bucket must share a dtype: tensors[0] is "
                                 f"{first.dtype}, tensors[{i}] is {t.dtype}")
            if t.device != first.device:
                raise ValueError(f"all tensors of a bucket must be on one device: tensors[0] "
                                 f"is on {first.device}, tensors[{i}] on {t.device}")
        seen: dict[int, int] = {}
        for i, t in enumerate(tensors):
            if id(t) in seen:
                raise ValueError(f"tensors[{i}] is tensors[{seen[id(t)]}]: a tensor can be in a "
                                 "bucket only once")
            seen[id(t)] = i
        self.name = name
        self.alignment = alignment
        self.tensors = tensors
        self.offsets: list[int] = []
        off = 0
        for t in tensors:
            self.offsets.append(off)
            off += t.numel()
        self.numel = off
        self.padded_numel = -(-off // alignment) * alignment
        self.buffer = torch.zeros(self.padded_numel, dtype=first.dtype, device=first.device)
        self._flatten()

    # -- layout -------------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.buffer.dtype

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    def __len__(self) -> int:
        return len(self.tensors)

    def __repr__(self) -> str:
        label = f"{self.name!r}, " if self.name is not None else ""
        return (f"Bucket({label}{len(self.tensors)} tensors, numel={self.numel}, "
                f"padded_numel={self.padded_numel}, dtype={self.dtype}, device={self.device})")

    def slice(self, i: int) -> torch.Tensor:
        """The flat slice of :attr:`buffer` that holds ``tensors[i]``."""
        off = self.offsets[i]
        return self.buffer[off:off + self.tensors[i].numel()]

    def check_flat(self) -> bool:
        """True while every tensor is still a contiguous view of :attr:`buffer` at its offset.

        It turns False when something replaced a tensor's storage (``param.data = ...``, a
        ``set_`` elsewhere); :meth:`reflatten` repairs that.
        """
        base = self.buffer.untyped_storage().data_ptr()
        for t, off in zip(self.tensors, self.offsets):
            if (t.untyped_storage().data_ptr() != base or t.storage_offset() != off
                    or not t.is_contiguous() or t.dtype != self.dtype
                    or t.device != self.device):
                return False
        return True

    def reflatten(self, tensors=None) -> None:
        """Copy the tensors' current values into the buffer and re-point them at it.

        ``tensors`` (optional) replaces the bucket's tensors one for one (same numel, dtype
        and device), e.g. new ``.grad`` tensors after ``zero_grad(set_to_none=True)``.
        """
        if tensors is not None:
            tensors = list(tensors)
            if len(tensors) != len(self.tensors):
                raise ValueError(f"tensors must have {len(self.tensors)} entries, got "
                                 f"{len(tensors)}")
            for i, (new, old) in enumerate(zip(tensors, self.tensors)):
                if (not isinstance(new, torch.Tensor) or new.numel() != old.numel()
                        or new.dtype != self.dtype or new.device != self.device):
                    raise ValueError(f"tensors[{i}] must be a {self.dtype} tensor of "
                                     f"{old.numel()} elements on {self.device}")
            self.tensors = tensors
        self._flatten()

    def _flatten(self) -> None:
        storage = self.buffer.untyped_storage()
        with torch.no_grad():
            for t, off in zip(self.tensors, self.offsets):
                n = t.numel()
                if not (t.untyped_storage().data_ptr() == storage.data_ptr()
                        and t.storage_offset() == off and t.is_contiguous()):
                    self.buffer[off:off + n].copy_(t.reshape(-1))
                t.set_(storage, off, t.shape, _contiguous_strides(t.shape))


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))
