"""Cython extensions of bagua-comm: they link only libdl (libnccl is dlopen'ed at run time)."""

import sys

from Cython.Build import cythonize
from setuptools import Extension, setup

# The MinMaxUInt8 kernels must round exactly like the numpy reference and the CUDA kernels:
# optimise, but never contract a*b+c into an FMA or reassociate float arithmetic.
KERNEL_FLAGS = [] if sys.platform == "win32" else ["-O3", "-ffp-contract=off", "-fno-trapping-math"]



def extensions():
    """The extensions, cythonized (paths relative to this directory).  benchmarks/gpu's
    build_inplace.py builds them without the project metadata, for a setuptools too old
    for the PEP 639 ``license`` string in pyproject.toml (it needs setuptools >= 77)."""
    return cythonize([
        Extension("bagua_comm._nccl", ["src/bagua_comm/_nccl.pyx"], libraries=["dl"]),
        Extension("bagua_comm._minmax", ["src/bagua_comm/_minmax.pyx"],
                  depends=["src/bagua_comm/_minmax_simd.h"],
                  extra_compile_args=KERNEL_FLAGS),
        Extension("bagua_comm._launch", ["src/bagua_comm/_launch.pyx"]),
        # the ring round's float arithmetic (``_ring_difference``) rounds as torch's ops do
        Extension("bagua_comm._worker", ["src/bagua_comm/_worker.pyx"],
                  depends=["src/bagua_comm/_minmax.pxd"], extra_compile_args=KERNEL_FLAGS),
    ], language_level=3, include_path=["src"], compiler_directives={"boundscheck": False, "wraparound": False})


if __name__ == "__main__":     # also how setuptools.build_meta runs this file
    setup(ext_modules=extensions())
