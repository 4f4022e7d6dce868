#!/usr/bin/env python3
"""MinMaxUInt8 and MinMaxUInt4 on the GPU: compress/decompress throughput against the device's
copy bandwidth.

In the same run it measures ``dst.copy_(src)`` on float32 tensors of the same size (the
memory-bandwidth reference: bytes read + written per second), then the CuPy kernels, and
prints each kernel's memory traffic per second (compress reads 4 B/element and writes ~1, or
~0.5 at 4 bits; decompress the reverse) as a fraction of that copy bandwidth.  Target: >= 0.60
for the 8-bit CuPy kernels, >= 0.50 for the 4-bit compressor (torch operations on CUDA).  It
also checks, on every size, that the GPU bytes equal the CPU (Cython) kernels' bytes.

    python benchmarks/gpu/minmax.py            # 16M and 64M floats, chunks 1..4096
    python benchmarks/gpu/minmax.py --quick    # one size, few chunk counts
    python benchmarks/gpu/minmax.py --bits 4   # the 4-bit compressor only
Without CUDA it runs the CPU kernels on a small size (a smoke run, not GPU figures).
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
from _common import add_results_options, device, record, started, table, timed

from bagua_comm.compression import MinMaxUInt4, MinMaxUInt8

COMPRESSORS = {8: (MinMaxUInt8, 0.60), 4: (MinMaxUInt4, 0.50)}   # class, target x copy bw


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sizes", default=None, help="comma list of element counts")
    ap.add_argument("--chunks", default=None, help="comma list of chunk counts")
    ap.add_argument("--bits", default="8,4", help="comma list of 8 and/or 4")
    add_results_options(ap)
    args = ap.parse_args(argv)
    start = started()
    dev = device(allow_cpu=True)
    gpu = dev.type == "cuda"
    if args.sizes:
        sizes = [int(s) for s in args.sizes.split(",")]
    else:
        sizes = [1 << 24] if args.quick else [1 << 24, 1 << 26]
        sizes = sizes if gpu else [1 << 20]
    if args.chunks:
        chunk_counts = [int(c) for c in args.chunks.split(",")]
    else:
        # 512 chunks of 16M floats: 32K elements each, the one-launch kernel; fewer: two
        chunk_counts = [1, 8, 64, 512] if args.quick else [1, 2, 8, 64, 512, 4096]
    reps = 20 if gpu else 3
    bits = [int(b) for b in args.bits.split(",")]
    if any(b not in COMPRESSORS for b in bits):
        ap.error(f"--bits takes 8 and/or 4, got {args.bits!r}")
    rows, worst = [], {b: None for b in bits}
    for n in sizes:
        g = torch.Generator().manual_seed(n)
        host = torch.randn(n, generator=g) * 3
        x = host.to(dev)
        dst = torch.empty_like(x)
        copy = timed(partial(dst.copy_, x), dev, reps)
        copy_bw = 2 * 4 * n / copy
        rows.append([n, "-", "copy (reference)", copy * 1e3, copy_bw / 1e9, 1.0, "-"])
        for b in bits:
            cls = COMPRESSORS[b][0]
            for chunks in chunk_counts:
                if n % cls(chunks).alignment(chunks):
                    continue
                c = cls(chunks)
                payload = c.compress(x)
                out = torch.empty_like(x)
                same = "-"
                if gpu:
                    cpu_bytes = c.compress(host)
                    same = "yes" if torch.equal(payload.cpu(), cpu_bytes) else "NO"
                t_c = timed(partial(c.compress, x, out=payload), dev, reps)
                t_d = timed(partial(c.decompress, payload, out), dev, reps)
                traffic = 4 * n + payload.numel()
                for name, t in (("compress", t_c), ("decompress", t_d)):
                    frac = traffic / t / copy_bw
                    worst[b] = frac if worst[b] is None else min(worst[b], frac)
                    rows.append([n, chunks, f"{b}-bit {name}", t * 1e3, traffic / t / 1e9,
                                 frac, same])
    header = ["elements", "chunks", "kernel", "ms", "GB/s traffic", "x copy bw", "bytes = CPU"]
    table(rows, header)
    record(args, "minmax.py", header, rows, start, argv)
    for b in bits:
        print(f"target: every {b}-bit kernel >= {COMPRESSORS[b][1]:.2f} x copy bandwidth; "
              f"worst here {worst[b]:.2f}" + ("" if gpu else "  (CPU smoke run)"))


if __name__ == "__main__":
    main()
