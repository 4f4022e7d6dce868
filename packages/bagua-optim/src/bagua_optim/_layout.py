"""Flat storage for runs of parameters and their gradients.

A *run* is a list of parameters of one param group, one dtype and one device whose data are
consecutive pieces of one flat 1-D buffer, and whose gradients, when present, are consecutive
pieces of a second one.  Parameters already laid out back to back (by bagua-algos buckets, an
earlier flatten, cuDNN RNN weights) are adopted where they are; with ``do_flatten=True`` the
others are copied into a new flat buffer and re-pointed (``p.data = view``).  Gradients are
looked at before every step: wherever they lie back to back they are used in place, otherwise
(``do_flatten=True`` only) they are copied into the run's own flat gradient and re-pointed.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch

_GRAD = operator.attrgetter("grad")
_PTR = torch.Tensor.data_ptr
_UNSEEN = object()      # a gradient never looked at: fails the identity check

# A segment spans at most this many elements (1 MiB of float32): enough that the per-update
# overhead no longer matters, small enough that an optimizer's several passes over a segment
# (and its temporaries) stay in cache as they do per parameter.
MAX_SEGMENT_NUMEL = 1 << 18

# Parameters of at least this many elements (128 KiB of float32) are not copied into a flat
# buffer: for them the per-parameter overhead is already smaller than the cost of copying new
# gradients into flat storage after zero_grad(set_to_none=True), so they are stepped exactly
# as without fusing.  (Ones already back to back, e.g. in a bucket, are fused whatever size.)
FLATTEN_MAX_NUMEL = 1 << 15


def _span(base: torch.Tensor, start: int, total: int) -> torch.Tensor:
    """A 1-D tensor of ``total`` elements over ``base``'s storage, from element ``start``."""
    return base.new_empty(0).set_(base.untyped_storage(), start, (total,), (1,))



def fusable(p: torch.Tensor) -> bool:
    """Whether ``p`` can live in a flat buffer: dense, contiguous, floating or complex."""
    return (p.layout == torch.strided and p.is_contiguous() and p.numel() > 0
            and (p.is_floating_point() or p.is_complex()))


class Run:
    """Consecutive parameters sharing one flat data buffer and one flat gradient buffer."""

    __slots__ = ("flat", "flat_grad", "grad_views", "move_grads", "numels", "offsets",
                 "own_grad", "own_slots", "params", "ptrs", "segments")

    def __init__(self, params: list[torch.Tensor], flat: torch.Tensor, move_grads: bool):
        self.params = params
        self.flat = flat
        self.move_grads = move_grads    # may re-point gradients into own_grad
        self.numels = [p.numel() for p in params]
        self.offsets = []
        off = 0
        for n in self.numels:
            self.offsets.append(off)
            off += n
        self.ptrs = list(map(_PTR, params))
        self.own_grad: torch.Tensor | None = None
        self.own_slots: list[torch.Tensor] = []
        self.flat_grad: torch.Tensor | None = None
        self.grad_views: list = [_UNSEEN] * len(params)
        self.segments = None            # built lazily by the step (see _segments.py)

    # -- checks on the hot path ------------------------------------------------------------
    def grads_in_place(self) -> bool:
        """Every gradient is the view (or the None) this run last recorded."""
        return all(map(operator.is_, map(_GRAD, self.params), self.grad_views))

    def params_in_place(self) -> bool:
        """No parameter's storage was replaced behind the optimizer's back."""
        return list(map(_PTR, self.params)) == self.ptrs

    # -- gradients ------------------------------------------------------------------------
    def _slots(self) -> list[torch.Tensor]:
        """Views of the run's own flat gradient, one per member (made once)."""
        if self.own_grad is None:
            self.own_grad = torch.zeros_like(self.flat)
            self.own_slots = [self.own_grad[o:o + n].view_as(p)
                              for p, o, n in zip(self.params, self.offsets, self.numels)]
        return self.own_slots

    def adopt_grads(self) -> bool:
        """Record the gradients as they are now; False when they cannot be fused this step.

        Gradients already back to back (in any storage) are used in place; otherwise, when
        allowed, they are copied into the run's own flat gradient and re-pointed there.
        (torch guarantees a dense gradient has its parameter's shape, dtype and device.)
        """
        grads = list(map(_GRAD, self.params))
        present = [g for g in grads if g is not None]
        try:
            flat_grad = self._back_to_back(grads, present)
        except RuntimeError:    # sparse gradients have no data pointer: step them unfused
            return False
        if flat_grad is None:
            if not self.move_grads:
                return False
            slots = self._slots()
            if len(present) == len(grads):
                torch._foreach_copy_(slots, grads)
                grads = list(slots)
            else:
                grads = [None if g is None else s for s, g in zip(slots, grads)]
                torch._foreach_copy_([g for g in grads if g is not None], present)
            with torch.no_grad():
                for p, g in zip(self.params, grads):
                    p.grad = g
            flat_grad = self.own_grad
        if self.flat_grad is None or flat_grad is None \
                or flat_grad.data_ptr() != self.flat_grad.data_ptr():
            self.segments = None    # stand-ins hold slices of the old flat gradient
        self.flat_grad = flat_grad
        self.grad_views = grads
        return True

    def _back_to_back(self, grads: list, present: list) -> torch.Tensor | None:
        """One flat tensor the present gradients are consecutive pieces of, or None."""
        if not present:
            return self.flat_grad if self.flat_grad is not None else self.own_grad
        size = self.flat.element_size()
        first = next(i for i, g in enumerate(grads) if g is not None)
        base = present[0].data_ptr() - self.offsets[first] * size
        for g, o in zip(grads, self.offsets):
            if g is not None and g.data_ptr() != base + o * size:
                return None
        if not all(map(torch.Tensor.is_contiguous, present)):
            return None
        if self.flat_grad is not None and self.flat_grad.data_ptr() == base:
            return self.flat_grad
        storage = present[0].untyped_storage()
        start, rem = divmod(base - storage.data_ptr(), size)
        if rem or start < 0 or (start + self.flat.numel()) * size > storage.nbytes():
            return None
        return _span(present[0], start, self.flat.numel())


def flatten(params: list[torch.Tensor]) -> Run:
    """Copy ``params`` into one new flat buffer and make each parameter a view of it."""
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    run = Run(params, flat, move_grads=True)
    with torch.no_grad():
        for p, o, n in zip(params, run.offsets, run.numels):
            p.data = flat[o:o + n].view_as(p)
    run.ptrs = list(map(_PTR, params))
    return run


def _adjacent(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and a.storage_offset() + a.numel() == b.storage_offset())


def adopt(params: list[torch.Tensor], move_grads: bool) -> tuple[list[Run], list]:
    """Runs of parameters already back to back in memory, and the parameters left over.

    Parameters are taken in storage order; nothing is copied.
    """
    runs: list[Run] = []
    rest: list[torch.Tensor] = []
    cur: list[torch.Tensor] = []

    def close():
        if len(cur) > 1:
            first = cur[0]
            flat = _span(first, first.storage_offset(), sum(p.numel() for p in cur))
            runs.append(Run(list(cur), flat, move_grads))
        else:
            rest.extend(cur)
        cur.clear()

    for p in sorted(params, key=_PTR):
        if cur and not _adjacent(cur[-1], p):
            close()
        cur.append(p)
    close()
    order = {id(p): i for i, p in enumerate(params)}
    rest.sort(key=lambda p: order[id(p)])
    return runs, rest


def split_by_key(params: Iterable[torch.Tensor]) -> dict[tuple, list[torch.Tensor]]:
    """Group parameters by (dtype, device), keeping their order."""
    out: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        out.setdefault((p.dtype, p.device), []).append(p)
    return out
