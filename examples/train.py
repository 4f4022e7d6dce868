#!/usr/bin/env python3
"""Train a classifier on many processes with any bagua algorithm.

    torchrun --nproc_per_node=2 examples/train.py --algorithm bytegrad
    torchrun --nnodes=2 --nproc_per_node=4 ... examples/train.py --algorithm decentralized
    torchrun --nproc_per_node=2 examples/train.py --quick      # 1 epoch on 1,024 samples

The data set is generated (nothing is downloaded): 10 classes labelled by a fixed random
"teacher" network on 32-dimensional Gaussian inputs, split into training and validation sets.
Each rank reads its own shard (``DistributedSampler``).  Compared with single-process
training, the only bagua lines are ``bc.init_process_group()`` and ``with_bagua(...)``.

``--checkpoint PATH`` saves model + optimizer (which carries the algorithm's state) after
every epoch, one file per rank (``PATH.rank<r>``: decentralized ranks differ), and resumes
from them if they exist, continuing exactly where it stopped.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import bagua_comm as bc
from bagua_algos import (
    AsyncModelAverage,
    ByteGrad,
    Decentralized,
    GradientAllReduce,
    LowPrecisionDecentralized,
    QAdam,
    QAdamOptimizer,
    with_bagua,
)

ALGORITHMS = ("gradient_allreduce", "bytegrad", "decentralized", "low_precision_decentralized",
              "async", "qadam")


def make_dataset(n: int, seed: int = 1234, features: int = 32, classes: int = 10):
    """Inputs ~ N(0, I); labels = argmax of a fixed random two-layer teacher network."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    w1 = torch.randn(features, 64, generator=g) / features ** 0.5
    w2 = torch.randn(64, classes, generator=g) / 8
    y = (torch.tanh(x @ w1) @ w2).argmax(dim=1)
    split = n * 4 // 5
    return TensorDataset(x[:split], y[:split]), TensorDataset(x[split:], y[split:])


def make_model(features: int = 32, hidden: int = 128, classes: int = 10) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, classes))


def make_algorithm(name: str, optimizer, args):
    if name == "gradient_allreduce":
        return GradientAllReduce(hierarchical=args.hierarchical)
    if name == "bytegrad":
        return ByteGrad(hierarchical=args.hierarchical)
    if name == "decentralized":
        return Decentralized(hierarchical=args.hierarchical,
                             peer_selection_mode=args.peer_selection_mode)
    if name == "low_precision_decentralized":
        return LowPrecisionDecentralized(hierarchical=args.hierarchical)
    if name == "async":
        return AsyncModelAverage(sync_interval_ms=args.sync_interval_ms,
                                 warmup_steps=args.warmup_steps)
    return QAdam(optimizer, hierarchical=args.hierarchical)


@torch.no_grad()
def evaluate(model, data) -> tuple[float, float]:
    model.eval()
    x, y = data.tensors
    logits = model(x)
    model.train()
    return (torch.nn.functional.cross_entropy(logits, y).item(),
            (logits.argmax(1) == y).float().mean().item())


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="bagua example: data-parallel training")
    ap.add_argument("--algorithm", choices=ALGORITHMS, default="gradient_allreduce")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--lr", type=float, default=None,
                    help="default 0.05 (SGD with momentum), 2e-3 for qadam")
    ap.add_argument("--samples", type=int, default=8192)
    ap.add_argument("--hierarchical", action=argparse.BooleanOptionalAction, default=None,
                    help="hierarchical communication (default: the algorithm's own default)")
    ap.add_argument("--peer-selection-mode", choices=("all", "shift_one"), default="all")
    ap.add_argument("--sync-interval-ms", type=int, default=50, help="async only")
    ap.add_argument("--warmup-steps", type=int, default=20, help="async and qadam")
    ap.add_argument("--checkpoint", default=None, help="save/resume path")
    ap.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="1 epoch on 1,024 samples")
    args = ap.parse_args(argv)
    if args.quick:
        args.epochs, args.samples = 1, 1024
    if args.hierarchical is None:   # each algorithm's documented default
        args.hierarchical = args.algorithm != "gradient_allreduce"
    if args.lr is None:
        args.lr = 2e-3 if args.algorithm == "qadam" else 0.05
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    bc.init_process_group(args.backend)
    rank, world = bc.get_rank(), bc.get_world_size()
    torch.manual_seed(args.seed)

    train_set, val_set = make_dataset(args.samples)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    model = make_model()
    if args.algorithm == "qadam":
        optimizer = QAdamOptimizer(model.parameters(), lr=args.lr, warmup_steps=args.warmup_steps)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    model = with_bagua(model, [optimizer], make_algorithm(args.algorithm, optimizer, args))

    start_epoch = 0
    ck_path = f"{args.checkpoint}.rank{rank}" if args.checkpoint else None
    if ck_path and os.path.exists(ck_path):
        ck = torch.load(ck_path, weights_only=True)
        model.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        start_epoch = ck["epoch"]
        if rank == 0:
            print(f"resumed from {args.checkpoint}.rank* at epoch {start_epoch}")

    loss0, acc0 = evaluate(model, val_set)
    if rank == 0:
        print(f"{args.algorithm} on {world} ranks ({bc.get_backend()}): "
              f"before training val loss {loss0:.4f} acc {acc0:.3f}")
    t0 = time.perf_counter()
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        bc.traffic.reset()
        steps = 0
        for x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            steps += 1
        loss, acc = evaluate(model, val_set)
        if rank == 0:
            sent = bc.traffic.bytes_sent() / max(steps, 1)
            print(f"epoch {epoch + 1}/{args.epochs}: val loss {loss:.4f} acc {acc:.3f} "
                  f"({sent / 1024:.1f} KiB sent per step)")
        if ck_path:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "epoch": epoch + 1}, ck_path)
    if args.algorithm == "async":
        model.abort()          # stop background averaging on every rank before exiting
    loss, acc = evaluate(model, val_set)
    if rank == 0:
        print(f"final: val loss {loss:.4f} acc {acc:.3f} "
              f"in {time.perf_counter() - t0:.1f}s")
    bc.destroy_process_group()
    return {"loss_before": loss0, "loss": loss, "accuracy": acc}


if __name__ == "__main__":
    main()
