"""Build bagua-comm's Cython extensions in place, for the GPU kit (no pip, no registry).

``python setup.py build_ext --inplace`` makes setuptools read pyproject.toml, whose PEP 639
``license = "Apache-2.0"`` string needs setuptools >= 77; an older setuptools rejects it.
This builds the same extensions (``setup.py``'s ``extensions()``: same flags) through a bare
``Distribution`` that reads no project metadata, so any setuptools with Cython >= 3 works.
"""

import os
import runpy
import sys
from pathlib import Path

import Cython
import setuptools
from setuptools import Distribution

PKG = Path(__file__).resolve().parents[2] / "packages" / "bagua-comm"


def main() -> None:
    print(f"setuptools {setuptools.__version__}, Cython {Cython.__version__}, "
          f"python {sys.version.split()[0]}")
    os.chdir(PKG)
    exts = runpy.run_path(str(PKG / "setup.py"), run_name="bagua_comm_setup")["extensions"]()
    dist = Distribution({"name": "bagua-comm", "ext_modules": exts,
                         "package_dir": {"": "src"}, "script_name": "setup.py"})
    cmd = dist.get_command_obj("build_ext")
    cmd.inplace = True
    cmd.ensure_finalized()
    cmd.run()
    for ext in exts:
        print("built", cmd.get_ext_fullpath(ext.name))


if __name__ == "__main__":
    main()
