"""Optimizer step time: torch's optimizers against bagua_optim.fuse_optimizer of the same ones.

For each model (2,000 small parameters; 10 large ones; a transformer-like stack) and each
optimizer mode (per-parameter loop ``foreach=False``, ``foreach=True``, ``fused=True`` where
torch has it, and torch's default), it times ``optimizer.step()`` of the plain optimizer and of
``fuse_optimizer`` of the same optimizer in the same run, with gradients in place, and prints
both and the ratio of the times (fused's time / plain's, "x plain's time": < 1, fused is
faster).  A user-defined optimizer is measured too.  The
"new grads" rows give every parameter a new gradient tensor before each step, as
``zero_grad(set_to_none=True)`` and a backward do: the fused step then first copies them into
its flat gradient and re-points them.

The ``vs-fused`` suite (run first) measures against torch's ``fused=True`` kernels, the fastest
CPU optimizers torch has: on the issue's four shapes (600 x 256, 2,000 x 64, 50 x 100,000,
4 x 4,000,000), a GPT-2-small-shaped and a ResNet-50-shaped parameter set, with gradients in
place and with new gradients each step.  Ours: ``fuse_optimizer(Adam(fused=True))`` and
``AdamW(fused=True)`` (default mode, bit-identical to them), ``fuse_optimizer(Adam(),
mode="fast")`` and, for reference, ``fuse_optimizer(Adam(foreach=True))``.  Its ratio is ours
/ torch's step time ("x torch's time": < 1, ours is faster).

Timings use one torch thread by default (``torch.set_num_threads(1)``, as the issue's did).

    python benchmarks/micro/optim.py                     # both suites, full sizes
    python benchmarks/micro/optim.py --suite vs-fused    # against fused=True only
    python benchmarks/micro/optim.py --quick             # well under a minute
    python benchmarks/micro/optim.py --suite vs-fused --results   # and into docs/results.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from bagua_optim import fuse_optimizer

sys.path.append(str(Path(__file__).resolve().parents[1]))  # benchmarks/
import _results


class Lion(torch.optim.Optimizer):
    """A user-defined elementwise optimizer, written the plain per-parameter way."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99)):
        super().__init__(params, dict(lr=lr, betas=betas))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["m"] = torch.zeros_like(p)
                update = st["m"].mul(b1).add_(p.grad, alpha=1 - b1).sign_()
                p.add_(update, alpha=-group["lr"])
                st["m"].mul_(b2).add_(p.grad, alpha=1 - b2)


def small_params(quick: bool) -> list[torch.nn.Parameter]:
    n = 2000
    sizes = [64, 128, 256, 512] if not quick else [32, 64, 128, 256]
    return [torch.nn.Parameter(torch.randn(sizes[i % 4])) for i in range(n)]


def large_params(quick: bool) -> list[torch.nn.Parameter]:
    numel = (1 << 18) if quick else (1 << 22)
    return [torch.nn.Parameter(torch.randn(numel)) for _ in range(10)]


def transformer_params(quick: bool) -> list[torch.nn.Parameter]:
    d, layers = (128, 4) if quick else (256, 8)
    layer = torch.nn.TransformerEncoderLayer(d, 4, dim_feedforward=4 * d, batch_first=True)
    model = torch.nn.Sequential(torch.nn.Embedding(1000, d),
                                torch.nn.TransformerEncoder(layer, layers,
                                                            enable_nested_tensor=False),
                                torch.nn.Linear(d, 1000))
    return list(model.parameters())


def clone_params(params):
    out = [torch.nn.Parameter(p.detach().clone()) for p in params]
    g = torch.Generator().manual_seed(1)
    for p in out:
        p.grad = torch.randn(p.shape, generator=g) * 1e-2
    return out


def fresh_grads(opt) -> None:
    """What zero_grad(set_to_none=True) and a backward leave: new gradient tensors."""
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.full_like(p, 1e-3)


def time_steps(opts, reps: int, before=None) -> list[float]:
    """Best step time (ms) of each optimizer over ``reps``: steps alternate so that they share
    the noise of a busy machine, and the minimum is what is left once other processes stop
    getting in the way (as timeit advises).  ``before(opt)`` runs before each step, untimed."""
    for _ in range(2):
        for opt in opts:
            opt.step()
    samples = [[] for _ in opts]
    for rep in range(reps):
        order = list(zip(opts, samples))
        for opt, out in order if rep % 2 else order[::-1]:     # neither always goes first
            if before is not None:
                before(opt)
            t0 = time.perf_counter()
            opt.step()
            out.append(time.perf_counter() - t0)
    return [min(s) * 1e3 for s in samples]


def _stack(params: list[torch.Size]) -> list[torch.Size]:
    return [torch.Size(s) for s in params]


def gpt2_small_shapes() -> list[torch.Size]:
    """GPT-2 small's 148 parameter tensors (124M elements), tied output embedding."""
    d, ff, out = 768, 3072, []
    for _ in range(12):
        out += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, ff), (ff,),
                (ff, d), (d,)]
    return _stack([(50257, d), (1024, d), *out, (d,), (d,)])


def resnet50_shapes() -> list[torch.Size]:
    """ResNet-50's 161 parameter tensors (25.6M elements)."""
    out = [(64, 3, 7, 7), (64,), (64,)]
    cin = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            out += [(width, cin, 1, 1), (width,), (width,), (width, width, 3, 3), (width,),
                    (width,), (4 * width, width, 1, 1), (4 * width,), (4 * width,)]
            if b == 0:
                out += [(4 * width, cin, 1, 1), (4 * width,), (4 * width,)]
            cin = 4 * width
    return _stack([*out, (1000, 2048), (1000,)])


def shape_sets(quick: bool) -> dict[str, list[torch.Size]]:
    if quick:
        return {"600 x 256": _stack([(256,)] * 600), "2,000 x 64": _stack([(64,)] * 2000),
                "10 x 100,000": _stack([(100_000,)] * 10),
                "2 x 1,000,000": _stack([(1_000_000,)] * 2)}
    return {"600 x 256": _stack([(256,)] * 600), "2,000 x 64": _stack([(64,)] * 2000),
            "50 x 100,000": _stack([(100_000,)] * 50),
            "4 x 4,000,000": _stack([(4_000_000,)] * 4),
            "GPT-2 small": gpt2_small_shapes(), "ResNet-50": resnet50_shapes()}


def _make(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    for p in out:
        p.grad = torch.randn(p.shape, generator=g) * 1e-2
    return out


def vs_fused(quick: bool) -> tuple[list[tuple], dict]:
    """Rows against torch's fused=True: (shapes, ours, form, torch ms, ours ms), and per row
    the A/A ratio (the twin's time / torch's: this run's noise floor)."""
    adam, adamw = torch.optim.Adam, torch.optim.AdamW
    ours = [("Adam(fused=True)", adam, lambda ps: fuse_optimizer(adam(ps, lr=1e-3, fused=True))),
            ("AdamW(fused=True)", adamw,
             lambda ps: fuse_optimizer(adamw(ps, lr=1e-3, fused=True))),
            ("Adam(), mode='fast'", adam,
             lambda ps: fuse_optimizer(adam(ps, lr=1e-3), mode="fast")),
            ("Adam(foreach=True)", adam,
             lambda ps: fuse_optimizer(adam(ps, lr=1e-3, foreach=True)))]
    print(f"\nvs torch fused=True: torch {torch.__version__}, {torch.get_num_threads()} "
          "thread(s), CPU; best step of the alternating repetitions; ratio: ours / torch's "
          "time (x torch's time, < 1: ours faster)")
    print("A/A: a second, identical torch fused=True optimizer timed in the same loop; its "
          "ratio is this run's noise floor")
    print(f"{'parameters':<15} {'fuse_optimizer(...)':<21} {'form':<15} {'fused=True ms':>13} "
          f"{'ours ms':>9} {'ratio':>7} {'A/A':>6}")
    rows, aa = [], {}
    for sname, shapes in shape_sets(quick).items():
        numel = sum(s.numel() for s in shapes)
        reps = max(5, min(25, int(1e8 // numel))) if not quick else 5
        for label, cls, make in ours:
            if label.startswith("Adam(foreach") and numel > 3e7:
                continue    # slow, and said already by the four shapes
            for form, before in (("grads in place", None), ("new grads", fresh_grads)):
                ref = cls(_make(shapes), lr=1e-3, fused=True)
                twin = cls(_make(shapes), lr=1e-3, fused=True)
                mine = make(_make(shapes))
                t_ref, t_ours, t_twin = time_steps([ref, mine, twin], reps, before)
                del ref, mine, twin
                rows.append((sname, label, form, t_ref, t_ours))
                aa[sname, label, form] = t_twin / t_ref
                print(f"{sname:<15} {label:<21} {form:<15} {t_ref:13.3f} {t_ours:9.3f} "
                      f"{t_ours / t_ref:6.2f}x {t_twin / t_ref:5.2f}x", flush=True)
    by = {(n, lab, f): to / tr for n, lab, f, tr, to in rows}
    small = "2,000 x 64"
    print("\nTargets (ratios of times from this run, x torch's time):")
    for lab in ("Adam(fused=True)", "AdamW(fused=True)"):
        worst = max(v for (n, la, f), v in by.items() if la == lab and f == "grads in place")
        band = [v for (n, la, f), v in aa.items() if la == lab]
        print(f"  {lab}: worst shape {worst:.2f}x (<= 1.0; A/A noise floor "
              f"{min(band):.2f}-{max(band):.2f}x), {small} "
              f"{by[small, lab, 'grads in place']:.2f}x (<= 0.33), {small} new grads "
              f"{by[small, lab, 'new grads']:.2f}x (<= 0.67)")
    return rows, aa


def modes(cls):
    yield "foreach=False", {"foreach": False}
    yield "foreach=True", {"foreach": True}
    if cls in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad):
        yield "fused=True", {"fused": True}
    yield "default", {}
    yield "default, new grads", {}


def figures(vs: tuple[list[tuple], dict] | None, plain: list[tuple] | None) -> dict:
    """What docs/results.json keeps of a run (benchmarks/_results.py): per row, both step
    times (ms) and their ratio as a multiple of the reference's time (< 1: ours faster)."""
    out = {}
    if vs is not None:
        rows, aa = vs
        out["vs_fused"] = {f"{n} | {lab} | {f}": {"torch_ms": tr, "ours_ms": to,
                                                  "x_torch_time": to / tr,
                                                  "aa_x_torch_time": aa[n, lab, f]}
                           for n, lab, f, tr, to in rows}
    if plain is not None:
        out["modes"] = {f"{m} | {o} | {lab}": {"plain_ms": tp, "fused_ms": tf,
                                               "x_plain_time": tf / tp}
                        for m, o, lab, tp, tf in plain}
    return _results.rounded(out, 4)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, few repetitions")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's own)")
    ap.add_argument("--suite", choices=("all", "vs-fused", "modes"), default="all")
    _results.add_options(ap)
    args = ap.parse_args(argv)
    start = _results.started()
    if args.threads:
        torch.set_num_threads(args.threads)
    vs = vs_fused(args.quick) if args.suite in ("all", "vs-fused") else None
    plain = plain_vs_fused(args.quick) if args.suite in ("all", "modes") else None
    _results.record_from_args(args, "benchmarks/micro/optim.py", figures(vs, plain), argv, start)


def plain_vs_fused(quick: bool) -> list[tuple]:
    """Each torch optimizer mode, plain against fuse_optimizer of the same (default mode):
    rows of (model, optimizer, mode, plain ms, fused ms)."""
    reps = 5 if quick else 25
    models = {"2000 small": small_params, "10 large": large_params,
              "transformer": transformer_params}
    opts = [(torch.optim.SGD, dict(lr=1e-2, momentum=0.9)), (torch.optim.Adam, dict(lr=1e-3))]
    if not quick:
        opts.append((torch.optim.RMSprop, dict(lr=1e-3)))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU; "
          f"best step time of {reps}")
    print(f"{'model':<12} {'optimizer':<9} {'mode':<18} {'plain ms':>10} {'fused ms':>10} "
          f"{'x plain':>9}")
    rows = []
    for mname, make in models.items():
        base = make(quick)
        cases = [(cls, kw, label, extra) for cls, kw in opts for label, extra in modes(cls)]
        cases.append((Lion, {}, "user-defined", {}))
        for cls, kw, label, extra in cases:
            plain = cls(clone_params(base), **kw, **extra)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                fused = fuse_optimizer(cls(clone_params(base), **kw, **extra))
            note = " (not fused: not elementwise here)" if caught else ""
            before = fresh_grads if label.endswith("new grads") else None
            t_plain, t_fused = time_steps([plain, fused], reps, before)
            rows.append((mname, cls.__name__, label, t_plain, t_fused))
            print(f"{mname:<12} {cls.__name__:<9} {label:<18} {t_plain:10.3f} {t_fused:10.3f} "
                  f"{t_fused / t_plain:8.3f}x{note}", flush=True)
    print()
    print("Targets on 2000 small parameters (fused default's best time as a multiple of the "
          "plain optimizer's, this run):")
    by = {(m, o, lab): (tp, tf) for m, o, lab, tp, tf in rows}
    for o in ("SGD", "Adam"):
        fused_default = by[("2000 small", o, "default")][1]
        loop = by[("2000 small", o, "foreach=False")][0]
        foreach = by[("2000 small", o, "foreach=True")][0]
        torch_fused = by[("2000 small", o, "fused=True")][0]
        print(f"  {o}: x per-parameter loop's time {fused_default / loop:6.3f}x "
              f"(target <= 0.2), x foreach=True's {fused_default / foreach:6.3f}x (<= 0.67), "
              f"x torch fused=True's {fused_default / torch_fused:6.3f}x (<= 1)")
    for o in ("SGD", "Adam"):
        ratios = [tf / tp for m, oo, _, tp, tf in rows if m == "10 large" and oo == o]
        gmean = statistics.geometric_mean(ratios)
        print(f"  10 large, {o}: x plain's time, geometric mean over modes {gmean:5.2f}x "
              f"(max {max(ratios):.2f}x; <= 1: parameters this large are never flattened, so "
              "any gap is timing noise)")
    return rows


if __name__ == "__main__":
    main()
