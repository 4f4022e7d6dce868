"""The main job against the floor and the physical limit (issue 44): the ``alone`` row, the
targets at depth and the headline, the compute-only bound and each row's efficiency, every
cost in a row's time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT / "benchmarks"))
import _paths  # noqa: E402,F401  (benchmarks/_paths.py: benchmarks/e2e on sys.path)

TINY = ["--quick", "--size", "tiny", "--steps", "4", "--warmup", "1", "--wall-seconds", "0.5",
        "--hosts", "2", "--procs-per-host", "1", "--no-testbed"]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    """One small run over loopback: DDP, ``alone`` (added by the job itself) and ``auto``."""
    tmp = tmp_path_factory.mktemp("depth")
    out = tmp / "e2e.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "e2e.py"), *TINY,
                        "--algorithms", "ddp,auto", "--json", str(out),
                        "--plot", str(tmp / "e2e.png"), "--workdir", str(tmp / "work"),
                        "--stall-seconds", "120"],
                       capture_output=True, text=True, timeout=400, cwd=tmp,
                       env=dict(os.environ, COLUMNS="80"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads(out.read_text())
    rep["stdout"] = r.stdout
    return rep


@pytest.mark.timeout(420)
def test_the_alone_row_is_in_every_run_and_sends_zero_bytes(report):
    runs = {r["algorithm"]: r for r in report["runs"]}
    assert list(runs) == ["ddp", "alone", "auto"]
    alone = runs["alone"]
    assert alone["status"] == "ok", alone
    # nothing communicated: the communication layer counted no byte, and (no testbed) the
    # figure reported is that count
    assert alone["bytes_source"] == "accounted"
    assert alone["bytes_per_step_accounted"] == 0 and alone["bytes_per_step"] == 0
    assert runs["ddp"]["bytes_per_step_accounted"] > 0
    # each rank trained its own model: the loss says it is the mean over them
    assert alone["loss_over"] == "mean of the ranks' models"
    assert runs["ddp"]["loss_over"] == "the model (identical on every rank)"
