"""Builds tests/fake_nccl.c into a stand-in libnccl (needs a C compiler; tests skip without)."""

import os
import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("fake_nccl.c")
COMPILER = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def build(out_dir: Path, old: bool = False) -> str:
    """Compile the fake library into ``out_dir`` and return its path."""
    out = Path(out_dir) / ("libnccl-old.so.2" if old else "libnccl-fake.so.2")
    cmd = [COMPILER, "-shared", "-fPIC", "-O1", "-o", str(out), str(SOURCE)]
    if old:
        cmd.insert(1, "-DFAKE_OLD")
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    return str(out)
