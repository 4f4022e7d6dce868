"""Build the Cython extensions of bagua-comm and bagua-algos in place, for the GPU kit and the
dev environment (no pip, no registry).

``python setup.py build_ext --inplace`` makes setuptools read pyproject.toml, whose PEP 639
``license = "Apache-2.0"`` string needs setuptools >= 77; an older setuptools rejects it.
This builds the same extensions (each package's ``setup.py`` ``extensions()``: same flags) through a bare
``Distribution`` that reads no project metadata, so any setuptools with Cython >= 3 works.
"""

import os
import runpy
import sys
from pathlib import Path

import Cython
import setuptools
from setuptools import Distribution

PACKAGES = Path(__file__).resolve().parents[2] / "packages"


def build(name: str) -> None:
    pkg = PACKAGES / name
    os.chdir(pkg)
    exts = runpy.run_path(str(pkg / "setup.py"), run_name=f"{name}_setup")["extensions"]()
    dist = Distribution({"name": name, "ext_modules": exts,
                         "package_dir": {"": "src"}, "script_name": "setup.py"})
    cmd = dist.get_command_obj("build_ext")
    cmd.inplace = True
    cmd.ensure_finalized()
    cmd.run()
    for ext in exts:
        print("built", cmd.get_ext_fullpath(ext.name))


def main() -> None:
    print(f"setuptools {setuptools.__version__}, Cython {Cython.__version__}, "
          f"python {sys.version.split()[0]}")
    for name in ("bagua-comm", "bagua-algos"):
        build(name)


if __name__ == "__main__":
    main()
