"""The main job: torch DDP against every bagua algorithm, end to end, on emulated networks.

    python benchmarks/e2e.py --quick          # 4 hosts, 100 Mbit/s, to DDP's loss after 80 steps
    python benchmarks/e2e.py --hosts 4 --bandwidths 100,1000 --json out/e2e.json
    python benchmarks/e2e.py --hosts 4 --bandwidths 100 --latencies 0,5,50   # with latency

For each link bandwidth the testbed (benchmarks/testbed) emulates ``--hosts`` machines, each
a network namespace behind a ``tc``-shaped link, and launches a real multi-node job with
``torchrun --nnodes N --nproc-per-node M`` (c10d rendezvous across the namespaces, gloo, one
thread per process; the M processes of a host talk over its loopback, hosts over the shaped
link).  The job trains the same transformer on the same generated data with torch DDP (plain,
``fp16_compress_hook``, PowerSGD), with each bagua algorithm and mode (``_e2e_rows``) and
``alone`` (every rank on its own shard, no communication: the floor) and reports the steps and
wall time each needs to reach DDP's held-out loss after N/4 .. 4N steps (``--depths``; DDP
trains to the deepest), the headline target (the first that ``alone`` does not reach:
``_e2e_targets``), each row's compute-only bound and efficiency there, samples/s, time per step split into compute and exposed communication, bytes sent
per rank per step (measured on the host's interface), the loss after N steps and after T
seconds.  An algorithm bagua_algos does not provide is reported as unavailable, never
skipped; so is ``ft_diloco`` (torchft's DiLoCo, the peer of ``diloco``: ``_e2e_ft``) where
torchft does not import.  ``--latency-ms``/``--latencies`` add a one-way delay between every two hosts (the
testbed's delay line); every run records its ``latency_ms``.  Where network namespaces cannot be made, the job runs as plain processes over
loopback (unshaped only) and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.append(str(Path(__file__).resolve().parents[1]))  # benchmarks/
import _paths  # noqa: E402,F401  (testbed and benchmarks/e2e on sys.path)
import _results  # noqa: E402

# isort: split
from _e2e_display import Display  # noqa: E402
from _e2e_model import SIZES, MarkovText, initial_loss, make_model, num_params  # noqa: E402
from _e2e_report import (  # noqa: E402
    PlainConsole,
    _mode,
    add_ratios,
    cell_label,
    check_targets,
    plot,
    verdict,
)
from _e2e_rows import ALONE, QUICK_ROWS, SYNC_SWEEP, default_rows, split_row  # noqa: E402
from _e2e_table import table  # noqa: E402
from _e2e_targets import DEPTHS, add_targets, depth_steps, figures  # noqa: E402

WORKER = str(HERE / "_e2e_worker.py")
# --quick (nox -s demo): the main run of docs/main-job.md#results, 4 hosts at 100 Mbit/s, the
# small model, DDP's loss after 10 to 80 steps (alone misses the last), a dozen rows (QUICK_ROWS)
QUICK = {"bandwidths": "100", "size": "small", "steps": 10, "wall_seconds": 4.0, "hosts": 4,
         "procs_per_host": 1, "budget_factor": 1.5, "depths": "1,2,4,8"}
FULL = {"bandwidths": "100,1000,none", "size": "base", "steps": 30, "wall_seconds": 30.0,
        "hosts": 2, "procs_per_host": 1, "budget_factor": 1.5,
        "depths": ",".join(f"{d:g}" for d in DEPTHS)}
_NUMERIC = ("samples_per_s", "step_s", "compute_s", "comm_s", "bytes_per_step",
            "bytes_per_step_accounted", "loss", "train_loss", "loss_at_wall", "window_steps",
            "window_s", "eval_curve", "loss_curve", "time_to_ddp_loss_s", "procs_per_host",
            "sync_every")


def _bandwidths(text: str) -> list:
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if part in ("none", "unshaped", "inf"):
            out.append(None)
            continue
        try:
            value = float(part[:-1]) * 1000 if part.endswith("g") else float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"bandwidths must be Mbit/s numbers (e.g. 100, 1000, 10g) or 'none', "
                f"got {part!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"bandwidths must be positive, got {part!r}")
        out.append(int(value) if value == int(value) else value)
    return out


def _latencies(text: str) -> list:
    out = []
    for part in text.split(","):
        try:
            value = float(part.strip().lower().removesuffix("ms"))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"latencies must be one-way milliseconds (e.g. 0,5,50), got {part!r}") from None
        if not 0 <= value <= 10_000:
            raise argparse.ArgumentTypeError(f"latencies must be in [0, 10000] ms, got {part!r}")
        out.append(int(value) if value == int(value) else value)
    return out


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help=f"one cell, a dozen rows ({QUICK}): the main run of "
                         "docs/main-job.md, about 17 minutes on an idle 2-core machine")
    ap.add_argument("--bandwidths", help="comma list of Mbit/s or 'none' (unshaped); "
                    f"default {FULL['bandwidths']}")
    lat = ap.add_mutually_exclusive_group()
    lat.add_argument("--latency-ms", help="one-way delay added between every two hosts, ms "
                     "(default 0: none)")
    lat.add_argument("--latencies", help="comma list of one-way delays (ms) to run each "
                     "bandwidth at, e.g. 0,5,50")
    ap.add_argument("--tcp-slow-start-after-idle", type=int, choices=(0, 1),
                    help="set net.ipv4.tcp_slow_start_after_idle in every emulated host (default: "
                         "the kernel's, 1). With 1, a connection idle between steps restarts "
                         "from its initial window: over a far link each step's burst pays "
                         "several round trips of slow start")
    ap.add_argument("--algorithms", help="comma list of rows (default: every row, "
                    "bytegrad_flat only with --procs-per-host > 1; --quick: "
                    f"{','.join(QUICK_ROWS)})")
    ap.add_argument("--hosts", type=int,
                    help="emulated hosts (network namespaces; default 2, --quick 4)")
    ap.add_argument("--procs-per-host", type=int,
                    help="processes per host (torchrun --nproc-per-node): intra-node traffic "
                         "on the host's loopback, hierarchical modes on; default 1")
    ap.add_argument("--size", choices=sorted(SIZES), help="model size (default base)")
    ap.add_argument("--steps", type=int, help="timed steps for throughput and loss@N "
                    f"(default {FULL['steps']}, --quick {QUICK['steps']})")
    ap.add_argument("--depths",
                    help="the targets: DDP's held-out loss after these multiples of N steps "
                         f"(default {FULL['depths']}, --quick "
                         f"{QUICK['depths']}); DDP trains to the deepest, the headline is "
                         "the first one the 'alone' row does not reach")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--wall-seconds", type=float, help="wall time T for loss@T")
    ap.add_argument("--batch-size", type=int, default=8, help="per rank")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--powersgd-rank", type=int, default=2, choices=[1, 2, 3, 4])
    ap.add_argument("--async-interval-ms", type=float, default=500.0,
                    help="AsyncModelAverage's sync_interval_ms (its timed window is extended "
                         "until it holds 2 averaging rounds)")
    ap.add_argument("--sync-every", type=int, default=0,
                    help="local_sgd/diloco rows' sync_every (default 0: chosen for the "
                         "workload from DDP's step time, see _e2e_rows.sync_every_for)")
    ap.add_argument("--sync-sweep",
                    help="extra diloco rows around the rule's H: comma list of xK (K times the "
                         "rule's H) or H; default (full run) " + ",".join(SYNC_SWEEP) +
                         ", none with --quick or --sync-every; 'none' for none")
    ap.add_argument("--budget-factor", type=float,
                    help="every row trains for max(T, this x DDP's time for N steps); "
                         "default 1.5")
    ap.add_argument("--full-budget", action="store_true",
                    help="every row trains its whole budget; by default a row stops once "
                         "past T at the first evaluation that reaches the deepest target")
    ap.add_argument("--no-testbed", action="store_true", help="plain loopback processes")
    ap.add_argument("--json", type=Path, help="write every number here")
    _results.add_options(ap)
    ap.add_argument("--plot", type=Path, default=Path("out/e2e/e2e.png"))
    ap.add_argument("--replot", type=Path, metavar="JSON",
                    help="run nothing: draw --plot again from an earlier run's --json")
    ap.add_argument("--workdir", type=Path, default=Path("out/e2e/work"))
    ap.add_argument("--stall-seconds", type=float, default=300.0,
                    help="a job making no progress for this long is killed")
    ap.add_argument("--testbed-name", default="e2e")
    args = ap.parse_args(argv)
    preset = QUICK if args.quick else FULL
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    try:
        args.bandwidths = _bandwidths(args.bandwidths)
        args.latencies = _latencies(args.latencies or args.latency_ms or "0")
    except argparse.ArgumentTypeError as err:
        ap.error(str(err))
    if args.latency_ms is not None:
        args.latency_ms = args.latencies[0]
    if args.algorithms is None:
        args.algorithms = ",".join(QUICK_ROWS if args.quick
                                   else default_rows(args.procs_per_host))
    args.algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    if "ddp" not in args.algorithms:
        args.algorithms.insert(0, "ddp")  # every ratio is against DDP from the same run
    if ALONE not in args.algorithms:      # the floor, in every cell: picks the headline target
        args.algorithms.insert(args.algorithms.index("ddp") + 1, ALONE)
    sweep = args.sync_sweep
    if sweep is None:
        sweep = "" if args.quick or args.sync_every else ",".join(SYNC_SWEEP)
    sweep = [h.strip() for h in sweep.split(",") if h.strip() and h.strip() != "none"]
    if sweep and "diloco" in args.algorithms:
        at = args.algorithms.index("diloco") + 1
        args.algorithms[at:at] = [f"diloco@{h}" for h in sweep
                                  if f"diloco@{h}" not in args.algorithms]
    for row in args.algorithms:
        try:
            split_row(row)
        except ValueError as err:
            ap.error(str(err))
    if args.hosts < 1 or args.procs_per_host < 1 or args.hosts * args.procs_per_host < 2:
        ap.error(f"--hosts x --procs-per-host must be at least 2 (a distributed job), got "
                 f"{args.hosts} x {args.procs_per_host}")
    if args.steps < 1 or args.warmup < 0 or args.batch_size < 1:
        ap.error("--steps and --batch-size must be >= 1 and --warmup >= 0")
    try:
        args.depth_steps = depth_steps(args.steps, args.depths)
    except ValueError as err:
        ap.error(str(err))
    return args


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Launcher:
    """Starts one job (all hosts) and tells whether it is still running."""

    def __init__(self, args, tb):
        self.args, self.tb = args, tb
        self.launches = 0

    def start(self, algorithms: list[str], outdir: Path,
              ddp_seconds: float = 0.0, ddp_budget_s: float = 0.0,
              stop_loss: float | None = None,
              network: tuple | None = None) -> list[subprocess.Popen]:
        a = self.args
        worker = [WORKER, "--algorithms", ",".join(algorithms), "--size", a.size,
                  "--steps", a.steps, "--warmup", a.warmup, "--wall-seconds", a.wall_seconds,
                  "--batch-size", a.batch_size, "--lr", a.lr, "--out", outdir,
                  "--procs-per-host", a.procs_per_host, "--powersgd-rank", a.powersgd_rank,
                  "--async-interval-ms", a.async_interval_ms, "--sync-every", a.sync_every,
                  "--budget-factor", a.budget_factor, "--ddp-seconds", ddp_seconds,
                  "--ddp-budget-seconds", ddp_budget_s,
                  "--depth-steps", ",".join(map(str, a.depth_steps)),
                  "--ifname", self.tb.data_ifname if self.tb else ""]
        if network and network[0]:     # the shaped link: what the rows' rules are told
            worker += ["--network-mbit", network[0], "--network-latency-ms", network[1] or 0]
        if a.full_budget:
            worker.append("--full-budget")
        elif stop_loss is not None:     # DDP ran in an earlier job: its deepest loss
            worker += ["--stop-loss", repr(stop_loss)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.launches += 1
        procs = []
        if self.tb is None:
            # Plain processes: each "host" is a torchrun agent on loopback (c10d rendezvous),
            # so ranks still know their node (LOCAL_WORLD_SIZE = --procs-per-host).
            port = _free_port()
            for i in range(a.hosts):
                argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(a.hosts),
                        "--nproc-per-node", str(a.procs_per_host), "--rdzv-backend", "c10d",
                        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id",
                        f"e2e{self.launches}", "--rdzv-conf", f"is_host={int(i == 0)}",
                        "--local-addr", "127.0.0.1", *map(str, worker)]
                log = open(outdir / f"host{i}.log", "w")  # noqa: SIM115 (closed by the caller)
                procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                              env=env))
            return procs
        for i in range(a.hosts):
            argv = self.tb.torchrun_argv(i, worker, nproc_per_node=a.procs_per_host,
                                         port=29400 + self.launches % 500,
                                         rdzv_id=f"e2e{self.launches}")
            log = open(outdir / f"host{i}.log", "w")  # noqa: SIM115
            procs.append(self.tb.popen(i, argv, stdout=log, stderr=subprocess.STDOUT, env=env))
        return procs


_EXC = re.compile(r"^(\[rank\d+\]: )?([\w.]+(Error|Exception|Interrupt)\b.*)$")


def _log_tail(outdir: Path, n: int = 2) -> str:
    """The exceptions the job's logs end with (or their last lines)."""
    found, last = [], []
    for log in sorted(outdir.glob("host*.log")):
        text = log.read_text(errors="replace").splitlines()
        last += text[-1:]
        for ln in text:
            m = _EXC.match(ln.strip())
            if m and "ChildFailedError" not in ln and m.group(2) not in found:
                found.append(m.group(2))
    return " | ".join((found or last)[-n:])


def _row_line(label: str, r: dict) -> str:
    """The line a row prints as it finishes."""
    if r["status"] != "ok":
        return f"{label} {r['algorithm']}: {r['status']}: {r.get('reason')}"
    return (f"{label} {r['algorithm']}: {r['samples_per_s']:.1f} samples/s, "
            f"{r['bytes_per_step'] / 1e6:.2f} MB/step, loss@N {r['loss']:.3f}, "
            f"{r.get('steps_run')} steps in its budget")


def _fraction(info: dict) -> float:
    """How far a row is from the worker's progress file: training, then evaluation."""
    frac = info["step"] / max(1, info.get("of") or 1)
    return 0.8 * frac if info.get("phase", "train") == "train" else 0.8 + 0.2 * frac


def _deepest_loss(ddp: dict, args) -> float | None:
    """DDP's held-out loss after its deepest step count (the deepest target), from its row."""
    deepest = max([args.steps, *args.depth_steps])
    return next((loss for step, _t, loss in ddp.get("eval_curve") or [] if step == deepest),
                None)


def run_bandwidth(bw, args, launcher: Launcher, display, latency_ms=0) -> list[dict]:
    """Every algorithm in one cell (bandwidth, latency); a crashed job is relaunched for the
    rest.  Each row's line is shown as soon as it finishes."""
    label = cell_label((bw, latency_ms))
    results: dict[str, dict] = {}
    remaining = list(args.algorithms)
    attempt = 0

    def finish(a: str, r: dict) -> None:
        results[a] = r
        display.done(_row_line(label, r))

    while remaining:
        outdir = args.workdir / f"{re.sub(r'[ /,]', '', label)}-{attempt}"
        outdir.mkdir(parents=True, exist_ok=True)
        for f in outdir.glob("*"):
            f.unlink()
        ddp = results.get("ddp", {})
        ok = ddp.get("status") == "ok"
        procs = launcher.start(remaining, outdir, (ddp.get("window_s") or 0.0) if ok else 0.0,
                               (ddp.get("budget_s") or 0.0) if ok else 0.0,
                               _deepest_loss(ddp, args) if ok else None,
                               network=(bw, latency_ms))
        last_change, last_seen = time.monotonic(), None
        stalled = False
        while any(p.poll() is None for p in procs):
            time.sleep(0.5)
            prog = outdir / "progress"
            seen = prog.read_text() if prog.exists() else None
            if seen and seen != last_seen:
                last_change, last_seen = time.monotonic(), seen
                try:
                    info = json.loads(seen)
                    display.row(f"{label} {info['algorithm']}", _fraction(info))
                except (ValueError, KeyError, TypeError):
                    pass
            for a in remaining:
                if (outdir / f"{a}.json").exists() and a not in results:
                    finish(a, json.loads((outdir / f"{a}.json").read_text()))
            if time.monotonic() - last_change > args.stall_seconds:
                stalled = True
                break
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        failed_code = next((p.returncode for p in procs if p.returncode), 0)
        started = False
        for a in list(remaining):
            js, marker = outdir / f"{a}.json", outdir / f"{a}.started"
            if js.exists():
                if a not in results:
                    finish(a, json.loads(js.read_text()))
                remaining.remove(a)
            elif marker.exists() and not started:
                started = True
                why = (f"no progress for {args.stall_seconds:.0f}s" if stalled
                       else f"job exited with {failed_code}")
                finish(a, {"algorithm": a, "status": "failed",
                           "reason": f"{why}: {_log_tail(outdir)}"})
                remaining.remove(a)
        if remaining and not started:
            # The job died before any algorithm began (rendezvous, import...): give up.
            for a in remaining:
                finish(a, {"algorithm": a, "status": "failed",
                           "reason": f"job failed before training ({failed_code}): "
                                     f"{_log_tail(outdir)}"})
            remaining = []
        attempt += 1
    runs = []
    for a in args.algorithms:
        r = {"bandwidth_mbit": bw, "latency_ms": latency_ms, **results[a]}
        for key in _NUMERIC:
            r.setdefault(key, None)
        runs.append(r)
    return runs


def delay_line_check(before: dict | None, after: dict | None) -> dict | None:
    """What the delay line did during one cell, and whether it kept up: packets that left
    more than 1 ms late (the line short of CPU) make the cell's latency larger than asked."""
    if before is None or after is None:
        return None
    d = {k: after[k] - before[k] for k in ("packets", "bytes", "dropped_queue", "cpu_s",
                                           "late_over_1ms", "late_over_5ms")}
    frac = d["late_over_1ms"] / max(1, d["packets"])
    d["late_over_1ms_frac"] = frac
    d["kept_up"] = frac < 0.01
    d["note"] = (f"{d['packets']} packets, {d['cpu_s']:.1f} CPU s, "
                 f"{100 * frac:.2f}% > 1 ms late" + ("" if d["kept_up"] else
                                                     " (FELL BEHIND: latency distorted)"))
    return d


def replot(report: dict, path: Path, source: str) -> Path | None:
    """The run's picture drawn again from its JSON (after a change to the drawing)."""
    params = (report.get("model") or {}).get("params")
    what = f"{params / 1e6:.2f}M-param transformer, " if params else ""
    return plot(report["runs"], path, subtitle=f"{what}redrawn from {source}",
                targets=report.get("targets"), headline=report.get("headline"))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.replot is not None:
        png = replot(json.loads(args.replot.read_text()), args.plot, args.replot.name)
        print(f"plot: {png}" if png else "plot: skipped (pip install matplotlib)")
        return 0
    start = _results.started()
    try:
        from rich.console import Console

        console = Console() if sys.stdout.isatty() else Console(width=80)
    except ImportError:  # plain text (tqdm's bar where it is installed); `pip install rich`
        console = PlainConsole()
    t_start = time.monotonic()
    tb = None
    tcp = None      # the hosts' TCP switches (the JSON's testbed.tcp)
    if args.no_testbed:
        ok, why = False, "--no-testbed given"
    else:
        from testbed import Testbed, testbed_available

        ok, why = testbed_available()
    if ok:
        sssi = args.tcp_slow_start_after_idle
        tb = Testbed(n_hosts=args.hosts, bandwidth_mbit=None, name=args.testbed_name,
                     tcp_slow_start_after_idle=None if sssi is None else bool(sssi))
        tb.__enter__()
        tcp = tb.tcp_settings()
        console.print(f"[bold]testbed[/]: {args.hosts} emulated hosts "
                      f"({', '.join(h.addr for h in tb.hosts)}), {why}")
    else:
        console.print(f"[bold red]NO TESTBED[/] ({why}): running {args.hosts} plain processes "
                      f"over loopback instead, unshaped only. Bandwidth effects are NOT "
                      f"measured in this mode.")
        args.bandwidths = [None]
        if any(args.latencies):
            console.print(f"[bold red]latency {args.latencies} ms not emulated[/] without a "
                          f"testbed: running at 0 ms only")
        args.latencies = [0]
    model = make_model(args.size)
    data = MarkovText(args.size)
    console.print(f"model: transformer '{args.size}', {num_params(model) / 1e6:.2f}M "
                  f"parameters; data: Markov text (loss from {initial_loss(data.vocab):.2f} "
                  f"to at best {data.entropy():.2f}); {args.steps} timed steps (N) of "
                  f"{args.batch_size} sequences per rank; held-out loss after N steps and "
                  f"after T={args.wall_seconds:g}s of training")
    args.workdir.mkdir(parents=True, exist_ok=True)
    launcher = Launcher(args, tb)
    runs: list[dict] = []
    try:
        with Display(console, len(args.bandwidths) * len(args.latencies)
                     * len(args.algorithms)) as display:
            for bw in args.bandwidths:
                for lat in args.latencies:
                    if tb is not None:
                        tb.reshape(bandwidth_mbit=bw)
                        tb.set_latency(lat)
                    before = tb.delay_stats() if tb is not None and lat else None
                    cell_runs = run_bandwidth(bw, args, launcher, display, lat)
                    line = delay_line_check(before, tb.delay_stats() if before else None)
                    if line is not None:
                        display.done(f"{cell_label((bw, lat))}: delay line {line['note']}")
                        display.finished -= 1         # a note, not a row
                    for r in cell_runs:
                        r["delay_line"] = line
                    runs += cell_runs
    finally:
        if tb is not None:
            tb.close()
    add_ratios(runs)
    depth_targets, headline, why_headline = add_targets(runs, args.depth_steps)
    targets = check_targets(runs, headline)
    shape = f"{args.hosts} hosts x {args.procs_per_host} processes"
    mode = (f"testbed: {shape}, {why}" if ok else
            f"NO TESTBED ({why}): {shape} as loopback processes, unshaped")
    console.print(table(runs, f"bagua end to end vs torch DDP ({mode})", depth_targets,
                        headline, why_headline, mode=_mode), markup=False, highlight=False)
    png = plot(runs, args.plot, subtitle=f"{num_params(model) / 1e6:.2f}M-param transformer, "
               f"{mode}", targets=depth_targets, headline=headline)
    console.print(f"plot: {png}" if png else "plot: skipped (pip install matplotlib)")
    for t in targets:
        mark = "[green]met[/]" if t["met"] else "[red]not met[/]"
        value = "none reached it" if t["value"] is None else f"{t['value']:.2f}"
        console.print(f"goal {t['target']} "
                      f"({cell_label((t['bandwidth_mbit'], t['latency_ms']))}, "
                      f"{t['algorithm']}, at {t['at']}): {value}, need {t['need']}: {mark}")
    lines = verdict(runs, targets)
    report = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "testbed": {"used": ok, "why": why, "mode": tb.mode if tb else None,
                    "tcp": tcp},
        "model": {"size": args.size, "params": num_params(model),
                  "loss_at_init": initial_loss(data.vocab), "loss_floor": data.entropy()},
        # docs/design.md §10: the targets at depth and the headline (the issue-era performance goals
        # are "goals")
        "targets": depth_targets, "headline": headline, "headline_why": why_headline,
        "runs": runs, "goals": targets, "verdict": lines,
        "plot": str(png) if png else None,
        "elapsed_s": time.monotonic() - t_start,
    }
    for path in {args.json, args.plot.with_suffix(".json")} - {None}:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1))
    console.print(f"json: {args.json or args.plot.with_suffix('.json')}; "
                  f"took {report['elapsed_s']:.0f}s")
    _results.record_from_args(args, "benchmarks/e2e/e2e.py", figures(report), argv, start)
    for line in lines:
        console.print(f"[bold]verdict[/]: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
