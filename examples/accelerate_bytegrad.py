#!/usr/bin/env python3
"""Keep a Hugging Face Accelerate training loop and send 8-bit gradients (ByteGrad's format):
after ``accelerator.prepare``, the model is torch's DistributedDataParallel, and bagua's
compressed allreduce is registered as its communication hook. Nothing else changes.

    torchrun --nproc_per_node=2 examples/accelerate_bytegrad.py
    accelerate launch --num_processes 2 --cpu examples/accelerate_bytegrad.py --quick

Trains the same small regression model twice from the same seed: the loop as Accelerate runs
it, then with ``compressed_allreduce_hook`` (MinMaxUInt8 with error feedback); prints both
held-out losses, the bytes each rank sent per step, and whether the ranks are bit-identical.
Needs ``pip install accelerate`` (it depends on torch, so install the torch you want first).
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator
from torch.nn.parallel import DistributedDataParallel

import bagua_comm as bc
from bagua_algos.ddp_hooks import CompressionHookState, compressed_allreduce_hook

IN = 32


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, 128), torch.nn.ReLU(),
                               torch.nn.Linear(128, 128), torch.nn.ReLU(),
                               torch.nn.Linear(128, 1))


def dataset(n=64 * 64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, IN, generator=g)
    return torch.utils.data.TensorDataset(x, x[:, :4].sum(1, keepdim=True).sin() + 0.1 * x[:, 4:5])


def held_out_loss(model):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1024, IN, generator=g)
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model(x), x[:, :4].sum(1, keepdim=True).sin()
                                            + 0.1 * x[:, 4:5]).item()


def train(accelerator, steps, hook: bool):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=64, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    state = None
    if hook:                                  # the one addition: before the first backward
        assert isinstance(model, DistributedDataParallel), type(model)
        state = CompressionHookState(error_feedback=True)    # MinMaxUInt8, one chunk per rank
        model.register_comm_hook(state, compressed_allreduce_hook)
    bc.traffic.reset()
    done = 0
    while done < steps:
        for x, y in loader:
            optimizer.zero_grad()
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            done += 1
            if done == steps:
                break
    sent = bc.traffic.bytes_sent() / steps
    raw = accelerator.unwrap_model(model)
    if not hook:  # DDP's own C++ allreduce, a ring: 2 (n-1)/n of the gradients
        n = accelerator.num_processes
        sent = 2 * (n - 1) / n * sum(p.numel() * p.element_size() for p in raw.parameters())
    return raw, sent


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--quick", action="store_true", help="60 steps")
    args = ap.parse_args()
    steps = 60 if args.quick else args.steps
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    if accelerator.num_processes < 2:
        raise SystemExit("launch with 2 or more processes: torchrun --nproc_per_node=2 ... "
                         "or accelerate launch --num_processes 2 ...")
    plain, plain_bytes = train(accelerator, steps, hook=False)
    hooked, hook_bytes = train(accelerator, steps, hook=True)

    flat = torch.cat([p.detach().reshape(-1) for p in hooked.parameters()])
    gathered = accelerator.gather(flat[None]).cpu()
    identical = all(torch.equal(row, gathered[0]) for row in gathered)
    if accelerator.is_main_process:
        print(f"held-out loss: Accelerate {held_out_loss(plain):.4f}, Accelerate + ByteGrad hook "
              f"{held_out_loss(hooked):.4f} after {steps} steps")
        print(f"bytes per rank per step: DDP {plain_bytes:,.0f}, hook {hook_bytes:,.0f} "
              f"({hook_bytes / plain_bytes:.3f}x)")
        print(f"ranks identical: {identical}")
    bc.destroy_process_group()           # bagua's groups first (the hook adopted torch's group)
    accelerator.end_training()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
