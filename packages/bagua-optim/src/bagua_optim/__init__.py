"""bagua_optim: a generic fused optimizer for any torch optimizer.

``fuse_optimizer(optimizer)`` keeps parameters, gradients and optimizer state of each param
group (per dtype and device) in flat storage and runs the optimizer's own update once per
contiguous run instead of once per parameter, bit-identically.
"""

from ._fuse import fuse_optimizer, is_fused_optimizer
from ._version import __version__

__all__ = ["__version__", "fuse_optimizer", "is_fused_optimizer"]
