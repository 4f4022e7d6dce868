"""bagua_comm against its peers, measured in the same run.

1. Collectives, nccl-tests style: for allreduce, allgather, reduce_scatter and alltoall on 2
   gloo ranks (spawned processes), size, time, algbw and busbw of bagua_comm's primitive and
   of torch.distributed's own call on the same buffers, and the time ratio (ours / torch;
   1.00 means no overhead).  Rounds alternate between the two; each figure is the median over
   rounds of the mean time per call.  ``size`` is the larger buffer (nccl-tests' convention),
   ``algbw = size / time``, ``busbw = algbw * 2(n-1)/n`` for allreduce and ``(n-1)/n`` for
   the others.
2. MinMaxUInt8 on one thread: compress and decompress throughput (GB/s of float32 data) of
   the Cython kernels against the same computation written with torch ops (same bytes,
   checked), and against a plain copy of the same bytes (the faster of ``Tensor.copy_`` and
   ``numpy.copyto``: the memory limit).
3. MinMaxUInt4 on one thread: compress, decompress and the round trip (compress then
   decompress) as a fraction of the same copy's bandwidth (target >= 50%).

    python benchmarks/micro/comm.py            # 4 KiB .. 64 MiB, 64 MiB compression input
    python benchmarks/micro/comm.py --quick    # well under a minute
    python benchmarks/micro/comm.py --compression-only   # 2. and 3. only
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import bagua_comm as bc
from bagua_comm.compression import HEADER_BYTES, MinMaxUInt4, MinMaxUInt8, record_bytes
from bagua_comm.testing import run_ranks

sys.path.append(str(Path(__file__).resolve().parents[1]))  # benchmarks/
import _results

PRIMITIVES = ["allreduce", "allgather", "reduce_scatter", "alltoall"]
_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_rscatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _calls(name, nbytes, world):
    """(ours, torch) zero-argument callables on preallocated float32 buffers of ``nbytes``."""
    n = nbytes // 4
    if name == "allreduce":
        t = torch.ones(n)
        return (lambda: bc.allreduce_inplace(t)), (lambda: dist.all_reduce(t))
    if name == "allgather":
        send, recv = torch.ones(n // world), torch.empty(n)
        return (lambda: bc.allgather(send, recv)), (lambda: _gather(recv, send))
    if name == "reduce_scatter":
        send, recv = torch.ones(n), torch.empty(n // world)
        return (lambda: bc.reduce_scatter(send, recv)), (lambda: _rscatter(recv, send))
    send, recv = torch.ones(n), torch.empty(n)
    return (lambda: bc.alltoall(send, recv)), (lambda: dist.all_to_all_single(recv, send))


def _time(fn, iters):
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def _overhead(rounds):
    """Per-call cost on this rank's own one-rank group (no network: what remains is the
    software path), ours vs torch's, for each primitive at 4 KiB."""
    singles = [bc.new_group([r]) for r in range(bc.get_world_size())]
    g = singles[bc.get_rank()]
    t = torch.ones(1024)
    out = torch.empty(1024)
    pairs = {
        "allreduce": (lambda: bc.allreduce_inplace(t, group=g),
                      lambda: dist.all_reduce(t, group=g.torch_group)),
        "allgather": (lambda: bc.allgather(t, out, group=g),
                      lambda: _gather(out, t, group=g.torch_group)),
        "reduce_scatter": (lambda: bc.reduce_scatter(t, out, group=g),
                           lambda: _rscatter(out, t, group=g.torch_group)),
        "alltoall": (lambda: bc.alltoall(t, out, group=g),
                     lambda: dist.all_to_all_single(out, t, group=g.torch_group)),
    }
    res = {}
    for name, (ours, theirs) in pairs.items():
        t_o, t_t = [], []
        for _ in range(rounds):
            for fn, acc in ((ours, t_o), (theirs, t_t)):
                start = time.perf_counter()
                for _ in range(300):
                    fn()
                acc.append((time.perf_counter() - start) / 300)
        res[name] = (statistics.median(t_o), statistics.median(t_t))
    return res


def _collectives(sizes, rounds, budget_bytes):
    world = bc.get_world_size()
    overhead = _overhead(rounds)
    rows = []
    for name in PRIMITIVES:
        for nbytes in sizes:
            ours, theirs = _calls(name, nbytes, world)
            iters = max(2, min(200, budget_bytes // nbytes))
            ours(), theirs()  # warm up (connections, allocations)
            t_ours, t_theirs = [], []
            for r in range(rounds):
                pair = [(ours, t_ours), (theirs, t_theirs)]
                for fn, acc in (pair if r % 2 == 0 else pair[::-1]):
                    acc.append(_time(fn, iters))
            rows.append((name, nbytes, statistics.median(t_ours), statistics.median(t_theirs)))
    return rows, overhead


def _fmt_size(n):
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n // div} {unit}"
    return f"{n} B"


def print_overhead(overhead):
    print("\n# Software overhead per call: one-rank group, 4 KiB, in-process (no network)")
    for name, (t_o, t_t) in overhead.items():
        print(f"{name:<15} ours {t_o * 1e6:7.1f} us   torch {t_t * 1e6:7.1f} us   "
              f"difference {(t_o - t_t) * 1e6:+6.1f} us")


def print_collectives(rows, world):
    print(f"\n# Collectives, {world} gloo ranks, float32; ours = bagua_comm, torch = "
          "torch.distributed (gloo)")
    print(f"{'primitive':<15}{'size':>9} | {'ours us':>10}{'algbw':>8}{'busbw':>8} | "
          f"{'torch us':>10}{'algbw':>8}{'busbw':>8} | {'ours/torch':>10}")
    for name, nbytes, t_o, t_t in rows:
        factor = 2 * (world - 1) / world if name == "allreduce" else (world - 1) / world
        alg_o, alg_t = nbytes / t_o / 1e9, nbytes / t_t / 1e9
        print(f"{name:<15}{_fmt_size(nbytes):>9} | {t_o * 1e6:>10.1f}{alg_o:>8.3f}"
              f"{alg_o * factor:>8.3f} | {t_t * 1e6:>10.1f}{alg_t:>8.3f}{alg_t * factor:>8.3f} | "
              f"{t_o / t_t:>10.3f}")
    big = [t_o / t_t for _, nbytes, t_o, t_t in rows if nbytes >= 1 << 20]
    if big:
        print(f"geometric mean ours/torch at >= 1 MiB: "
              f"{statistics.geometric_mean(big):.3f} (target <= 1.05)")


# -- compression ------------------------------------------------------------------------------
_255 = torch.tensor(255.0)


def torch_compress(x, chunks):
    """The MinMaxUInt8 format written with torch ops (vectorised over chunks)."""
    m = x.numel() // chunks
    v = x.view(chunks, m)
    mn = v.amin(1, keepdim=True) + 0.0
    mx = v.amax(1, keepdim=True) + 0.0
    scale = _255.div(mx - mn + 1e-7)  # not 255.0 / t: torch computes that as 255 * (1 / t)
    upper = torch.round(mx * scale)
    lower = upper - 255.0
    q = torch.minimum(torch.round(v * scale), upper).sub_(lower).clamp_(0, 255).to(torch.uint8)
    rec = record_bytes(m)
    payload = torch.zeros(chunks, rec, dtype=torch.uint8)
    payload[:, :8] = torch.cat([mn, mx], dim=1).view(torch.uint8)
    payload[:, HEADER_BYTES:HEADER_BYTES + m] = q
    return payload.view(-1)


def torch_decompress(payload, out, chunks):
    m = out.numel() // chunks
    rows = payload.view(chunks, record_bytes(m))
    mm = rows[:, :8].contiguous().view(torch.float32)
    mn, mx = mm[:, :1], mm[:, 1:]
    scale = _255.div(mx - mn + 1e-7)
    lower = torch.round(mx * scale) - 255.0
    out.view(chunks, m).copy_((rows[:, HEADER_BYTES:HEADER_BYTES + m].float() + lower) / scale)
    return out


def _interleaved(fns, reps):
    """Median time of each callable, measured round-robin so load changes hit all alike."""
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def compression(nbytes, chunks, reps):
    import numpy as np

    torch.set_num_threads(1)
    x = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(0))
    c = MinMaxUInt8(chunks)
    payload = c.compress(x)
    same = torch.equal(payload, torch_compress(x, chunks))
    buf = torch.empty_like(payload)
    out, copy_dst = torch.empty_like(x), torch.empty_like(x)
    copy_dst.copy_(x), out.zero_()  # touch every page first
    xn, dn = x.numpy(), copy_dst.numpy()
    t = _interleaved({
        "compress (ours)": lambda: c.compress(x),
        "compress (ours, out=)": lambda: c.compress(x, out=buf),
        "compress (torch ops)": lambda: torch_compress(x, chunks),
        "decompress (ours)": lambda: c.decompress(payload, out),
        "decompress (torch ops)": lambda: torch_decompress(payload, out, chunks),
        "copy (Tensor.copy_)": lambda: copy_dst.copy_(x),
        "copy (numpy.copyto)": lambda: np.copyto(dn, xn),
    }, reps)
    gbs = {k: nbytes / v / 1e9 for k, v in t.items()}
    print(f"\n# MinMaxUInt8, one thread, {_fmt_size(nbytes)} of float32 in {chunks} chunks "
          f"(identical bytes to the torch-ops version: {'yes' if same else 'NO'}); "
          f"medians of {reps} interleaved rounds")
    for k, v in gbs.items():
        print(f"{k:<26}{v:>8.2f} GB/s")
    mc = max(gbs["copy (Tensor.copy_)"], gbs["copy (numpy.copyto)"])  # the faster copy
    print(f"compress: ours / torch ops = {gbs['compress (ours)'] / gbs['compress (torch ops)']:.2f}x"
          f" (target >= 3); ours / memcpy = {gbs['compress (ours)'] / mc:.0%} (target >= 30%)"
          f"; with out=: {gbs['compress (ours, out=)'] / mc:.0%}")
    print(f"decompress: ours / torch ops = "
          f"{gbs['decompress (ours)'] / gbs['decompress (torch ops)']:.2f}x; "
          f"ours / memcpy = {gbs['decompress (ours)'] / mc:.0%}")
    return gbs


def compression4(nbytes, chunks, reps):
    """MinMaxUInt4 on one thread: compress, decompress and the round trip against a copy of
    the same bytes (the faster of ``Tensor.clone``-style ``copy_`` and ``numpy.copyto``)."""
    import numpy as np

    torch.set_num_threads(1)
    x = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(0))
    c = MinMaxUInt4(chunks)
    ef = MinMaxUInt4(chunks, error_feedback=True)    # DiLoCo's outer gradient, as recommend runs it
    buf = torch.empty(c.payload_numel(x.numel()), dtype=torch.uint8)
    payload = c.compress(x)
    out, copy_dst = torch.empty_like(x), torch.empty_like(x)
    copy_dst.copy_(x), out.zero_()  # touch every page first
    xn, dn = x.numpy(), copy_dst.numpy()
    t = _interleaved({
        "compress (out=)": lambda: c.compress(x, out=buf),
        "compress, EF (out=)": lambda: ef.compress(x, out=buf),
        "decompress": lambda: c.decompress(payload, out),
        "copy (Tensor.copy_)": lambda: copy_dst.copy_(x),
        "copy (numpy.copyto)": lambda: np.copyto(dn, xn),
    }, reps)
    gbs = {k: nbytes / v / 1e9 for k, v in t.items()}
    print(f"\n# MinMaxUInt4, one thread, {_fmt_size(nbytes)} of float32 in {chunks} chunks; "
          f"medians of {reps} interleaved rounds")
    for k, v in gbs.items():
        print(f"{k:<26}{v:>8.2f} GB/s")
    mc = max(gbs["copy (Tensor.copy_)"], gbs["copy (numpy.copyto)"])
    trip = nbytes / (t["compress (out=)"] + t["decompress"]) / 1e9
    print(f"compress / memcpy = {gbs['compress (out=)'] / mc:.0%}; decompress / memcpy = "
          f"{gbs['decompress'] / mc:.0%}; compress + decompress (one round trip) = "
          f"{trip:.2f} GB/s = {trip / mc:.0%} of memcpy (target >= 50%)")
    # error feedback: the residual added, the payload decoded again, the new residual and its
    # non-finite chunks reset, on top of the plain compress (at least one decode and two passes)
    print(f"compress with error feedback: {t['compress, EF (out=)'] / t['compress (out=)']:.2f}x "
          f"the plain compress's time")
    return {**gbs, "round trip": trip}


def figures(world, rows=None, overhead=None, uint8=None, uint4=None) -> dict:
    """What docs/results.json keeps of a run (benchmarks/_results.py): per collective and size
    both times and ours as a multiple of torch's (< 1: faster); the per-call overhead; each
    compressor's GB/s and its time as a multiple of the faster copy's and of torch ops'."""
    out: dict = {"world": world}
    if rows:
        out["collectives"] = {f"{name} | {_fmt_size(nbytes)}": {
            "bytes": nbytes, "ours_us": t_o * 1e6, "torch_us": t_t * 1e6,
            "x_torch_time": t_o / t_t} for name, nbytes, t_o, t_t in rows}
    if overhead:
        out["overhead_us"] = {name: {"ours": t_o * 1e6, "torch": t_t * 1e6,
                                     "difference": (t_o - t_t) * 1e6}
                              for name, (t_o, t_t) in overhead.items()}
    for key, gbs, ours in (("uint8", uint8, ("compress (ours)", "decompress (ours)")),
                           ("uint4", uint4, ("compress (out=)", "compress, EF (out=)",
                                             "decompress", "round trip"))):
        if not gbs:
            continue
        copy = max(gbs["copy (Tensor.copy_)"], gbs["copy (numpy.copyto)"])
        entry = {"gbs": dict(gbs), "x_copy_time": {k: copy / gbs[k] for k in ours}}
        if key == "uint8":
            entry["x_torch_ops_time"] = {
                k: gbs[k.replace("(ours)", "(torch ops)")] / gbs[k] for k in ours}
        out[key] = entry
    return _results.rounded(out, 4)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes, few rounds (< 1 minute)")
    p.add_argument("--world", type=int, default=2, help="gloo ranks (default 2)")
    p.add_argument("--compression-only", action="store_true",
                   help="only the compressors' throughput (no collectives)")
    _results.add_options(p)
    args = p.parse_args(argv)
    start = _results.started()
    if args.quick:
        sizes = [4 << 10, 64 << 10, 1 << 20, 4 << 20]
        rounds, budget, comp_bytes, reps = 5, 8 << 20, 16 << 20, 5
    else:
        sizes = [4 << 10 << (2 * i) for i in range(8)]  # 4 KiB .. 64 MiB
        rounds, budget, comp_bytes, reps = 9, 64 << 20, 64 << 20, 11
    rows = overhead = None
    if not args.compression_only:
        rows, overhead = run_ranks(_collectives, args.world, args=(sizes, rounds, budget),
                                   timeout=1800)[0]
        print_collectives(rows, args.world)
        print_overhead(overhead)
    uint8 = compression(comp_bytes, chunks=args.world * 4, reps=reps)
    uint4 = compression4(comp_bytes, chunks=args.world * 4, reps=reps)
    _results.record_from_args(args, "benchmarks/micro/comm.py",
                              figures(args.world, rows, overhead, uint8, uint4), argv, start)


if __name__ == "__main__":
    main()
