#!/usr/bin/env python3
"""LowRank against torch's own PowerSGD hook on the main job's model, step for step (2 ranks).

    python benchmarks/studies/low_rank_vs_powersgd.py --steps 30 --size small

2 gloo ranks, the e2e workload (``_e2e_model``: TinyGPT on Markov text, Adam lr 2e-3, batch 8
per rank, the same batches and initial weights for every row), ``--warmup`` steps then
``--steps`` steps; prints each row's held-out loss after ``--steps`` (and after every
``--every`` steps).  Rows:

- ``ddp``: torch DDP, no hook (the reference);
- ``ddp_powersgd``: torch's ``powerSGD_hook`` configured exactly as the e2e row
  (``_e2e_rows.build_torch``: rank 2, error feedback, warm start,
  ``start_powerSGD_iter = max(2, warmup)``);
- ``low_rank``: ``LowRank(rank=2, start_step=...)`` as the e2e row (the same warm-up);
- ``low_rank_nowarm``: ``LowRank(rank=2)``, compressed from the first step.

Used to find why LowRank lost more loss per step than the hook while sending its bytes.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
import _paths  # noqa: F401  (testbed and benchmarks/e2e on sys.path)
from _e2e_model import MarkovText, lm_loss, make_model
from _e2e_rows import bagua_spec, build_torch, powersgd_start

ROWS = ("ddp", "ddp_powersgd", "low_rank", "low_rank_nowarm")
LR, BATCH = 2e-3, 8


def _build(row, model, warmup):
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    if row in ("ddp", "ddp_powersgd"):
        return build_torch(row, model, powersgd_rank=2, powersgd_start=powersgd_start(warmup)), opt
    from bagua_algos import LowRank, with_bagua

    if row == "low_rank":
        _name, kwargs = bagua_spec("low_rank", 1, warmup=warmup)
        algo = LowRank(**kwargs)
    else:
        algo = LowRank(rank=2)
    return with_bagua(model, [opt], algo), opt


@torch.no_grad()
def _evaluate(model, batches) -> float:
    model.eval()
    loss = sum(float(lm_loss(model(x), y)) for x, y in batches) / len(batches)
    model.train()
    return loss


def _rank_main(rows, size, warmup, steps, every, port):
    import bagua_comm as bc

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    bc.init_process_group(backend="gloo")
    data = MarkovText(size)
    train = data.batches(256, BATCH, seed=1000 + rank)
    evalset = data.batches(4, 32, seed=7)
    out = {}
    for row in rows:
        model = make_model(size, seed=0)
        wrapped, opt = _build(row, model, warmup)
        curve = []
        for i in range(warmup + steps):
            x, y = train[i % len(train)]
            opt.zero_grad(set_to_none=True)
            lm_loss(wrapped(x), y).backward()
            opt.step()
            done = i + 1 - warmup
            if done > 0 and (done % every == 0 or done == steps):
                curve.append((done, _evaluate(model, evalset)))
        out[row] = curve
        dist.barrier()
    bc.destroy_process_group()
    dist.destroy_process_group()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--size", default="small")
    ap.add_argument("--warmup", type=int, default=2, help="as e2e.py's --warmup")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--port", type=int, default=29731)
    a = ap.parse_args(argv)
    from bagua_comm.testing import run_ranks

    rows = a.rows.split(",")
    res = run_ranks(_rank_main, 2, args=(rows, a.size, a.warmup, a.steps, a.every, a.port),
                    init=False, timeout=3600)
    print(f"held-out loss after N steps (2 ranks, {a.size}, warmup {a.warmup}; rank-mean)")
    steps = [s for s, _ in res[0][rows[0]]]
    print(f"{'row':<18}" + "".join(f"{'N=' + str(s):>10}" for s in steps))
    for row in rows:
        vals = [sum(r[row][k][1] for r in res) / len(res) for k in range(len(steps))]
        print(f"{row:<18}" + "".join(f"{v:>10.3f}" for v in vals))
    return 0


if __name__ == "__main__":
    sys.exit(main())
