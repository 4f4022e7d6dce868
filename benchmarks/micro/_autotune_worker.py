"""torchrun worker of benchmarks/micro/autotune.py: fixed bucket sizes against the autotuner.

One process per emulated host.  Every configuration (the default bucket size, each size of
the grid, and ``autotune=True`` starting from the default) gets its own copy of the same
model (same seed) wrapped by ``with_bagua``.  The autotuned copy trains first until its tuner
has settled (the steps it needed are recorded); then, after ``--warmup`` steps each, the
configurations are timed ``--steps`` steps each, interleaved: one step of every configuration
per round, in an order that rotates every round (so slow phases of a loaded machine spread
evenly over the configurations).  A configuration's figure is the median over its steps of
the slowest rank's step time.  Rank 0 writes ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.append(str(Path(__file__).resolve().parents[1]))  # benchmarks/
import _paths  # noqa: F401  (testbed and benchmarks/e2e on sys.path)
from _e2e_model import MarkovText, lm_loss, make_model, num_params


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--algorithm", default="gradient_allreduce")
    ap.add_argument("--size", default="small")
    ap.add_argument("--grid", required=True, help="comma list of bucket sizes in bytes")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-tune-steps", type=int, default=400)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    import bagua_comm as bc
    from bagua_algos import Algorithm, with_bagua
    from bagua_algos.module import DEFAULT_BUCKET_SIZE

    bc.init_process_group(backend="gloo")
    rank, world = bc.get_rank(), bc.get_world_size()
    harness = dist.new_group(backend="gloo")
    data = MarkovText(args.size)
    train = data.batches(64, args.batch_size, seed=1000 + rank)
    grid = [int(s) for s in args.grid.split(",")]
    configs = [("default", DEFAULT_BUCKET_SIZE, False)]
    configs += [(f"fixed {s}", s, False) for s in grid]
    configs += [("autotune", DEFAULT_BUCKET_SIZE, True)]
    runs = {}
    for label, size, tune in configs:
        model = make_model(args.size, seed=0)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        wrapped = with_bagua(model, [opt], Algorithm.init(args.algorithm), bucket_size=size,
                             autotune={"cache": False} if tune else False)
        runs[label] = {"model": wrapped, "opt": opt, "i": 0, "bucket_size": size}

    def step(run) -> None:
        x, y = train[run["i"] % len(train)]
        run["i"] += 1
        run["opt"].zero_grad(set_to_none=True)
        lm_loss(run["model"](x), y).backward()
        run["opt"].step()

    def slowest(value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=harness)
        return float(t)

    # 1. the autotuner settles (every rank reads the same report: it is decided collectively)
    tuned = runs["autotune"]
    dist.barrier(group=harness)
    t0 = time.perf_counter()
    while True:
        step(tuned)
        report = tuned["model"].autotune_report()
        if report["done"] or tuned["i"] >= args.max_tune_steps:
            break
    tune_s = slowest(time.perf_counter() - t0)
    tuned["bucket_size"] = tuned["model"].bucket_size
    if rank == 0:
        print(f"autotune: done={report['done']} after {report['steps']} steps "
              f"({tune_s:.1f}s): {report['best']}", flush=True)

    # 2. timed steps, interleaved: one step of every configuration per round, the order
    # rotating, so a loaded machine's slow phases spread evenly over the configurations
    labels = list(runs)
    for label in labels:
        for _ in range(args.warmup):
            step(runs[label])
    mine: dict[str, list[float]] = {k: [] for k in labels}
    for r in range(args.steps):
        order = labels[r % len(labels):] + labels[:r % len(labels)]
        for label in order:
            dist.barrier(group=harness)
            t = time.perf_counter()
            step(runs[label])
            mine[label].append(time.perf_counter() - t)
        if rank == 0 and (r + 1) % 10 == 0:
            print(f"timed round {r + 1}/{args.steps}", flush=True)
    per_step = {}
    for label in labels:          # a step lasts as long as its slowest rank
        t = torch.tensor(mine[label], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=harness)
        per_step[label] = t.tolist()
    if rank == 0:
        out = {
            "model": {"size": args.size, "params": num_params(make_model(args.size)),
                      "bytes": 4 * num_params(make_model(args.size))},
            "algorithm": args.algorithm, "world_size": world,
            "batch_size": args.batch_size, "steps": args.steps,
            "default_bucket_size": DEFAULT_BUCKET_SIZE,
            "configs": [{"label": k, "bucket_size": runs[k]["bucket_size"],
                         "layout": [len(b.params) for b in runs[k]["model"].buckets],
                         "step_s_all": per_step[k],
                         "step_s": statistics.median(per_step[k]),
                         "step_s_mean": statistics.fmean(per_step[k]),
                         "samples_per_s": world * args.batch_size
                         / statistics.median(per_step[k])} for k in labels],
            "autotune": {"report": report, "tune_s": tune_s, "steps": report["steps"],
                         "done": report["done"]},
        }
        Path(args.out).write_text(json.dumps(out, indent=1))
    dist.barrier(group=harness)
    for run in runs.values():
        run["model"].detach_algorithm()
    bc.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
