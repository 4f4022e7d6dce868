"""The Cython extension of bagua-algos: the step engine's hot loop (always built; no
pure-Python fallback)."""

from Cython.Build import cythonize
from setuptools import Extension, setup


def extensions():
    """The extensions, cythonized (paths relative to this directory); benchmarks/gpu's
    build_inplace.py builds them in place without the project metadata."""
    return cythonize([
        Extension("bagua_algos._engine._hot", ["src/bagua_algos/_engine/_hot.pyx"]),
    ], language_level=3, compiler_directives={"boundscheck": False, "wraparound": False})


if __name__ == "__main__":     # also how setuptools.build_meta runs this file
    setup(ext_modules=extensions())
