"""Cython extensions of bagua-comm: they link only libdl (libnccl is dlopen'ed at run time)."""

from Cython.Build import cythonize
from setuptools import Extension, setup

extensions = [
    Extension("bagua_comm._nccl", ["src/bagua_comm/_nccl.pyx"], libraries=["dl"]),
]

setup(ext_modules=cythonize(extensions, language_level=3,
                            compiler_directives={"boundscheck": False, "wraparound": False}))
