#!/usr/bin/env python3
"""bagua-algos against PyTorch DDP (gloo) on 2 ranks over loopback, in the same run.

    python benchmarks/micro/algos.py            # every model size, bytes table on the 2.4M MLP
    python benchmarks/micro/algos.py --quick    # the two small sizes, a few steps (under a minute)
    python benchmarks/micro/algos.py --sizes large --algorithms ""   # one size, step time only

Prints, for ``with_bagua(GradientAllReduce())`` and ``DistributedDataParallel`` at each model
size of ``--sizes`` (small 0.11M, quick 0.40M, base 2.37M, large 20.4M parameters), the median
step time (forward + backward + optimizer step, measured in alternating rounds so both see
the same machine load) and their ratio; then, for every algorithm, the bytes each rank sends
per step as counted by bagua_comm.traffic, against DDP's (counted by a DDP comm hook that
records its buckets with the same ring-allreduce formula the comm layer uses).

By default each rank is its own node (``--local-world-size 1``), so hierarchical defaults
(ByteGrad, Decentralized, LowPrecisionDecentralized, QAdam) take their inter-node path.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # benchmarks/
import _results

# name: (width, depth, rounds) -- MLPs 256 -> width x depth -> 10.  A round is one DDP step
# and one GradientAllReduce step back to back (which goes first alternates); the ratio is the
# median over rounds of the pair's ratio, so a load that drifts (a shared machine) hits both.
SIZES = {"small": (224, 2, 300), "quick": (512, 2, 200), "base": (1024, 3, 80),
         "large": (2560, 4, 24)}
ALGORITHMS = ["gradient_allreduce", "bytegrad", "decentralized", "low_precision_decentralized",
              "async", "qadam"]


def _model(width: int, depth: int, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers, d = [], 256
    for _ in range(depth):
        layers += [torch.nn.Linear(d, width), torch.nn.ReLU()]
        d = width
    layers.append(torch.nn.Linear(d, 10))
    return torch.nn.Sequential(*layers)


def _data(batch: int, rank: int):
    g = torch.Generator().manual_seed(rank)
    return torch.randn(batch, 256, generator=g), torch.randint(0, 10, (batch,), generator=g)


def _step(model, opt, x, y):
    t0 = time.perf_counter()
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    return time.perf_counter() - t0


def _algorithm(name, opt):
    from bagua_algos import Algorithm, QAdam

    if name == "qadam":
        return QAdam(opt)
    if name == "async":
        return Algorithm.init("async", sync_interval_ms=50)
    return Algorithm.init(name)


def _optimizer(name, model):
    from bagua_algos import QAdamOptimizer

    if name == "qadam":
        return QAdamOptimizer(model.parameters(), lr=1e-3, warmup_steps=2)
    return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)


def _time_size(width, depth, batch, rounds, steps, warmup, x, y):
    """Median step time of DDP and GradientAllReduce on one model, in alternating rounds."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import bagua_comm as bc
    from bagua_algos import GradientAllReduce, with_bagua

    ddp_model = _model(width, depth)
    ddp = DistributedDataParallel(ddp_model, process_group=dist.group.WORLD)
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=1e-3, momentum=0.9)
    bg_model = _model(width, depth)
    bg_opt = torch.optim.SGD(bg_model.parameters(), lr=1e-3, momentum=0.9)
    bg = with_bagua(bg_model, [bg_opt], GradientAllReduce())
    for _ in range(warmup):
        _step(ddp, ddp_opt, x, y)
        _step(bg, bg_opt, x, y)
    times = {"ddp": [], "bagua": []}
    ratios, cpu_ratios = [], []
    for r in range(rounds):
        # alternate which one goes first, so neither always follows the other's traffic
        order = ("ddp", "bagua") if r % 2 == 0 else ("bagua", "ddp")
        this, cpu = {}, {}
        for which in order:
            model, opt = (ddp, ddp_opt) if which == "ddp" else (bg, bg_opt)
            bc.barrier()
            c0 = time.process_time()
            this[which] = [_step(model, opt, x, y) for _ in range(steps)]
            cpu[which] = time.process_time() - c0
            times[which] += this[which]
        # the two blocks of a round ran back to back, under the same load
        ratios.append(statistics.median(this["bagua"]) / statistics.median(this["ddp"]))
        cpu_ratios.append(cpu["bagua"] / max(cpu["ddp"], 1e-9))
    bg.detach_algorithm()
    return {**{k: statistics.median(v) for k, v in times.items()},
            "ratio": statistics.median(ratios), "cpu_ratio": statistics.median(cpu_ratios)}


def _rank_main(sizes, bytes_model, batch, steps_per_round, warmup, algorithms):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import bagua_comm as bc
    from bagua_algos import with_bagua

    rank = bc.get_rank()
    x, y = _data(batch, rank)
    out = {"time": {}}

    # -- step time at every size: DDP and GradientAllReduce in alternating rounds -------------
    for name, width, depth, size_rounds in sizes:
        out["time"][name] = _time_size(width, depth, batch, size_rounds, steps_per_round,
                                       warmup, x, y)
    width, depth, steps = bytes_model
    if not algorithms:
        return out

    # -- DDP's bytes per step, through a counting comm hook ------------------------------------
    counted = []

    def counting_allreduce(state, bucket):
        buf = bucket.buffer()
        n = dist.get_world_size()
        counted.append(2 * buf.numel() * buf.element_size() * (n - 1) / n)
        fut = dist.all_reduce(buf.div_(n), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    hooked = DistributedDataParallel(_model(width, depth), process_group=dist.group.WORLD)
    hooked.register_comm_hook(None, counting_allreduce)
    hooked_opt = torch.optim.SGD(hooked.parameters(), lr=1e-3)
    for _ in range(steps):
        _step(hooked, hooked_opt, x, y)
    out["bytes"] = {"ddp": sum(counted) / steps}

    # -- every algorithm's bytes per step, from bagua_comm.traffic -------------------------------
    for name in algorithms:
        model = _model(width, depth)
        opt = _optimizer(name, model)
        out.setdefault("params", sum(p.numel() for p in model.parameters()))
        wrapped = with_bagua(model, [opt], _algorithm(name, opt))
        for _ in range(3):                              # past warmups (QAdam: 2 steps)
            _step(wrapped, opt, x, y)
        bc.barrier()
        bc.traffic.reset()
        step_times = [_step(wrapped, opt, x, y) for _ in range(steps)]
        if name == "async":
            wrapped.abort()
        out["bytes"][name] = bc.traffic.bytes_sent() / steps
        out.setdefault("step", {})[name] = statistics.median(step_times)
        wrapped.detach_algorithm()
        bc.barrier()
    return out


def _params(width: int, depth: int) -> int:
    return sum(p.numel() for p in _model(width, depth).parameters())


def main(argv=None):
    from bagua_comm.testing import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="sizes small,quick; fewer rounds; bytes on the quick size")
    ap.add_argument("--sizes", default=None,
                    help=f"comma-separated model sizes to time, from {list(SIZES)} "
                         "(default: all; --quick: small,quick)")
    ap.add_argument("--width", type=int, default=None, help="bytes table's MLP width")
    ap.add_argument("--depth", type=int, default=None, help="bytes table's MLP depth")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=None,
                    help="steps per algorithm per round (default 1), and the bytes table's steps")
    ap.add_argument("--rounds", type=int, default=None,
                    help="rounds per size (default: per size, see SIZES; --quick: half)")
    ap.add_argument("--local-world-size", type=int, default=1,
                    help="ranks per emulated node (1: each rank is a node)")
    ap.add_argument("--algorithms", default=",".join(ALGORITHMS),
                    help="comma-separated registry names to count bytes for ('' for none)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    _results.add_options(ap)
    args = ap.parse_args(argv)
    start = _results.started()
    names = (args.sizes or ("small,quick" if args.quick else ",".join(SIZES))).split(",")
    names = [n for n in names if n]
    unknown = sorted(set(names) - set(SIZES))
    if unknown or not names:
        ap.error(f"--sizes must name one or more of {list(SIZES)}, got {args.sizes!r}")
    sizes = [(n, SIZES[n][0], SIZES[n][1],
              args.rounds or (SIZES[n][2] // 2 if args.quick else SIZES[n][2])) for n in names]
    bytes_size = SIZES["quick" if args.quick else "base"]
    width = args.width or bytes_size[0]
    depth = args.depth or bytes_size[1]
    bytes_steps = args.steps or (8 if args.quick else 20)
    steps_per_round = args.steps or 1
    algorithms = [a for a in args.algorithms.split(",") if a]
    unknown = sorted(set(algorithms) - set(ALGORITHMS))
    if unknown:
        ap.error(f"unknown algorithms {unknown}; choose from {ALGORITHMS}")
    res = run_ranks(_rank_main, 2,
                    args=(sizes, (width, depth, bytes_steps), args.batch, steps_per_round, 2,
                          algorithms),
                    local_world_size=args.local_world_size, threads=args.threads, timeout=1800)
    print(f"2 ranks, gloo over loopback, local_world_size={args.local_world_size}, batch "
          f"{args.batch}/rank, {args.threads} torch thread(s) per rank")
    print("\nstep time, DDP (gloo) vs with_bagua(GradientAllReduce()): median step times;\n"
          "ratio: median over rounds (one step of each, back to back) of bagua / DDP; "
          "CPU ratio: the same\nfor the process's CPU time (all its threads: the work each "
          "step costs, whatever the load); mean over ranks")
    print(f"  {'size':6s} {'MLP':>8s} {'params':>8s} {'DDP ms':>9s} {'bagua ms':>9s} "
          f"{'ratio':>7s} {'CPU ratio':>9s} {'rounds':>7s}")
    worst, figures = 0.0, {"step_time": {}}
    for name, w, d, n_rounds in sizes:
        t_ddp = statistics.mean(r["time"][name]["ddp"] for r in res)
        t_bg = statistics.mean(r["time"][name]["bagua"] for r in res)
        ratio = statistics.mean(r["time"][name]["ratio"] for r in res)
        cpu_ratio = statistics.mean(r["time"][name]["cpu_ratio"] for r in res)
        worst = max(worst, ratio)
        figures["step_time"][name] = {"mlp": f"{d}x{w}", "ddp_ms": t_ddp * 1e3,
                                      "bagua_ms": t_bg * 1e3, "x_ddp_time": ratio,
                                      "cpu_x_ddp_time": cpu_ratio, "rounds": n_rounds}
        print(f"  {name:6s} {f'{d}x{w}':>8s} {_params(w, d) / 1e6:7.2f}M {t_ddp * 1e3:9.2f} "
              f"{t_bg * 1e3:9.2f} {ratio:7.3f} {cpu_ratio:9.3f} {n_rounds:7d}")
    print(f"  worst ratio {worst:.3f}   (target <= 1.02 at every size)")
    if not algorithms:
        _results.record_from_args(args, "benchmarks/micro/algos.py", _results.rounded(figures, 4),
                                  argv, start)
        return
    r0 = res[0]
    print(f"\nbytes sent per rank per step (rank 0), MLP {depth}x{width} "
          f"({r0['params'] / 1e6:.2f} M params, {r0['params'] * 4 / 2**20:.1f} MiB fp32)")
    ddp_bytes = r0["bytes"]["ddp"]
    figures["bytes"] = {"mlp": f"{depth}x{width}", "ddp_bytes_per_step": ddp_bytes}
    print(f"  {'algorithm':30s} {'bytes/step':>14s} {'x DDP':>8s} {'step ms':>9s}")
    print(f"  {'DDP (gloo)':30s} {ddp_bytes:14,.0f} {1.0:8.3f} {'':>9s}")
    for name in algorithms:
        b = r0["bytes"][name]
        t = statistics.mean(r["step"][name] for r in res)
        note = "   (time-based: sync every 50 ms)" if name == "async" else ""
        print(f"  {name:30s} {b:14,.0f} {b / ddp_bytes:8.3f} {t * 1e3:9.2f}{note}")
        figures["bytes"][name] = {"bytes_per_step": b, "x_ddp_bytes": b / ddp_bytes,
                                  "step_ms": t * 1e3}
    print("  (step ms in this table: one round of steps per algorithm, noisier than above)")
    print("\ntargets: bytegrad and low_precision_decentralized <= 0.3 x DDP")
    _results.record_from_args(args, "benchmarks/micro/algos.py", _results.rounded(figures, 4),
                              argv, start)


if __name__ == "__main__":
    main()
