#!/usr/bin/env python3
"""DiLoCo at a deep target: which local steps and outer settings reach DDP's held-out loss
after N steps in fewer steps (the main job's model and data, ranks as processes, no link).

    python benchmarks/studies/diloco_depth.py                      # 4 ranks, N=80, H=55 and 75
    python benchmarks/studies/diloco_depth.py --sync-every 55 --variants base,linear:0.3
    python benchmarks/studies/diloco_depth.py --quick              # 2 ranks, N=8, H=6, 2 rows

Steps, not seconds: the network does not enter, so the figures hold on a loaded machine.
Every row starts from the same weights and each rank sees the same batches in every row
(the main job's: ``MarkovText`` small, 8 sequences per rank, Adam lr 2e-3).  The DDP row is
``GradientAllReduce`` (DDP's maths); its held-out loss after N steps is the target.  A DiLoCo
row (4-bit outer gradient with error feedback, as ``recommend`` runs it) runs whole sync
periods up to ``--max-x`` (default 2) times DDP's N steps, at least two: the held-out loss is the mean over the ranks' models, and at a
sync, when they are one model, the loss the target is read against.

Variants (comma-separated ``--variants``):

- ``base``: constant inner lr, outer lr 0.7, Nesterov momentum 0.5 (``recommend``'s DiLoCo);
- ``linear:F`` / ``cosine:F``: the inner lr falls from lr to F x lr over each sync period and
  starts again after the sync (a per-period schedule, set by the training loop);
- ``outer:LR:M``: outer lr LR, momentum M (Nesterov when M > 0);
- ``overlap:T``: ``base`` whose syncs each overlap T inner steps (``overlap_steps=T``,
  Streaming DiLoCo's overlap with one fragment: the sync started after step kH is applied
  after step kH + T, the inner progress made meanwhile kept). The ranks then never hold one
  model (each keeps its own T steps), so the loss read there is the anchor's: the model
  every rank agrees on, the sync's result (the one a user evaluates and saves), reached T
  steps after the sync started. The mean over the ranks' own models is kept too
  (``ranks_curve``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))       # the main job's model and data


def _schedule(variant: str, sync_every: int):
    """The inner lr's factor after ``s`` optimizer steps."""
    kind, *rest = variant.split(":")
    if kind not in ("linear", "cosine"):
        return lambda s: 1.0
    floor = float(rest[0]) if rest else 0.1
    span = max(1, sync_every - 1)
    if kind == "linear":
        return lambda s: 1.0 - (1.0 - floor) * (s % sync_every) / span
    return lambda s: floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * (s % sync_every) / span))


def _overlap(variant: str) -> int:
    kind, *rest = variant.split(":")
    return int(rest[0]) if kind == "overlap" else 0


def _outer(variant: str) -> tuple[float, float]:
    kind, *rest = variant.split(":")
    return (float(rest[0]), float(rest[1])) if kind == "outer" else (0.7, 0.5)


def _check(variant: str) -> str:
    kind, *rest = variant.split(":")
    ok = (kind == "base" and not rest) or (kind in ("linear", "cosine") and len(rest) <= 1) or (
        kind == "outer" and len(rest) == 2) or (
        kind == "overlap" and len(rest) == 1 and rest[0].isdigit())
    if not ok:
        raise SystemExit(f"--variants: {variant!r} is not base, linear:F, cosine:F, "
                         f"outer:LR:M or overlap:T")
    return variant


def run_rank(variant: str, sync_every: int, steps: int, lr: float, size: str, every: int):
    import copy

    import torch
    import torch.distributed as dist
    from _e2e_model import MarkovText, lm_loss, make_model
    from _e2e_worker import _evaluate

    import bagua_algos
    import bagua_comm as bc
    from bagua_comm.compression import MinMaxUInt4

    rank, world = bc.get_rank(), bc.get_world_size()
    data = MarkovText(size)
    train = data.batches(256, 8, seed=1000 + rank)
    evalset = data.batches(4, 32, seed=7)
    model = make_model(size, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    if variant == "ddp":
        algo = bagua_algos.Algorithm.init("gradient_allreduce", hierarchical=False)
    else:
        olr, om = _outer(variant)
        algo = bagua_algos.Algorithm.init(
            "diloco", sync_every=sync_every, outer_lr=olr, outer_momentum=om, nesterov=om > 0,
            overlap_steps=_overlap(variant), compressor=MinMaxUInt4(world, error_feedback=True))
    wrapped = bagua_algos.with_bagua(model, [opt], algo)
    harness = dist.new_group(backend="gloo")
    factor = _schedule(variant, sync_every)
    curve, ranks_curve = [], []
    for step in range(1, steps + 1):
        for g in opt.param_groups:
            g["lr"] = lr * factor(step - 1)
        x, y = train[(step - 1) % len(train)]
        opt.zero_grad(set_to_none=True)
        lm_loss(wrapped(x), y).backward()
        opt.step()
        tau = _overlap(variant)
        applied = step >= sync_every + tau and (step - tau) % sync_every == 0
        if step % every == 0 or (variant != "ddp" and applied):
            with torch.no_grad():
                t = torch.tensor([_evaluate(model, evalset)])
            dist.all_reduce(t, group=harness)        # the mean over the ranks' models
            if tau and applied:     # the synced model, as the main job scores a hiding row
                ranks_curve.append((step, float(t) / world))
                twin = copy.deepcopy(model)
                twin.load_state_dict(wrapped.synced_state_dict())
                with torch.no_grad():
                    t = torch.tensor([_evaluate(twin, evalset)])
            curve.append((step, float(t) / world if not (tau and applied) else float(t)))
    wrapped.detach_algorithm()
    return curve, ranks_curve


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--ddp-steps", type=int, default=80, help="N: the target is DDP's loss "
                    "after N steps")
    ap.add_argument("--sync-every", default="55,75", help="H values")
    ap.add_argument("--max-x", type=float, default=2.0, help="each row runs whole sync "
                    "periods up to this many times N steps (at least two periods)")
    ap.add_argument("--variants", default="base,linear:0.1,cosine:0.1,outer:1.0:0.0")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--size", default="small")
    ap.add_argument("--quick", action="store_true", help="2 ranks, N=8, H=6, base and overlap:2")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.ranks, args.ddp_steps, args.sync_every = 2, 8, "6"
        args.variants = "base,overlap:2"
    hs = [int(h) for h in args.sync_every.split(",") if h.strip()]
    variants = [_check(v) for v in args.variants.split(",") if v.strip()]
    if args.ranks < 2 or args.ddp_steps < 1 or not hs or min(hs) < 1:
        ap.error("--ranks must be >= 2, --ddp-steps and every --sync-every >= 1")
    from bagua_comm.testing import run_ranks

    every = max(1, args.ddp_steps // 16)
    ddp = run_ranks(run_rank, args.ranks, args=("ddp", 1, args.ddp_steps, args.lr, args.size,
                                                every), timeout=3600)[0][0]
    target = ddp[-1][1]
    print(f"DDP ({args.ranks} ranks): held-out loss {target:.4f} after {args.ddp_steps} steps "
          f"(the target)", flush=True)
    rows = []
    for h in hs:
        periods = max(2, math.floor(args.max_x * args.ddp_steps / h))
        for v in variants:
            tau = _overlap(v)
            if tau >= h:
                ap.error(f"--variants {v}: T must be < every --sync-every ({h})")
            curve, ranks_curve = run_ranks(
                run_rank, args.ranks, args=(v, h, periods * h + tau, args.lr, args.size, every),
                timeout=3600)[0]
            syncs = [(s, loss) for s, loss in curve if s >= h + tau and (s - tau) % h == 0]
            reached = next((s for s, loss in syncs if loss <= target), None)
            rows.append({"sync_every": h, "variant": v, "syncs": syncs, "curve": curve,
                         "ranks_curve": ranks_curve,
                         "reached_at": reached,
                         "steps_x_ddp": None if reached is None else reached / args.ddp_steps})
            print(f"H={h:4d} {v:16s} at syncs: "
                  + "  ".join(f"{s}: {loss:.4f}" for s, loss in syncs)
                  + f"  -> {'reached at step ' + str(reached) if reached else 'not reached'}"
                  + ("  (the anchor's loss; the ranks' own models: "
                     + "  ".join(f"{s}: {loss:.4f}" for s, loss in ranks_curve) + ")"
                     if ranks_curve else ""),
                  flush=True)
    result = {"ranks": args.ranks, "ddp_steps": args.ddp_steps, "target": target,
              "ddp_curve": ddp, "rows": rows, "lr": args.lr, "size": args.size}
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
