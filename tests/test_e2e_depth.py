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
        "--depths", "0.25,0.5,1,2,4", "--budget-factor", "1.25",
        "--hosts", "2", "--procs-per-host", "1", "--no-testbed"]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    """One small run over loopback: DDP, ``alone`` (added by the job itself), ``auto`` and
    DiLoCo at H=3 (N=4 timed steps)."""
    tmp = tmp_path_factory.mktemp("depth")
    out = tmp / "e2e.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "e2e.py"), *TINY,
                        "--algorithms", "ddp,auto,diloco", "--sync-every", "3",
                        "--json", str(out),
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
    assert list(runs) == ["ddp", "alone", "auto", "diloco"]
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


def _curve(losses, dt=1.0):
    """An evaluation curve [step, seconds, loss] with one evaluation per step."""
    return [[k + 1, (k + 1) * dt, v] for k, v in enumerate(losses)]


def _synthetic_runs():
    """DDP falls 4.0 -> 1.0 over 16 steps; ``alone`` falls as fast at first, then stalls at
    2.5 (its ranks never see each other's data); ``fast`` follows DDP at half its time."""
    ddp = [4.0 - 3.0 * k / 15 for k in range(16)]
    alone = [max(2.5, v) for v in ddp] + [2.5] * 40
    base = {"status": "ok", "bandwidth_mbit": 100, "latency_ms": 0, "compute_s": 0.25}
    return [{**base, "algorithm": "ddp", "eval_curve": _curve(ddp)},
            {**base, "algorithm": "alone", "eval_curve": _curve(alone, 0.5)},
            {**base, "algorithm": "fast", "eval_curve": _curve(ddp, 0.5)},
            {**base, "algorithm": "stuck", "eval_curve": _curve([4.0] * 20)},
            {"algorithm": "gone", "status": "unavailable", "bandwidth_mbit": 100,
             "latency_ms": 0}]


def test_the_headline_is_the_first_target_alone_does_not_reach():
    from _e2e_targets import add_targets, depth_steps, pick_headline

    steps = depth_steps(8, "0.25,0.5,1,2")
    assert steps == [2, 4, 8, 16]
    runs = _synthetic_runs()
    targets, headline, why = add_targets(runs, steps)
    assert [t["name"] for t in targets] == ["ddp@2", "ddp@4", "ddp@8", "ddp@16"]
    # DDP's loss after 2, 4, 8 and 16 steps; alone gets to 2.5, i.e. to DDP's loss after 8
    # steps (2.6) but not after 16 (1.0)
    alone = runs[1]
    assert alone["steps_to_target"] == {"ddp@2": 2, "ddp@4": 4, "ddp@8": 8, "ddp@16": None}
    assert headline == "ddp@16" and "does not reach" in why and "ddp@8" in why
    assert alone["time_to_target_s"]["ddp@16"] is None and alone["efficiency"] is None
    # a row that did not run has every target, unreached
    assert runs[4]["steps_to_target"] == dict.fromkeys(alone["steps_to_target"])
    assert runs[4]["efficiency"] is None
    # a deeper alone (no plateau): every target reached, the deepest is the headline and
    # the output says so; no alone row at all: the middle target, said so
    runs[1]["steps_to_target"] = {t["name"]: 1 for t in targets}
    name, why = pick_headline(targets, runs)
    assert name == "ddp@16" and "every target" in why
    name, why = pick_headline(targets, [r for r in runs if r["algorithm"] != "alone"])
    assert name == "ddp@8" and "no 'alone' row" in why
    for bad in ("", "0,1", "-1", "a,b"):
        with pytest.raises(ValueError, match="--depths"):
            depth_steps(8, bad)


def test_the_bound_is_ddps_steps_times_the_cells_compute_time_and_efficiency_its_ratio():
    from _e2e_targets import add_targets

    runs = _synthetic_runs()
    runs[2]["compute_s"] = 0.4        # a noisy measurement: the cell's median (0.25) is used
    _targets, headline, _why = add_targets(runs, [2, 4, 8, 16])
    by = {r["algorithm"]: r for r in runs}
    assert by["ddp"]["steps_to_target"][headline] == 16
    for name in ("ddp", "alone", "fast", "stuck"):
        assert by[name]["bound_s"] == pytest.approx(16 * 0.25)
    assert by["ddp"]["efficiency"] == pytest.approx(4.0 / 16.0)   # 1 s a step, 0.25 compute
    assert by["fast"]["efficiency"] == pytest.approx(4.0 / 8.0)
    assert by["stuck"]["efficiency"] is None and by["gone"]["bound_s"] is None


@pytest.mark.timeout(420)
def test_the_json_has_the_targets_the_headline_and_each_rows_efficiency(report):
    names = [t["name"] for t in report["targets"]]
    steps = [t["ddp_steps"] for t in report["targets"]]
    assert steps == [1, 2, 4, 8, 16] and names == [f"ddp@{k}" for k in steps]  # N=4 x depths
    assert report["headline"] in names and report["headline_why"]
    assert f"headline H = {report['headline']}" in report["stdout"]
    ddp = next(r for r in report["runs"] if r["algorithm"] == "ddp")
    assert ddp["steps_run"] >= 16        # DDP trains to the deepest target's step count
    for t in report["targets"]:          # and reaches each of its own losses at the latest there
        assert ddp["steps_to_target"][t["name"]] <= t["ddp_steps"]
    for r in report["runs"]:
        assert set(r["steps_to_target"]) == set(names) == set(r["time_to_target_s"])
        t = r["time_to_target_s"][report["headline"]]
        if t is None:
            assert r["efficiency"] is None
        else:            # from the JSON's own fields
            assert r["efficiency"] == pytest.approx(r["bound_s"] / t, rel=1e-9)
            assert r["bound_s"] > 0


@pytest.mark.timeout(420)
def test_the_auto_rows_time_starts_before_its_network_probe(report):
    auto = next(r for r in report["runs"] if r["algorithm"] == "auto")
    assert auto["status"] == "ok", auto
    probe = auto["auto_choice"]["probe_s"]    # recommend's measurement
    assert auto["auto_choice"]["setup_s"] >= probe > 0     # and with_bagua's set-up
    assert auto["setup_s"] >= probe          # every rank's clock started before both
    # the clock started before the probe: the first evaluation (after one step) is later
    # than the probe alone took, and so is the time to every target it reached
    assert auto["eval_curve"][0][1] > probe
    assert all(t is None or t > probe for t in auto["time_to_target_s"].values())
    # the throughput window is the steps only (the probe is once per run)
    assert auto["window_s"] < auto["eval_curve"][-1][1]
    said = " ".join(report["stdout"].split())     # the notes wrap at 80 columns
    assert f"its {probe:.1f}s probe counted in its time" in said
    # every row's clock starts before its wrap (DDP's constructor, with_bagua's set-up): the
    # auto row pays nothing the others do not
    for r in report["runs"]:
        assert r["setup_s"] > 0 and r["eval_curve"][0][1] > r["setup_s"], r["algorithm"]


@pytest.mark.timeout(420)
def test_a_sync_rows_throughput_window_holds_whole_sync_periods(report):
    diloco = next(r for r in report["runs"] if r["algorithm"] == "diloco")
    assert diloco["status"] == "ok" and diloco["sync_every"] == 3
    # N=4 timed steps, H=3: the window runs on to 6 steps, two whole periods
    assert diloco["window_steps"] == 6 and diloco["window_syncs"] == 2
    ddp = next(r for r in report["runs"] if r["algorithm"] == "ddp")
    assert ddp["window_syncs"] is None and ddp["window_steps"] == 4
    # its bytes: one model-sized allreduce per 3 steps, DDP's per step
    assert diloco["bytes_per_step_accounted"] == pytest.approx(
        ddp["bytes_per_step_accounted"] / 3, rel=0.05)
    assert "2 syncs in 6 st" in " ".join(report["stdout"].split())


def test_the_display_tells_the_time_left_and_the_plot_draws_only_rows_that_ran():
    from _e2e_display import text_bar, time_left
    from _e2e_report import ran

    assert time_left(30.0, 3, 9) == pytest.approx(60.0)      # 10 s a row, 6 rows to go
    assert time_left(30.0, 0, 9) is None
    bar = text_bar(3, 12, 90.0, width=8)
    assert bar.startswith("[##......] 3.0/12 rows, 1:30 elapsed, ~4:30 left"), bar
    runs = [{"algorithm": a, "status": s} for a, s in (("ddp", "ok"), ("gone", "unavailable"),
                                                      ("broke", "failed"), ("alone", "ok"),
                                                      ("ddp", "ok"))]
    assert ran(runs) == ["ddp", "alone"]


def test_the_table_fits_80_columns_with_every_long_row_name_shortened_and_explained():
    from _e2e_rows import DEFAULT_ROWS
    from _e2e_table import NAME, short, table

    names = [*DEFAULT_ROWS, "diloco@x0.5", "low_rank_r64_u8", "topk_1pct_u4"]
    assert all(len(short(n)) <= NAME for n in names)
    assert len({short(n) for n in names}) == len(names)        # no two rows look the same
    runs = [{"algorithm": n, "status": "ok", "bandwidth_mbit": 10, "latency_ms": 50,
             "bytes_per_step": 19.85e6, "step_s": 12.345, "loss": 2.1234,
             "loss_over": "mean of the ranks' models", "steps_to_target": {"ddp@120": 1234},
             "time_to_target_s": {"ddp@120": 12345.6}, "bound_s": 1234.5,
             "efficiency": 0.1} for n in names]
    runs.append({"algorithm": "ft_diloco", "status": "unavailable", "bandwidth_mbit": 10,
                 "latency_ms": 50, "reason": "torchft does not import here " * 5})
    text = table(runs, "title", [{"name": "ddp@120", "ddp_steps": 120, "loss": 1.5}],
                 "ddp@120", "why", mode=lambda r: "a long mode note " * 8)
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "low_precision_decentralized" in text and "lp_decent" in text   # the legend
    assert "torchft does not import here torchft" in " ".join(text.split())


def test_the_trade_off_map_ranks_the_rows_at_the_headline_with_the_floor_in_every_cell():
    from _e2e_targets import add_targets
    from tradeoff import build_map

    runs = _synthetic_runs()
    for r in runs:
        r["world_size"] = 4
    targets, headline, _why = add_targets(runs, [2, 4, 8, 16])
    report = {"model": {"params": 1000}, "runs": runs, "targets": targets,
              "headline": headline}
    [entry] = build_map(report, exclude=("auto",))
    # at ddp@16 'alone' (faster per step) never gets there: 'fast' wins, DDP is second
    assert entry["target"] == "ddp@16" and entry["winner"] == "fast"
    assert entry["times_s"]["alone"] is None and entry["alone_vs_best"] is None
    assert entry["margin"] == pytest.approx(16.0 / 8.0)
    assert entry["efficiency"]["fast"] == pytest.approx(0.5)
    assert entry["steps_factor"]["fast"] == 1.0 and entry["steps_factor"]["alone"] is None
    # at a shallow target, not communicating at all wins: the map says so
    [shallow] = build_map({**report, "headline": "ddp@4"}, exclude=("auto",))
    assert shallow["winner"] in ("alone", "fast") and shallow["alone_vs_best"] == 1.0


def test_a_map_joined_from_several_runs_picks_one_headline_alone_reaches_in_none(tmp_path):
    """Two e2e JSONs, one cell each, each with its own headline: 'alone' stalls at 3.5 in
    the first (its headline ddp@4) and at 2.5 in the second (its headline ddp@16).  The
    joined map ranks both cells at the first target no 'alone' reached in any of them."""
    import tradeoff
    from _e2e_targets import add_targets

    paths, own = [], []
    for k, (bw, floor) in enumerate(((10, 3.5), (100, 2.5))):
        runs = _synthetic_runs()
        for r in runs:
            r["bandwidth_mbit"], r["world_size"] = bw, 4
        runs[1]["eval_curve"] = _curve([max(floor, 4.0 - 3.0 * j / 15) for j in range(40)],
                                       0.5)
        targets, headline, _why = add_targets(runs, [2, 4, 8, 16])
        own.append(headline)
        path = tmp_path / f"e2e{k}.json"
        path.write_text(json.dumps({"model": {"params": 1000}, "runs": runs,
                                    "targets": targets, "headline": headline}))
        paths.append(path)
    assert own == ["ddp@4", "ddp@16"]
    out = tmp_path / "map.json"
    tradeoff.main(["--from-json", *map(str, paths), "--json", str(out),
                   "--plot", str(tmp_path / "map.png"), "--exclude", "auto"])
    cells = json.loads(out.read_text())["cells"]
    assert [c["target"] for c in cells] == ["ddp@16", "ddp@16"]
    # the first cell re-read at ddp@16: 'fast' 16 steps of 0.5 s (at ddp@4 it was 2 s)
    assert cells[0]["times_s"]["fast"] == pytest.approx(8.0)
    assert [c["alone_vs_best"] for c in cells] == [None, None]
    assert cells[0]["efficiency"]["fast"] == pytest.approx(16 * 0.25 / 8.0)


def test_the_diloco_rows_as_the_anchors_run_it_each_change_one_knob():
    """Issue 44's rows: each is DiLoCo with one change (or two, named), the 4-bit ones with
    MinMaxUInt4 and error feedback; every one builds, and the table tells them apart."""
    from _e2e_rows import OUTER_BYTES, SYNC_ROWS, bagua_spec, mode_note
    from _e2e_table import short

    from bagua_algos import Algorithm
    from bagua_comm.compression import MinMaxUInt4

    want = {"diloco_warm": {"outer_warmup": 8},
            "diloco_stream": {"fragments": 2, "overlap_steps": 1},
            "diloco_m05": {"outer_momentum": 0.5},
            "diloco_u4_m05": {"outer_momentum": 0.5},
            "diloco_u4_m05_stream": {"outer_momentum": 0.5, "fragments": 2, "overlap_steps": 1}}
    for row, kwargs in want.items():
        assert row in SYNC_ROWS
        name, got = bagua_spec(row, 2, world=4)
        comp = got.pop("compressor", None)
        assert name == "diloco" and got == kwargs, row
        if "_u4" in row:
            assert isinstance(comp, MinMaxUInt4) and comp.chunks == 4 and comp.error_feedback
            assert OUTER_BYTES[row] == 1 / 8
        else:
            assert comp is None
        Algorithm.init(name, sync_every=4, **got)
    assert len({short(r) for r in want}) == len(want)
    assert mode_note("diloco_u4_m05_stream", 2, sync_every=4) == (
        "H=4, 4-bit EF, mu 0.5, 2 frag. overlap 1")



def _stop_run(tmp: Path, *extra: str) -> dict:
    """DDP and DiLoCo (H=3; ``alone`` added by the job) with a budget of 20x DDP's time to its
    deepest target and a T far below it: room to stop early."""
    out = tmp / "e2e.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "e2e.py"), *TINY[:-1],
                        "--no-testbed", "--wall-seconds", "0.05", "--budget-factor", "20",
                        "--algorithms", "ddp,diloco", "--sync-every", "3", *extra,
                        "--json", str(out), "--plot", str(tmp / "e2e.png"),
                        "--workdir", str(tmp / "work"), "--stall-seconds", "120"],
                       capture_output=True, text=True, timeout=400, cwd=tmp)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.timeout(600)
def test_a_row_stops_at_its_first_evaluation_that_reaches_the_deepest_target(tmp_path):
    """Past T and its window, a row trains no further than the deepest target (DDP's loss
    after its deepest step count): its curve ends at its first evaluation at or below it, and
    up to there it is the curve of the same row trained for its whole budget
    (``--full-budget``), so every figure read from it is the same."""
    (tmp_path / "stop").mkdir()
    (tmp_path / "full").mkdir()
    stop = _stop_run(tmp_path / "stop")
    full = _stop_run(tmp_path / "full", "--full-budget")
    deepest = max(stop["targets"], key=lambda t: t["ddp_steps"])["loss"]
    runs = {r["algorithm"]: r for r in stop["runs"]}
    whole = {r["algorithm"]: r for r in full["runs"]}
    assert runs["ddp"]["stopped_at_deepest"] is None   # DDP sets the targets: it runs them all
    assert all(r["stopped_at_deepest"] is None for r in whole.values())
    stopped = [a for a, r in runs.items() if r["status"] == "ok" and r["stopped_at_deepest"]]
    assert set(stopped) == {"alone", "diloco"}, {a: r["eval_curve"][-1] for a, r in runs.items()}
    for a in stopped:
        curve, ref = runs[a]["eval_curve"], whole[a]["eval_curve"]
        step, _t, loss = curve[-1]
        assert step == runs[a]["stopped_at_deepest"] == runs[a]["steps_run"], (a, curve[-3:])
        assert loss <= deepest, (a, loss, deepest)
        assert len(ref) > len(curve) and whole[a]["steps_run"] > step   # it did save steps
        assert [(s, v) for s, _, v in curve] == [(s, v) for s, _, v in ref[:len(curve)]], a


def test_a_hiding_row_overlaps_the_steps_its_sync_takes():
    """``diloco_u4_m05_hide``: overlap_steps = the sync as recommend prices it on hosts that
    restart TCP after idle (two slow-start exchanges, the ring's bytes, the codec), in steps
    of compute (at most H - 1; 1 where nothing is known); its H from the overlapped plan."""
    import math

    from _e2e_rows import (
        HIDING_ROWS,
        OUTER_BYTES,
        SYNC_ROWS,
        bagua_spec,
        hidden_sync_steps,
        sync_every_for,
    )

    from bagua_algos.tuning.recommend import diloco_plan

    net = {"bandwidth_mbit": 100, "latency_ms": 100, "nodes": 4, "model_bytes": 5.76e6,
           "slow_start": True}
    per_peer = 5.76e6 / 8 / 4                              # 180 kB, 4 bits, 1/4 each
    trips = 1 + math.log2(per_peer / (10 * 1448))          # slow start from 10 segments
    sync_s = (2 * trips * 0.1 + 1.5 * 5.76e6 / 8 / 12.5e6  # two exchanges + the ring's bytes
              + 2 * 1e-9 * 5.76e6)                         # + the codec, both ways
    assert 0.9 < sync_s < 1.1
    assert hidden_sync_steps(75, 0.066, net) == math.ceil(sync_s / 0.066)
    assert hidden_sync_steps(8, 0.066, net) == 7          # below H
    assert hidden_sync_steps(75, 0.066, None) == 1
    # no link known: DDP's allreduce in this job, an eighth of it
    assert hidden_sync_steps(75, 0.066, None, ddp_step_s=0.866) == math.ceil(0.1 / 0.066)
    h = sync_every_for(0.866, 0.066, 80, bytes_scale=1 / 8, network=net, overlap=True)
    plan = diloco_plan(sync_s, 0.066, 80, overlap=True)
    assert h == plan.sync_every > hidden_sync_steps(h, 0.066, net) == plan.overlap_steps
    assert "diloco_u4_m05_hide" in HIDING_ROWS and "diloco_u4_m05_hide" in SYNC_ROWS
    assert OUTER_BYTES["diloco_u4_m05_hide"] == 1 / 8
    name, kw = bagua_spec("diloco_u4_m05_hide", 1, world=4)
    assert name == "diloco" and kw["outer_momentum"] == 0.5 and kw["compressor"].chunks == 4
