#!/usr/bin/env python3
"""TopK and LowRank on sklearn's digits: held-out accuracy against DDP's (2 ranks).

    python benchmarks/studies/sparse_digits.py --seeds 3
    python benchmarks/studies/sparse_digits.py --seeds 3 --low-rank-start-step 10   # dense warm-up steps

2 gloo ranks, the conv net of ``qadam_digits.py`` (Bagua's MNIST example sized for 8x8
digits), Adam lr 1e-3, batch 64 per rank, 14 epochs, the same weights and batches for every
row of a seed.  Rows: ``ddp`` (GradientAllReduce, which is DDP bit for bit), ``topk`` (1% of
the entries per parameter, 8-bit values; the main job's ``topk`` row sends 0.5%),
``topk_fp`` (1%, values in float32), ``low_rank`` (rank 2; ``low_rank_u8``: its factors
in 8 bits, opt-in), and with ``--optimizer sgd``
``topk_dgc`` (TopK with DGC's momentum correction: ``TopK(momentum=0.9)`` and SGD without
momentum, against DDP with SGD momentum 0.9; ``topk_dgc_fp``: values in float32).  Prints correct/450 per seed and row, the mean,
and each row's mean difference from ``ddp`` in accuracy points (target: within 1 point).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import qadam_digits  # noqa: E402
from qadam_digits import BATCH, WORLD, Net, batches, data, evaluate  # noqa: E402

LR = 1e-3
ROWS = ("ddp", "topk", "topk_fp", "low_rank")
MOMENTUM = 0.9


def algorithm(row, density, topk_start, low_rank_start):
    from bagua_algos import GradientAllReduce, LowRank, TopK
    from bagua_comm.compression import MinMaxUInt8

    return {"ddp": lambda: GradientAllReduce(),
            "topk": lambda: TopK(density=density, compressor=MinMaxUInt8(1),
                                 start_step=topk_start),
            "topk_fp": lambda: TopK(density=density, start_step=topk_start),
            "topk_dgc": lambda: TopK(density=density, compressor=MinMaxUInt8(1),
                                     start_step=topk_start, momentum=MOMENTUM),
            "topk_dgc_fp": lambda: TopK(density=density, start_step=topk_start,
                                        momentum=MOMENTUM),
            "low_rank": lambda: LowRank(rank=2, start_step=low_rank_start),
            "low_rank_u8": lambda: LowRank(rank=2, start_step=low_rank_start,
                                           compressor=MinMaxUInt8(8 * WORLD))}[row]()


def _rank_main(seeds, rows, opt_name, lr, epochs, density, topk_start=0, low_rank_start=0):
    import bagua_comm as bc
    from bagua_algos import with_bagua

    qadam_digits.EPOCHS = epochs
    xtr, ytr, xte, yte = data()
    rank = bc.get_rank()
    out = {}
    for seed in seeds:
        for row in rows:
            torch.manual_seed(seed)
            model = Net()
            # topk_dgc: the momentum moves into TopK (DGC's momentum correction)
            opt = (torch.optim.Adam(model.parameters(), lr=lr) if opt_name == "adam" else
                   torch.optim.SGD(model.parameters(), lr=lr,
                                   momentum=0.0 if row.startswith("topk_dgc") else MOMENTUM))
            model = with_bagua(model, [opt], algorithm(row, density, topk_start, low_rank_start))
            torch.manual_seed(seed * 7 + rank)       # dropout differs per rank
            for idx in batches(seed, len(xtr)):
                opt.zero_grad()
                F.nll_loss(model(xtr[idx[rank]]), ytr[idx[rank]]).backward()
                opt.step()
            model.detach_algorithm()
            out[(seed, row)] = evaluate(model.module, xte, yte)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    ap.add_argument("--lr", type=float, help="default: 1e-3 (adam), 0.05 (sgd, momentum 0.9)")
    ap.add_argument("--epochs", type=int, default=14)
    ap.add_argument("--density", type=float, default=0.01, help="topk rows' density")
    ap.add_argument("--topk-start-step", type=int, default=0,
                    help="TopK(start_step=): steps sent as the plain average first")
    ap.add_argument("--low-rank-start-step", type=int, default=0,
                    help="LowRank(start_step=): steps sent as the plain average first")
    args = ap.parse_args(argv)
    from bagua_comm.testing import run_ranks

    seeds = list(range(args.seeds))
    rows = [r for r in args.rows.split(",") if r]
    if "ddp" not in rows:
        rows.insert(0, "ddp")
    if any(r.startswith("topk_dgc") for r in rows) and args.optimizer != "sgd":
        ap.error("the topk_dgc row moves SGD's momentum into TopK: use --optimizer sgd")
    lr = args.lr or (LR if args.optimizer == "adam" else 0.05)
    res = run_ranks(_rank_main, WORLD, args=(seeds, rows, args.optimizer, lr, args.epochs,
                                             args.density, args.topk_start_step,
                                             args.low_rank_start_step), timeout=3600)[0]
    n = len(data()[3])
    print(f"batch {BATCH} per rank x {WORLD} ranks, {args.epochs} epochs, {args.optimizer} lr "
          f"{lr}, topk density {args.density}, start_step topk {args.topk_start_step} "
          f"low_rank {args.low_rank_start_step}; correct/{n} per seed")
    print(f"{'row':10s} " + " ".join(f"seed{s:<3d}" for s in seeds) + "   mean%   vs ddp")
    base = sum(res[(s, "ddp")][1] for s in seeds) / len(seeds) / n * 100
    for row in rows:
        acc = sum(res[(s, row)][1] for s in seeds) / len(seeds) / n * 100
        print(f"{row:10s} " + " ".join(f"{res[(s, row)][1]:<7d}" for s in seeds)
              + f"  {acc:6.2f}  {acc - base:+6.2f}")


if __name__ == "__main__":
    main()
