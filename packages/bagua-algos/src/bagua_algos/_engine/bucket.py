"""Buckets: a group of parameters whose gradients (and, if asked, weights) live in one flat,
padded buffer, so that one collective moves them all."""

from __future__ import annotations

import torch

from bagua_comm.bucket import Bucket

from . import _hot


def _same_storage(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    return a is not None and a.data_ptr() == b.data_ptr() and a.shape == b.shape


def _dense(t: torch.Tensor) -> bool:
    """True when ``t``'s elements fill ``t.numel()`` consecutive storage slots (a
    contiguous tensor, or a permutation of one: channels_last, transposed)."""
    expected = 1
    for size, stride in sorted((d for d in zip(t.shape, t.stride()) if d[0] != 1),
                               key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))


class BaguaBucket:
    """Parameters of one dtype and device, with flat ``grad`` (and ``weight``) buffers.

    ``grad`` (and ``weight``) are 1-D buffers of ``padded_numel`` elements (a multiple of the
    algorithm's alignment; the padding stays zero).  With ``flag_slots`` (the module gives
    them to the last bucket) ``grad`` is the front of ``grad_and_flags``, whose tail
    ``flags`` holds that many "got a gradient" flags; otherwise ``grad_and_flags`` is
    ``grad`` and ``flags`` None.  With ``flatten=True`` every parameter's
    ``.grad`` (and, with ``flatten_weights=True``, its data) is a view of the buffer, so
    communication reads and writes them in place; otherwise values are staged through the
    buffer by :meth:`gather_grads`/:meth:`scatter_grads` (and the weight counterparts).
    """

    def __init__(self, index: int, params: list[torch.nn.Parameter], *, alignment: int = 1,
                 flatten: bool = True, flatten_weights: bool = False,
                 names: list[str] | None = None, flag_slots: int = 0):
        if not params:
            raise ValueError("a bucket needs at least one parameter")
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(f"a bucket holds one dtype and device, got {dtypes} on {devices}")
        if alignment < 1:
            raise ValueError(f"alignment must be >= 1, got {alignment}")
        self.index = index
        self.name = f"bucket{index}"
        self.params = list(params)
        # what each slot describes: state is keyed by these names, never by bucket index
        self.names = list(names) if names is not None else [f"{index}.{i}"
                                                            for i in range(len(params))]
        if len(self.names) != len(self.params):
            raise ValueError(f"names must name each of the {len(params)} parameters")
        self.dtype = params[0].dtype
        self.device = params[0].device
        self.flatten = flatten
        # gradient slots: zero tensors shaped like the parameters, flattened by bagua_comm
        grads = self._zeros_bucket(alignment, "grad")
        self.numel = grads.numel
        self.padded_numel = grads.padded_numel
        self.offsets = grads.offsets
        self.grad = grads.buffer
        self._grad_views = grads.tensors
        self.flags: torch.Tensor | None = None
        self.grad_and_flags = self.grad
        if flag_slots:
            self._add_flag_slots(flag_slots)
        self.weight: torch.Tensor | None = None
        self._weight_views: list[torch.Tensor] = []
        self._alignment = alignment
        if flatten_weights:
            self._init_weights()

    def _add_flag_slots(self, n: int) -> None:
        """Move ``grad`` to the front of a buffer ``n`` elements longer: the tail,
        :attr:`flags`, holds the module's per-tensor "got a gradient" flags, so that an
        algorithm reducing :attr:`grad_and_flags` elementwise carries them in the step's own
        collective.  No parameter's view and no algorithm state covers the tail."""
        full = torch.zeros(self.padded_numel + n, dtype=self.dtype, device=self.device)
        storage = full.untyped_storage()
        for v, off in zip(self._grad_views, self.offsets):
            v.set_(storage, off, v.shape, _contiguous_strides(v.shape))
        self.grad = full[:self.padded_numel]
        self.flags = full[self.padded_numel:]
        self.grad_and_flags = full

    def _zeros_bucket(self, alignment: int, what: str) -> Bucket:
        """A flat zero buffer laid out like the parameters, with views shaped like them."""
        return Bucket([torch.zeros_like(p, memory_format=torch.contiguous_format)
                       for p in self.params], alignment=alignment, name=f"{self.name}.{what}")

    def _init_weights(self) -> None:
        if self.flatten:   # the parameters themselves become views of the weight buffer
            self._flatten_weights()
            return
        self._ensure_weight()
        self.gather_weights()

    def _flatten_weights(self) -> None:
        """Make every parameter a view of one flat weight buffer, keeping its strides (a
        channels_last or transposed parameter stays so, as under DDP): a dense parameter's
        slice holds its elements in memory order; any other becomes contiguous."""
        self.weight = torch.zeros(self.padded_numel, dtype=self.dtype, device=self.device)
        storage = self.weight.untyped_storage()
        self._weight_views = []
        with torch.no_grad():
            for p, off in zip(self.params, self.offsets):
                n = p.numel()
                if n and _dense(p):
                    stride = p.stride()
                    memory_order = p.as_strided((n,), (1,), p.storage_offset())
                else:
                    stride = _contiguous_strides(p.shape)
                    memory_order = p.reshape(-1)
                self.weight[off:off + n].copy_(memory_order)
                p.set_(storage, off, p.shape, stride)
                self._weight_views.append(self.weight.as_strided(p.shape, stride, off))

    @property
    def nbytes(self) -> int:
        return self.padded_numel * self.grad.element_size()

    # -- gradients ----------------------------------------------------------------------------
    def gather_grads(self, divide_by: int | None = None) -> None:
        """Make ``grad`` hold every parameter's current gradient (missing ones count as 0),
        divided by ``divide_by`` if given, as DDP's reducer divides: a multiplication by the
        scalar ``1 / divide_by`` (rounded to the gradient's dtype), fused into the copy a
        gradient that is not yet a view of ``grad`` needs anyway (one pass, not two)."""
        _hot.gather_grads(self.params, self._grad_views, self.flatten,
                          None if divide_by is None else 1.0 / divide_by)

    def adopt_grads(self) -> None:
        """Copy existing gradients into ``grad`` (and, flattened, re-point them at it): a
        new layout keeps the gradients of the old one."""
        with torch.no_grad():
            for p, v in zip(self.params, self._grad_views):
                if p.grad is not None:
                    v.copy_(p.grad)
                    if self.flatten:
                        p.grad = v

    def scatter_grads(self) -> None:
        """Make every parameter's gradient equal its slice of ``grad``."""
        if self.flatten:
            return
        with torch.no_grad():
            for p, v in zip(self.params, self._grad_views):
                if p.grad is None:
                    p.grad = v.clone()
                else:
                    p.grad.copy_(v)

    # -- weights ------------------------------------------------------------------------------
    def _ensure_weight(self) -> torch.Tensor:
        if self.weight is None:
            self._weights = self._zeros_bucket(self._alignment, "weight")
            self.weight = self._weights.buffer
            self._weight_views = self._weights.tensors
        return self.weight

    def gather_weights(self) -> torch.Tensor:
        """Return the flat weight buffer holding the current parameter values."""
        self._ensure_weight()
        with torch.no_grad():
            for p, v in zip(self.params, self._weight_views):
                if not _same_storage(p.data, v):
                    v.copy_(p)
        return self.weight

    def scatter_weights(self) -> None:
        """Write the flat weight buffer back into the parameters (no-op when they are views)."""
        with torch.no_grad():
            for p, v in zip(self.params, self._weight_views):
                if not _same_storage(p.data, v):
                    p.copy_(v)

    def weight_views(self) -> list[torch.Tensor]:
        self._ensure_weight()
        return list(self._weight_views)

    def grad_views(self) -> list[torch.Tensor]:
        return list(self._grad_views)

    def check_flat(self, grads: bool = True) -> bool:
        """True when every gradient is a view of ``grad`` (unless ``grads=False``) and, where
        a weight buffer exists, every parameter a view of ``weight``."""
        ok = not grads or all(_same_storage(p.grad, v)
                              for p, v in zip(self.params, self._grad_views))
        if self.weight is not None:
            ok = ok and all(_same_storage(p.data, v)
                            for p, v in zip(self.params, self._weight_views))
        return ok

    def __repr__(self) -> str:
        return (f"BaguaBucket({self.name}, {len(self.params)} tensors, {self.numel} x "
                f"{self.dtype}, padded to {self.padded_numel})")
