#!/usr/bin/env python3
"""Host work of one training step: torch DDP, every with_bagua algorithm, and DDP with bagua's
ByteGrad comm hook, counted exactly on CPU (2 gloo ranks), plus an overhead-bound timing.

    python benchmarks/micro/step_counts.py                      # counts + timing (~3 min)
    python benchmarks/micro/step_counts.py --no-timing          # counts only
    python benchmarks/micro/step_counts.py --json out.json      # also write the figures

Counts, per variant, over one training step (zero_grad, forward, backward, optimizer step),
as the wrapped step minus the same step of the unwrapped model on the same rank (with the same
optimizer: SGD with momentum, QAdamOptimizer for QAdam):

* ``buckets``: DDP's (``reducer._get_zeros_like_grad_buckets()``), bagua's ``len(buckets)``;
* ``ops``: aten and c10d ops seen by a ``TorchDispatchMode`` on every thread that runs during
  the step (the mode is pushed in each new thread, so bagua's worker threads count too; a
  compiled worker thread is handed a Python no-op to see the change of phase);
* ``calls``: Python function calls (``sys.setprofile`` / ``threading.setprofile`` "call"
  events, every thread);
* ``handoffs``: work handed to another thread (calls of ``ThreadPoolExecutor.submit``,
  ``Thread.start`` and ``queue`` ``put``, and jobs handed to bagua_comm's compiled worker
  threads, which make no Python call: ``bagua_comm._worker.handed_over()``).

Models: ``mlp`` (Linear 1024-256-256-256-256-10, 10 tensors) and ``t100`` (50 Linear(32, 32),
100 tensors); bucket size ``--bucket-kib`` (16 KiB) for both DDP (``bucket_cap_mb``) and
with_bagua (``bucket_size``).

Timing (``--timing``, default on): batch 1 through 40 Linear(64, 64) layers, at 1 and 2 ranks,
median step time (wall) and process CPU time per step (every thread; steadier than wall time
on a loaded machine) of each variant against DDP in rotating rounds, and the A/A band: the
same measurement of DDP against a second DDP (a variant's ratio inside it is no difference).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # benchmarks/
import _results

ALGORITHMS = ["gradient_allreduce", "bytegrad", "qadam", "decentralized",
              "low_precision_decentralized", "async", "topk", "low_rank", "diloco",
              "local_sgd"]
TIMED = ["gradient_allreduce", "bytegrad", "qadam", "ddp_hook"]
# the timed variant's peer, when it is not DDP stepping SGD: the same optimizer's math
PEER = {"qadam": "ddp_adam"}
_HANDOFF = {("submit", "thread.py"), ("start", "threading.py"), ("put", "queue.py")}


def make_model(name: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if name == "mlp":
        dims = [1024, 256, 256, 256, 256, 10]
    elif name == "t100":
        dims = [32] * 51
    elif name == "deep":                     # the overhead-bound timing model
        dims = [64] * 41
    else:
        raise ValueError(f"model must be mlp, t100 or deep, got {name!r}")
    layers = []
    for a, b in itertools.pairwise(dims):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _batch(model_name: str, batch: int, rank: int):
    g = torch.Generator().manual_seed(rank)
    d_in = {"mlp": 1024, "t100": 32, "deep": 64}[model_name]
    d_out = {"mlp": 10, "t100": 32, "deep": 64}[model_name]
    return torch.randn(batch, d_in, generator=g), torch.randint(0, d_out, (batch,), generator=g)


def _step(model, opt, x, y):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


# -- counting ---------------------------------------------------------------------------------
class _Counter:
    """Counts ops (one step, under a dispatch mode) and Python calls and hand-offs (another
    step, without it: the mode's own Python would count) on every thread."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                with counter.lock:
                    counter.ops += 1
                return func(*args, **(kwargs or {}))

        self.Mode = Mode
        self.lock = threading.Lock()
        self.phase = None                # "ops", "calls" or None
        self.ops = self.calls = self.handoffs = 0
        self._threads = threading.local()

    def _prof(self, frame, event, _arg):
        tls = self._threads
        # a worker thread follows the phase at its next event: the mode is on only for "ops"
        want = self.phase == "ops" and tls.worker
        if want != (tls.mode is not None):
            if want:
                tls.mode = self.Mode()
                tls.mode.__enter__()
            else:
                mode, tls.mode = tls.mode, None
                mode.__exit__(None, None, None)
        if event != "call" or self.phase != "calls":
            return
        code = frame.f_code
        with self.lock:
            self.calls += 1
            if (code.co_name, code.co_filename.rsplit("/", 1)[-1]) in _HANDOFF:
                self.handoffs += 1

    def _thread_entry(self, frame, event, arg):
        self._threads.worker = True
        self._threads.mode = None
        sys.setprofile(self._prof)
        self._prof(frame, event, arg)

    def install(self):
        """Before any worker thread exists: every later thread is counted."""
        threading.setprofile(self._thread_entry)

    def count(self, step):
        """Ops of one call of ``step``, Python calls and hand-offs of the next one."""
        try:
            from bagua_comm import _worker
        except ImportError:         # a tree before the compiled worker: nothing to add
            _worker = _NoWorker

        self._threads.worker = False
        self._threads.mode = None
        self.ops = self.calls = self.handoffs = 0
        self.phase = "ops"
        _poke(_worker)              # compiled workers enter the mode
        try:
            with self.Mode():
                step()
        finally:
            self.phase = None
        time.sleep(0.05)            # worker threads finish and leave the mode
        _poke(_worker)
        self.phase = "calls"
        handed = _worker.handed_over()
        sys.setprofile(self._prof)
        try:
            step()
        finally:
            sys.setprofile(None)
            self.phase = None
        time.sleep(0.05)
        # jobs handed to bagua_comm's compiled worker threads (no Python call to count)
        self.handoffs += _worker.handed_over() - handed
        return {"ops": self.ops, "calls": self.calls, "handoffs": self.handoffs}


def _noop():
    pass


class _NoWorker:
    @staticmethod
    def workers():
        return []

    @staticmethod
    def handed_over():
        return 0


def _poke(worker_module):
    """A Python no-op on each of bagua_comm's compiled worker threads: its loop makes no
    Python call, so the thread would otherwise see no profiling event, and so no change of
    phase, during a step."""
    for w in worker_module.workers():
        if not w.closed:
            w.submit(_noop).wait()


def _algorithm(name, opt):
    from bagua_algos import Algorithm, QAdam

    if name == "qadam":
        return QAdam(opt)
    if name == "async":
        return Algorithm.init("async", sync_interval_ms=10_000)
    return Algorithm.init(name)


def _optimizer_kind(name):
    return "qadam" if name == "qadam" else "sgd"


def _optimizer(name, model):
    from bagua_algos import QAdamOptimizer

    if name == "qadam":
        return QAdamOptimizer(model.parameters(), lr=1e-3, warmup_steps=2)
    return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)


def _variant(name, model_name, bucket_bytes):
    """(step callable, buckets, cleanup) for one variant."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from bagua_algos import with_bagua

    model = make_model(model_name)
    opt = _optimizer(name, model)
    if name in ("ddp", "ddp_hook", "ddp_b", "ddp_adam"):
        ddp = DistributedDataParallel(model, process_group=dist.group.WORLD,
                                      bucket_cap_mb=bucket_bytes / 2**20)
        opt = (torch.optim.Adam(ddp.parameters(), lr=1e-3) if name == "ddp_adam" else
               torch.optim.SGD(ddp.parameters(), lr=1e-3, momentum=0.9))
        if name == "ddp_hook":
            from bagua_algos.ddp_hooks import CompressionHookState, compressed_allreduce_hook

            ddp.register_comm_hook(CompressionHookState(), compressed_allreduce_hook)
        return ddp, opt, lambda: len(ddp.reducer._get_zeros_like_grad_buckets()), \
            lambda: None
    wrapped = with_bagua(model, [opt], _algorithm(name, opt), bucket_size=bucket_bytes)

    def close():
        if name == "async":
            wrapped.abort()
        wrapped.detach_algorithm()
    return wrapped, opt, lambda: len(wrapped.buckets), close


def _count_rank(counter_box, models, variants, bucket_bytes, warmup):
    import bagua_comm as bc

    counter = counter_box[0]
    out = {}
    for model_name in models:
        x, y = _batch(model_name, 8, bc.get_rank())
        bare = {}
        for kind in {_optimizer_kind(n) for n in variants}:     # the same optimizer's step
            base = make_model(model_name)
            base_opt = _optimizer(kind, base)
            for _ in range(warmup):
                _step(base, base_opt, x, y)
            bare[kind] = counter.count(functools.partial(_step, base, base_opt, x, y))
        rows = {}
        for name in variants:
            plain = bare[_optimizer_kind(name)]
            model, opt, buckets, close = _variant(name, model_name, bucket_bytes)
            for _ in range(warmup):
                _step(model, opt, x, y)
            bc.barrier()
            got = counter.count(functools.partial(_step, model, opt, x, y))
            rows[name] = {"buckets": buckets(), "ops": got["ops"] - plain["ops"],
                          "calls": got["calls"] - plain["calls"],
                          "handoffs": got["handoffs"] - plain["handoffs"]}
            close()
            bc.barrier()
        out[model_name] = rows
    return out


_COUNTER: list = []


def count_main(models, variants, bucket_bytes, warmup):
    return _count_rank(_COUNTER, models, variants, bucket_bytes, warmup)


def _install_counter():
    _COUNTER.append(_Counter())
    _COUNTER[0].install()


# -- timing -----------------------------------------------------------------------------------
def time_main(variants, rounds, steps, warmup):
    """Median step time per variant; each round runs DDP, a second DDP (A/A) and every
    variant back to back in a rotating order."""
    import bagua_comm as bc

    x, y = _batch("deep", 1, bc.get_rank())
    # QAdam's optimizer is Adam: its peer is DDP stepping torch's Adam, not SGD (whose step
    # is about half Adam's work on this model and made QAdam look 1.46x DDP's at 1 rank)
    refs = {n: PEER.get(n, "ddp") for n in variants}
    names = ["ddp", "ddp_b", *sorted(set(refs.values()) - {"ddp"}), *variants]
    built = {n: _variant(n, "deep", 1 << 20) for n in names}
    for n in names:
        for _ in range(warmup):
            _step(built[n][0], built[n][1], x, y)
    ratios = {n: [] for n in names if n != "ddp"}
    cpu_ratios = {n: [] for n in names if n != "ddp"}
    medians = {n: [] for n in names}
    cpus = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        this, cpu = {}, {}
        for n in order:
            model, opt = built[n][0], built[n][1]
            bc.barrier()
            ts = []
            c0 = time.process_time()
            for _ in range(steps):
                t0 = time.perf_counter()
                _step(model, opt, x, y)
                ts.append(time.perf_counter() - t0)
            cpu[n] = (time.process_time() - c0) / steps
            this[n] = statistics.median(ts)
            medians[n].append(this[n])
            cpus[n].append(cpu[n])
        for n in ratios:
            ref = refs.get(n, "ddp")
            ratios[n].append(this[n] / this[ref])
            cpu_ratios[n].append(cpu[n] / max(cpu[ref], 1e-9))
    for n in names:
        built[n][3]()
    out = {"step_ms": {n: 1e3 * statistics.median(v) for n, v in medians.items()},
           "cpu_ms": {n: 1e3 * statistics.median(v) for n, v in cpus.items()},
           "ratio": {n: statistics.median(v) for n, v in ratios.items()},
           "cpu_ratio": {n: statistics.median(v) for n, v in cpu_ratios.items()},
           "peer": {n: refs.get(n, "ddp") for n in ratios}}
    for key, src in (("aa_band", ratios), ("aa_band_cpu", cpu_ratios)):
        aa = sorted(src["ddp_b"])
        lo, hi = aa[len(aa) // 10], aa[-1 - len(aa) // 10]
        out[key] = [min(lo, 1 / hi), max(hi, 1 / lo)]
    return out


# -- main -------------------------------------------------------------------------------------
def _table(title, header, rows):
    print(f"\n{title}")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(str(c).rjust(w) if i else str(c).ljust(w)
                        for i, (c, w) in enumerate(zip(r, widths))))


def main(argv=None):
    from bagua_comm.testing import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="mlp,t100")
    ap.add_argument("--algorithms", default=",".join(ALGORITHMS))
    ap.add_argument("--bucket-kib", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--no-timing", dest="timing", action="store_false")
    ap.add_argument("--no-counts", dest="counts", action="store_false")
    ap.add_argument("--timed", default=",".join(TIMED), help="variants timed against DDP")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--steps", type=int, default=5, help="steps per variant per round")
    ap.add_argument("--json", default=None, help="write the figures to this file")
    _results.add_options(ap)
    args = ap.parse_args(argv)
    start = _results.started()
    models = [m for m in args.models.split(",") if m]
    variants = ["ddp", *[a for a in args.algorithms.split(",") if a], "ddp_hook"]
    result = {"bucket_bytes": args.bucket_kib * 1024, "argv": sys.argv[1:]}
    if args.counts:
        got = run_ranks(_counted_entry, 2, args=(models, variants, args.bucket_kib * 1024,
                                                 args.warmup), timeout=900)[0]
        result["counts"] = got
        for model_name, rows in got.items():
            ddp = rows["ddp"]
            table = []
            for name, r in rows.items():
                table.append([name, r["buckets"], r["ops"], r["calls"], r["handoffs"],
                              f"{r['calls'] / max(ddp['calls'], 1):.2f}",
                              f"{r['ops'] / max(r['buckets'], 1):.1f}"])
            _table(f"{model_name}: per step, wrapped minus unwrapped (rank 0, 2 gloo ranks, "
                   f"{args.bucket_kib} KiB buckets)",
                   ["variant", "buckets", "extra ops", "py calls", "hand-offs",
                    "calls/DDP", "ops/bucket"], table)
    if args.timing:
        timed = [t for t in args.timed.split(",") if t]
        result["timing"] = {}
        for n in (1, 2):
            got = run_ranks(time_main, n, args=(timed, args.rounds, args.steps, 3),
                            timeout=1800)[0]
            result["timing"][str(n)] = got
            band, cband = got["aa_band"], got["aa_band_cpu"]
            rows = [[name, f"{ms:.3f}", f"{got['ratio'].get(name, 1.0):.3f}",
                     f"{got['cpu_ms'][name]:.3f}", f"{got['cpu_ratio'].get(name, 1.0):.3f}",
                     got["peer"].get(name, "ddp")]
                    for name, ms in got["step_ms"].items()]
            _table(f"overhead-bound step (batch 1, 40 x Linear(64, 64)), {n} rank(s); A/A band "
                   f"(DDP vs a second DDP, 10th-90th percentile of rounds): wall "
                   f"{band[0]:.3f}-{band[1]:.3f}, CPU {cband[0]:.3f}-{cband[1]:.3f}",
                   ["variant", "wall ms", "x peer", "CPU ms", "CPU x peer", "peer"], rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    _results.record_from_args(args, "benchmarks/micro/step_counts.py",
                              _results.rounded({k: v for k, v in result.items() if k != "argv"},
                                               4), argv, start)
    return result


def _counted_entry(models, variants, bucket_bytes, warmup):
    """Installs the thread counter first: bagua's worker threads start lazily, later."""
    _install_counter()
    return count_main(models, variants, bucket_bytes, warmup)


if __name__ == "__main__":
    main()
