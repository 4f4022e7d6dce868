#!/usr/bin/env python3
"""A sparse-gradient algorithm written against bagua_algos' framework: random-k with error
feedback, the sibling of the built-in ``TopK``.

    torchrun --nproc_per_node=2 examples/sparse_algorithm.py            # 300 steps
    torchrun --nproc_per_node=2 examples/sparse_algorithm.py --quick    # 40 steps (the test)

Every rank picks the *same* random ``density`` fraction of each parameter's entries (the
generator is seeded by the step and the parameter's name), so the selected values can simply
be averaged with one allreduce per bucket; TopK's supports differ between ranks and need an
allgather instead.  What a rank did not send stays in its residual (error feedback) and is
added to its next gradient.  The residuals are kept by parameter name, so they ride in the
optimizer's checkpoint whatever the bucket layout.
"""

from __future__ import annotations

import argparse
import zlib

import torch

# --8<-- [start:algorithm]
import bagua_comm as bc
from bagua_algos import Algorithm, AlgorithmImpl, with_bagua


class RandomK(Algorithm, name="random_k"):
    """Average a shared random ``density`` fraction of each gradient; keep the rest."""

    def __init__(self, density: float = 0.1, seed: int = 0):
        if isinstance(density, bool) or not isinstance(density, (int, float)) \
                or not 0 < density <= 1:
            raise ValueError(f"density must be a number in (0, 1], got {density!r}")
        self.density, self.seed = float(density), seed

    def reify(self, group):
        return RandomKImpl(group, self.density, self.seed)


class _Pending:
    """A bucket's allreduce in flight, and what to do once it has completed."""

    def __init__(self, work, finish):
        self.work, self.finish = work, finish

    def wait(self):
        self.work.wait()
        self.finish()


class RandomKImpl(AlgorithmImpl):
    def __init__(self, group, density, seed):
        super().__init__(group)
        self.density, self.seed = density, seed
        self.residuals: dict[str, torch.Tensor] = {}     # by parameter name

    def _support(self, ctx, name, numel):
        k = max(1, int(self.density * numel))
        gen = torch.Generator().manual_seed(self.seed + 7919 * ctx.step + zlib.crc32(name.encode()))
        return torch.randperm(numel, generator=gen)[:k]   # the same on every rank

    def bucket_ready_hook(self, ctx, bucket):
        picks = []                        # (gradient view, support) per parameter
        for name, grad in zip(bucket.names, bucket.grad_views()):
            flat = grad.view(-1)
            res = self.residuals.setdefault(name, torch.zeros_like(flat))
            res.add_(flat)                # corrected gradient
            picks.append((flat, res, self._support(ctx, name, flat.numel())))
        values = torch.cat([res[idx] for _, res, idx in picks])
        for _, res, idx in picks:
            res[idx] = 0                  # sent: only the rest is carried over
        work = bc.allreduce_inplace(values, bc.ReduceOp.AVG, group=self.group, async_op=True)

        def finish():
            pos = 0
            for flat, _, idx in picks:    # the average, scattered back; zeros elsewhere
                flat.zero_()
                flat[idx] = values[pos:pos + idx.numel()]
                pos += idx.numel()

        return _Pending(work, finish)

    def state_dict(self):
        return {"residuals": {k: v.clone() for k, v in self.residuals.items()}}

    def load_state_dict(self, state):
        self.residuals = {k: v.clone() for k, v in state["residuals"].items()}
# --8<-- [end:algorithm]


def batch(step: int, rank: int, n: int = 32):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, 16, generator=g)
    return x, torch.sin(x @ torch.linspace(-1, 1, 16)).unsqueeze(1)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="a custom sparse algorithm: random-k")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--density", type=float, default=0.1)
    ap.add_argument("--quick", action="store_true", help="40 steps")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps = 40

    bc.init_process_group("gloo")
    rank = bc.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model = with_bagua(model, [optimizer], Algorithm.init("random_k", density=args.density))
    x_val, y_val = batch(10**6, 0, n=512)
    with torch.no_grad():
        before = torch.nn.functional.mse_loss(model(x_val), y_val).item()
    for step in range(args.steps):
        optimizer.zero_grad()
        x, y = batch(step, rank)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = torch.empty(flat.numel() * bc.get_world_size())
    bc.allgather(flat, gathered)
    same = all(torch.equal(c, flat) for c in gathered.chunk(bc.get_world_size()))
    with torch.no_grad():
        val = torch.nn.functional.mse_loss(model(x_val), y_val).item()
    saved = optimizer.state_dict()["bagua_algos"]["impl"]["residuals"]
    if rank == 0:
        print(f"random_k (density {args.density}) on {bc.get_world_size()} ranks, "
              f"{args.steps} steps: validation loss {before:.4f} -> {val:.4f}")
        print(f"ranks identical: {same}; checkpointed residuals: {sorted(saved)}")
    bc.destroy_process_group()
    if not same or not val < before:
        raise SystemExit("random_k: ranks differ or the loss did not fall")


if __name__ == "__main__":
    main()
