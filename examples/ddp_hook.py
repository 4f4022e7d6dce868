#!/usr/bin/env python3
"""Keep torch's DistributedDataParallel and send 8-bit gradients: bagua's compressed allreduce
as a DDP communication hook (no with_bagua).

    torchrun --nproc_per_node=2 examples/ddp_hook.py
    torchrun --nproc_per_node=2 examples/ddp_hook.py --quick        # 60 steps
    torchrun --nproc_per_node=2 examples/ddp_hook.py --compressor uint4

Trains a small regression model twice from the same seed: plain DDP, then DDP with
``compressed_allreduce_hook`` (MinMaxUInt8 with error feedback, or MinMaxUInt4), and prints
both losses, the bytes each rank sent per step, and whether the ranks' weights are
bit-identical.  The hook's state (error-feedback residuals) is checkpointed with
``torch.save`` and read back with ``weights_only=True``.
"""

from __future__ import annotations

import argparse
import io

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import bagua_comm as bc
from bagua_algos.ddp_hooks import CompressionHookState, compressed_allreduce_hook
from bagua_comm.compression import MinMaxUInt4

IN = 32


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, 128), torch.nn.ReLU(),
                               torch.nn.Linear(128, 128), torch.nn.ReLU(),
                               torch.nn.Linear(128, 1))


def batch(step, rank, n=64):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, IN, generator=g)
    return x, (x[:, :4].sum(1, keepdim=True).sin() + 0.1 * x[:, 4:5])


def held_out_loss(model):
    with torch.no_grad():
        x, y = batch(10**6, 0, n=1024)
        return torch.nn.functional.mse_loss(model(x), y).item()


def train(steps, state=None):
    rank = dist.get_rank()
    model = make_model()
    ddp = DDP(model)
    if state is not None:
        ddp.register_comm_hook(state, compressed_allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    bc.traffic.reset()
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(step, rank)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    sent = bc.traffic.bytes_sent() / steps
    if state is None:   # DDP's own C++ allreduce: a ring, 2 (n-1)/n of the gradients
        n = dist.get_world_size()
        sent = 2 * (n - 1) / n * sum(p.numel() * p.element_size() for p in model.parameters())
    return model, sent


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--quick", action="store_true", help="60 steps")
    ap.add_argument("--compressor", choices=["uint8", "uint4"], default="uint8")
    args = ap.parse_args()
    steps = 60 if args.quick else args.steps
    dist.init_process_group("gloo")          # as a DDP script does; bagua adopts this group
    rank, world = dist.get_rank(), dist.get_world_size()

    plain, plain_bytes = train(steps)
    if args.compressor == "uint4":
        state = CompressionHookState(compressor=MinMaxUInt4(world, error_feedback=True))
    else:
        state = CompressionHookState(error_feedback=True)   # MinMaxUInt8, one chunk per rank
    hooked, hook_bytes = train(steps, state)

    # identical ranks: every rank decoded the same bytes
    flat = torch.cat([p.detach().reshape(-1) for p in hooked.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    identical = all(torch.equal(g, gathered[0]) for g in gathered)

    # the hook's state in a checkpoint, loadable with weights_only=True
    buf = io.BytesIO()
    torch.save({"model": hooked.state_dict(), "ddp_hook": state.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    CompressionHookState(error_feedback=args.compressor == "uint8",
                         compressor=None if args.compressor == "uint8"
                         else MinMaxUInt4(world, error_feedback=True)
                         ).load_state_dict(ckpt["ddp_hook"])
    if rank == 0:
        print(f"held-out loss: DDP {held_out_loss(plain):.4f}, DDP + {args.compressor} hook "
              f"{held_out_loss(hooked):.4f} after {steps} steps")
        print(f"bytes per rank per step: DDP {plain_bytes:,.0f}, hook {hook_bytes:,.0f} "
              f"({hook_bytes / plain_bytes:.3f}x)")
        print(f"ranks identical: {identical}; checkpoint residuals: "
              f"{len(ckpt['ddp_hook']['compressor']['residuals'])}")
    bc.destroy_process_group()    # bagua's groups first, then torch's
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
