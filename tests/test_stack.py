"""The five packages installed together: metadata matches docs/design.md section 2's dependency rules."""

import importlib
import importlib.metadata as md
import re
import subprocess
import sys

import pytest

PACKAGES = ["bagua-comm", "bagua-algos", "bagua-optim", "bagua-data", "bagua-net"]
# docs/design.md section 2: what each package may require at run time (extras aside).
ALLOWED = {
    "bagua-comm": {"torch", "numpy"},
    "bagua-algos": {"bagua-comm", "torch"},
    "bagua-optim": {"torch"},
    "bagua-data": {"torch"},
    "bagua-net": set(),
}


def _requirements(dist):
    reqs = md.requires(dist) or []
    names = set()
    for r in reqs:
        if "extra ==" in r:
            continue
        names.add(re.split(r"[ ;<>=!~\[]", r, maxsplit=1)[0].lower().replace("_", "-"))
    return names


@pytest.mark.parametrize("dist", PACKAGES)
def test_runtime_dependencies_follow_the_design(dist):
    assert _requirements(dist) == ALLOWED[dist]


@pytest.mark.parametrize("dist", PACKAGES)
def test_each_package_has_its_own_version(dist):
    mod = importlib.import_module(dist.replace("-", "_"))
    assert mod.__version__ == md.version(dist)


def test_importing_everything_loads_no_cuda_library():
    code = ("import sys, bagua_comm, bagua_algos, bagua_optim, bagua_data, bagua_net; "
            "maps = open('/proc/self/maps').read(); "
            "assert not [m for m in sys.modules if m.split('.')[0] == 'cupy']; "
            "assert 'libnccl' not in maps and 'libcuda.so' not in maps and 'libcudart' not in maps")
    subprocess.run([sys.executable, "-c", code], check=True)
