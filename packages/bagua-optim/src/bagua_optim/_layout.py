"""Flat storage for runs of parameters and their gradients.

A *run* is a list of parameters of one param group, one dtype and one device whose data are
consecutive views of one flat 1-D buffer (and, once they have gradients, whose gradients are
consecutive views of a second flat buffer).  With ``do_flatten=True`` the run owns both
buffers: parameters are copied in and re-pointed with ``p.data = view``.  With
``do_flatten=False`` a run only adopts parameters that some other component (for example a
bagua-algos bucket) already laid out back to back, and nothing is ever moved.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch

_GRAD = operator.attrgetter("grad")
_PTR = torch.Tensor.data_ptr


def _span(first: torch.Tensor, total: int) -> torch.Tensor:
    """A 1-D tensor of ``total`` elements over ``first``'s storage, starting where it starts."""
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (total,), (1,))


def fusable(p: torch.Tensor) -> bool:
    """Whether ``p`` can live in a flat buffer: dense, contiguous, floating or complex."""
    return (p.layout == torch.strided and p.is_contiguous() and p.numel() > 0
            and (p.is_floating_point() or p.is_complex()))


class Run:
    """Consecutive parameters sharing one flat data buffer and one flat gradient buffer."""

    __slots__ = ("flat", "flat_grad", "grad_views", "numels", "offsets", "owned", "params",
                 "ptrs", "segments")

    def __init__(self, params: list[torch.Tensor], flat: torch.Tensor, owned: bool):
        self.params = params
        self.flat = flat
        self.owned = owned              # we allocated flat/flat_grad and may move grads in
        self.numels = [p.numel() for p in params]
        self.offsets = []
        off = 0
        for n in self.numels:
            self.offsets.append(off)
            off += n
        self.ptrs = list(map(_PTR, params))
        self.flat_grad: torch.Tensor | None = None
        self.grad_views: list[torch.Tensor | None] = [None] * len(params)
        self.segments = None            # built lazily by the step (see _segments.py)

    # -- checks on the hot path ------------------------------------------------------------
    def grads_in_place(self) -> bool:
        """Every gradient is the view (or the None) this run last recorded."""
        return all(map(operator.is_, map(_GRAD, self.params), self.grad_views))

    def params_in_place(self) -> bool:
        """No parameter's storage was replaced behind the optimizer's back."""
        return list(map(_PTR, self.params)) == self.ptrs

    # -- gradients ------------------------------------------------------------------------
    def _slot(self, buf: torch.Tensor, i: int) -> torch.Tensor:
        o = self.offsets[i]
        return buf[o:o + self.numels[i]].view_as(self.params[i])

    def adopt_grads(self) -> bool:
        """Record the gradients as they are now, moving foreign ones into the flat buffer.

        Returns False when a gradient cannot be a view of this run's flat gradient (sparse,
        another dtype or device, or, for a run that may not move anything, not where the
        other gradients put it): the caller then steps the run unfused.
        """
        if not self.owned:
            return self._find_grads()
        if self.flat_grad is None:
            self.flat_grad = torch.zeros_like(self.flat)
        moved_src, moved_dst = [], []
        for i, p in enumerate(self.params):
            g = p.grad
            if g is None or g is self.grad_views[i]:
                self.grad_views[i] = g
                continue
            slot = self._slot(self.flat_grad, i)
            if g.layout != torch.strided or g.dtype != p.dtype or g.device != p.device \
                    or g.shape != p.shape:
                return False
            if g.data_ptr() != slot.data_ptr() or not g.is_contiguous():
                moved_src.append(g)
                moved_dst.append(slot)
                g = slot
            self.grad_views[i] = g
        if moved_src:
            torch._foreach_copy_(moved_dst, moved_src)
            with torch.no_grad():
                for p, v in zip(self.params, self.grad_views):
                    if p.grad is not v:
                        p.grad = v
        return True

    def _find_grads(self) -> bool:
        """For a run that moves nothing: do the gradients lie back to back as well?"""
        grads = [p.grad for p in self.params]
        base = None
        for i, g in enumerate(grads):
            if g is None:
                continue
            if g.layout != torch.strided or g.dtype != self.flat.dtype \
                    or g.device != self.flat.device or not g.is_contiguous() \
                    or g.shape != self.params[i].shape:
                return False
            start = g.storage_offset() - self.offsets[i]
            if base is None:
                base = g
                base_start = start
            elif (g.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
                  or start != base_start):
                return False
        if base is not None:
            total = self.flat.numel()
            if base_start < 0 or (base_start + total) * base.element_size() \
                    > base.untyped_storage().nbytes():
                return False
            self.flat_grad = base.new_empty(0).set_(
                base.untyped_storage(), base_start, (total,), (1,))
        self.grad_views = grads
        return True


def flatten(params: list[torch.Tensor]) -> Run:
    """Copy ``params`` into one new flat buffer and make each parameter a view of it."""
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    run = Run(params, flat, owned=True)
    with torch.no_grad():
        for i, p in enumerate(params):
            p.data = run._slot(flat, i)
    run.ptrs = list(map(_PTR, params))
    grads = [p.grad for p in params]
    if any(g is not None for g in grads):
        run.flat_grad = torch.zeros_like(flat)
        if not run.adopt_grads():
            # a gradient that cannot be fused (sparse, ...): leave it to the per-step check
            run.flat_grad = torch.zeros_like(flat)
            run.grad_views = [None] * len(params)
    return run


def _adjacent(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and a.storage_offset() + a.numel() == b.storage_offset())


def adopt(params: list[torch.Tensor]) -> list[Run]:
    """Runs of parameters that are already back to back in memory; nothing is copied.

    Parameters are taken in storage order.  Their gradients are looked at by each step
    (``Run.adopt_grads``): a run is fused only while they lie back to back as well.
    """
    ordered = sorted(params, key=_PTR)
    runs: list[Run] = []
    cur: list[torch.Tensor] = []

    def close():
        if len(cur) > 1:
            run = Run(list(cur), _span(cur[0], sum(p.numel() for p in cur)), owned=False)
            run.grad_views = [object()] * len(cur)     # never "in place": looked at first
            runs.append(run)
        cur.clear()

    for p in ordered:
        if cur and not _adjacent(cur[-1], p):
            close()
        cur.append(p)
    close()
    return runs


def split_by_key(params: Iterable[torch.Tensor]) -> dict[tuple, list[torch.Tensor]]:
    """Group parameters by (dtype, device), keeping their order."""
    out: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        out.setdefault((p.dtype, p.device), []).append(p)
    return out
