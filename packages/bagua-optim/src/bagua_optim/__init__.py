"""bagua_optim: a generic fused optimizer for any torch optimizer (DESIGN.md section 6)."""

from ._version import __version__

__all__ = ["__version__"]
