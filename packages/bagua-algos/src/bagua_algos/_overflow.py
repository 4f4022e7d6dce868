"""What a gradient overflow (a step ``torch.amp.GradScaler`` skips) asks of the algorithms.

:func:`all_finite` tells that this rank's step will be skipped; algorithms that count
optimizer steps (DiLoCo) or owe a round per step (LowPrecisionDecentralized) count it there,
since the skipped step's optimizer hooks never run and the peers must still find its
collectives.  :class:`Spares` keeps state that a skipped step must leave as it was.

An error-feedback algorithm (TopK's residuals and DGC velocities, LowRank's residuals)
updates per-rank state from each step's gradient.  When any rank's gradient overflows, the
exchanged result is non-finite on every rank and GradScaler skips the optimizer step
everywhere; DDP then keeps nothing of that step, and neither must the algorithm, or the
overflow stays in its state and every later step is skipped too.  So the new state is
written into a spare tensor and kept only once the step's result is known to be finite:
swapping tensors instead of copying them costs nothing on the finite path, and the spare
pool holds one tensor per shape in use.
"""

from __future__ import annotations

import torch


def all_finite(tensors) -> bool:
    """Whether every tensor of ``tensors`` (e.g. this rank's gradients) is finite: one host
    synchronisation, whatever their number."""
    tensors = [t._values() if t.is_sparse else t for t in tensors if t is not None]
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return True
    norms = torch._foreach_norm(tensors, float("inf"))
    dev = norms[0].device
    return bool(torch.stack([n.float().to(dev) for n in norms]).isfinite().all())


class Spares:
    """A pool of tensors to write the next value of some state into."""

    def __init__(self) -> None:
        self._free: dict[tuple, list[torch.Tensor]] = {}

    @staticmethod
    def _key(t: torch.Tensor) -> tuple:
        return tuple(t.shape), t.dtype, t.device

    def take(self, like: torch.Tensor) -> torch.Tensor:
        """A tensor of ``like``'s shape, dtype and device (contents undefined)."""
        free = self._free.get(self._key(like))
        return free.pop() if free else torch.empty_like(like)

    def give(self, t: torch.Tensor) -> None:
        self._free.setdefault(self._key(t), []).append(t)

    def settle(self, store, key, new: torch.Tensor, keep: bool) -> None:
        """``store[key] = new`` if ``keep`` (the old value becomes a spare), else drop
        ``new``: the same decision on every rank when ``keep`` is read from the step's
        exchanged result."""
        if keep:
            self.give(store[key])
            store[key] = new
        else:
            self.give(new)

    def clear(self) -> None:
        self._free.clear()
