#!/usr/bin/env python3
"""Elastic training: checkpoint every N steps, resume at whatever world size torchrun gives.

torchrun is the elastic engine. On a failure (a node lost, a rank killed) or a membership
change (a node joins), it stops every worker and starts them again with a new ``RANK`` and
``WORLD_SIZE``. This script is what the workers must then do:

* join with a ``timeout`` so that a dead or stopped peer turns into an error (and a non-zero
  exit, which is torchrun's cue to restart) instead of a hang;
* resume from the last checkpoint that rank 0 wrote, *after* ``with_bagua`` (model, optimizer
  — which carries the algorithm's state — and the sampler's position in the epoch), at any
  world size: bagua re-derives the per-rank algorithm state for the new world and the
  load-balanced sampler deals the epoch's remaining samples over the new ranks;
* checkpoint every ``--checkpoint-every`` steps, atomically (write, then rename).

Launch it elastically on every node (2 to 3 nodes, c10d rendezvous), the same command on each,
and again on a node that comes back::

    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    torchrun --nnodes=2:3 --nproc-per-node=1 --max-restarts=3 \\
        --rdzv-backend=c10d --rdzv-endpoint=$HEAD_NODE:29400 --rdzv-id=job1 \\
        --rdzv-conf=last_call_timeout=5,join_timeout=600 --monitor-interval=1 \\
        examples/elastic.py --checkpoint-dir /shared/ckpt --steps 2000

What each setting is for (torch 2.13's torchrun):

* ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` is needed for restarts. Without it the workers
  share the store that the first rendezvous's rank-0 agent made, for the whole job: every
  restart's process group finds the previous launch's addresses there (``Gloo
  connectFullMesh failed ... Connection refused``), and a node joining later waits for a
  ``MASTER_ADDR`` that is never written again (it times out, and the others time out in
  ``_assign_worker_ranks``). With it, each rendezvous round gets a new store.
  ``bagua_comm.init_process_group`` warns when it is missing and workers may be restarted.
* ``--max-restarts`` counts failures (a node lost); a node joining restarts the job without
  counting.
* ``--rdzv-endpoint``: the c10d rendezvous lives in the torchrun of ``$HEAD_NODE`` (the node
  whose address it is); that node must stay up for the job to survive.
* ``last_call_timeout``: how long a round waits for more nodes once ``MIN`` are in.
  ``join_timeout``: how long a node may wait to get into a round (a node that comes back
  waits for the others to stop their workers). A lost node is dropped from the rendezvous
  after ``keep_alive_interval`` x ``keep_alive_max_attempt`` (5 s x 3 by default), which is
  most of the time to resume.
* ``--checkpoint-dir`` must be shared by every node (rank 0 writes, every rank reads).
* ``--timeout`` (the process group's) bounds how long survivors wait on a lost peer before
  they fail and torchrun restarts them.

On one machine, as a quick try (kill one worker with ``kill -9`` and watch it resume)::

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=1 --nproc-per-node=2 --max-restarts=3 examples/elastic.py \\
        --checkpoint-dir /tmp/ckpt --steps 300 --step-sleep 0.05

``--events PATH`` appends one JSON line per event (start, step, checkpoint, error) so that a
run across restarts can be analysed; ``benchmarks/ft/elastic.py`` drives the full scenario
(3 emulated hosts, one lost and brought back) and plots it.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

import bagua_comm as bc
from bagua_algos import Algorithm, QAdamOptimizer, with_bagua
from bagua_data import LoadBalancingDistributedSampler

CHECKPOINT = "checkpoint.pt"


class TeacherData(Dataset):
    """Generated classification data (nothing downloaded); items are ``(x, y, index)``."""

    def __init__(self, n: int, seed: int = 1234, features: int = 32, classes: int = 10):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, features, generator=g)
        w1 = torch.randn(features, 64, generator=g) / features ** 0.5
        w2 = torch.randn(64, classes, generator=g) / 8
        self.y = (torch.tanh(self.x @ w1) @ w2).argmax(dim=1)

    def __len__(self) -> int:
        return self.y.numel()

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


class EvenBatches(Sampler):
    """What is left of the sampler's epoch on this rank, in batches of near-equal size (at
    most ``batch_size``), drawn from the sampler as each batch is needed.

    After a resume at another world size, the epoch's remaining samples are re-dealt over the
    new ranks and a rank's share is rarely a multiple of the batch size: plain batching ends
    the epoch with a batch of a few samples, whose step (a gradient of 1-2 samples, carried
    on by momentum) measurably set the loss back (0.77 -> 1.1 for ~20 steps, 3 ranks resumed
    at 2). Every rank's share has the same length, so every rank makes the same batches.
    """

    def __init__(self, sampler: LoadBalancingDistributedSampler, batch_size: int):
        self.sampler, self.batch_size = sampler, batch_size

    def _sizes(self) -> list[int]:
        done = self.sampler.state_dict()["history"][-1][1]   # this rank's position
        left = len(self.sampler) - done
        n = math.ceil(left / self.batch_size)
        return [left // n + (i < left % n) for i in range(n)] if n else []

    def __iter__(self):
        sizes = self._sizes()
        it = iter(self.sampler)   # counts what it hands out: the checkpoint's position
        for size in sizes:
            yield [next(it) for _ in range(size)]

    def __len__(self) -> int:
        return len(self._sizes())


def make_model(features: int = 32, hidden: int = 128, classes: int = 10) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, classes))


class Events:
    """Appends JSON lines to ``path`` (one file for the whole job, any host)."""

    def __init__(self, path: str | None, rank: int, world: int):
        self.path, self.rank, self.world = path, rank, world
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def __call__(self, event: str, **fields) -> None:
        if self.path is None:
            return
        rec = {"event": event, "t": time.time(), "rank": self.rank, "world": self.world,
               "restart": self.restart, "pid": os.getpid(), **fields}
        with open(self.path, "a") as f:  # one short write per line: lines stay whole
            f.write(json.dumps(rec) + "\n")


def save_checkpoint(directory: Path, model, optimizer, sampler, step: int, epoch: int) -> None:
    """Rank 0 only; atomic, so a crash mid-write leaves the previous checkpoint intact."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{CHECKPOINT}.tmp"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "sampler": sampler.state_dict(), "step": step, "epoch": epoch}, tmp)
    os.replace(tmp, directory / CHECKPOINT)


def load_checkpoint(directory: Path, model, optimizer, sampler) -> tuple[int, int]:
    """Every rank loads rank 0's file, after ``with_bagua``. Returns ``(step, epoch)``."""
    path = directory / CHECKPOINT
    if not path.exists():
        return 0, 0
    ck = torch.load(path, weights_only=True)
    model.load_state_dict(ck["model"])
    optimizer.load_state_dict(ck["optimizer"])   # carries the algorithm's state
    sampler.load_state_dict(ck["sampler"])       # the job's position, re-dealt to this world
    return ck["step"], ck["epoch"]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--algorithm", default="gradient_allreduce",
                    choices=Algorithm.registered(), help="any registered bagua algorithm")
    ap.add_argument("--steps", type=int, default=500, help="total optimizer steps of the job")
    ap.add_argument("--checkpoint-dir", required=True, help="shared by every node")
    ap.add_argument("--checkpoint-every", type=int, default=20, help="steps between checkpoints")
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--samples", type=int, default=16384)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--timeout", type=float, default=30.0,
                    help="seconds before a silent peer is an error (process group timeout)")
    ap.add_argument("--step-sleep", type=float, default=0.0,
                    help="extra seconds per step (to stretch a demo run)")
    ap.add_argument("--events", default=None, help="append JSON-line events here")
    ap.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    args = ap.parse_args(argv)
    for name in ("steps", "checkpoint_every", "batch_size", "samples"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.timeout <= 0:
        ap.error("--timeout must be > 0 seconds")
    return args


def make_algorithm(name: str, optimizer):
    if name == "qadam":
        return Algorithm.init("qadam", q_adam_optimizer=optimizer)
    return Algorithm.init(name)


def train(args) -> dict:
    bc.init_process_group(args.backend, timeout=timedelta(seconds=args.timeout))
    rank, world = bc.get_rank(), bc.get_world_size()
    events = Events(args.events, rank, world)
    torch.manual_seed(0)

    data = TeacherData(args.samples)
    sampler = LoadBalancingDistributedSampler(data, complexity_fn=data.x.norm(dim=1),
                                              num_replicas=world, rank=rank, seed=0)
    loader = DataLoader(data, batch_sampler=EvenBatches(sampler, args.batch_size))  # 0 workers

    model = make_model()
    if args.algorithm == "qadam":
        optimizer = QAdamOptimizer(model.parameters(), lr=2e-3, warmup_steps=20)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    model = with_bagua(model, [optimizer], make_algorithm(args.algorithm, optimizer))

    ckdir = Path(args.checkpoint_dir)
    step, epoch = load_checkpoint(ckdir, model, optimizer, sampler)
    events("start", step=step, epoch=epoch)
    if rank == 0:
        how = f"resumed at step {step}" if step else "starting"
        logging.info("%s on %d ranks (%s, %s)", how, world, bc.get_backend(), args.algorithm)

    while step < args.steps:
        sampler.set_epoch(epoch)               # keeps a restored mid-epoch position
        for x, y, idx in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            step += 1
            events("step", step=step, epoch=epoch, loss=loss.item(), samples=idx.tolist())
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if step % args.checkpoint_every == 0 or step == args.steps:
                if rank == 0:
                    save_checkpoint(ckdir, model, optimizer, sampler, step, epoch)
                    events("checkpoint", step=step, epoch=epoch)
                bc.barrier()   # nobody runs ahead of a checkpoint it may have to resume from
            if step >= args.steps:
                break
        else:
            epoch += 1
    if args.algorithm == "async":
        model.abort()
    events("done", step=step)
    bc.destroy_process_group()
    return {"step": step, "world": world}


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args = parse_args(argv)
    try:
        train(args)
    except Exception as err:
        # Record the detection time, then exit non-zero so that torchrun restarts the job.
        Events(args.events, int(os.environ.get("RANK", -1)),
               int(os.environ.get("WORLD_SIZE", -1)))("error", error=f"{type(err).__name__}: "
                                                                  f"{str(err)[:300]}")
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
