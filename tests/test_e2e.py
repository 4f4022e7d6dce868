"""benchmarks/e2e/e2e.py end to end (through the benchmarks/e2e.py shim), with a tiny
configuration: the JSON has every number."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT / "benchmarks"))
import _paths  # noqa: E402,F401  (benchmarks/_paths.py: benchmarks/e2e on sys.path)

# isort: split
from _e2e_model import SIZES, MarkovText, lm_loss, make_model, num_params  # noqa: E402
from _e2e_report import markdown  # noqa: E402
from _e2e_rows import SYNC_ROWS, split_row  # noqa: E402

REQUIRED = ("bandwidth_mbit", "latency_ms", "algorithm", "samples_per_s", "loss", "bytes_per_step")
# Every field a measured run has (time to accuracy included).
FIELDS = REQUIRED + ("status", "world_size", "procs_per_host", "step_s", "compute_s", "comm_s",
                     "bytes_per_step_accounted", "bytes_source", "window_steps", "window_s",
                     "loss_at_wall", "eval_curve", "loss_curve", "step_x_ddp_time",
                     "loss_vs_ddp", "ddp_loss_target", "time_to_ddp_loss_s",
                     "tta_x_ddp_time", "budget_s")
TINY = ["--quick", "--size", "tiny", "--steps", "4", "--warmup", "1", "--wall-seconds", "0.5",
        "--depths", "0.25,0.5,1,2,4", "--budget-factor", "1.25",
        "--hosts", "2", "--procs-per-host", "1"]


def _run(tmp_path: Path, *extra: str, env: dict | None = None) -> dict:
    out = tmp_path / "e2e.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "e2e.py"), *TINY,
                        "--json", str(out), "--plot", str(tmp_path / "e2e.png"),
                        "--workdir", str(tmp_path / "work"), "--testbed-name", f"e2t{os.getpid() % 100000}",
                        "--stall-seconds", "120", *extra],
                       capture_output=True, text=True, timeout=400, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    try:
        if env is not None and WITHOUT_EXTRAS in env.get("PYTHONPATH", ""):
            raise ImportError("blocked in the child")
        import matplotlib  # noqa: F401
    except ImportError:
        assert "plot: skipped (pip install matplotlib)" in r.stdout
    else:
        assert (tmp_path / "e2e.png").stat().st_size > 10_000
    return json.loads(out.read_text()), r.stdout


@pytest.mark.timeout(420)
def test_e2e_writes_every_field_and_ddp_traffic_matches_a_ring_allreduce(tmp_path):
    report, stdout = _run(tmp_path, "--bandwidths", "100", "--latency-ms", "2",
                          "--algorithms", "ddp,gradient_allreduce,no_such_algorithm")
    runs = {r["algorithm"]: r for r in report["runs"]}
    assert list(runs) == ["ddp", "alone", "gradient_allreduce", "no_such_algorithm"]
    for r in report["runs"]:
        assert set(REQUIRED) <= set(r)
        assert r["bandwidth_mbit"] == (100 if report["testbed"]["used"] else None)
        # Latency through the delay line: it carried the cell's packets and the report says
        # whether it kept up (< 1% of them > 1 ms late).  Whether it does depends on the
        # machine's load (a timing, so not asserted here: the testbed's own test measures
        # the delay under an idle link, and the benchmarks flag a line that fell behind).
        assert r["latency_ms"] == (2 if report["testbed"]["used"] else 0)
        if report["testbed"]["used"]:
            line = r["delay_line"]
            assert line["packets"] > 0, r
            assert 0 <= line["late_over_1ms_frac"] <= 1
            assert line["kept_up"] == (line["late_over_1ms_frac"] < 0.01)
            assert ("FELL BEHIND" in line["note"]) == (not line["kept_up"])
    if report["testbed"]["used"]:
        assert "| 2 ms |" in markdown(report["runs"])
        # the TCP switches the hosts ran under, as read in a host: a new namespace inherits
        # the machine's congestion control and starts with the slow-start switch on
        cc = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
        assert report["testbed"]["tcp"] == {"tcp_congestion_control": cc,
                                            "tcp_slow_start_after_idle": "1"}
    else:
        assert report["testbed"]["tcp"] is None
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
        # Measured on the host's interface (the delay line's TUN device): the payload plus
        # TCP/IP headers and ACKs.
        assert ddp["bytes_source"] == "wire"
        assert 0.95 * grad_bytes < ddp["bytes_per_step"] < 1.6 * grad_bytes
    ga = runs["gradient_allreduce"]
    assert ga["status"] == "ok", ga          # a crashed row fails the test, never passes it
    # Same averaged gradients as DDP, same optimizer, same data: the same loss.
    assert ga["loss"] == pytest.approx(ddp["loss"], rel=1e-4)
    # ratios are times, as a multiple of DDP's (< 1: sooner)
    assert ga["step_x_ddp_time"] == pytest.approx(ddp["samples_per_s"] / ga["samples_per_s"])


WITHOUT_EXTRAS = "without-extras"
# The packages nox's bench sessions add (noxfile.py BENCH_EXTRAS): a user may have none of them.
EXTRAS = ("rich", "matplotlib", "tqdm")


def _env_without_extras(tmp_path: Path) -> dict:
    """The environment with rich, matplotlib and tqdm unimportable: stub packages first on
    PYTHONPATH that raise what an absent package raises (the child and its workers inherit it)."""
    stubs = tmp_path / WITHOUT_EXTRAS
    for name in EXTRAS:
        (stubs / name).mkdir(parents=True)
        (stubs / name / "__init__.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{name}' (blocked)\", name='{name}')\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(stubs), *filter(None, [env.get("PYTHONPATH")])])
    return env


def test_the_stubs_block_the_extras(tmp_path):
    env = _env_without_extras(tmp_path)
    for name in EXTRAS:
        r = subprocess.run([sys.executable, "-c", f"import {name}"], env=env,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and "ModuleNotFoundError" in r.stderr, (name, r.stderr)


MAIN_JOB_JSON = ROOT / "benchmarks" / "studies" / "results" / "main-job-2026-11-29b.json"


def test_replot_draws_a_runs_picture_again_from_its_json_and_runs_nothing(tmp_path):
    """``--replot`` (how docs/img/main-job-4hosts-100mbit.png was drawn from the main run's
    JSON): no job, no testbed, the picture written; without matplotlib it says so."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "e2e.py"), "--replot", str(MAIN_JOB_JSON),
           "--plot", str(tmp_path / "again.png"), "--workdir", str(tmp_path / "work")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert not (tmp_path / "work").exists()                        # nothing ran
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "plot: skipped (pip install matplotlib)" in r.stdout
    else:
        assert (tmp_path / "again.png").stat().st_size > 10_000, r.stdout
    r = subprocess.run(cmd[:-4] + ["--plot", str(tmp_path / "none.png")], capture_output=True,
                       text=True, timeout=120, cwd=tmp_path, env=_env_without_extras(tmp_path))
    assert r.returncode == 0 and "plot: skipped (pip install matplotlib)" in r.stdout, r.stderr
    assert not (tmp_path / "none.png").exists()


def test_the_main_runs_json_has_its_headline_and_goals_at_it():
    """The main run the docs quote (docs/main-job.md#results): its headline is a target
    ``alone`` did not reach, and every goal in it is at that headline, never credited to
    ``alone``."""
    report = json.loads(MAIN_JOB_JSON.read_text())
    runs = {r["algorithm"]: r for r in report["runs"]}
    h = report["headline"]
    assert runs["alone"]["time_to_target_s"][h] is None
    assert runs["auto"]["time_to_target_s"][h] < runs["ddp"]["time_to_target_s"][h]
    assert report["goals"] and all(g["at"] == h and g["algorithm"] != "alone"
                                   for g in report["goals"])


@pytest.mark.timeout(420)
def test_e2e_without_rich_matplotlib_or_tqdm_finishes_and_writes_its_json(tmp_path):
    # Plain console and progress: every row's closing line (logged with markup=False) printed,
    # the table and the JSON written, the plot skipped with a note.
    report, stdout = _run(tmp_path, "--no-testbed", "--algorithms", "ddp,no_such_algorithm",
                          env=_env_without_extras(tmp_path))
    runs = {r["algorithm"]: r for r in report["runs"]}
    assert runs["ddp"]["status"] == "ok" and runs["ddp"]["samples_per_s"] > 0
    assert runs["no_such_algorithm"]["status"] == "unavailable"
    assert report["plot"] is None
    assert not (tmp_path / "e2e.png").exists()
    assert "bagua end to end vs torch DDP" in stdout            # the plain table
    assert "json: " in stdout
    # each row's line as it finished, before the table, each with the plain bar and the
    # time left after it (issue 48)
    table_at = stdout.index("bagua end to end")
    assert -1 < stdout.index("unshaped ddp: ") < stdout.index("unshaped alone: ") < table_at
    assert "1.0/3 rows" in stdout and "3.0/3 rows" in stdout and " left" in stdout
    # the table within 80 columns: the long reason wrapped under the rows, never cut
    table = stdout[table_at:stdout.index("json: ")]
    assert max(len(line) for line in table.splitlines()) <= 80, table
    said = " ".join(table.split())
    assert "no_such_algo~: unavailable: not in bagua_algos' registry" in said
    assert "no_such_algo~ = no_such_algorithm" in said                  # the names' legend


@pytest.mark.timeout(420)
def test_e2e_without_a_testbed_says_so_and_runs_over_loopback(tmp_path):
    results = tmp_path / "results.json"
    report, stdout = _run(tmp_path, "--no-testbed", "--algorithms", "ddp", "--results",
                          str(results), "--results-run", "tiny")
    assert report["testbed"]["used"] is False
    assert "NO TESTBED" in stdout
    run, alone = report["runs"]
    assert alone["algorithm"] == "alone"
    assert run["bandwidth_mbit"] is None and run["status"] == "ok"
    assert run["bytes_source"] == "accounted"
    assert all(run[k] is not None for k in REQUIRED if k != "bandwidth_mbit")
    # --results: the run's figures merged into that file (benchmarks/_results.py)
    entry = json.loads(results.read_text())["runs"]["tiny"]
    assert entry["command"].startswith("python benchmarks/e2e/e2e.py --quick")
    fig = entry["figures"]
    assert fig["headline"] == report["headline"] and fig["targets"] == report["targets"]
    assert set(fig["rows"]) == {"ddp", "alone"}
    names = [t["name"] for t in report["targets"]]
    assert names and list(fig["rows"]["ddp"]["time_to_target_s"]) == names
    assert all(v in (None, 1.0) for v in fig["rows"]["ddp"]["x_ddp_time"].values())


def _powersgd_ranks(serialize: bool) -> dict:
    import torch
    from _e2e_rows import build_torch
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    torch.manual_seed(0)
    model = make_model("tiny")
    # Buckets of ~10 KB: a dozen in flight per backward, as many as a big model has.
    if serialize:
        ddp = build_torch("ddp_powersgd", model, powersgd_rank=1, powersgd_start=2,
                          bucket_cap_mb=0.01)
    else:  # torch's hook as is (the race this test guards against)
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, bucket_cap_mb=0.01)
        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                   start_powerSGD_iter=2, use_error_feedback=True,
                                   warm_start=True, random_seed=0)
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    import torch.distributed as dist

    data = MarkovText("tiny").batches(12, 16, seed=dist.get_rank())
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = lm_loss(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"params": flat, "losses": losses}


@pytest.mark.timeout(300)
def test_ddp_powersgd_with_many_buckets_runs_on_gloo_and_keeps_ranks_identical():
    """torch's powerSGD_hook issues its second allreduce from a callback: with several buckets
    on gloo the ranks issued collectives in different orders and gloo failed ("Received data
    size doesn't match expected size") or hung.  Serialized, DDP's invariant holds: every rank
    ends with the same parameters, and it trains."""
    from bagua_comm.testing import run_ranks

    a, b = run_ranks(_powersgd_ranks, 2, args=(True,), timeout=240)
    torch = pytest.importorskip("torch")
    torch.testing.assert_close(a["params"], b["params"], rtol=0, atol=0)
    assert max(a["losses"][-3:]) < a["losses"][0] - 0.2


def _check_every_field(report: dict, hosts: int, procs: int) -> dict:
    assert report["config"]["hosts"] == hosts and report["config"]["procs_per_host"] == procs
    assert report["verdict"] and report["verdict"][0].startswith("runs: ")
    runs = {r["algorithm"]: r for r in report["runs"]}
    for name, r in runs.items():
        if name == "ft_diloco" and r["status"] == "unavailable":   # torchft not installed
            assert "torchft" in r["reason"], r
            continue
        assert r["status"] == "ok", (name, r.get("reason"))
        assert set(FIELDS) <= set(r), (name, set(FIELDS) - set(r))
        assert r["world_size"] == hosts * procs and r["procs_per_host"] == procs
        # Every figure measures the algorithm doing its job: it communicated in its window.
        if split_row(name)[0] in SYNC_ROWS:   # talk every sync_every steps (diloco_u4 too)
            continue
        if name == "alone":                  # the floor: never talks (test_e2e_depth.py)
            continue
        if (r.get("auto_choice") or {}).get("algorithm") in SYNC_ROWS:   # auto chose DiLoCo
            continue
        assert r["bytes_per_step"] > 0 and r["bytes_per_step_accounted"] > 0, name
        assert r["eval_curve"] and r["ddp_loss_target"] == runs["ddp"]["loss"]
        t = r["time_to_ddp_loss_s"]
        assert t is None or 0 < t <= r["eval_curve"][-1][1]
    ddp = runs["ddp"]
    # DDP reaches its own loss after N steps, at the latest at step N (its clock started
    # before its wrap: setup_s, then the window's N steps).
    assert 0 < ddp["time_to_ddp_loss_s"] <= (ddp["setup_s"] + ddp["window_s"]) * 1.001
    return runs


@pytest.mark.timeout(420)
def test_e2e_two_processes_per_host_every_row_communicates_in_its_window(tmp_path):
    from _e2e_rows import default_rows

    report, stdout = _run(tmp_path, "--procs-per-host", "2", "--bandwidths", "100",
                          "--algorithms", ",".join(default_rows(2)))
    runs = _check_every_field(report, 2, 2)
    assert {"ddp_fp16", "ddp_powersgd", "ddp_bytegrad_hook", "bytegrad_flat",
            "decentralized_shift_one", "async"} <= set(runs)
    # DDP with bagua's 8-bit hook: about a quarter of DDP's float32 allreduce bytes (plus
    # the 32-byte record headers), counted by bagua_comm's traffic counter.
    hook, ddp_bytes = runs["ddp_bytegrad_hook"], runs["ddp"]["bytes_per_step_accounted"]
    assert 0.24 * ddp_bytes < hook["bytes_per_step_accounted"] < 0.3 * ddp_bytes
    # AsyncModelAverage's timed window holds averaging rounds (not local training only).
    assert runs["async"]["async_rounds_in_window"] >= 2
    assert runs["async"]["window_steps"] >= report["config"]["steps"]
    # Hierarchical: the link carries only the node leaders' (compressed) traffic (the
    # accounted figure also counts the full-precision traffic on the host's loopback).
    if report["testbed"]["used"]:
        assert runs["bytegrad"]["bytes_per_step"] < runs["bytegrad_flat"]["bytes_per_step"]
    # Hierarchical GradientAllReduce averages the same gradients as DDP.
    assert runs["gradient_allreduce"]["loss"] == pytest.approx(runs["ddp"]["loss"], rel=1e-3)
    n = len(report["runs"])
    assert f"verdict: runs: {n} of {n} measured" in stdout.replace("\n", " ")


@pytest.mark.timeout(420)
def test_e2e_four_hosts_shift_one_sends_one_model_per_step(tmp_path):
    report, _ = _run(tmp_path, "--hosts", "4", "--bandwidths", "100",
                     "--algorithms", "ddp,decentralized_shift_one,async")
    runs = _check_every_field(report, 4, 1)
    grad_bytes = 4 * num_params(make_model("tiny"))
    # Ring allreduce over 4 ranks: 2 (n-1)/n = 1.5 model sizes per rank per step; shift_one
    # sends the model once, to one peer.
    assert runs["ddp"]["bytes_per_step_accounted"] == pytest.approx(1.5 * grad_bytes)
    assert runs["decentralized_shift_one"]["bytes_per_step_accounted"] == pytest.approx(
        grad_bytes, rel=0.02)


def test_latency_arguments_make_one_cell_per_bandwidth_and_latency():
    from e2e import parse_args

    a = parse_args(["--quick", "--latencies", "0,5,50", "--bandwidths", "10,100"])
    assert a.latencies == [0, 5, 50] and a.bandwidths == [10, 100]
    assert parse_args(["--quick", "--latency-ms", "7.5"]).latencies == [7.5]
    assert parse_args(["--quick"]).latencies == [0]
    for bad in (["--latencies", "5,-1"], ["--latency-ms", "fast"],
                ["--latency-ms", "5", "--latencies", "0,5"]):
        with pytest.raises(SystemExit):
            parse_args(["--quick", *bad])


@pytest.mark.timeout(420)
def test_diloco_sweep_rows_run_their_own_h_and_send_one_model_per_h_steps(tmp_path):
    """``diloco@H`` fixes H and ``diloco@xK`` scales the rule's H (here ``--sync-every 2``):
    each row sends one model-sized allreduce every H steps, no more."""
    # --wall-seconds: every row trains past step 16, after which it is read only at syncs
    # and every 5 steps (with the tiny run's 0.5 s, a loaded machine left torchft's row 16)
    report, _ = _run(tmp_path, "--no-testbed", "--steps", "8", "--sync-every", "2",
                     "--wall-seconds", "1.5",
                     "--algorithms", "ddp,diloco,diloco@x2,diloco@8,diloco_u4@4,ft_diloco@4")
    runs = {r["algorithm"]: r for r in report["runs"]}
    assert list(runs) == ["ddp", "alone", "diloco", "diloco@x2", "diloco@8", "diloco_u4@4",
                          "ft_diloco@4"]
    assert [runs[a]["sync_every"] for a in ("diloco", "diloco@x2", "diloco@8")] == [2, 4, 8]
    ddp_bytes = runs["ddp"]["bytes_per_step_accounted"]   # one gradient allreduce per step
    ft = runs["ft_diloco@4"]          # torchft's DiLoCo at H = 4 (unavailable without torchft)
    synced = ft["status"] == "ok"
    if not synced:
        assert "torchft" in ft["reason"], ft
    for name in ["diloco", "diloco@x2", "diloco@8"] + (["ft_diloco@4"] if synced else []):
        r = runs[name]
        assert r["status"] == "ok", r
        assert r["bytes_per_step_accounted"] == pytest.approx(ddp_bytes / r["sync_every"],
                                                              rel=0.05), name
    # The 4-bit outer gradient: an eighth of float32's bytes, plus the records' headers
    # (measured: a third more on this 13k-parameter model).
    u4 = runs["diloco_u4@4"]
    assert u4["status"] == "ok" and u4["sync_every"] == 4
    assert ddp_bytes / 4 / 8 < u4["bytes_per_step_accounted"] < 1.5 * ddp_bytes / 4 / 8
    if synced:
        # read when each of its syncs lands, as ours are: every H = 4 inner steps since it
        # wrapped, the warm-up steps in (before: every 4th step past 16, up to 3 late)
        read = {s for s, *_ in ft["eval_curve"]}
        w = report["config"]["warmup"]
        syncs = {i for i in range(17, ft["steps_run"] + 1) if (w + i) % 4 == 0}
        assert syncs and syncs <= read, (sorted(syncs - read), sorted(read))


def test_sync_rows_use_recommends_rule_and_a_compressed_row_counts_its_own_bytes():
    """The DiLoCo rows' H comes from the function ``recommend`` uses (one rule, so the auto
    row and the DiLoCo row agree), told the run's length in steps; a 4-bit row's sync costs an
    eighth of the allreduce."""
    from _e2e_rows import DEFAULT_ROWS, OUTER_BYTES, sync_every_for

    from bagua_algos.tuning.recommend import diloco_plan, diloco_sync_every

    # 4 hosts at 10 Mbit/s, small model: DDP 7.4 s a step, 0.1 s of it compute; a run to
    # DDP's loss after 80 steps
    ddp_step, compute, n = 7.4, 0.1, 80
    h = sync_every_for(ddp_step, compute, n)
    assert h == diloco_sync_every(ddp_step - compute, compute, total_steps=n)
    u4 = sync_every_for(ddp_step, compute, n, bytes_scale=OUTER_BYTES["diloco_u4"])
    assert u4 == diloco_plan((ddp_step - compute) / 8, compute, n).sync_every
    # an eighth of the sync's cost: more syncs (shorter periods) pay off
    assert u4 <= h
    # the cell's link known: a 4-bit row's sync as recommend prices it (latency included),
    # a float32 row's still DDP's allreduce
    from bagua_algos.tuning.recommend import diloco_sync_seconds

    net = {"bandwidth_mbit": 100, "latency_ms": 100, "nodes": 4, "model_bytes": 5.76e6}
    assert sync_every_for(ddp_step, compute, n, bytes_scale=OUTER_BYTES["diloco_u4"],
                          network=net) == diloco_plan(diloco_sync_seconds(**net), compute,
                                                      n).sync_every
    assert sync_every_for(ddp_step, compute, n, network=net) == h
    # the length unknown: the 10%-overhead rule
    assert sync_every_for(ddp_step, compute, None, bytes_scale=1 / 8) == math.ceil(
        (ddp_step - compute) / 8 / (0.1 * compute))
    assert "diloco_u4" in DEFAULT_ROWS and "diloco_u8" not in DEFAULT_ROWS


def test_quantised_low_rank_rows_send_8_bit_factors_in_chunks_the_world_divides():
    from _e2e_rows import bagua_spec, mode_note

    from bagua_comm.compression import MinMaxUInt8

    for row, rank in (("low_rank_r32_u8", 32), ("low_rank_r64_u8", 64)):
        name, kwargs = bagua_spec(row, 1, world=4)
        assert name == "low_rank" and kwargs["rank"] == rank and kwargs["start_step"] == 2
        comp = kwargs["compressor"]
        assert isinstance(comp, MinMaxUInt8) and comp.chunks == 32 and not comp.error_feedback
        assert mode_note(row, 1) == f"rank {rank}, 8-bit factors, EF, warm, start 2"
    assert "compressor" not in bagua_spec("low_rank", 1, world=4)[1]


def test_quick_is_the_main_run_of_the_docs_at_a_target_alone_misses():
    """``--quick`` (``nox -s demo``, README's first command) is the run docs/main-job.md
    quotes: 4 hosts at 100 Mbit/s, DDP's loss after 10 to 80 steps, its thirteen rows; the
    full run keeps N/4 .. 4N; an explicit flag wins over either preset."""
    from _e2e_rows import QUICK_ROWS
    from e2e import parse_args

    q = parse_args(["--quick"])
    assert (q.hosts, q.procs_per_host, q.bandwidths, q.size) == (4, 1, [100], "small")
    assert q.depth_steps == [10, 20, 40, 80] and q.budget_factor == 1.5
    assert q.algorithms == QUICK_ROWS
    report = json.loads(MAIN_JOB_JSON.read_text())
    assert [r["algorithm"] for r in report["runs"]] == QUICK_ROWS        # the run quoted
    assert [t["ddp_steps"] for t in report["targets"]] == q.depth_steps
    full = parse_args(["--bandwidths", "100"])
    assert full.depth_steps == [8, 15, 30, 60, 120]          # N = 30: 0.25N .. 4N
    assert parse_args(["--quick", "--depths", "1,2"]).depth_steps == [10, 20]


def test_sweep_rows_are_checked_and_added_to_the_full_run_only():
    from e2e import parse_args

    full = parse_args(["--hosts", "4", "--bandwidths", "100"]).algorithms
    at = full.index("diloco")
    assert full[at + 1:at + 4] == ["diloco@x0.5", "diloco@x2", "diloco@x4"]
    assert not any("@" in a for a in parse_args(["--quick"]).algorithms)
    assert not any("@" in a for a in parse_args(["--sync-every", "16"]).algorithms)
    for bad in ("bytegrad@x2", "diloco@", "diloco@fast", "diloco@-3", "diloco@x0"):
        with pytest.raises(SystemExit):
            parse_args(["--quick", "--algorithms", f"ddp,{bad}"])


@pytest.mark.timeout(420)
def test_auto_row_runs_the_automatic_choice_and_says_what_it_chose(tmp_path):
    """On loopback (fast, near) the rule keeps the exact allreduce: the auto rows (recommend
    told the compute, and with_bagua(..., "auto") as written, which times no step where
    DiLoCo has no chance) train as GradientAllReduce does, i.e. as DDP does, and record
    their choice."""
    report, _ = _run(tmp_path, "--no-testbed", "--algorithms", "ddp,auto,auto_wrap")
    runs = {r["algorithm"]: r for r in report["runs"]}
    for name in ("auto", "auto_wrap"):
        auto = runs[name]
        assert auto["status"] == "ok", auto
        assert auto["auto_choice"]["algorithm"] == "gradient_allreduce"
        assert auto["auto_choice"]["setup_s"] < 10
        assert auto["loss"] == pytest.approx(runs["ddp"]["loss"], rel=1e-4)
    assert markdown(report["runs"]).count("chose gradient_allreduce") == 2


def _cell_row(name, t, **kw):
    """A measured row of one 4-host, 100 Mbit/s cell: ``t`` its time to DDP's loss."""
    return {"algorithm": name, "status": "ok", "bandwidth_mbit": 100, "latency_ms": 0,
            "world_size": 4, "procs_per_host": 1, "time_to_ddp_loss_s": t,
            "step_x_ddp_time": 1.0, "comm_s": 1.7 if name == "ddp" else 0.0,
            "step_s": 1.98 if name == "ddp" else 0.3, **kw}


def test_diloco_targets_take_the_fastest_diloco_row_and_each_rows_bytes_at_its_own_h():
    """Issue 24's targets from a report: time from the fastest DiLoCo row (4-bit included),
    bytes per row at the H the rule gave it, measured when the window held a sync and one
    allreduce per H steps (times the compression) when it did not."""
    from _e2e_report import check_targets

    run = _cell_row
    runs = [run("ddp", 59.3, bytes_per_step=19.85e6, window_steps=30),
            run("diloco", 36.3, sync_every=33, window_steps=30, bytes_per_step=0.0),
            run("diloco_u4", 26.8, sync_every=7, window_steps=30, bytes_per_step=0.335e6),
            run("ft_diloco", 41.4, sync_every=33, window_steps=30, bytes_per_step=0.0)]
    got = {(t["target"].split(" (")[0].split(" at the")[0], t["algorithm"]): t
           for t in check_targets(runs)}
    time = got[("DiLoCo time to DDP's loss vs DDP's, 4 hosts", "diloco_u4")]
    assert time["value"] == pytest.approx(26.8 / 59.3) and not time["met"]
    peer = got[("DiLoCo ahead of torchft's DiLoCo", "diloco_u4")]
    assert peer["value"] == pytest.approx(26.8 / 41.4) and peer["met"]
    fp32 = got[("DiLoCo bytes per step vs DDP's", "diloco")]
    assert fp32["value"] == pytest.approx(1 / 33) and not fp32["met"]
    u4 = got[("DiLoCo bytes per step vs DDP's", "diloco_u4")]
    assert u4["value"] == pytest.approx(0.335 / 19.85) and u4["met"]


def test_torchfts_diloco_at_a_given_h_is_a_peer_compared_with_ours_at_that_h():
    """``ft_diloco@16`` is torchft's DiLoCo at H = 16: never one of bagua's rows, and compared
    with ``diloco@16`` (the same plan), not with the rule's H."""
    from _e2e_report import check_targets
    from _e2e_rows import mode_note, sync_every_of_row

    assert sync_every_of_row("ft_diloco@16", 75) == 16
    assert mode_note("ft_diloco@16", 1, sync_every=16) == "torchft, H=16"

    run = _cell_row
    runs = [run("ddp", 60.0, bytes_per_step=8.7e6, window_steps=30),
            run("diloco@16", 12.0, sync_every=16, window_steps=32, bytes_per_step=0.5e6),
            run("ft_diloco@16", 10.0, sync_every=16, window_steps=32, bytes_per_step=0.5e6)]
    got = check_targets(runs)
    same = [g for g in got if g["target"].startswith("DiLoCo ahead of torchft's DiLoCo at the "
                                                     "same H=16")]
    assert len(same) == 1 and same[0]["algorithm"] == "diloco@16"
    assert same[0]["value"] == pytest.approx(1.2) and not same[0]["met"]
    best = [g for g in got if g["target"].startswith("DiLoCo time to DDP's loss")]
    assert best and all(g["algorithm"] != "ft_diloco@16" for g in best)   # never ours


def test_an_auto_row_that_chose_diloco_is_written_as_json_and_says_its_h():
    """recommend's DiLoCo carries a compressor object in its kwargs: the report keeps its repr
    (the row once crashed writing its JSON) and the table says H and the bits."""
    from _e2e_report import _mode
    from _e2e_rows import jsonable

    from bagua_algos.tuning.recommend import choose

    name, kwargs, _, _ = choose(10, 0, 4, 5.76e6, compute_s=0.29)
    assert name == "diloco"
    row = {"algorithm": "auto", "auto_choice": {"algorithm": name, "kwargs": jsonable(kwargs),
                                                "bucket_size": 10 * 2**20}}
    back = json.loads(json.dumps(row))
    assert back["auto_choice"]["kwargs"]["compressor"].startswith("MinMaxUInt4(chunks=4")
    assert _mode(back) == f"chose diloco, H={kwargs['sync_every']}, 4-bit"


def test_sparse_targets_take_the_best_topk_or_low_rank_row_against_bytegrad_and_the_hook():
    """Issue 27's targets from a report: the best of every topk*/low_rank* row against
    ByteGrad's time, the topk row's bytes and the low_rank row's time against torch's
    PowerSGD hook."""
    from _e2e_report import check_targets

    def run(name, t, mb):
        return {"algorithm": name, "status": "ok", "bandwidth_mbit": 100, "latency_ms": 0,
                "world_size": 4, "procs_per_host": 1, "time_to_ddp_loss_s": t,
                "step_x_ddp_time": 1.0, "bytes_per_step": mb * 1e6,
                "comm_s": 1.7 if name == "ddp" else 0.2, "step_s": 1.96 if name == "ddp" else 0.5}

    runs = [run("ddp", 58.7, 19.85), run("bytegrad", 27.6, 4.99),
            run("ddp_powersgd", 61.7, 0.33), run("topk", 57.7, 0.27),
            run("low_rank", 69.7, 0.33), run("low_rank_r32_u8", 19.6, 1.01)]
    got = {t["target"].split(" (")[0].split(",")[0]: t for t in check_targets(runs)}
    best = got["best TopK/LowRank sooner to DDP's loss than ByteGrad"]
    assert best["algorithm"] == "low_rank_r32_u8" and best["met"]
    assert best["value"] == pytest.approx(19.6 / 27.6)
    topk = got["TopK bytes per step vs the PowerSGD hook's"]
    assert topk["value"] == pytest.approx(0.27 / 0.33) and topk["met"]
    low = got["LowRank no later to DDP's loss than the PowerSGD hook"]
    assert low["value"] == pytest.approx(69.7 / 61.7) and not low["met"]
    # without the quantised row, ByteGrad stays ahead: not met
    slower = [r for r in runs if r["algorithm"] != "low_rank_r32_u8"]
    miss = next(t for t in check_targets(slower) if t["target"].startswith("best TopK"))
    assert miss["algorithm"] == "topk" and not miss["met"]


def test_goals_are_at_the_headline_target_and_never_credit_alone():
    """The issue-era goals ("best bagua time to DDP's loss vs DDP's", "no DDP-hook peer
    sooner than our best") once took DDP's loss after N steps, where ``alone`` wins, and
    counted ``alone`` as one of ours (a main run of 2026-11-29 credited it with 0.17x DDP's
    time).  With a headline they are at it, and ``alone`` is never "our best"."""
    from _e2e_report import check_targets

    def run(name, t_n, t_h):
        return {"algorithm": name, "status": "ok", "bandwidth_mbit": 100, "latency_ms": 0,
                "world_size": 4, "procs_per_host": 1, "time_to_ddp_loss_s": t_n,
                "time_to_target_s": {"ddp@10": t_n, "ddp@80": t_h},
                "step_x_ddp_time": 1.0, "comm_s": 0.7 if name == "ddp" else 0.0,
                "step_s": 0.85 if name == "ddp" else 0.1}

    runs = [run("ddp", 8.5, 68.6), run("alone", 1.4, None), run("bytegrad", 3.0, 28.2),
            run("diloco_u4_m05", 2.0, 8.9), run("ddp_powersgd", 2.5, 40.0)]
    at_n = {t["target"].split(" (")[0]: t for t in check_targets(runs)}
    best = at_n["best bagua time to DDP's loss vs DDP's time"]
    assert best["algorithm"] == "diloco_u4_m05" and best["at"] == "ddp@N"     # not alone
    assert best["value"] == pytest.approx(2.0 / 8.5)
    got = {t["target"].split(" (")[0]: t for t in check_targets(runs, "ddp@80")}
    best = got["best bagua time to DDP's loss vs DDP's time"]
    assert best["algorithm"] == "diloco_u4_m05" and best["at"] == "ddp@80"
    assert best["value"] == pytest.approx(8.9 / 68.6) and best["met"]
    peer = got["no DDP-hook peer sooner than our best"]
    assert peer["value"] == pytest.approx(8.9 / 40.0) and peer["met"]
    # the peer ahead at the headline: the goal is missed, whatever the shallow target said
    runs[-1]["time_to_target_s"]["ddp@80"] = 7.0
    peer = next(t for t in check_targets(runs, "ddp@80") if t["target"].startswith("no DDP"))
    assert peer["value"] == pytest.approx(8.9 / 7.0) and not peer["met"]


def test_ratios_to_ddp_are_times_lower_is_sooner():
    """One direction for every ratio the main job writes and prints (issue 48): a run's time
    (of a sample, to DDP's loss) as a multiple of DDP's, < 1 sooner; the throughput targets
    are the same rule put as times (1.5x DDP's throughput: <= 1/1.5 of its time)."""
    from _e2e_report import add_ratios, check_targets

    def run(name, sps, t, bw=100):
        return {"algorithm": name, "status": "ok", "bandwidth_mbit": bw, "latency_ms": 0,
                "world_size": 4, "procs_per_host": 1, "samples_per_s": sps, "loss": 2.0,
                "eval_curve": [[10, t, 2.0]], "comm_s": 1.7 if name == "ddp" else 0.2,
                "step_s": 2.0 if name == "ddp" else 0.5}

    runs = [run("ddp", 100.0, 60.0), run("decentralized", 160.0, 50.0),
            run("decentralized_shift_one", 140.0, 40.0), run("bytegrad", 300.0, 20.0),
            run("ddp", 100.0, 10.0, bw=None), run("gradient_allreduce", 96.0, 10.0, bw=None)]
    add_ratios(runs)
    dec = runs[1]
    assert dec["step_x_ddp_time"] == pytest.approx(100 / 160)
    assert dec["tta_x_ddp_time"] == pytest.approx(50 / 60)
    assert runs[0]["step_x_ddp_time"] == runs[0]["tta_x_ddp_time"] == 1.0
    assert not any(k.startswith(("speedup", "tta_speedup")) for r in runs for k in r)
    got = {t["target"].split(",")[0].split(" (")[0]: t for t in check_targets(runs)}
    thr = got["Decentralized time of a sample vs DDP's"]
    assert thr["algorithm"] == "decentralized" and thr["value"] == pytest.approx(100 / 160)
    assert thr["met"]                                  # 1.6x DDP's throughput >= 1.5x
    ga = got["unshaped GradientAllReduce time of a sample vs DDP's"]
    assert ga["value"] == pytest.approx(100 / 96) and ga["met"]   # 0.96x throughput >= 0.95x
    runs[-1]["samples_per_s"] = 94.0
    add_ratios(runs)
    ga = next(t for t in check_targets(runs) if t["target"].startswith("unshaped"))
    assert ga["value"] == pytest.approx(100 / 94) and not ga["met"]
