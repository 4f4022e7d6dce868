"""Optimizer step time: torch's optimizers against bagua_optim.fuse_optimizer of the same ones.

For each model (2,000 small parameters; 10 large ones; a transformer-like stack) and each
optimizer mode (per-parameter loop ``foreach=False``, ``foreach=True``, ``fused=True`` where
torch has it, and torch's default), it times ``optimizer.step()`` of the plain optimizer and of
``fuse_optimizer`` of the same optimizer in the same run, with gradients in place, and prints
both and the ratio (>1: fused is faster).  A user-defined optimizer is measured too.  The
"new grads" rows give every parameter a new gradient tensor before each step, as
``zero_grad(set_to_none=True)`` and a backward do: the fused step then first copies them into
its flat gradient and re-points them.

    python benchmarks/optim.py            # full sizes
    python benchmarks/optim.py --quick    # well under a minute
    python benchmarks/optim.py --threads 1    # steadier figures on a shared, busy machine
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from bagua_optim import fuse_optimizer


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


def modes(cls):
    yield "foreach=False", {"foreach": False}
    yield "foreach=True", {"foreach": True}
    if cls in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad):
        yield "fused=True", {"fused": True}
    yield "default", {}
    yield "default, new grads", {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, few repetitions")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    reps = 5 if args.quick else 25
    models = {"2000 small": small_params, "10 large": large_params,
              "transformer": transformer_params}
    opts = [(torch.optim.SGD, dict(lr=1e-2, momentum=0.9)), (torch.optim.Adam, dict(lr=1e-3))]
    if not args.quick:
        opts.append((torch.optim.RMSprop, dict(lr=1e-3)))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU; "
          f"best step time of {reps}")
    print(f"{'model':<12} {'optimizer':<9} {'mode':<18} {'plain ms':>10} {'fused ms':>10} "
          f"{'speed-up':>9}")
    rows = []
    for mname, make in models.items():
        base = make(args.quick)
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
                  f"{t_plain / t_fused:8.2f}x{note}", flush=True)
    print()
    print("Targets on 2000 small parameters (ratios of best times in this run):")
    by = {(m, o, lab): (tp, tf) for m, o, lab, tp, tf in rows}
    for o in ("SGD", "Adam"):
        fused_default = by[("2000 small", o, "default")][1]
        loop = by[("2000 small", o, "foreach=False")][0]
        foreach = by[("2000 small", o, "foreach=True")][0]
        torch_fused = by[("2000 small", o, "fused=True")][0]
        print(f"  {o}: fused default vs per-parameter loop {loop / fused_default:6.2f}x "
              f"(target >= 5), vs foreach=True {foreach / fused_default:6.2f}x (>= 1.5), "
              f"vs torch fused=True {torch_fused / fused_default:6.2f}x (>= 1)")
    for o in ("SGD", "Adam"):
        ratios = [tp / tf for m, oo, _, tp, tf in rows if m == "10 large" and oo == o]
        gmean = statistics.geometric_mean(ratios)
        print(f"  10 large, {o}: fused/plain speed-up, geometric mean over modes {gmean:5.2f}x "
              f"(min {min(ratios):.2f}x; >= 1: parameters this large are never flattened, so "
              "any gap is timing noise)")


if __name__ == "__main__":
    main()
