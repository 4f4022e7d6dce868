#!/usr/bin/env python3
"""Let bagua pick the algorithm for the network it finds: ``recommend`` and ``"auto"``.

    torchrun --nproc_per_node=2 examples/choose_algorithm.py            # 200 steps
    torchrun --nproc_per_node=2 examples/choose_algorithm.py --quick    # 20 steps (the test)
    BAGUA_ALGORITHM=bytegrad torchrun --nproc_per_node=2 examples/choose_algorithm.py

1. Times a few local steps of the model (``compute_s``: DiLoCo is only weighed when the
   computation is known), then ``recommend(model, compute_s=..., total_steps=...)`` measures
   bandwidth, latency and the 8-bit codec between the ranks (a few seconds at most), logs
   one line with what it found and why it chose, and returns the same answer on every rank.
2. Shows what the same rule would pick on networks you may train on later (``measurement=``
   skips measuring): a far, slow link and a fast, near one.
3. Trains with the recommended algorithm, then wraps once more with ``"auto"`` (what a
   script does when it does not want to call ``recommend`` itself).

``BAGUA_ALGORITHM=<name>`` overrules the choice without changing code; an explicit algorithm
given to ``with_bagua`` is never second-guessed.  On one machine (loopback) the network is
fast and near, so the choice is the exact allreduce; the rule is in docs/tradeoff.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

import bagua_comm as bc
from bagua_algos import recommend, with_bagua


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(64, 32, generator=g)
    return x, (x[:, :4].sum(1) > 0).long()


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 2))


def step_seconds(model, opt, rank: int, steps: int = 5) -> float:
    """A local step's computation (forward, backward, optimizer), the median of ``steps``."""
    times = []
    for s in range(steps):
        t = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(batch(s, rank)[0]), batch(s, rank)[1]).backward()
        opt.step()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    steps = 20 if args.quick else 200
    bc.init_process_group()
    rank, world = bc.get_rank(), bc.get_world_size()

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    compute = step_seconds(make_model(), torch.optim.SGD(make_model().parameters(), lr=0.0),
                           rank)
    # every rank must pass the same numbers: take the slowest rank's
    compute = torch.tensor([compute], dtype=torch.float64)
    bc.allreduce_inplace(compute, op=bc.ReduceOp.MAX)
    compute = compute.item()

    # 1. measure and choose (collective; one log line on rank 0)
    rec = recommend(model, compute_s=compute, total_steps=steps, time_limit_s=2.0)
    # every rank got the same answer: compare with rank 0's
    agree = torch.tensor([float(bc.broadcast_object(rec.name, src=0) == rec.name)])
    bc.allreduce_inplace(agree, op=bc.ReduceOp.MIN)
    m = rec.measurement
    if rank == 0:
        if m is not None:
            print(f"measured: {m.bandwidth_mbit:.0f} Mbit/s, {m.latency_ms:.3f} ms a tiny exchange, "
                  f"{m.nodes} nodes of {m.world_size} ranks, in {m.elapsed_s:.2f} s")
        print(f"chosen: {rec.name} {rec.kwargs}")

    # 2. the same rule on other networks (no measuring: every rank passes the same numbers)
    if m is not None:
        for label, bw, lat in (("far, slow link (10 Mbit/s, 50 ms)", 10.0, 50.0),
                               ("fast, near link (10 Gbit/s, 0.05 ms)", 10_000.0, 0.05)):
            other = dataclasses.replace(m, bandwidth_mbit=bw, latency_ms=lat, nodes=world)
            pick = recommend(model, compute_s=compute, total_steps=steps, measurement=other)
            if rank == 0:
                print(f"on a {label}: {pick.name} {pick.kwargs}")

    # 3. train with the choice
    model = with_bagua(model, [opt], rec.algorithm)
    for step in range(steps):
        x, y = batch(step, rank)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    mine = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    theirs = mine.clone()
    bc.broadcast(theirs, 0)
    model.detach_algorithm()
    again = with_bagua(model.module, [opt], "auto")   # measures again; same rule, same answer
    if rank == 0:
        print(f"trained {steps} steps with {type(rec.algorithm).__name__}: loss {loss.item():.3f}; "
              f"ranks identical: {bool(torch.equal(mine, theirs))}")
        print(f"with_bagua(..., 'auto') chose {type(again.algorithm).__name__}")
        print(f"every rank chose the same: {bool(agree.item())}")
    again.detach_algorithm()
    bc.destroy_process_group()


if __name__ == "__main__":
    main()
