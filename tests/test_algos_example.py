"""Full stack: examples/train.py under torchrun trains, and resumes from its checkpoint to the
same result as the uninterrupted run."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train.py"


def _train(tmp_path, *args):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(EXAMPLE), "--samples", "2048", "--backend", "gloo", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    before = float(re.search(r"before training val loss ([\d.]+)", out.stdout).group(1))
    final = re.search(r"final: val loss ([\d.]+) acc ([\d.]+)", out.stdout)
    return before, float(final.group(1)), out.stdout


@pytest.mark.parametrize("algorithm", ["low_precision_decentralized"])
def test_example_trains_and_resumes_exactly(tmp_path, algorithm):
    ck = str(tmp_path / "ck")
    before, full, _ = _train(tmp_path, "--algorithm", algorithm, "--epochs", "3")
    assert full < 0.6 * before
    _train(tmp_path, "--algorithm", algorithm, "--epochs", "2", "--checkpoint", ck)
    _, resumed, log = _train(tmp_path, "--algorithm", algorithm, "--epochs", "3",
                             "--checkpoint", ck)
    assert "resumed from" in log
    assert resumed == full
