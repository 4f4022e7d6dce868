"""Helpers shared by the tests: datasets, and every rank's order from both samplers."""

from __future__ import annotations

import torch
from torch.utils.data import DistributedSampler

from bagua_data import LoadBalancingDistributedSampler


def lognormal_lengths(n: int, seed: int = 0, sigma: float = 1.0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return (torch.exp(torch.randn(n, generator=g) * sigma) * 64).round().clamp(1).long().tolist()


def flat(orders: list[list[int]]) -> list[int]:
    """All ranks' indices, sorted (the epoch's multiset)."""
    return sorted(i for o in orders for i in o)


def torch_orders(n: int, world: int, epoch: int = 0, **kw) -> list[list[int]]:
    out = []
    for r in range(world):
        s = DistributedSampler(range(n), num_replicas=world, rank=r, **kw)
        s.set_epoch(epoch)
        out.append(list(s))
    return out


def our_orders(lengths, world: int, epoch: int = 0, **kw) -> list[list[int]]:
    out = []
    for r in range(world):
        s = LoadBalancingDistributedSampler(lengths, lengths, num_replicas=world, rank=r, **kw)
        s.set_epoch(epoch)
        out.append(list(s))
    return out


def step_imbalance(orders: list[list[int]], lengths, batch_size: int) -> float:
    """Mean over steps of (max over ranks of a batch's total length) / (mean over ranks)."""
    lt = torch.tensor(lengths, dtype=torch.float64)
    steps = len(orders[0]) // batch_size
    cost = torch.stack([lt[torch.tensor(o[:steps * batch_size])].view(steps, batch_size).sum(1)
                        for o in orders])
    return float((cost.max(0).values / cost.mean(0)).mean())
