"""bagua_data: load-balanced distributed samplers (DESIGN.md section 7)."""

from ._version import __version__

__all__ = ["__version__"]
