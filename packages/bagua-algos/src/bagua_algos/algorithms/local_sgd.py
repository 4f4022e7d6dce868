"""LocalSGD: every rank trains alone and the ranks average their parameters every
``sync_every`` optimizer steps (DiLoCo with a plain outer step)."""

from __future__ import annotations

from .diloco import DiLoCo


class LocalSGD(DiLoCo, name="local_sgd"):
    """``DiLoCo(sync_every, outer_lr=1.0, outer_momentum=0.0, nesterov=False)``: the outer
    step θ_a ← θ_a - mean(θ_a - θ_i) is the average of the ranks' parameters (up to
    rounding).  ``LocalSGD(sync_every=1)`` with plain SGD equals DDP with SGD up to rounding.
    The anchor costs 1x the parameters in float32 (no momentum); ``compressor``,
    ``hierarchical`` and ``anchor_device`` are DiLoCo's.
    """

    def __init__(self, sync_every: int = 32, *, compressor=None, hierarchical: bool = False,
                 anchor_device=None):
        super().__init__(sync_every, outer_lr=1.0, outer_momentum=0.0, nesterov=False,
                         compressor=compressor, hierarchical=hierarchical,
                         anchor_device=anchor_device)

    def __repr__(self) -> str:
        return f"LocalSGD(sync_every={self.sync_every})"
