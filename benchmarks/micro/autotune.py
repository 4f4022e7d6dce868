"""Autotuned bucket size against the default and a grid of fixed sizes, on emulated links.

    python benchmarks/micro/autotune.py                          # 100 Mbit/s and unshaped
    python benchmarks/micro/autotune.py --bandwidths none --steps 15 --json out/autotune/quick.json

For each link bandwidth the testbed (benchmarks/testbed) emulates ``--hosts`` machines (network
namespaces behind ``tc``-shaped links) and one ``torchrun --nnodes N`` job trains the same
transformer (benchmarks/e2e/_e2e_model.py) with ``with_bagua(..., GradientAllReduce())`` at: the
default bucket size (10 MiB), each size of a grid (powers of 4 from 16 KiB to the whole
model), and ``autotune=True`` (starting from the default; cache off, so it really tunes),
timed interleaved step by step after autotune has settled.  It prints throughput of each
(from the median step time), the steps autotune needed to settle, and the ratios
autotuned / best of the grid and autotuned / default; it plots the grid with where autotune
landed.  Targets: autotuned >= 0.95x the best fixed size and >= 1.0x the default on every
link, settled within 200 steps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.append(str(Path(__file__).resolve().parents[1]))  # benchmarks/
import _paths  # noqa: E402,F401  (testbed and benchmarks/e2e on sys.path)
import _results  # noqa: E402

# isort: split
from _e2e_model import make_model, num_params  # noqa: E402
from _e2e_report import bw_label  # noqa: E402

WORKER = str(HERE / "_autotune_worker.py")


def _grid(model_bytes: int) -> list[int]:
    sizes, s = [], 16 * 1024
    while True:
        sizes.append(s)
        if s >= model_bytes:
            return sizes
        s *= 4


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bandwidths", default="100,none",
                    help="comma list of Mbit/s or 'none' (unshaped)")
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--size", default="small", help="model size of benchmarks/e2e/_e2e_model.py")
    ap.add_argument("--algorithm", default="gradient_allreduce")
    ap.add_argument("--grid", help="comma list of bucket sizes (bytes); default powers of 4 "
                    "from 16 KiB to the model's size")
    ap.add_argument("--steps", type=int, default=30,
                    help="timed steps per configuration (interleaved)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--no-testbed", action="store_true", help="plain loopback processes")
    ap.add_argument("--json", type=Path, default=Path("out/autotune/autotune.json"))
    ap.add_argument("--plot", type=Path, default=Path("out/autotune/autotune.png"))
    ap.add_argument("--workdir", type=Path, default=Path("out/autotune/work"))
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per bandwidth")
    ap.add_argument("--testbed-name", default="autotune")
    _results.add_options(ap)
    args = ap.parse_args(argv)
    args.bandwidths = [None if b.strip().lower() in ("none", "unshaped") else float(b)
                       for b in args.bandwidths.split(",")]
    if args.grid is None:
        args.grid = _grid(4 * num_params(make_model(args.size)))
    else:
        args.grid = [int(s) for s in args.grid.split(",")]
    return args


def run_job(bw, args, tb, attempt: int) -> dict:
    outdir = args.workdir / bw_label(bw).replace(" ", "").replace("/", "")
    outdir.mkdir(parents=True, exist_ok=True)
    out = outdir / "result.json"
    out.unlink(missing_ok=True)
    worker = [WORKER, "--algorithm", args.algorithm, "--size", args.size,
              "--grid", ",".join(map(str, args.grid)), "--steps", args.steps,
              "--warmup", args.warmup,
              "--batch-size", args.batch_size, "--out", out]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               BAGUA_AUTOTUNE_LOG=str(outdir / "trials.jsonl"))
    (outdir / "trials.jsonl").unlink(missing_ok=True)
    procs, logs = [], []
    if tb is None:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(args.hosts), *map(str, worker)]
        logs.append(open(outdir / "host0.log", "w"))  # noqa: SIM115
        procs.append(subprocess.Popen(argv, stdout=logs[-1], stderr=subprocess.STDOUT, env=env))
    else:
        for i in range(args.hosts):
            argv = tb.torchrun_argv(i, worker, port=29500 + attempt,
                                    rdzv_id=f"autotune{attempt}")
            logs.append(open(outdir / f"host{i}.log", "w"))  # noqa: SIM115
            procs.append(tb.popen(i, argv, stdout=logs[-1], stderr=subprocess.STDOUT, env=env))
    deadline = time.monotonic() + args.timeout
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{bw_label(bw)}: no result within {args.timeout:.0f}s")
            time.sleep(1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for f in logs:
            f.close()
    if not out.exists():
        tail = (outdir / "host0.log").read_text(errors="replace").splitlines()[-15:]
        raise RuntimeError(f"{bw_label(bw)}: the job failed:\n" + "\n".join(tail))
    result = json.loads(out.read_text())
    result["bandwidth_mbit"] = bw
    return result


def summarise(result: dict) -> dict:
    cfg = {c["label"]: c for c in result["configs"]}
    fixed = [c for c in result["configs"] if c["label"] != "autotune"]
    best = max(fixed, key=lambda c: c["samples_per_s"])
    tuned, default = cfg["autotune"], cfg["default"]
    # Configurations with the same bucket layout are the same configuration: how far apart
    # their figures are is this run's noise floor.
    same: dict = {}
    for c in result["configs"]:
        same.setdefault(tuple(c["layout"]), []).append(c)
    twins = [g for g in same.values() if len(g) > 1]
    noise = max((max(c["samples_per_s"] for c in g) / min(c["samples_per_s"] for c in g) - 1
                 for g in twins), default=None)
    return {
        "noise_floor": noise,
        "same_layout": [[c["label"] for c in g] for g in twins],
        "bandwidth_mbit": result["bandwidth_mbit"],
        "autotune_samples_per_s": tuned["samples_per_s"],
        "autotune_bucket_size": tuned["bucket_size"],
        "autotune_steps": result["autotune"]["steps"],
        "autotune_done": result["autotune"]["done"],
        "autotune_trials": len(result["autotune"]["report"]["trials"]),
        "autotune_tune_s": result["autotune"]["tune_s"],
        "default_samples_per_s": default["samples_per_s"],
        "best_label": best["label"], "best_bucket_size": best["bucket_size"],
        "best_samples_per_s": best["samples_per_s"],
        "vs_best": tuned["samples_per_s"] / best["samples_per_s"],
        "vs_default": tuned["samples_per_s"] / default["samples_per_s"],
    }


def _mib(n: int) -> str:
    return f"{n / 2**20:g} MiB" if n >= 2**20 else f"{n / 1024:g} KiB"


def print_result(result: dict, s: dict) -> None:
    print(f"\n== {bw_label(s['bandwidth_mbit'])}: {result['model']['params'] / 1e6:.2f}M "
          f"parameters, {result['world_size']} ranks, {result['algorithm']}")
    print(f"{'configuration':<22}{'bucket':>12}{'samples/s':>12}{'median ms':>11}"
          f"{'mean ms':>10}{'min ms':>9}")
    for c in result["configs"]:
        print(f"{c['label']:<22}{_mib(c['bucket_size']):>12}{c['samples_per_s']:>12.1f}"
              f"{1e3 * c['step_s']:>11.0f}{1e3 * c['step_s_mean']:>10.0f}"
              f"{1e3 * min(c['step_s_all']):>9.0f}")
    print(f"autotune settled after {s['autotune_steps']} steps ({s['autotune_trials']} trials, "
          f"{s['autotune_tune_s']:.0f}s) on {_mib(s['autotune_bucket_size'])}; best of the "
          f"grid: {s['best_label']}")
    print(f"autotuned / best fixed = {s['vs_best']:.3f}   autotuned / default = "
          f"{s['vs_default']:.3f}")
    if s["noise_floor"] is not None:
        print(f"noise floor: {100 * s['noise_floor']:.1f}% between configurations with the "
              f"same bucket layout ({'; '.join(' = '.join(g) for g in s['same_layout'])})")


def targets(summaries: list[dict]) -> list[dict]:
    out = []
    for s in summaries:
        bw = s["bandwidth_mbit"]
        out += [
            {"bandwidth_mbit": bw, "target": "autotuned / best fixed", "value": s["vs_best"],
             "need": ">= 0.95", "met": s["vs_best"] >= 0.95},
            {"bandwidth_mbit": bw, "target": "autotuned / default", "value": s["vs_default"],
             "need": ">= 1.0", "met": s["vs_default"] >= 1.0},
            {"bandwidth_mbit": bw, "target": "steps to settle", "value": s["autotune_steps"],
             "need": "<= 200", "met": s["autotune_done"] and s["autotune_steps"] <= 200},
        ]
    return out


def figures(summaries: list[dict], mode: str) -> dict:
    """What docs/results.json keeps of a run (benchmarks/_results.py): per link, the bucket
    size autotune settled on, the steps it took, and its step time as a multiple of the best
    fixed size's and of the default's (ratios are times: < 1 is faster)."""
    links = {}
    for s in summaries:
        links[bw_label(s["bandwidth_mbit"])] = {
            "autotune_bucket_size": s["autotune_bucket_size"],
            "autotune_steps": s["autotune_steps"], "autotune_done": s["autotune_done"],
            "autotune_samples_per_s": s["autotune_samples_per_s"],
            "best_fixed": s["best_label"], "best_samples_per_s": s["best_samples_per_s"],
            "default_samples_per_s": s["default_samples_per_s"],
            "x_best_time": s["best_samples_per_s"] / s["autotune_samples_per_s"],
            "x_default_time": s["default_samples_per_s"] / s["autotune_samples_per_s"],
            "noise_floor": s["noise_floor"]}
    return _results.rounded({"mode": mode, "links": links}, 4)


def plot(results: list[dict], summaries: list[dict], path: Path, subtitle: str):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), squeeze=False)
    for ax, r, s in zip(axes[0], results, summaries):
        grid = [c for c in r["configs"] if c["label"].startswith("fixed")]
        ax.plot([c["bucket_size"] for c in grid], [c["samples_per_s"] for c in grid], "o-",
                label="fixed bucket size")
        d = next(c for c in r["configs"] if c["label"] == "default")
        ax.plot([d["bucket_size"]], [d["samples_per_s"]], "s", color="gray",
                label=f"default ({_mib(d['bucket_size'])})")
        ax.plot([s["autotune_bucket_size"]], [s["autotune_samples_per_s"]], "*", ms=16,
                color="C3", label=f"autotune ({s['autotune_steps']} steps to settle)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bucket size (bytes)")
        ax.set_ylabel("samples/s")
        ax.set_title(f"{bw_label(s['bandwidth_mbit'])}: autotuned {s['vs_best']:.2f}x best, "
                     f"{s['vs_default']:.2f}x default", fontsize=9)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"bagua autotune vs fixed bucket sizes ({subtitle})", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


def main(argv=None) -> int:
    args = parse_args(argv)
    start = _results.started()
    t_start = time.monotonic()
    tb, why = None, "--no-testbed given"
    if not args.no_testbed:
        from testbed import Testbed, testbed_available

        ok, why = testbed_available()
        if ok:
            tb = Testbed(n_hosts=args.hosts, bandwidth_mbit=None, name=args.testbed_name)
            tb.__enter__()
    if tb is None:
        print(f"NO TESTBED ({why}): {args.hosts} loopback processes, unshaped only")
        args.bandwidths = [None]
    mode = f"testbed: {args.hosts} hosts, {why}" if tb else f"NO TESTBED ({why})"
    load = os.getloadavg()
    print(f"{mode}; grid {[_mib(s) for s in args.grid]}; load average "
          f"{load[0]:.1f} on {os.cpu_count()} CPUs")
    results, summaries = [], []
    try:
        for attempt, bw in enumerate(args.bandwidths):
            if tb is not None:
                tb.reshape(bandwidth_mbit=bw)
            r = run_job(bw, args, tb, attempt)
            s = summarise(r)
            print_result(r, s)
            results.append(r)
            summaries.append(s)
    finally:
        if tb is not None:
            tb.close()
    checks = targets(summaries)
    print()
    for t in checks:
        print(f"target {t['target']} ({bw_label(t['bandwidth_mbit'])}): {t['value']:.3g}, "
              f"need {t['need']}: {'met' if t['met'] else 'NOT met'}")
    png = plot(results, summaries, args.plot, mode)
    print(f"plot: {png}" if png else "plot: skipped (pip install matplotlib)")
    report = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "mode": mode, "load_average_at_start": load, "results": results,
              "summaries": summaries, "targets": checks,
              "elapsed_s": time.monotonic() - t_start}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    print(f"json: {args.json}; took {report['elapsed_s']:.0f}s")
    _results.record_from_args(args, "benchmarks/micro/autotune.py", figures(summaries, mode),
                              argv, start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
