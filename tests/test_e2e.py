"""benchmarks/e2e.py end to end, with a tiny configuration: the JSON has every number."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from _e2e_model import SIZES, make_model, num_params  # noqa: E402

REQUIRED = ("bandwidth_mbit", "algorithm", "samples_per_s", "loss", "bytes_per_step")
TINY = ["--size", "tiny", "--steps", "3", "--warmup", "1", "--wall-seconds", "0.5",
        "--hosts", "2"]


def _run(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "e2e.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "e2e.py"), *TINY,
                        "--json", str(out), "--plot", str(tmp_path / "e2e.png"),
                        "--workdir", str(tmp_path / "work"), "--testbed-name", f"e2t{os.getpid() % 100000}",
                        "--stall-seconds", "120", *extra],
                       capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "plot: skipped (pip install matplotlib)" in r.stdout
    else:
        assert (tmp_path / "e2e.png").stat().st_size > 10_000
    return json.loads(out.read_text()), r.stdout


@pytest.mark.timeout(420)
def test_e2e_writes_every_field_and_ddp_traffic_matches_a_ring_allreduce(tmp_path):
    report, stdout = _run(tmp_path, "--bandwidths", "100",
                          "--algorithms", "ddp,gradient_allreduce,no_such_algorithm")
    runs = {r["algorithm"]: r for r in report["runs"]}
    assert list(runs) == ["ddp", "gradient_allreduce", "no_such_algorithm"]
    for r in report["runs"]:
        assert set(REQUIRED) <= set(r)
        assert r["bandwidth_mbit"] == (100 if report["testbed"]["used"] else None)
    # An algorithm bagua_algos does not register is reported, never silently skipped.
    assert runs["no_such_algorithm"]["status"] == "unavailable"
    assert runs["no_such_algorithm"]["samples_per_s"] is None
    assert "no_such_algorithm" in stdout and "unavailable" in stdout
    ddp = runs["ddp"]
    assert ddp["status"] == "ok", ddp
    assert ddp["samples_per_s"] > 0 and ddp["step_s"] > 0
    assert math.isclose(ddp["compute_s"] + ddp["comm_s"], ddp["step_s"], rel_tol=1e-6) or (
        ddp["comm_s"] == 0 and ddp["compute_s"] >= ddp["step_s"])
    # Training happened: the loss fell below the uniform guess over the vocabulary.
    assert 0 < ddp["loss"] < math.log(SIZES["tiny"][0])
    # DDP's gradient allreduce over 2 ranks sends 2 (n-1)/n = 1x the gradient bytes per rank.
    grad_bytes = 4 * num_params(make_model("tiny"))
    assert ddp["bytes_per_step_accounted"] == pytest.approx(grad_bytes)
    if report["testbed"]["used"]:
        # Measured on the host's interface: the payload plus TCP/IP headers and ACKs.
        assert ddp["bytes_source"] == "wire"
        assert 0.95 * grad_bytes < ddp["bytes_per_step"] < 1.6 * grad_bytes
    ga = runs["gradient_allreduce"]
    if ga["status"] == "ok":
        # Same averaged gradients as DDP, same optimizer, same data: the same loss.
        assert ga["loss"] == pytest.approx(ddp["loss"], rel=1e-4)
        assert ga["speedup_vs_ddp"] == pytest.approx(ga["samples_per_s"] / ddp["samples_per_s"])


@pytest.mark.timeout(420)
def test_e2e_without_a_testbed_says_so_and_runs_over_loopback(tmp_path):
    report, stdout = _run(tmp_path, "--no-testbed", "--algorithms", "ddp")
    assert report["testbed"]["used"] is False
    assert "NO TESTBED" in stdout
    [run] = report["runs"]
    assert run["bandwidth_mbit"] is None and run["status"] == "ok"
    assert run["bytes_source"] == "accounted"
    assert all(run[k] is not None for k in REQUIRED if k != "bandwidth_mbit")
