"""Every sampler's batches for one rank, and what a plan costs; shared by benchmarks/micro/data.py
and its 2-rank loop.  Each rank builds its own sampler, as in a real job."""

from __future__ import annotations

import torch
from torch.utils.data import DistributedSampler

from bagua_data import (
    LengthGroupedDistributedBatchSampler,
    LoadBalancingDistributedBatchSampler,
    LoadBalancingDistributedSampler,
)

# name -> label, in the tables' order
SAMPLERS = {
    "torch": "torch DistributedSampler",
    "lb": "LoadBalancingDistributedSampler",
    "lb_budget": "LoadBalancingDistributedBatchSampler, padded budget",
    "hf": "length-grouped (HF group_by_length style)",
    "lg": "LengthGroupedDistributedBatchSampler, batch_size",
    "lg_budget": "LengthGroupedDistributedBatchSampler, max_cost",
}


def lognormal_lengths(n: int, median: float, sigma: float, seed: int,
                      max_len: int = 1024) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    x = torch.exp(torch.randn(n, generator=g, dtype=torch.float64) * sigma) * median
    return x.round().clamp(1, max_len).long().tolist()


def fixed_batches(order: list[int], batch_size: int) -> list[list[int]]:
    return [order[i:i + batch_size] for i in range(0, len(order) - batch_size + 1, batch_size)]


def padded_budget_fn(lengths: list[int], budget: int):
    """batch_fn: consecutive samples while (count x longest) stays within ``budget``."""
    def batch_fn(indices: list[int]) -> list[list[int]]:
        batches, batch, longest = [], [], 0
        for i in indices:
            longer = max(longest, lengths[i])
            if batch and longer * (len(batch) + 1) > budget:
                batches.append(batch)
                batch, longer = [], lengths[i]
            batch.append(i)
            longest = longer
        return batches + [batch] if batch else batches
    return batch_fn


def hf_grouped(lengths: list[int], world: int, rank: int, batch_size: int, seed: int,
               epoch: int, mega: int = 50) -> list[list[int]]:
    """Hugging Face ``group_by_length``-style batches: shuffle, sort mega-batches of ``mega``
    batches per rank by length (longest first), cut batches of ``batch_size``, deal
    consecutive batches to the ranks in order (the incomplete tail dropped)."""
    g = torch.Generator().manual_seed(seed + epoch)
    perm = torch.randperm(len(lengths), generator=g).tolist()
    size = mega * world * batch_size
    mine: list[list[int]] = []
    for s in range(0, len(perm), size):
        chunk = sorted(perm[s:s + size], key=lambda i: -lengths[i])
        batches = fixed_batches(chunk, batch_size)
        mine.extend(batches[j + rank] for j in range(0, len(batches) - world + 1, world))
    return mine


def rank_batches(name: str, lengths: list[int], world: int, rank: int, batch_size: int,
                 budget: int, seed: int, epoch: int) -> list[list[int]]:
    """Rank ``rank``'s batches of one epoch under sampler ``name``."""
    if name == "hf":
        return hf_grouped(lengths, world, rank, batch_size, seed, epoch)
    if name == "torch":
        s = DistributedSampler(lengths, world, rank, seed=seed)
    elif name in ("lb", "lb_budget"):
        s = LoadBalancingDistributedSampler(lengths, lengths, world, rank, seed=seed)
    else:
        kw = {"batch_size": batch_size} if name == "lg" else {"max_cost": float(budget)}
        s = LengthGroupedDistributedBatchSampler(lengths, lengths, num_replicas=world,
                                                 rank=rank, seed=seed, cost="padded", **kw)
    if name == "lb_budget":
        s = LoadBalancingDistributedBatchSampler(s, padded_budget_fn(lengths, budget))
    s.set_epoch(epoch)
    if name in ("torch", "lb"):
        return fixed_batches(list(s), batch_size)
    return list(s)


def plan_stats(per_rank: list[list[list[int]]], lengths: list[int]) -> dict:
    """A plan's padded cost (sum over steps of the slowest rank's count x longest), useful
    share, per-step imbalance (slowest over mean, padded), and the slowest rank's tokens."""
    lt = torch.tensor(lengths, dtype=torch.float64)
    steps = min(len(b) for b in per_rank)
    padded = torch.tensor([[len(b) * float(lt[b].max()) for b in batches[:steps]]
                           for batches in per_rank])
    tokens = torch.tensor([[float(lt[b].sum()) for b in batches[:steps]]
                           for batches in per_rank])
    slowest = padded.max(0).values
    world = len(per_rank)
    return {"padded": float(slowest.sum()), "steps": steps,
            "useful": float(tokens.sum()) / (world * float(slowest.sum())),
            "imbalance": float((slowest / padded.mean(0)).mean()),
            "imbalance_total": float(slowest.sum() / padded.mean(0).sum()),
            "slowest_tokens": float(tokens.sum(1).max()),
            "samples": sum(len(b) for batches in per_rank for b in batches[:steps])}
