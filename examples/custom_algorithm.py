#!/usr/bin/env python3
"""A custom algorithm: periodic model averaging (local SGD) written against bagua_algos'
``Algorithm`` / ``AlgorithmImpl`` framework, then trained with ``with_bagua`` like the built-in
ones.

    torchrun --nproc_per_node=2 examples/custom_algorithm.py            # 300 steps
    torchrun --nproc_per_node=2 examples/custom_algorithm.py --quick    # 32 steps (the test)

Each rank trains on its own batches without communicating; every ``period`` optimizer steps
the weights are averaged across ranks (one allreduce per bucket of flat weights). Between
averagings the ranks drift apart; right after one they are identical, which the script checks.
The averaging counter is algorithm state, so it rides in the optimizer's checkpoint.
"""

from __future__ import annotations

import argparse

import torch

# --8<-- [start:algorithm]
import bagua_comm as bc
from bagua_algos import Algorithm, AlgorithmImpl, with_bagua


class PeriodicAverage(Algorithm, name="periodic_average"):
    """Average the weights every ``period`` optimizer steps; no gradient communication."""

    def __init__(self, period: int = 4):
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            raise ValueError(f"period must be an int >= 1 (optimizer steps between "
                             f"averagings), got {period!r}")
        self.period = period

    def reify(self, group):
        return PeriodicAverageImpl(group, self.period)


class PeriodicAverageImpl(AlgorithmImpl):
    flatten_weights = True         # each bucket's parameters are views of one flat buffer
    uses_grad_buckets = False      # no gradient communication in backward

    def __init__(self, group, period: int):
        super().__init__(group)
        self.period = period
        self.steps = 0
        self.averagings = 0

    def init_operations(self, module, buckets):
        self.buckets = buckets

    def post_optimizer_step_hook(self, module, optimizer):
        self.steps += 1
        if self.steps % self.period:
            return
        with torch.no_grad():
            for bucket in self.buckets:
                weights = bucket.gather_weights()
                bc.allreduce_inplace(weights, bc.ReduceOp.AVG, group=self.group)
                bucket.scatter_weights()
        self.averagings += 1

    def state_dict(self):
        return {"steps": self.steps, "averagings": self.averagings}

    def load_state_dict(self, state):
        self.steps, self.averagings = int(state["steps"]), int(state["averagings"])
# --8<-- [end:algorithm]


def batch(step: int, rank: int, n: int = 32):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, 16, generator=g)
    return x, torch.sin(x @ torch.linspace(-1, 1, 16)).unsqueeze(1)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description="a custom bagua algorithm: local SGD")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--period", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="32 steps")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps = 32

    bc.init_process_group("gloo")
    rank = bc.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model = with_bagua(model, [optimizer],
                       Algorithm.init("periodic_average", period=args.period))

    x_val, y_val = batch(10**6, 0, n=512)
    first = None
    for step in range(args.steps):
        optimizer.zero_grad()
        x, y = batch(step, rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        first = loss.item() if first is None else first

    # Right after an averaging every rank holds the same weights.
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = torch.empty(flat.numel() * bc.get_world_size())
    bc.allgather(flat, gathered)
    in_sync = all(torch.equal(c, flat) for c in gathered.chunk(bc.get_world_size()))
    with torch.no_grad():
        val = torch.nn.functional.mse_loss(model(x_val), y_val).item()
    state = optimizer.state_dict()["bagua_algos"]        # the algorithm's state, checkpointed
    if rank == 0:
        print(f"periodic_average (period {args.period}) on {bc.get_world_size()} ranks: "
              f"{args.steps} steps, {model.impl.averagings} averagings")
        print(f"train loss {first:.4f} -> {loss.item():.4f}, validation loss {val:.4f}")
        print(f"ranks identical after the last averaging: {in_sync}; "
              f"checkpointed algorithm state: {state['impl']}")
    expect_sync = args.steps % args.period == 0
    if in_sync != expect_sync:
        raise SystemExit(f"ranks identical: {in_sync}, expected {expect_sync}")
    bc.destroy_process_group()
    return {"val": val, "in_sync": in_sync}


if __name__ == "__main__":
    main()
