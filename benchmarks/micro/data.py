"""Padding, balance and throughput: bagua_data's samplers against their peers, in one run.

1. Padded cost on the issue's data (default 20,000 samples, lognormal lengths of mean ~70
   with a tail clipped at 2,048; 4 ranks; batch 32): torch's DistributedSampler,
   LoadBalancingDistributedSampler, LoadBalancingDistributedBatchSampler with a padded-token
   budget, a Hugging Face ``group_by_length``-style grouping (mega-batches of 50 batches per
   rank sorted by length, batches dealt to the ranks in order), and
   LengthGroupedDistributedBatchSampler with ``batch_size`` and with ``max_cost``.  A step's
   padded cost is its slowest rank's batch count x longest sample; the table gives the
   epoch's sum, the useful share (real tokens over ranks x padded cost), the per-step
   cross-rank imbalance (slowest over mean, padded, averaged over steps) and its ratio to the
   length-grouped reference.
2. A real 2-rank loop over gloo (spawned processes): every step sleeps for the rank's
   padded batch cost (``--us-per-token``), a stand-in for accelerator time, then allreduces
   (the slowest rank sets the pace).  All six samplers, rounds alternating; samples/s and the
   ratio to DistributedSampler.
3. Per-step imbalance of unpadded totals (sum of lengths) at several world sizes, for
   DistributedSampler and the load-balancing samplers (``--worlds``).

    python benchmarks/micro/data.py            # all three
    python benchmarks/micro/data.py --quick    # well under a minute
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _data_plans import (
    SAMPLERS,
    fixed_batches,
    lognormal_lengths,
    plan_stats,
    rank_batches,
)
from torch.utils.data import DistributedSampler

from bagua_data import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler

sys.path.append(str(Path(__file__).resolve().parents[1]))  # benchmarks/
import _results


def plan(name: str, args, world: int, epoch: int) -> list[list[list[int]]]:
    return [rank_batches(name, args.lengths, world, r, args.batch_size, args.budget, args.seed,
                         epoch) for r in range(world)]


def measure_padding(args) -> dict[str, dict]:
    """Every sampler's plan statistics at ``args.ranks``, averaged over epochs."""
    out = {}
    for name in SAMPLERS:
        runs = [plan_stats(plan(name, args, args.ranks, e), args.lengths)
                for e in range(args.epochs)]
        out[name] = {k: statistics.mean(r[k] for r in runs) for k in runs[0]}
    return out


# --------------------------------------------------------------------------- 2-rank loop

def _train_rank(rank: int, world: int, store_path: str, cfg: dict, out_path: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    try:
        lengths = cfg["lengths"]
        grad = torch.zeros(cfg["grad_numel"])
        times = {k: [] for k in cfg["samplers"]}
        samples = {k: [] for k in cfg["samplers"]}
        for rnd in range(cfg["rounds"]):
            for name in cfg["samplers"]:
                # each rank builds its own sampler, as in a real job (not timed)
                mine = rank_batches(name, lengths, world, rank, cfg["batch_size"],
                                    cfg["budget"], cfg["seed"], rnd)
                count = torch.tensor([len(mine)])
                dist.all_reduce(count, op=dist.ReduceOp.MIN)
                mine = mine[:int(count)]     # DistributedSampler-style plans are already equal
                dist.barrier()
                t0, done = time.perf_counter(), 0
                for batch in mine:
                    # a padded forward/backward: time proportional to count x longest
                    time.sleep(len(batch) * max(lengths[i] for i in batch)
                               * cfg["us_per_token"] * 1e-6)
                    dist.all_reduce(grad)
                    done += len(batch)
                dist.barrier()
                times[name].append(time.perf_counter() - t0)
                total = torch.tensor([done])
                dist.all_reduce(total)
                samples[name].append(int(total))
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump({"times": times, "samples": samples}, f)
    finally:
        dist.destroy_process_group()


def measure_loop(args) -> dict:
    world = 2
    cfg = {"lengths": args.lengths, "batch_size": args.batch_size, "budget": args.budget,
           "seed": args.seed, "rounds": args.rounds, "samplers": list(SAMPLERS),
           "us_per_token": args.us_per_token, "grad_numel": args.grad_numel}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_train_rank, args=(world, os.path.join(tmp, "store"), cfg, out), nprocs=world,
                 join=True)
        with open(out) as f:
            return json.load(f)


# --------------------------------------------------------------------------- unpadded

def step_costs(per_rank_batches: list[list[list[int]]], lengths: torch.Tensor) -> torch.Tensor:
    """(ranks, steps) total length of each rank's batch at each step."""
    steps = min(len(b) for b in per_rank_batches)
    return torch.tensor([[float(lengths[b].sum()) for b in batches[:steps]]
                         for batches in per_rank_batches])


def imbalance(costs: torch.Tensor) -> float:
    return float((costs.max(0).values / costs.mean(0)).mean())


def token_budget_fn(lengths: list[int], budget: int):
    """batch_fn: consecutive samples while the batch's total length stays within budget."""
    def batch_fn(indices: list[int]) -> list[list[int]]:
        batches, batch, total = [], [], 0
        for i in indices:
            if batch and total + lengths[i] > budget:
                batches.append(batch)
                batch, total = [], 0
            batch.append(i)
            total += lengths[i]
        return batches + [batch] if batch else batches
    return batch_fn


def measure_unpadded(args) -> list[dict]:
    lengths = lognormal_lengths(args.unpadded_samples, 64.0, 1.0, seed=1)
    lt = torch.tensor(lengths)
    budget = int(args.batch_size * lt.float().mean())
    rows = []
    for world in args.worlds:
        row = {"world": world}
        for name, make in (
            ("torch", lambda r, w=world: DistributedSampler(lengths, w, r, seed=3)),
            ("ours", lambda r, w=world: LoadBalancingDistributedSampler(lengths, lengths, w, r,
                                                                        seed=3)),
        ):
            runs = []
            for epoch in range(args.epochs):
                per_rank = []
                for r in range(world):
                    s = make(r)
                    s.set_epoch(epoch)
                    per_rank.append(fixed_batches(list(s), args.batch_size))
                runs.append(imbalance(step_costs(per_rank, lt)))
            row[name] = statistics.mean(runs)
        runs = []
        for epoch in range(args.epochs):
            per_rank = []
            for r in range(world):
                s = LoadBalancingDistributedSampler(lengths, lengths, world, r, seed=3)
                b = LoadBalancingDistributedBatchSampler(s, token_budget_fn(lengths, budget))
                b.set_epoch(epoch)
                per_rank.append(list(b))
            runs.append(imbalance(step_costs(per_rank, lt)))
        row["ours_budget"] = statistics.mean(runs)
        rows.append(row)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes, well under a minute")
    p.add_argument("--samples", type=int, default=20_000, help="dataset size")
    p.add_argument("--median", type=float, default=48.0, help="median length (mean ~70)")
    p.add_argument("--sigma", type=float, default=0.85, help="lognormal sigma of the lengths")
    p.add_argument("--max-len", type=int, default=2048, help="lengths are clipped to this")
    p.add_argument("--ranks", type=int, default=4, help="world size of the padding table")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--budget", type=int, default=4096,
                   help="padded-token budget (count x longest) of the budgeted samplers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=3, help="epochs averaged in the tables")
    p.add_argument("--rounds", type=int, default=3, help="rounds per sampler in the loop")
    p.add_argument("--us-per-token", type=float, default=2.0,
                   help="loop: microseconds slept per padded token of a rank's batch")
    p.add_argument("--grad-numel", type=int, default=1 << 16, help="allreduced floats per step")
    p.add_argument("--worlds", type=int, nargs="*", default=[2, 4, 8, 16],
                   help="world sizes of the unpadded-imbalance table (none: skip it)")
    p.add_argument("--unpadded-samples", type=int, default=200_000)
    p.add_argument("--skip-loop", action="store_true")
    _results.add_options(p)
    args = p.parse_args(argv)
    start = _results.started()
    figures = {}
    if args.quick:
        args.epochs, args.rounds, args.unpadded_samples, args.worlds = 1, 1, 20_000, [2, 8]
    args.lengths = lognormal_lengths(args.samples, args.median, args.sigma, seed=1,
                                     max_len=args.max_len)

    print(f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    mean = sum(args.lengths) / len(args.lengths)
    print(f"== padded cost: {args.samples} samples, lognormal lengths (mean {mean:.1f}, max "
          f"{max(args.lengths)}), {args.ranks} ranks, batch {args.batch_size}, budgets "
          f"{args.budget} padded tokens; {args.epochs} epoch(s) averaged")
    stats = measure_padding(args)
    figures["padding"] = {name: {**stats[name], "x_ref_padded": stats[name]["padded"]
                                 / stats["hf"]["padded"]} for name in SAMPLERS}
    ref = stats["hf"]["padded"]
    print(f"{'sampler':<52} {'padded':>8} {'useful':>7} {'imbal.':>7} {'vs ref':>7} "
          f"{'steps':>6} {'slowest rank tokens':>20}")
    for name, label in SAMPLERS.items():
        st = stats[name]
        print(f"{label:<52} {st['padded'] / 1e6:7.3f}M {st['useful']:7.1%} "
              f"{st['imbalance']:7.3f} {st['padded'] / ref:6.2f}x {st['steps']:6.0f} "
              f"{st['slowest_tokens'] / 1e6:19.3f}M")
    print("(imbal.: per-step slowest over mean padded cost, averaged over steps; vs ref: "
          "padded cost over the length-grouped reference's)")
    sys.stdout.flush()

    if not args.skip_loop:
        res = measure_loop(args)
        print(f"\n== 2-rank loop over gloo: each step sleeps {args.us_per_token:g} us per "
              f"padded token of the rank's batch, then allreduces {args.grad_numel} floats; "
              f"{args.rounds} round(s) per sampler, alternating")
        tput = {k: sum(res["samples"][k]) / sum(v) for k, v in res["times"].items()}
        figures["loop"] = {k: {"samples_per_s": v, "x_torch_samples_per_s": v / tput["torch"],
                               "round_s": res["times"][k]} for k, v in tput.items()}
        print(f"{'sampler':<52} {'samples/s':>9} {'ratio':>6}  {'slept':>6}  per round")
        for name, label in SAMPLERS.items():
            # the slowest rank's sleep summed over the steps: the loop's time without overhead
            slept = statistics.mean(
                plan_stats(plan(name, args, 2, e), args.lengths)["padded"]
                for e in range(args.rounds)) * args.us_per_token * 1e-6
            print(f"{label:<52} {tput[name]:9.0f} {tput[name] / tput['torch']:5.2f}x  "
                  f"{slept:5.2f}s  " + ", ".join(f"{t:.2f}s" for t in res["times"][name]))
        print("(slept: the slowest rank's sleep per round, i.e. the round's time without the "
              "allreduce and wake-up overhead)")
        sys.stdout.flush()

    if args.worlds:
        print(f"\n== unpadded per-step imbalance (max/mean of a step's total length over "
              f"ranks), lognormal lengths median 64 sigma 1, {args.unpadded_samples} samples, "
              f"batch {args.batch_size}")
        print(f"{'ranks':>5} {'DistributedSampler':>19} {'LoadBalancing':>14} "
              f"{'LB+token budget':>16}")
        figures["unpadded_imbalance"] = measure_unpadded(args)
        for row in figures["unpadded_imbalance"]:
            print(f"{row['world']:>5} {row['torch']:>19.4f} {row['ours']:>14.4f} "
                  f"{row['ours_budget']:>16.4f}")
    _results.record_from_args(args, "benchmarks/micro/data.py", _results.rounded(figures, 4),
                              argv, start)


if __name__ == "__main__":
    main()
