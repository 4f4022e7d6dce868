"""Importing bagua_algos pulls in no CUDA library and only the bagua packages it declares."""

import subprocess
import sys

ALLOWED = {"bagua_algos", "bagua_comm", "bagua_optim"}


def test_import_is_self_contained():
    code = ("import sys, bagua_algos; "
            "print(sorted({m.split('.')[0] for m in sys.modules}))")
    mods = eval(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               check=True).stdout)
    assert not [m for m in mods if m.startswith("bagua_") and m not in ALLOWED]
    assert "cupy" not in mods
