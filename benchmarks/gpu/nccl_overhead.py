#!/usr/bin/env python3
"""Per-call overhead of bagua_comm's NCCL path against torch.distributed's NCCL, one rank.

One process, one GPU, a one-rank NCCL communicator on each side (bagua_comm's own binding,
and torch's ProcessGroupNCCL), the same preallocated tensors.  For each primitive and size it
times ``reps`` back-to-back calls followed by one synchronisation (host clock: what a training
loop pays per call) and prints both, their difference in microseconds and the ratio
(ours / torch).  The small sizes are the per-call overhead; the large ones show that the GPU
work is the same.  Target (issue 12): at most 5 us over torch per call.

    python benchmarks/gpu/nccl_overhead.py [--quick]
    python benchmarks/gpu/nccl_overhead.py --profile   # where our per-call time goes (cProfile)
Without CUDA it prints why it is skipped and exits 0.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
import torch.distributed as dist
from _common import add_results_options, device, host_timed, record, started, table
from _pg import init_one_rank, shutdown

import bagua_comm as bc


def calls(name, n, dev):
    if name == "allreduce":
        t = torch.ones(n, device=dev)
        return partial(bc.allreduce_inplace, t), partial(dist.all_reduce, t)
    if name == "broadcast":
        t = torch.ones(n, device=dev)
        return partial(bc.broadcast, t, 0), partial(dist.broadcast, t, 0)
    if name == "allgather":
        s, r = torch.ones(n, device=dev), torch.empty(n, device=dev)
        return partial(bc.allgather, s, r), partial(dist.all_gather_into_tensor, r, s)
    s, r = torch.ones(n, device=dev), torch.empty(n, device=dev)
    return partial(bc.reduce_scatter, s, r), partial(dist.reduce_scatter_tensor, r, s)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile 2000 of our 4-byte allreduces: the host functions that take "
                         "the per-call time, instead of the table")
    add_results_options(ap)
    args = ap.parse_args(argv)
    start = started()
    dev = device(allow_cpu=False)
    if dev is None:
        return
    backend = init_one_rank()
    assert backend == "nccl", backend
    from bagua_comm import _nccl_loader

    print(f"bagua_comm libnccl {_nccl_loader.nccl_version()} at "
          f"{_nccl_loader.nccl_library_path()}; torch NCCL {torch.cuda.nccl.version()}")
    if args.profile:
        import cProfile
        import pstats

        ours, _theirs = calls("allreduce", 1, dev)
        host_timed(ours, dev, 200)
        prof = cProfile.Profile()
        prof.runcall(host_timed, ours, dev, 400)        # 5 rounds of 400 calls
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        shutdown()
        return
    sizes = [1, 1024, 1 << 18] if args.quick else [1, 256, 4096, 1 << 16, 1 << 20, 1 << 24]
    reps = 200 if args.quick else 1000
    rows = []
    for name in ("allreduce", "broadcast", "allgather", "reduce_scatter"):
        for n in sizes:
            ours, theirs = calls(name, n, dev)
            t_o = host_timed(ours, dev, reps)
            t_t = host_timed(theirs, dev, reps)
            rows.append([name, n * 4, t_t * 1e6, t_o * 1e6, (t_o - t_t) * 1e6, t_o / t_t])
    header = ["primitive", "bytes", "torch us", "ours us", "ours - torch us", "ours / torch"]
    table(rows, header)
    record(args, "nccl_overhead.py", header, rows, start, argv)
    print("target: ours - torch <= 5 us per call")
    shutdown()


if __name__ == "__main__":
    main()
