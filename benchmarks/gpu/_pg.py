"""A one-process job for the GPU benchmarks: torch.distributed (NCCL for CUDA tensors, gloo
for CPU ones) and bagua_comm on top of it, over a FileStore."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist

import bagua_comm as bc


def init_one_rank() -> str:
    """Initialise both stacks as rank 0 of 1; returns bagua_comm's backend."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="bagua-gpu-bench-"), "s"), 1)
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, store=store, rank=0, world_size=1)
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    bc.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return bc.get_backend()


def shutdown() -> None:
    bc.destroy_process_group()
    if dist.is_initialized():
        dist.destroy_process_group()
