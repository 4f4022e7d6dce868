"""Where a sampler sits in the job: ``num_replicas`` and ``rank``."""

from __future__ import annotations

import torch.distributed as dist


def resolve_world(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """Explicit values win; else torch.distributed's when initialised; else 1 and 0."""
    initialised = dist.is_available() and dist.is_initialized()
    if num_replicas is None:
        num_replicas = dist.get_world_size() if initialised else 1
    if rank is None:
        rank = dist.get_rank() if initialised else 0
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"num_replicas must be an int >= 1, got {num_replicas!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_replicas:
        raise ValueError(f"rank must be an int in [0, {num_replicas - 1}] "
                         f"(num_replicas={num_replicas}), got {rank!r}")
    return num_replicas, rank
