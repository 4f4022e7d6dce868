#!/usr/bin/env python3
"""fuse_optimizer on CUDA against torch's own foreach and fused=True Adam, AdamW and SGD.

Parameter sets: 2,000 small parameters, and a real model's parameter list (a GPT-2-small
shaped transformer: 12 layers, d=768, 50,257-token embedding; ~124M parameters).  For each
optimizer it builds, on identical parameters and gradients, torch's ``foreach=True``, torch's
``fused=True``, ``fuse_optimizer`` of a ``foreach=True`` optimizer, and the same with
``mode="fast"`` (torch's fused kernel over the flat buffers); times ``step()`` with
CUDA events (median of rounds), prints the step times and ours as a multiple of each of
torch's ("x foreach's time", "x fused's time": < 1 means ours is faster; targets <= 0.67 and
<= 1.0), and checks exactness: after
the timed steps ours must be bit-identical to torch's foreach; its difference to fused=True
(other kernels, other rounding) is printed, and so is ``mode="fast"``'s (the same kernel).

    python benchmarks/gpu/optim.py            # both parameter sets
    python benchmarks/gpu/optim.py --quick    # smaller model, fewer steps
Without CUDA it runs a small CPU smoke version (not GPU figures).
"""

from __future__ import annotations

import argparse

import torch
from _common import add_results_options, device, record, started, table, timed

from bagua_optim import fuse_optimizer

OPTIMIZERS = {"Adam": (torch.optim.Adam, {"lr": 1e-3}),
              "AdamW": (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.01}),
              "SGD": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9})}


def small_shapes(n=2000):
    return [(64,), (128,), (32, 8), (256,)] * (n // 4)


def model_shapes(quick: bool):
    d, layers, vocab = (256, 2, 5000) if quick else (768, 12, 50257)
    layer = torch.nn.TransformerEncoderLayer(d, max(d // 64, 1), 4 * d, batch_first=True)
    model = torch.nn.Sequential(torch.nn.Embedding(vocab, d),
                                torch.nn.TransformerEncoder(layer, layers,
                                                            enable_nested_tensor=False),
                                torch.nn.LayerNorm(d), torch.nn.Linear(d, vocab))
    return [tuple(p.shape) for p in model.parameters()]


def params_like(shapes, dev, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, generator=g).to(dev))
        p.grad = (torch.randn(s, generator=g) * 1e-2).to(dev)
        out.append(p)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    add_results_options(ap)
    args = ap.parse_args(argv)
    start = started()
    dev = device(allow_cpu=True)
    gpu = dev.type == "cuda"
    quick = args.quick or not gpu
    n_small = 2000 if gpu else 400
    sets = {f"{n_small} small": small_shapes(n_small),
            "GPT-2-small" if not quick else "small transformer": model_shapes(quick)}
    reps = 20 if gpu else 2
    rows, bad = [], []
    for set_name, shapes in sets.items():
        numel = sum(torch.Size(s).numel() for s in shapes)
        print(f"{set_name}: {len(shapes)} parameters, {numel / 1e6:.1f}M elements", flush=True)
        for name, (cls, kw) in OPTIMIZERS.items():
            pf = params_like(shapes, dev)
            pu = params_like(shapes, dev)
            po = params_like(shapes, dev)
            pq = params_like(shapes, dev)
            foreach = cls(pf, foreach=True, **kw)
            try:
                fused = cls(pu, fused=True, **kw)
            except (RuntimeError, ValueError, TypeError) as err:
                fused = None
                print(f"  {name}: torch fused=True unavailable here ({err})")
            ours = fuse_optimizer(cls(po, foreach=True, **kw))
            try:
                fast = fuse_optimizer(cls(pq, foreach=True, **kw), mode="fast")
            except ValueError as err:
                fast = None
                print(f"  {name}: mode='fast' unavailable here ({err})")
            t_f = timed(foreach.step, dev, reps)
            t_u = timed(fused.step, dev, reps) if fused else float("nan")
            t_o = timed(ours.step, dev, reps)
            t_q = timed(fast.step, dev, reps) if fast else float("nan")
            # every optimizer took the same number of steps on the same grads
            exact = all(torch.equal(a, b) for a, b in zip(pf, po))
            diff = (max((a - b).abs().max().item() for a, b in zip(pu, po)) if fused
                    else float("nan"))
            diff_q = (max((a - b).abs().max().item() for a, b in zip(pu, pq))
                      if fused and fast else float("nan"))
            if not exact:
                bad.append(f"{set_name}/{name}")
            rows.append([set_name, name, t_f * 1e3, t_u * 1e3, t_o * 1e3, t_o / t_f,
                         t_o / t_u, "yes" if exact else "NO", diff, t_q * 1e3, t_q / t_u,
                         diff_q])
    header = ["params", "optimizer", "foreach ms", "fused ms", "ours ms", "x foreach",
              "x fused", "ours == foreach", "max |ours - fused|", "fast ms", "fast x fused",
              "max |fast - fused|"]
    table(rows, header)
    record(args, "optim.py", header, rows, start, argv)
    print("targets (ours' time as a multiple of torch's): x foreach <= 0.67, x fused <= 1.0 "
          "(fast: fast x fused <= 1.0)"
          + ("" if gpu else "  (CPU smoke run: not GPU figures)"))
    if bad:
        print("NOT bit-identical to torch foreach:", ", ".join(bad))
        raise SystemExit(1)


if __name__ == "__main__":
    main()
