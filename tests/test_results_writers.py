"""The benchmarks write their own figures into docs/results.json (``--results``).

Each writer is run on a tiny synthetic result into a copy of a results file, and the merged file
is checked against the figures computed here from the same numbers: the other runs and the
per-page lists are kept, the run says where it comes from, ratios are times (< 1: faster).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "benchmarks"))
import _paths  # noqa: E402,F401  (benchmarks/e2e on sys.path)
import _results  # noqa: E402


def _module(rel: str, name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def results(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"about": "x", "headline": {}, "pages": {"README.md": ["0.47x"]},
                                "runs": {"older": {"command": "python benchmarks/e2e.py"}}}))
    return path


def _args(path, run=None, note=""):
    ap = argparse.ArgumentParser()
    _results.add_options(ap)
    argv = ["--results", str(path)] + (["--results-run", run] if run else [])
    return ap.parse_args(argv + (["--results-note", note] if note else []))


def _kept(path, run):
    data = json.loads(path.read_text())
    assert data["about"] == "x" and data["pages"] == {"README.md": ["0.47x"]}
    assert data["runs"]["older"] == {"command": "python benchmarks/e2e.py"}
    return data["runs"][run]


def test_options_default_to_docs_results_json():
    ap = argparse.ArgumentParser()
    _results.add_options(ap)
    assert ap.parse_args(["--results"]).results == ROOT / "docs" / "results.json"
    assert ap.parse_args([]).results is None


def test_record_merges_a_run_and_says_where_it_comes_from(results):
    start = _results.started()
    entry = _results.record("benchmarks/e2e/e2e.py", {"a": 1.23456}, path=results, run="r",
                            cmd="python benchmarks/e2e/e2e.py --quick", start=start,
                            note="idle")
    assert _kept(results, "r") == entry
    assert entry["benchmark"] == "benchmarks/e2e/e2e.py"
    assert entry["command"] == "python benchmarks/e2e/e2e.py --quick"
    assert entry["date"] == start["at"].date().isoformat()
    assert entry["machine"]["note"] == "idle" and entry["machine"]["cores"] >= 1
    assert "load_average_start" in entry["machine"] and entry["figures"] == {"a": 1.23456}
    # the same name again replaces that run, and only it
    _results.record("benchmarks/e2e/e2e.py", {"a": 2}, path=results, run="r",
                    cmd="python benchmarks/e2e/e2e.py", start=start)
    assert _kept(results, "r")["figures"] == {"a": 2}
    with pytest.raises(ValueError, match="cmd"):
        _results.record("benchmarks/e2e/e2e.py", {"a": 1}, path=results, cmd="e2e")
    with pytest.raises(ValueError, match="figures"):
        _results.record("benchmarks/e2e/e2e.py", {}, path=results,
                        cmd="python benchmarks/e2e/e2e.py")


def test_command_is_the_line_that_reruns_it():
    assert (_results.command(ROOT / "benchmarks/micro/optim.py", ["--suite", "vs-fused"])
            == "python benchmarks/micro/optim.py --suite vs-fused")


def test_e2e_writes_targets_and_times_against_its_cells_ddp(results):
    from _e2e_targets import figures

    def run(alg, bw, t30, t60, steps30, bound=None):
        return {"algorithm": alg, "status": "ok", "bandwidth_mbit": bw, "latency_ms": 0,
                "time_to_target_s": {"ddp@30": t30, "ddp@60": t60},
                "steps_to_target": {"ddp@30": steps30, "ddp@60": None if t60 is None else 60},
                "bound_s": bound, "efficiency": bound / t60 if bound and t60 else None}

    report = {"targets": [{"name": "ddp@30", "ddp_steps": 30, "loss": 2.5},
                          {"name": "ddp@60", "ddp_steps": 60, "loss": 2.1}],
              "headline": "ddp@60",
              "runs": [run("ddp", 100, 58.64, 120.0, 30, 40.0),
                       run("bytegrad", 100, 27.31, 50.0, 31, 40.0),
                       run("topk", 100, 70.0, None, 40, 40.0),
                       run("ddp", 1000, 20.0, 40.0, 30, 40.0),
                       run("bytegrad", 1000, 25.0, 45.0, 31, 40.0),
                       {"algorithm": "async", "status": "unavailable",
                        "bandwidth_mbit": 100, "latency_ms": 0}]}
    _results.record_from_args(_args(results, "e2e-test"), "benchmarks/e2e/e2e.py",
                              figures(report), ["--quick"], _results.started())
    entry = _kept(results, "e2e-test")
    assert entry["command"] == "python benchmarks/e2e/e2e.py --quick"
    fig = entry["figures"]
    assert fig["headline"] == "ddp@60" and fig["targets"] == report["targets"]
    assert set(fig["rows"]) == {"ddp @100/0", "bytegrad @100/0", "topk @100/0",
                                "ddp @1000/0", "bytegrad @1000/0"}
    bg = fig["rows"]["bytegrad @100/0"]
    assert bg["time_to_target_s"] == {"ddp@30": 27.3, "ddp@60": 50.0}
    assert bg["x_ddp_time"] == {"ddp@30": round(27.31 / 58.64, 2), "ddp@60": round(50 / 120, 2)}
    assert bg["steps_to_target"] == {"ddp@30": 31, "ddp@60": 60}
    assert bg["bound_s"] == 40.0 and bg["efficiency"] == 0.8
    assert fig["rows"]["bytegrad @1000/0"]["x_ddp_time"]["ddp@60"] == round(45 / 40, 2)
    assert fig["rows"]["topk @100/0"]["x_ddp_time"]["ddp@60"] is None


def test_tradeoff_writes_each_cell(results):
    tradeoff = _module("benchmarks/e2e/tradeoff.py", "_tradeoff_under_test")
    entries = [{"label": "100 Mbit/s, 5 ms", "target": "ddp@60", "winner": "diloco",
                "margin": 1.23456, "auto": "diloco", "auto_vs_best": 1.0, "alone_vs_best": None,
                "times_s": {"ddp": 100.0, "diloco": 50.0}, "efficiency": {"ddp": 0.4},
                "steps_factor": {"ddp": 1.0}, "delay_line": {"late": 0}}]
    _results.record_from_args(_args(results), "benchmarks/e2e/tradeoff.py",
                              tradeoff.figures({"headline": "ddp@60"}, entries), [], None)
    (name, entry), = [(k, v) for k, v in json.loads(results.read_text())["runs"].items()
                      if k != "older"]
    assert name.startswith("tradeoff-")
    cell = entry["figures"]["cells"]["100 Mbit/s, 5 ms"]
    assert cell["winner"] == "diloco" and cell["margin"] == 1.235 and "delay_line" not in cell
    assert entry["figures"]["headline"] == "ddp@60"


def test_fused_optimizer_benchmark_writes_times_and_ratios_of_times(results):
    optim = _module("benchmarks/micro/optim.py", "_micro_optim_under_test")
    vs = ([("2,000 x 64", "Adam(fused=True)", "grads in place", 8.7, 1.0)],
          {("2,000 x 64", "Adam(fused=True)", "grads in place"): 1.05})
    plain = [("2000 small", "Adam", "foreach=False", 146.5, 1.9)]
    _results.record_from_args(_args(results, "optim", "idle"), "benchmarks/micro/optim.py",
                              optim.figures(vs, plain), ["--suite", "all"], None)
    entry = _kept(results, "optim")
    row = entry["figures"]["vs_fused"]["2,000 x 64 | Adam(fused=True) | grads in place"]
    assert row == {"torch_ms": 8.7, "ours_ms": 1.0, "x_torch_time": round(1.0 / 8.7, 4),
                   "aa_x_torch_time": 1.05}
    mode = entry["figures"]["modes"]["2000 small | Adam | foreach=False"]
    assert mode["x_plain_time"] == round(1.9 / 146.5, 4) < 1
    assert entry["machine"]["note"] == "idle"


def test_a_gpu_kit_benchmark_records_its_table_end_to_end(results):
    """benchmarks/gpu/minmax.py, run for real (its CPU smoke form, a tiny size) with
    ``--results``: its table's rows land in the file with the command that made them."""
    pytest.importorskip("bagua_comm.compression")
    cmd = [sys.executable, "benchmarks/gpu/minmax.py", "--sizes", "4096", "--chunks", "1",
           "--bits", "8", "--results", str(results), "--results-run", "minmax-smoke"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    entry = _kept(results, "minmax-smoke")
    assert entry["command"].startswith("python benchmarks/gpu/minmax.py --sizes 4096")
    kernels = [r["kernel"] for r in entry["figures"]["rows"]]
    assert kernels == ["copy (reference)", "8-bit compress", "8-bit decompress"]
    assert all(r["elements"] == 4096 and r["ms"] > 0 for r in entry["figures"]["rows"])


def test_the_sampler_benchmark_records_its_tables_end_to_end(results):
    """benchmarks/micro/data.py, run for real (a small padding table, no loop): each sampler's
    padded cost and its multiple of the length-grouped reference's, as recorded."""
    pytest.importorskip("bagua_data")
    cmd = [sys.executable, "benchmarks/micro/data.py", "--quick", "--skip-loop", "--samples",
           "2000", "--results", str(results), "--results-run", "data-smoke"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    padding = _kept(results, "data-smoke")["figures"]["padding"]
    ref = padding["hf"]["padded"]
    for name, row in padding.items():
        assert row["x_ref_padded"] == pytest.approx(row["padded"] / ref, abs=1e-4), name
    assert padding["torch"]["x_ref_padded"] > 1          # padding a random order costs more
