"""bagua_algos: with_bagua() and the Bagua algorithms (DESIGN.md section 5)."""

from ._version import __version__

__all__ = ["__version__"]
