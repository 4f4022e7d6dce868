#!/usr/bin/env python3
"""DiLoCo: train alone for ``sync_every`` steps, then one outer Nesterov step on the averaged
parameter change; checkpoint and resume in the middle.

    torchrun --nproc_per_node=2 examples/diloco.py            # 400 steps
    torchrun --nproc_per_node=2 examples/diloco.py --quick    # 64 steps (the test)

Prints the loss, the bytes this rank sent per step against what DDP would send, and checks
that the ranks are identical right after the last sync.
"""

from __future__ import annotations

import argparse
import io

import torch

import bagua_comm as bc
from bagua_algos import DiLoCo, with_bagua
from bagua_comm.compression import MinMaxUInt8


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(32, 16, generator=g)
    return x, torch.sin(x @ torch.linspace(-1, 1, 16)).unsqueeze(1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sync-every", type=int, default=8)
    args = ap.parse_args()
    steps = 64 if args.quick else 400
    bc.init_process_group()
    rank = bc.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # the outer gradient travels as 8 bits (one chunk per rank), with error feedback
    algo = DiLoCo(sync_every=args.sync_every,
                  compressor=MinMaxUInt8(bc.get_world_size(), error_feedback=True))
    model = with_bagua(model, [opt], algo)
    ddp_bytes = 2 * (bc.get_world_size() - 1) / bc.get_world_size() * 4 * sum(
        p.numel() for p in model.parameters())
    bc.traffic.reset()
    checkpoint = None
    for step in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(batch(step, rank)[0]), batch(step, rank)[1])
        loss.backward()
        opt.step()
        if step + 1 == steps // 2:        # a checkpoint mid-run: anchor, momentum, counter
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buf)
            checkpoint = buf.getvalue()
        if rank == 0 and (step + 1) % (steps // 4) == 0:
            print(f"step {step + 1}: loss {loss.item():.4f}", flush=True)
    sent = bc.traffic.bytes_sent() / steps
    mine = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    theirs = mine.clone()
    bc.broadcast(theirs, 0)
    same = bool(torch.equal(mine, theirs)) if steps % args.sync_every == 0 else None
    state = torch.load(io.BytesIO(checkpoint), weights_only=False)["optimizer"]["bagua_algos"]
    if rank == 0:
        print(f"bytes per step: {sent:.0f} (DDP: {ddp_bytes:.0f}, {ddp_bytes / sent:.0f}x more)")
        print(f"checkpoint holds: {sorted(state['impl'])}")
        print(f"ranks identical after the last sync: {same}")
    bc.destroy_process_group()


if __name__ == "__main__":
    main()
