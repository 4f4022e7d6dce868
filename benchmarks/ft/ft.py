#!/usr/bin/env python3
"""Restart-free fault tolerance: lose a host, keep training, take it back (bagua_algos.ft).

Three emulated hosts (the testbed's network namespaces, as root: one replica each, the torchft
Lighthouse on host 0, links shaped to ``--mbit``; elsewhere, or with ``--no-testbed``,
processes on loopback with the Lighthouse in this process) train with ``--algo`` (default
ByteGrad with error feedback) under ``bagua_algos.ft.FaultTolerant``.  Once every host
has committed ``--kill-after`` steps, host 2 is killed with SIGKILL; the survivors go on at 2.
Host 2 is started again, heals from a survivor at a step boundary and all go on at 3.  The
same story then runs with torchft's own DDP (``torchft.DistributedDataParallel`` +
``Manager`` + ``OptimizerWrapper``) as the peer, under the same Lighthouse settings
(heartbeat timeout, join timeout, quorum tick).  ``--fault`` picks the moment: a plain kill,
a lost link, a returning host whose first heal fails, a kill inside an optimizer-step
exchange, a second host killed inside the group configure of host 2's return (``join``),
the heal source killed half-way through host 2's heal transfer (``mid-heal``).

Reported (``--json PATH``, and a plot ``ft.png`` beside it): ``stall_s`` (the fault to
the survivors' first committed step in a quorum without the lost host, slowest survivor),
``first_commit_s`` (the fault to their first committed step of any quorum: a step already
past its collectives when the host died commits at once, so this one depends on where in
the step the kill landed, not on the system), ``rebuild_s`` (the part of the stall after
the Lighthouse formed the quorum without the lost host: from the start of its group
configure to that first commit, slowest survivor; the stall's wait for the heartbeat
timeout varies with the kill's phase against the heartbeats, this part does not), ``steps_lost`` (step attempts the survivors
did not commit), ``heal_s`` (the returning host's quorum + state transfer + rebuild),
``replicas_identical`` (every live replica's full state bit for bit at the heal step:
parameters, optimizer and algorithm state, LR scheduler, sampler position), and the same under
``peer``.  ``--heartbeat-ms`` is the Lighthouse's heartbeat timeout for both runs (default
1000 ms, replicas beat every 100 ms).  Exits 1 if a target is missed.

    python benchmarks/ft/ft.py --quick --json out/ft/result.json

``--soak SECONDS`` runs no fault at all and counts false drops (a live host left out of a
quorum, a step not committed) at the heartbeat timeout given, under whatever load the machine
has: the measure of whether a short heartbeat is safe.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
OURS = ROOT / "tests" / "_ft_worker.py"
PEER = Path(__file__).resolve().parent / "_ft_ddp_worker.py"
HOSTS, LOST = 3, 2
ALGOS = ("gradient_allreduce", "bytegrad", "decentralized", "low_precision_decentralized",
         "qadam", "local_sgd", "diloco", "diloco_fragments", "topk", "low_rank")
SYNCING = ("low_precision_decentralized", "local_sgd", "diloco", "diloco_fragments")


# the job's secret (heal transfer and group authentication), one per benchmark run
_SECRET = os.environ.get("BAGUA_FT_SECRET") or secrets.token_hex(16)


def _env():
    env = dict(os.environ, RUST_LOG="error")
    env["BAGUA_FT_SECRET"] = _SECRET     # the job's secret: the same for every replica
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), *sys.path])
    return env


def _log(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _wait(pred, limit, what):
    end = time.time() + limit
    while not pred():
        if time.time() > end:
            raise TimeoutError(f"{what} did not happen within {limit} s")
        time.sleep(0.02)


def _flat(obj, prefix=""):
    if isinstance(obj, dict):
        return {k2: v2 for k, v in obj.items() for k2, v2 in _flat(v, f"{prefix}/{k}").items()}
    if isinstance(obj, (list, tuple)):
        return {k2: v2 for i, v in enumerate(obj) for k2, v2 in _flat(v, f"{prefix}/{i}").items()}
    return {prefix: obj}


# per-rank state: equal across replicas only right after a change of world size (each rank
# restarts it); a rebuild at the same size (a joiner's second try) keeps each rank's own
_PER_RANK = ("/rank", "compressor")


def _same(a, b) -> bool:
    fa = {k: v for k, v in _flat(a).items() if not any(p in k for p in _PER_RANK)}
    fb = {k: v for k, v in _flat(b).items() if not any(p in k for p in _PER_RANK)}
    if fa.keys() != fb.keys():
        return False
    return all(torch.equal(x, fb[k]) if isinstance(x, torch.Tensor) else x == fb[k]
               for k, x in fa.items())


_LIGHTHOUSE = ("import sys, time\n"
               "from bagua_algos.ft import lighthouse\n"
               "lh = lighthouse(heartbeat_timeout_ms=int(sys.argv[1]), join_timeout_ms=1000)\n"
               "print(lh.address(), flush=True)\n"
               "time.sleep(1e9)\n")


class Hosts:
    """Where replicas and the Lighthouse run: the testbed's emulated hosts (root, network
    namespaces, each link shaped to ``mbit``), or plain processes on loopback.

    On the testbed each process also gets its own UTS namespace whose hostname is its host's
    address: torchft advertises its stores and its state-transfer server by
    ``socket.gethostname()``, which in a namespace would name the machine, not the host."""

    def __init__(self, use_testbed: bool, mbit: float | None):
        self.tb, self.why = None, "--no-testbed"
        if use_testbed:
            sys.path.append(str(ROOT / "benchmarks"))
            import _paths  # noqa: F401  (testbed on sys.path)
            from testbed import Testbed, testbed_available

            ok, self.why = testbed_available()
            if ok and os.geteuid() == 0:
                self.tb = Testbed(n_hosts=HOSTS, bandwidth_mbit=mbit, name="ft")
            elif ok:
                self.why = "not root (the testbed's user namespaces cannot SIGKILL a host)"

    @property
    def label(self) -> str:
        if self.tb is None:
            return f"loopback processes ({self.why})"
        bw = f"{self.tb.bandwidth_mbit:g} Mbit/s" if self.tb.bandwidth_mbit else "unshaped"
        return f"testbed: {HOSTS} emulated hosts, {bw} links"

    def popen(self, host: int, cmd: list[str], **kw) -> subprocess.Popen:
        if self.tb is None:
            return subprocess.Popen(cmd, **kw)
        addr = self.tb.hosts[host].addr
        return self.tb.popen(host, ["unshare", "--uts", "sh", "-c",
                                    f'hostname {addr} && exec "$0" "$@"', *cmd], **kw)

    def lighthouse(self, heartbeat_ms: int):
        """``(address, stop)`` of a Lighthouse: in this process, or on host 0."""
        if self.tb is None:
            from bagua_algos.ft import lighthouse

            lh = lighthouse(heartbeat_timeout_ms=heartbeat_ms, join_timeout_ms=1000)
            return lh.address(), lh.shutdown
        p = self.popen(0, [sys.executable, "-c", _LIGHTHOUSE, str(heartbeat_ms)], env=_env(),
                       stdout=subprocess.PIPE, text=True)
        ready, _, _ = select.select([p.stdout], [], [], 60)
        line = p.stdout.readline().strip() if ready else ""
        if not line.startswith("http"):
            p.kill()
            raise RuntimeError(f"the Lighthouse on host 0 did not start: {line!r}")
        return line, p.kill

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def _spawn(hosts: Hosts, worker: Path, lighthouse: str, out: Path, tag: str, host: int,
           step_sleep: float, extra: list[str]) -> subprocess.Popen:
    """One host's replica process, logging to ``out/<tag>.log``, started and stopped through
    ``out``'s ready/go/stop files."""
    (out / tag).mkdir(exist_ok=True)
    cmd = [sys.executable, str(worker), "--lighthouse", lighthouse, "--replica-id", f"host{host}",
           "--tag", tag, "--sync-dir", str(out), "--log", str(out / f"{tag}.log"),
           "--step-sleep", str(step_sleep), "--batch", "8", *extra]
    return hosts.popen(host, cmd, env=_env(), stdout=open(out / f"{tag}.out", "w"),
                       stderr=subprocess.STDOUT)


# --fault join / mid-heal: the host that dies while host 2 comes back (and is healed), and
# the worker's flag that makes it die there.  torchft serves a lone joiner from the first
# up-to-date replica in replica-id order: host0 is the heal source.
SECOND = {"join": (1, "--die-in-configure", str(HOSTS)), "mid-heal": (0, "--die-mid-heal")}


def _stall(logs, tags, t_fault, size):
    """(stall, first commit, steps lost, rebuild) after ``t_fault`` over the hosts ``tags``:
    the stall ends at each one's first committed step in a quorum of ``size`` (without the
    lost host), the first commit at its first committed step of any quorum (a step already
    past its collectives when the host died commits at once: that is not the end of the
    stall); the rebuild runs from the start of that quorum's group configure (logged by the
    workers as ``configured``) to the same commit: what the system does once the Lighthouse
    has formed the quorum, without the wait for the heartbeat timeout, whose phase against
    the kill varies from run to run by up to the heartbeat interval and the quorum tick."""
    stall = first_any = 0.0
    rebuild = None
    lost = 0
    for s in tags:
        after = [r for r in logs[s] if r["t"] > t_fault]
        first = next(r for r in after if r["committed"] and r["world"] == size)
        any_ = next(r for r in after if r["committed"])
        stall = max(stall, first["t"] - t_fault)
        first_any = max(first_any, any_["t"] - t_fault)
        lost = max(lost, sum(1 for r in after if not r["committed"] and r["t"] <= first["t"]))
        if first.get("configured") is not None and first["configured"] > t_fault:
            rebuild = max(rebuild or 0.0, first["t"] - first["configured"])
    return stall, first_any, lost, rebuild


def scenario(hosts: Hosts, system: str, lighthouse: str, out: Path, args) -> dict:
    shutil.rmtree(out, ignore_errors=True)      # an old run's stop/ready files would end this one
    out.mkdir(parents=True, exist_ok=True)
    worker = OURS if system == "bagua" else PEER
    extra = (["--algo", args.algo, "--samples", str(args.samples)] if system == "bagua" else [])
    extra += ["--timeout", str(args.timeout)]
    # --fault sync: the lost host kills itself in the first step after --kill-after in which
    # LocalSGD/DiLoCo (sync_every=2) sync: the survivors are in that exchange
    kill_at = args.kill_after + (args.kill_after % 2 == 0) if args.fault == "sync" else -1
    second = SECOND.get(args.fault)

    def spawn(tag, host, *more):
        return _spawn(hosts, worker, lighthouse, out, tag, host, args.step_sleep,
                      ["--dump", str(out / tag), "--steps", "100000", *extra, *more])

    def flags(i):
        if i == LOST:
            return ("--kill-at", str(kill_at))
        if second is not None and i == second[0]:       # armed once host 2 is gone
            return (*second[1:], "--fault-after", str(args.kill_after + 1))
        return ()

    procs = {f"h{i}": spawn(f"h{i}", i, *flags(i)) for i in range(HOSTS)}
    try:
        _wait(lambda: all((out / f"ready-h{i}").exists() for i in range(HOSTS)), 180, "start")
        t_start = time.time()
        for i in range(HOSTS):
            (out / f"go-h{i}").touch()
        committed = lambda tag: sum(r["committed"] for r in _log(out / f"{tag}.log"))  # noqa: E731
        _wait(lambda: all(committed(f"h{i}") >= args.kill_after for i in range(HOSTS)), 180,
              "the first steps")
        if args.fault == "sync":      # it kills itself in the step of the exchange
            procs[f"h{LOST}"].wait(180)
            t_kill = (out / f"h{LOST}.log").stat().st_mtime   # its last logged step's end
        else:
            t_kill = time.time()
            if args.fault == "link":     # the host vanishes: no FIN, no RST, silence
                hosts.tb.set_link(LOST, up=False)
            procs[f"h{LOST}"].send_signal(signal.SIGKILL)
            procs[f"h{LOST}"].wait()
        survivors = [f"h{i}" for i in range(HOSTS) if i != LOST]
        base = {s: committed(s) for s in survivors}
        _wait(lambda: all(committed(s) >= base[s] + args.alone for s in survivors), 120,
              "training at 2")
        t_back = time.time()
        if args.fault == "link":
            hosts.tb.set_link(LOST, up=True)
        procs["back"] = spawn("back", LOST, *(("--fail-heals", "1")
                                              if args.fault == "heal-fail" else ()))
        _wait(lambda: (out / "ready-back").exists(), 180, "the return's start")
        (out / "go-back").touch()
        t_fault = t_kill
        if second is not None:        # the second host dies while host 2 joins
            victim = procs[f"h{second[0]}"]
            _wait(lambda: victim.poll() is not None, 120, f"the {args.fault} fault")
            t_fault = time.time()
            if victim.returncode != -signal.SIGKILL:
                raise RuntimeError(f"host {second[0]} exited {victim.returncode}, not killed "
                                   f"by the {args.fault} fault: see {out}/h{second[0]}.out")
        _wait(lambda: committed("back") >= args.after, 120, "training together again")
        (out / "stop").touch()
        for p in procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    live = [t for t in survivors if second is None or t != f"h{second[0]}"]
    size = len(live) + 1                        # the live survivors and the returned host
    logs = {t: _log(out / f"{t}.log") for t in [*survivors, "back"]}
    if second is None:
        stall, first_any, lost, rebuild = _stall(logs, survivors, t_fault, HOSTS - 1)
    else:
        stall, first_any, lost, rebuild = _stall(logs, live, t_fault, size)
    heal_s = next((r["heal_s"] for r in logs["back"] if r.get("heal_s") is not None), None)
    # the step it healed at: before its first committed step (with --fault heal-fail its
    # first attempt is not committed)
    heal_step = next(r["step"] for r in logs["back"] if r["committed"]) - 1
    dumps = [out / t / f"quorum-{heal_step}-{size}.pt" for t in [*live, "back"]]
    identical = all(d.exists() for d in dumps)
    if identical:
        states = [torch.load(d, weights_only=False) for d in dumps]
        identical = all(_same(states[0], s) for s in states[1:])
    series = {t: [(r["t"] - t_start, r["loss"], r["committed"]) for r in log_]
              for t, log_ in {f"h{i}": _log(out / f"h{i}.log") for i in range(HOSTS)}.items()}
    series["back"] = [(r["t"] - t_start, r["loss"], r["committed"]) for r in logs["back"]]
    return {"status": "ok", "stall_s": round(stall, 3), "first_commit_s": round(first_any, 3),
            "rebuild_s": None if rebuild is None else round(rebuild, 3), "steps_lost": lost, "heal_s": None if heal_s is None else round(heal_s, 3),
            "replicas_identical": identical, "heal_step": heal_step,
            "events_s": {"kill": round(t_kill - t_start, 3), "return": round(t_back - t_start, 3),
                         "fault": round(t_fault - t_start, 3)},
            "series": series}


def soak(hosts: Hosts, lighthouse: str, out: Path, args) -> dict:
    """No fault at all for ``args.soak`` seconds: every replica that leaves a quorum, every
    step not committed, is a false drop (the heartbeat judged a live host dead)."""
    shutil.rmtree(out, ignore_errors=True)      # an old run's stop file would end this one
    out.mkdir(parents=True, exist_ok=True)

    def spawn(tag, host):
        return _spawn(hosts, OURS, lighthouse, out, tag, host, args.step_sleep,
                      ["--steps", "1000000", "--algo", "bytegrad", "--samples", "1000000",
                       "--timeout", str(args.timeout)])

    procs = [spawn(f"h{i}", i) for i in range(HOSTS)]
    loads = []
    try:
        _wait(lambda: all((out / f"ready-h{i}").exists() for i in range(HOSTS)), 180, "start")
        for i in range(HOSTS):
            (out / f"go-h{i}").touch()
        _wait(lambda: all(_log(out / f"h{i}.log") for i in range(HOSTS)), 120, "the first step")
        end = time.time() + args.soak
        while time.time() < end:
            loads.append(float(Path("/proc/loadavg").read_text().split()[0]))
            time.sleep(1.0)
        (out / "stop").touch()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = [_log(out / f"h{i}.log") for i in range(HOSTS)]
    steps = sum(len(log_) for log_ in logs)
    small = sum(1 for log_ in logs for r in log_ if r["world"] < HOSTS)
    uncommitted = sum(1 for log_ in logs for r in log_ if not r["committed"])
    return {"status": "ok", "seconds": args.soak, "heartbeat_timeout_ms": args.heartbeat_ms,
            "step_attempts": steps, "steps_below_full_world": small,
            "steps_not_committed": uncommitted,
            "false_drop_rate": round((small + uncommitted) / max(steps, 1), 5),
            "loadavg": {"min": min(loads), "mean": round(sum(loads) / len(loads), 2),
                        "max": max(loads)} if loads else None}


def plot(result: dict, path: Path) -> Path | None:
    """The story's four panels; None where matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 6), sharex="col")
    for col, (name, res) in enumerate((("bagua_algos.ft (ByteGrad)", result),
                                       ("torchft DDP", result["peer"]))):
        for tag, pts in res["series"].items():
            pts = [p for p in pts if p[2]]
            if not pts:
                continue
            t = [p[0] for p in pts]
            axes[0][col].plot(t, [p[1] for p in pts], ".", ms=2, label=tag)
            rate = [0.0] + [1.0 / max(b - a, 1e-3) for a, b in itertools.pairwise(t)]
            axes[1][col].plot(t, rate, lw=0.7, label=tag)
        for ax in axes[:, col]:
            ax.axvline(res["events_s"]["kill"], color="r", ls="--", lw=0.8)
            ax.axvline(res["events_s"]["return"], color="g", ls="--", lw=0.8)
        axes[0][col].set_title(f"{name}: stall {res['stall_s']} s, heal {res['heal_s']} s")
        axes[0][col].set_ylabel("loss")
        axes[1][col].set_ylabel("committed steps / s")
        axes[1][col].set_xlabel("wall time (s); red: kill -9 host 2, green: host 2 started")
        axes[0][col].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.append(str(ROOT / "benchmarks"))
    import _results

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps (CI-sized)")
    ap.add_argument("--json", default="", help="write the result here")
    _results.add_options(ap)
    ap.add_argument("--out", default="out/ft")
    ap.add_argument("--heartbeat-ms", type=int, default=1000)
    ap.add_argument("--step-sleep", type=float, default=0.02)
    ap.add_argument("--mbit", type=float, default=1000.0,
                    help="each emulated host's link, Mbit/s (0: unshaped); testbed only")
    ap.add_argument("--samples", type=int, default=4096,
                    help="the dataset's size: after a membership change the survivors deal "
                         "its unseen samples anew (torchft's peer has no sampler)")
    ap.add_argument("--algo", default="bytegrad", choices=ALGOS,
                    help="bagua's algorithm (the peer is torchft's DDP)")
    ap.add_argument("--fault", choices=("kill", "link", "heal-fail", "sync", "join", "mid-heal"),
                    default="kill",
                    help="kill: SIGKILL host 2's replica (its kernel still closes the "
                         "connections); link: also take host 2's link down first, so its "
                         "peers hear nothing (a machine that loses power; testbed only); "
                         "heal-fail: as kill, and the returning host's first heal transfer "
                         "fails (a reset connection); sync: host 2 kills itself in a step in "
                         "which the others exchange weights in the optimizer step (--algo "
                         "local_sgd, diloco, diloco_fragments, low_precision_decentralized); "
                         "join: as kill, and host 1 is killed inside the group configure of "
                         "host 2's return; mid-heal: as kill, and host 0, the heal source, is "
                         "killed part-way through host 2's heal transfer (the stall is then "
                         "measured from that second death)")
    ap.add_argument("--timeout", type=float, default=10.0,
                    help="bagua's FaultTolerant(timeout=) in seconds: how long a collective "
                         "waits for a silent peer (it bounds the stall with --fault link)")
    ap.add_argument("--no-testbed", action="store_true",
                    help="processes on loopback instead of the testbed's emulated hosts")
    ap.add_argument("--soak", type=float, default=0.0,
                    help="no fault: run 3 hosts this many seconds and count false drops "
                         "(quorums without a live host, uncommitted steps) under the load "
                         "the machine has; run something CPU-heavy beside it for load 8+")
    args = ap.parse_args(argv)
    start = _results.started()
    os.environ.setdefault("RUST_LOG", "error")     # the Lighthouse in this process: quiet
    if args.soak < 0:
        ap.error("--soak must be >= 0 seconds")
    if args.fault == "sync" and args.algo not in SYNCING:
        ap.error(f"--fault sync needs an algorithm that syncs in the optimizer step: {SYNCING}")
    if args.fault == "link" and args.no_testbed:
        ap.error("--fault link needs the testbed (a host's link to take down)")
    args.kill_after, args.alone, args.after = (10, 10, 10) if args.quick else (40, 40, 40)
    out = Path(args.out)
    hosts = Hosts(not args.no_testbed, args.mbit or None)
    print(f"ft: {hosts.label}", flush=True)
    try:
        if args.soak:
            address, stop = hosts.lighthouse(args.heartbeat_ms)
            result = soak(hosts, address, out / "soak", args)
            stop()
            result["hosts"] = hosts.label
            print(json.dumps(result, indent=1))
            if args.json:
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(json.dumps(result))
            _results.record_from_args(args, "benchmarks/ft/ft.py", _results.rounded(result),
                                      argv, start)
            return 0
        load = Path("/proc/loadavg").read_text().split()[0]
        address, stop = hosts.lighthouse(args.heartbeat_ms)
        result = scenario(hosts, "bagua", address, out / "bagua", args)
        stop()
        address, stop = hosts.lighthouse(args.heartbeat_ms)   # the same settings for both
        result["peer"] = scenario(hosts, "torchft_ddp", address, out / "peer", args)
        stop()
    finally:
        hosts.close()
    result["hosts"] = hosts.label
    result["fault"] = args.fault
    result["timeout_s"] = args.timeout
    result["loadavg"] = [load, Path("/proc/loadavg").read_text().split()[0]]
    result["algo"] = args.algo
    result["samples"] = args.samples
    result["heartbeat_timeout_ms"] = {"bagua": args.heartbeat_ms, "peer": args.heartbeat_ms}
    fails = []
    # the same Lighthouse settings for both: our stall must not exceed the peer's (0.1 s of
    # scheduling noise allowed on a loaded machine)
    if not result["stall_s"] <= result["peer"]["stall_s"] + 0.1:
        fails.append("stall")
    if result["steps_lost"] > 1:
        fails.append("steps_lost")
    if result["heal_s"] is None or result["heal_s"] >= 2.0:
        fails.append("heal")
    if not result["replicas_identical"]:
        fails.append("identical")
    result["failures"] = fails
    result["status"] = "ok" if not fails else "missed: " + ", ".join(fails)
    brief = {k: v for k, v in result.items() if k != "series"}
    brief["peer"] = {k: v for k, v in result["peer"].items() if k != "series"}
    print(json.dumps(brief, indent=1))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result))
    _results.record_from_args(args, "benchmarks/ft/ft.py", _results.rounded(brief), argv, start)
    png = plot(result, out / "ft.png")      # after the JSON: a plot error loses nothing
    print(f"plot: {png}" if png else "plot: skipped (pip install matplotlib)")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
