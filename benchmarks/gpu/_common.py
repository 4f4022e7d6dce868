"""Shared helpers of the GPU benchmarks: device choice, timing, table printing, recording."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # benchmarks/
import _results

add_results_options = _results.add_options
started = _results.started


def device(allow_cpu: bool) -> torch.device | None:
    """``cuda`` when there is a GPU; else ``cpu`` if the script can run there (with a note),
    else None after printing why it is skipped."""
    if torch.cuda.is_available():
        print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__} "
              f"CUDA {torch.version.cuda}")
        return torch.device("cuda")
    if allow_cpu:
        print("device: CPU (no CUDA here): a smoke run, NOT GPU figures")
        return torch.device("cpu")
    print("skipped: needs CUDA (no GPU here)")
    return None


def sync(dev) -> None:
    if getattr(dev, "type", dev) == "cuda":
        torch.cuda.synchronize()


def timed(fn, dev, reps: int, rounds: int = 5) -> float:
    """Median over ``rounds`` of the mean seconds per call of ``fn`` (``reps`` calls)."""
    fn()
    sync(dev)
    out = []
    for _ in range(rounds):
        if getattr(dev, "type", dev) == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(reps):
                fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / 1000 / reps)
        else:
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            out.append((time.perf_counter() - t0) / reps)
    return statistics.median(out)


def host_timed(fn, dev, reps: int, rounds: int = 5) -> float:
    """Like :func:`timed`, by the host clock around ``reps`` calls and one synchronisation."""
    fn()
    sync(dev)
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync(dev)
        out.append((time.perf_counter() - t0) / reps)
    return statistics.median(out)


def table(rows: list[list], header: list[str]) -> None:
    cells = [header] + [[c if isinstance(c, str) else f"{c:.3g}" if isinstance(c, float)
                         else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for i, r in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    sys.stdout.flush()


def record(args, script: str, header: list[str], rows: list[list], start: dict,
           argv=None) -> None:
    """With ``--results``: the table's rows (one dict per row, keyed by the header) and the
    device into docs/results.json or the given file (benchmarks/_results.py)."""
    gpu = torch.cuda.is_available()
    figures = {"device": torch.cuda.get_device_name() if gpu else "CPU (smoke run, not GPU "
               "figures)", "cuda": torch.version.cuda if gpu else None,
               "rows": [dict(zip(header, r)) for r in rows]}
    _results.record_from_args(args, f"benchmarks/gpu/{script}", _results.rounded(figures, 4),
                              argv, start)
