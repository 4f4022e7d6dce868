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


def test_the_comm_benchmark_writes_collectives_and_compressors_as_times(results):
    comm = _module("benchmarks/micro/comm.py", "_micro_comm_under_test")
    rows = [("allreduce", 4 << 20, 0.021, 0.020), ("alltoall", 4 << 10, 0.0005, 0.0004)]
    overhead = {"allreduce": (12e-6, 10e-6)}
    copy = {"copy (Tensor.copy_)": 8.0, "copy (numpy.copyto)": 10.0}
    uint8 = {"compress (ours)": 4.0, "compress (ours, out=)": 5.0, "compress (torch ops)": 1.0,
             "decompress (ours)": 5.0, "decompress (torch ops)": 2.0, **copy}
    uint4 = {"compress (out=)": 2.5, "compress, EF (out=)": 1.0, "decompress": 4.0,
             "round trip": 1.6, **copy}
    _results.record_from_args(_args(results, "comm"), "benchmarks/micro/comm.py",
                              comm.figures(2, rows, overhead, uint8, uint4), ["--quick"], None)
    entry = _kept(results, "comm")
    assert entry["command"] == "python benchmarks/micro/comm.py --quick"
    fig = entry["figures"]
    assert fig["world"] == 2
    assert fig["collectives"]["allreduce | 4 MiB"] == {
        "bytes": 4 << 20, "ours_us": 21000.0, "torch_us": 20000.0,
        "x_torch_time": round(0.021 / 0.020, 4)}
    assert fig["collectives"]["alltoall | 4 KiB"]["x_torch_time"] == round(0.0005 / 0.0004, 4)
    assert fig["overhead_us"]["allreduce"] == {"ours": 12.0, "torch": 10.0, "difference": 2.0}
    # a compressor's time as a multiple of the faster copy's and of torch ops' (< 1: faster)
    assert fig["uint8"]["x_copy_time"] == {"compress (ours)": 10 / 4, "decompress (ours)": 2.0}
    assert fig["uint8"]["x_torch_ops_time"] == {"compress (ours)": 0.25,
                                                "decompress (ours)": 0.4}
    assert fig["uint4"]["x_copy_time"] == {"compress (out=)": 4.0, "compress, EF (out=)": 10.0,
                                           "decompress": 2.5, "round trip": round(10 / 1.6, 4)}
    assert fig["uint4"]["gbs"]["round trip"] == 1.6
    # without the collectives (--compression-only) the file keeps the compressors alone
    assert set(comm.figures(2, None, None, uint8, uint4)) == {"world", "uint8", "uint4"}


def test_the_comm_benchmark_records_its_compressors_end_to_end(results):
    """benchmarks/micro/comm.py, run for real (the compressors only, --quick) with
    ``--results``: each compressor's GB/s and its multiple of the copy's time land in the
    file, consistent with one another."""
    pytest.importorskip("bagua_comm.compression")
    cmd = [sys.executable, "benchmarks/micro/comm.py", "--quick", "--compression-only",
           "--results", str(results), "--results-run", "comm-smoke"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    fig = _kept(results, "comm-smoke")["figures"]
    assert "collectives" not in fig
    for key in ("uint8", "uint4"):
        gbs = fig[key]["gbs"]
        copy = max(gbs["copy (Tensor.copy_)"], gbs["copy (numpy.copyto)"])
        for name, x in fig[key]["x_copy_time"].items():
            assert x == pytest.approx(copy / gbs[name], rel=2e-3), (key, name)


def test_the_net_benchmark_writes_gbs_and_times_against_iperf3_and_a_baseline(results):
    net = _module("benchmarks/micro/net.py", "_micro_net_under_test")
    mib = 1 << 20
    sizes = [mib, 16 * mib]
    plugin = {1: {mib: 0.5, 16 * mib: 1.0}, 4: {mib: 1.2, 16 * mib: 3.0}}
    iperf = {1: 1.1, 4: 2.4}
    base = {"gbs": {(mib, 4): (1.2, 1.5)}, "setup_s": {4: (0.002, 0.004)}}
    figs = net.figures({"loopback": (sizes, plugin, iperf)}, base)
    _results.record_from_args(_args(results, "net"), "benchmarks/micro/net.py", figs,
                              ["--quick", "--link", "loopback"], None)
    fig = _kept(results, "net")["figures"]
    loop = fig["loopback"]
    assert loop["gbs"] == {"1 MiB | N=1": 0.5, "16 MiB | N=1": 1.0, "1 MiB | N=4": 1.2,
                           "16 MiB | N=4": 3.0}
    assert loop["iperf3_gbs"] == {"N=1": 1.1, "N=4": 2.4} and loop["largest"] == "16 MiB"
    # bagua-net's time for the largest size's bytes as a multiple of iperf3's (-P N)
    assert loop["x_iperf3_time"] == {"N=1": 1.1, "N=4": 0.8}
    vs = fig["vs_baseline"]
    assert vs["gbs"]["1 MiB | N=4"] == {"this": 1.2, "baseline": 1.5, "x_baseline_time": 1.25}
    assert vs["setup_ms"]["N=4"] == {"this": 2.0, "baseline": 4.0, "x_baseline_time": 0.5}


def test_the_autotune_benchmark_writes_each_links_choice_and_times(results):
    autotune = _module("benchmarks/micro/autotune.py", "_micro_autotune_under_test")
    summaries = [{"bandwidth_mbit": 100.0, "autotune_bucket_size": 4 << 20,
                  "autotune_steps": 40, "autotune_done": True,
                  "autotune_samples_per_s": 90.0, "best_label": "fixed 1 MiB",
                  "best_samples_per_s": 100.0, "default_samples_per_s": 80.0,
                  "noise_floor": 0.021},
                 {"bandwidth_mbit": None, "autotune_bucket_size": 1 << 20,
                  "autotune_steps": 25, "autotune_done": True,
                  "autotune_samples_per_s": 300.0, "best_label": "fixed 256 KiB",
                  "best_samples_per_s": 310.0, "default_samples_per_s": 300.0,
                  "noise_floor": None}]
    _results.record_from_args(_args(results, "autotune"), "benchmarks/micro/autotune.py",
                              autotune.figures(summaries, "testbed: 2 hosts"),
                              ["--bandwidths", "100,none"], None)
    fig = _kept(results, "autotune")["figures"]
    assert fig["mode"] == "testbed: 2 hosts"
    from _e2e_report import bw_label

    shaped, unshaped = fig["links"][bw_label(100.0)], fig["links"][bw_label(None)]
    # autotuned's step time as a multiple of the best fixed size's and the default's
    assert shaped["x_best_time"] == round(100 / 90, 4) and shaped["x_default_time"] == round(
        80 / 90, 4)
    assert shaped["autotune_bucket_size"] == 4 << 20 and shaped["autotune_steps"] == 40
    assert unshaped["x_default_time"] == 1.0 and unshaped["best_fixed"] == "fixed 256 KiB"
