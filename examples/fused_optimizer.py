#!/usr/bin/env python3
"""The fused optimizer alone: needs only torch and bagua-optim (``pip install bagua-optim``).

    python examples/fused_optimizer.py            # 200 steps, prints both step times (~10 s)
    python examples/fused_optimizer.py --quick    # 20 steps of a smaller model (what CI runs)

A model with many small parameters (the case where per-parameter optimizer loops are slow)
is trained twice from the same initial weights on the same batches: once with a plain
``torch.optim.AdamW``, once with the same optimizer passed through ``fuse_optimizer``. The
script checks that the two runs end bit-identical, that a fused checkpoint loads into an
unfused optimizer, and prints the median ``step()`` time of each, leaving out the first
steps (the fused optimizer probes and flattens there; so does torch's foreach path, less).

It runs on one thread (``--threads``): an optimizer step over many small tensors is a loop of
small kernels, which extra threads only slow down, and many threads on a few shared cores
stall the whole run.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from bagua_optim import fuse_optimizer, is_fused_optimizer


def make_model(layers: int, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.GELU()]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(width, 1))


def train(model, optimizer, steps: int, width: int, name: str) -> list[float]:
    """Train on fixed batches; return the time each ``optimizer.step()`` took."""
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    g = torch.Generator().manual_seed(1)
    times = []
    t_start = time.perf_counter()
    for i in range(steps):
        x = torch.randn(32, width, generator=g)
        y = x.sum(dim=1, keepdim=True).sin()
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        t0 = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - t0)
        scheduler.step()
        if (i + 1) % max(1, steps // 4) == 0 or i + 1 == steps:
            print(f"  {name}: step {i + 1}/{steps}, {time.perf_counter() - t_start:.1f} s",
                  flush=True)
    return times


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--layers", type=int, default=100, help="3 parameter-holding modules each")
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--quick", action="store_true", help="20 steps, 20 layers")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.layers = 20, 20
    torch.set_num_threads(args.threads)
    warmup = min(5, args.steps // 4)

    plain_model = make_model(args.layers, args.width)
    fused_model = copy.deepcopy(plain_model)
    n_params = sum(1 for _ in plain_model.parameters())

    plain_opt = torch.optim.AdamW(plain_model.parameters(), lr=1e-3, foreach=True)
    fused_opt = fuse_optimizer(torch.optim.AdamW(fused_model.parameters(), lr=1e-3, foreach=True))
    assert is_fused_optimizer(fused_opt)

    print(f"{n_params} parameters, {args.steps} AdamW steps each, {args.threads} thread(s)",
          flush=True)
    plain_t = train(plain_model, plain_opt, args.steps, args.width, "plain AdamW")
    fused_t = train(fused_model, fused_opt, args.steps, args.width, "fused AdamW")

    identical = all(torch.equal(a, b) for a, b in zip(plain_model.parameters(),
                                                        fused_model.parameters()))
    # A fused optimizer's state_dict() has the ordinary layout: it loads into a plain one.
    restored = torch.optim.AdamW(copy.deepcopy(plain_model).parameters(), lr=1e-3)
    restored.load_state_dict(fused_opt.state_dict())
    state_ok = all(torch.equal(restored.state_dict()["state"][i]["exp_avg"],
                               plain_opt.state_dict()["state"][i]["exp_avg"])
                   for i in range(n_params))

    plain_ms = 1e3 * statistics.median(plain_t[warmup:])
    fused_ms = 1e3 * statistics.median(fused_t[warmup:])
    print(f"median step() after {warmup} warm-up steps: plain {plain_ms:.2f} ms, fused "
          f"{fused_ms:.2f} ms (fused takes {fused_ms / plain_ms:.2f}x plain's time; one run, "
          f"on a busy machine the ratio varies)")
    print(f"bit-identical parameters: {identical}; checkpoint loads unfused: {state_ok}")
    if not (identical and state_ok):
        raise SystemExit("fused and plain runs differ")
    return {"identical": identical, "plain_ms": plain_ms, "fused_ms": fused_ms}


if __name__ == "__main__":
    main()
