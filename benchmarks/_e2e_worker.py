"""torchrun worker of benchmarks/e2e.py: trains the workload with each algorithm in turn.

One process per emulated host.  For every algorithm it builds the same model (same seed),
measures compute-only step time on a private copy, wraps the model (torch DDP, or
``bagua_algos.with_bagua(model, [opt], Algorithm.init(name))``), warms up, then times
``--steps`` steps (then keeps training until ``--wall-seconds`` have passed, for the
loss-against-time curve).  Rank 0 writes ``<out>/<algorithm>.json``; progress goes to
``<out>/progress``.  An algorithm that bagua_algos does not register is written as
unavailable (every rank sees the same registry, so nobody waits on a collective).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _e2e_model import MarkovText, lm_loss, make_model, num_params


class Unavailable(Exception):
    """The algorithm cannot be built here (not installed / not registered yet)."""


def _counting_allreduce_hook(counter: list):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def hook(state, bucket):
        buf = bucket.buffer()
        world = dist.get_world_size()
        counter[0] += 2 * (world - 1) / world * buf.numel() * buf.element_size()
        return default_hooks.allreduce_hook(None, bucket)

    return hook


def _build(name: str, model, args, counter: list):
    """``(wrapped_model, optimizer)`` for ``name`` (raises :class:`Unavailable`)."""
    if name == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
        ddp = DistributedDataParallel(model)
        ddp.register_comm_hook(None, _counting_allreduce_hook(counter))
        return ddp, opt
    try:
        import bagua_algos
    except ImportError as err:
        raise Unavailable(f"bagua_algos is not installed ({err})") from err
    missing = [n for n in ("Algorithm", "with_bagua") if not hasattr(bagua_algos, n)]
    if missing:
        raise Unavailable(f"bagua_algos {bagua_algos.__version__} has no {', '.join(missing)} "
                          f"yet")
    kwargs = {}
    if name == "qadam":
        if not hasattr(bagua_algos, "QAdamOptimizer"):
            raise Unavailable("bagua_algos has no QAdamOptimizer yet")
        opt = bagua_algos.QAdamOptimizer(model.parameters(), lr=args.lr,
                                         warmup_steps=args.warmup + args.qadam_warmup)
        kwargs["q_adam_optimizer"] = opt
    else:
        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    try:
        algo = bagua_algos.Algorithm.init(name, **kwargs)
    except ValueError as err:
        if "unknown algorithm" in str(err):
            raise Unavailable("not in bagua_algos' registry yet (registered: "
                              f"{', '.join(getattr(bagua_algos.Algorithm, 'registered', list)())})"
                              ) from err
        raise
    return bagua_algos.with_bagua(model, [opt], algo), opt


def _compute_time(model, batches, steps: int = 3) -> float:
    """Seconds per forward+backward+step with no communication at all (a private copy)."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    times = []
    for i in range(steps + 1):
        x, y = batches[i % len(batches)]
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        lm_loss(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t)
    return sorted(times[1:])[len(times[1:]) // 2]


@torch.no_grad()
def _evaluate(model, batches) -> float:
    was = model.training
    model.eval()
    loss = sum(float(lm_loss(model(x), y)) for x, y in batches) / len(batches)
    model.train(was)
    return loss


def _tx_bytes(ifname: str | None) -> int:
    if not ifname:
        return 0
    return int(Path(f"/sys/class/net/{ifname}/statistics/tx_bytes").read_text())


def _accounted_bytes() -> int:
    try:
        from bagua_comm import traffic
    except ImportError:
        return 0
    return traffic.bytes_sent()


def _progress(args, name: str, step: int, total: int) -> None:
    if dist.get_rank() == 0:
        tmp = Path(args.out) / "progress.tmp"
        tmp.write_text(json.dumps({"algorithm": name, "step": step, "of": total}))
        tmp.replace(Path(args.out) / "progress")


def run_one(name: str, args, train, evalset, harness) -> dict:
    model = make_model(args.size, seed=args.seed)
    compute_s = _compute_time(copy.deepcopy(model), train)
    counter = [0.0]
    wrapped, opt = _build(name, model, args, counter)

    def step(x, y) -> float:
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(wrapped(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    total = args.warmup + args.steps
    for i in range(args.warmup):
        step(*train[i % len(train)])
        _progress(args, name, i + 1, total)
    dist.barrier(group=harness)
    tx0, acc0, ddp0 = _tx_bytes(args.ifname), _accounted_bytes(), counter[0]
    t0 = time.perf_counter()
    paused = 0.0
    times, losses = [], []
    rec: dict = {}
    i = 0
    target = args.steps
    while True:
        losses.append(step(*train[(args.warmup + i) % len(train)]))
        i += 1
        elapsed = time.perf_counter() - t0 - paused
        times.append(elapsed)
        if i == args.steps:
            rec["steps_s"] = elapsed
            rec["tx"] = _tx_bytes(args.ifname) - tx0
            rec["accounted"] = (counter[0] - ddp0) if name == "ddp" else (
                _accounted_bytes() - acc0)
            p = time.perf_counter()
            rec["eval_loss"] = _evaluate(model, evalset)
            # Keep training until --wall-seconds (for the loss-against-time curve); every
            # rank must run the same number of steps, so agree on it from the slowest rank.
            slowest = torch.tensor([elapsed], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=harness)
            per_step = float(slowest) / args.steps
            target = min(args.max_steps, max(args.steps, math.ceil(args.wall_seconds / per_step)))
            paused += time.perf_counter() - p
        if "eval_at_wall" not in rec and (elapsed >= args.wall_seconds or (
                i >= target and i >= args.steps)):
            # Held-out loss at wall time T (local, no collective: ranks may differ by a step).
            p = time.perf_counter()
            rec["eval_at_wall"] = _evaluate(model, evalset)
            rec["wall_reached"] = elapsed >= args.wall_seconds
            paused += time.perf_counter() - p
        if i <= args.steps:
            _progress(args, name, args.warmup + i, total)
        if i >= target:
            break
    if name == "async" and hasattr(wrapped, "abort"):
        wrapped.abort()
    rec.update(times=times, losses=losses, compute_s=compute_s)
    dist.barrier(group=harness)
    return rec


def _combine(name: str, recs: list[dict], args, params: int, world: int) -> dict:
    steps_s = max(r["steps_s"] for r in recs)
    step_s = steps_s / args.steps
    compute_s = max(r["compute_s"] for r in recs)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    wire = [r["tx"] / local / args.steps for r in recs] if args.ifname else None
    accounted = sum(r["accounted"] for r in recs) / len(recs) / args.steps
    n = min(len(r["times"]) for r in recs)
    curve = [[max(r["times"][k] for r in recs), sum(r["losses"][k] for r in recs) / len(recs)]
             for k in range(n)]


    return {
        "algorithm": name, "status": "ok", "reason": None, "world_size": world,
        "params": params,
        "samples_per_s": world * args.batch_size * args.steps / steps_s,
        "step_s": step_s, "compute_s": compute_s, "comm_s": max(0.0, step_s - compute_s),
        "bytes_per_step": (sum(wire) / len(wire)) if wire else accounted,
        "bytes_source": "wire" if wire else "accounted",
        "bytes_per_step_accounted": accounted,
        "loss": sum(r["eval_loss"] for r in recs) / len(recs),
        "train_loss": sum(c[1] for c in curve[max(0, args.steps - 5):args.steps]) / min(
            5, args.steps),
        "wall_s": args.wall_seconds,
        "loss_at_wall": sum(r["eval_at_wall"] for r in recs) / len(recs),
        "wall_reached": all(r["wall_reached"] for r in recs),
        "steps": args.steps, "steps_run": n,
        "loss_curve": curve[:: max(1, n // 200)],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--algorithms", required=True)
    ap.add_argument("--size", default="base")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--max-steps", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--wall-seconds", type=float, default=30.0)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--qadam-warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ifname", default="")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    try:
        import bagua_comm as bc
        bc.init_process_group(backend="gloo")
    except ImportError:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # The harness's own collectives never share a group with the algorithms' traffic
    # (AsyncModelAverage communicates from a background thread).
    harness = dist.new_group(backend="gloo")
    data = MarkovText(args.size)
    # Enough distinct batches that no run cycles through them often (no memorising).
    train = data.batches(256, args.batch_size, seed=1000 + rank)
    evalset = data.batches(4, 32, seed=7)
    out = Path(args.out)
    params = num_params(make_model(args.size, seed=args.seed))
    for name in args.algorithms.split(","):
        if rank == 0:
            (out / f"{name}.started").write_text(str(time.time()))
        try:
            rec = run_one(name, args, train, evalset, harness)
        except Unavailable as err:
            if rank == 0:
                (out / f"{name}.json").write_text(json.dumps(
                    {"algorithm": name, "status": "unavailable", "reason": str(err)}))
            continue
        except Exception:
            traceback.print_exc()
            raise
        recs = [None] * world
        dist.all_gather_object(recs, rec, group=harness)
        if rank == 0:
            result = _combine(name, recs, args, params, world)
            (out / f"{name}.json").write_text(json.dumps(result))
    dist.barrier(group=harness)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
