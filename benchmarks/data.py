"""Load balance and end-to-end throughput: bagua_data's samplers against DistributedSampler.

Two measurements, both samplers in the same run:

1. Per-step imbalance on lognormal sequence lengths: for each step, the largest total length
   any rank gets divided by the mean over ranks (1.0 is perfect; the slowest rank sets the
   pace of a synchronous step).  Averaged over an epoch, for several world sizes.
2. Throughput of a real 2-rank training loop (torch.distributed over gloo, spawned processes)
   whose per-sample cost grows with the sample's length (a transformer layer's: a projection,
   ``length * dim**2``, plus attention scores, ``length**2 * dim``) and that synchronises
   with an allreduce every step.  ``--cost compute`` runs those matmuls, ``--cost sleep``
   sleeps for the same cost model (a noise-free stand-in for accelerator time on a busy
   CPU), ``both`` (default) runs one loop of each.  Rounds alternate between the samplers.

    python benchmarks/data.py            # full
    python benchmarks/data.py --quick    # well under a minute
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

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, DistributedSampler

from bagua_data import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler


def lognormal_lengths(n: int, median: float, sigma: float, seed: int,
                      max_len: int = 1024) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    x = torch.exp(torch.randn(n, generator=g, dtype=torch.float64) * sigma) * median
    return x.round().clamp(1, max_len).long().tolist()


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


def step_costs(per_rank_batches: list[list[list[int]]], lengths: torch.Tensor) -> torch.Tensor:
    """(ranks, steps) total length of each rank's batch at each step."""
    steps = min(len(b) for b in per_rank_batches)
    return torch.tensor([[float(lengths[b].sum()) for b in batches[:steps]]
                         for batches in per_rank_batches])


def imbalance(costs: torch.Tensor) -> float:
    return float((costs.max(0).values / costs.mean(0)).mean())


def fixed_batches(order: list[int], batch_size: int) -> list[list[int]]:
    return [order[i:i + batch_size] for i in range(0, len(order) - batch_size + 1, batch_size)]


def measure_imbalance(args) -> list[dict]:
    lengths = lognormal_lengths(args.samples, args.median, args.sigma, seed=1,
                                max_len=args.max_len)
    lt = torch.tensor(lengths)
    budget = int(args.batch_size * lt.float().mean())
    rows = []
    for world in args.world_sizes:
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


# --------------------------------------------------------------------------- training loop

def _train_rank(rank: int, world: int, store_path: str, cfg: dict, out_path: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    try:
        lengths = lognormal_lengths(cfg["n"], cfg["median"], cfg["sigma"], seed=2,
                                    max_len=cfg["max_len"])
        samplers = {
            "torch": DistributedSampler(lengths, seed=5),
            "ours": LoadBalancingDistributedSampler(lengths, lengths, seed=5),
        }
        g = torch.Generator().manual_seed(0)
        x = torch.randn(cfg["max_len"], cfg["dim"], generator=g)
        w = torch.randn(cfg["dim"], cfg["dim"], generator=g)
        grad = torch.zeros(cfg["grad_numel"])
        results = {}

        def work(batch: list[int], cost: str) -> None:
            # A transformer layer's cost per sample: a projection (length x dim x dim) plus
            # attention scores (length x length x dim), so cost grows with length, faster
            # than linearly for long samples.
            if cost == "sleep":
                units = sum(n * (1 + n / cfg["dim"]) for n in batch)
                time.sleep(units * cfg["sleep_us"] * 1e-6)
            else:
                for n in batch:
                    for _ in range(cfg["layers"]):
                        h = torch.mm(x[:n], w)
                        torch.mm(h, h.t())

        for cost in cfg["costs"]:
            times = {k: [] for k in samplers}
            waits = {k: [] for k in samplers}
            for rnd in range(cfg["rounds"]):
                for name, sampler in samplers.items():
                    sampler.set_epoch(rnd)
                    loader = DataLoader(lengths, batch_size=cfg["batch_size"], sampler=sampler,
                                        drop_last=True, collate_fn=list)
                    dist.barrier()
                    t0, waited = time.perf_counter(), 0.0
                    for batch in loader:
                        work(batch, cost)  # a batch holds lengths: the dataset is the column
                        t1 = time.perf_counter()
                        dist.all_reduce(grad)
                        waited += time.perf_counter() - t1
                    dist.barrier()
                    times[name].append(time.perf_counter() - t0)
                    waits[name].append(waited)
            results[cost] = {"times": times, "waits": waits}
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()


def measure_throughput(args, costs: list[str]) -> tuple[dict, dict, int]:
    """Per cost mode the times and waits of both samplers; their cost imbalance; samples."""
    world = 2
    cfg = {"n": world * args.train_batch_size * args.steps, "median": args.median,
           "sigma": args.sigma, "max_len": args.max_len, "dim": args.dim,
           "grad_numel": args.grad_numel, "layers": args.layers,
           "batch_size": args.train_batch_size, "rounds": args.rounds, "costs": costs,
           "sleep_us": args.sleep_us}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_train_rank, args=(world, os.path.join(tmp, "store"), cfg, out), nprocs=world,
                 join=True)
        with open(out) as f:
            res = json.load(f)
    samples = cfg["n"] // (world * args.train_batch_size) * args.train_batch_size * world
    # The loop's own per-step cost imbalance, from its cost model, for both samplers.
    lengths = lognormal_lengths(cfg["n"], cfg["median"], cfg["sigma"], seed=2,
                                max_len=cfg["max_len"])
    cost = torch.tensor([n * (1 + n / cfg["dim"]) for n in lengths], dtype=torch.float64)
    imbalances = {}
    for name, make in (("torch", lambda r: DistributedSampler(lengths, world, r, seed=5)),
                       ("ours", lambda r: LoadBalancingDistributedSampler(lengths, lengths,
                                                                          world, r, seed=5))):
        runs = []
        for epoch in range(args.rounds):
            per_rank = []
            for r in range(world):
                sampler = make(r)
                sampler.set_epoch(epoch)
                per_rank.append(fixed_batches(list(sampler), args.train_batch_size))
            runs.append(imbalance(step_costs(per_rank, cost)))
        imbalances[name] = statistics.mean(runs)
    return res, imbalances, samples


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes, well under a minute")
    p.add_argument("--samples", type=int, default=200_000, help="dataset size for imbalance")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--median", type=float, default=64.0, help="median sequence length")
    p.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of the lengths")
    p.add_argument("--max-len", type=int, default=1024, help="lengths are clipped to this")
    p.add_argument("--epochs", type=int, default=3, help="epochs averaged for imbalance")
    p.add_argument("--train-batch-size", type=int, default=16, help="batch of the 2-rank loop")
    p.add_argument("--steps", type=int, default=150, help="training steps per round")
    p.add_argument("--rounds", type=int, default=4, help="rounds per sampler (alternating)")
    p.add_argument("--cost", choices=["compute", "sleep", "both"], default="both",
                   help="per-sample work of the loop: real matmuls, a sleep, or one run of each")
    p.add_argument("--dim", type=int, default=128, help="model width of the cost model")
    p.add_argument("--layers", type=int, default=4, help="layers per sample for --cost compute")
    p.add_argument("--sleep-us", type=float, default=5.0,
                   help="us per cost unit (length * (1 + length / dim)) for --cost sleep")
    p.add_argument("--grad-numel", type=int, default=1 << 18, help="allreduced floats per step")
    p.add_argument("--skip-train", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.samples, args.epochs, args.steps, args.rounds = 20_000, 1, 30, 2
        args.world_sizes = [2, 8]

    print(f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores: timings on a "
          f"busy machine are noisy; --cost sleep is the least sensitive)")
    print(f"== per-step imbalance (max/mean of a step's total length over ranks), "
          f"lognormal lengths median={args.median:g} sigma={args.sigma:g}, "
          f"{args.samples} samples, batch {args.batch_size}")
    print(f"{'ranks':>5} {'DistributedSampler':>19} {'LoadBalancing':>14} "
          f"{'LB+token budget':>16} {'ratio':>7}")
    for row in measure_imbalance(args):
        print(f"{row['world']:>5} {row['torch']:>19.4f} {row['ours']:>14.4f} "
              f"{row['ours_budget']:>16.4f} {row['torch'] / row['ours']:>6.3f}x")
    if args.skip_train:
        return
    costs = ["compute", "sleep"] if args.cost == "both" else [args.cost]
    results, imbalances, samples = measure_throughput(args, costs)
    for cost in costs:
        res = results[cost]
        print(f"\n== 2-rank training loop over gloo: cost={cost}, batch "
              f"{args.train_batch_size}, {args.steps} steps x {args.rounds} rounds per sampler "
              f"(alternating), allreduce of {args.grad_numel} floats per step")
        tput = {k: samples * len(v) / sum(v) for k, v in res["times"].items()}
        per_round = [a / b for a, b in zip(res["times"]["torch"], res["times"]["ours"])]
        for name, label in (("torch", "DistributedSampler"), ("ours", "LoadBalancing")):
            wait = sum(res["waits"][name]) / sum(res["times"][name])
            print(f"{label:>19}: {tput[name]:9.1f} samples/s  (per-step cost imbalance "
                  f"{imbalances[name]:.3f}; rank 0 waits in allreduce {wait:5.1%})")
        print(f"{'throughput ratio':>19}: {tput['ours'] / tput['torch']:.3f}x  (per round: "
              + ", ".join(f"{r:.3f}" for r in per_round) + ")")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
