"""State that a step skipped by ``torch.amp.GradScaler`` leaves as it was.

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
