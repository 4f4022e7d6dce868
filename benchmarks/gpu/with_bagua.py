#!/usr/bin/env python3
"""with_bagua on CUDA with one NCCL rank against DistributedDataParallel (NCCL), same run.

One process, one GPU.  For each model (an MLP of ~50M parameters and a small transformer) it
times training steps (forward + backward + optimizer step, CUDA-synchronised per step, median
over alternating rounds) of DDP and of ``with_bagua`` with every algorithm, prints the step
times and the ratio (ours / DDP; 1.00 = no overhead), and the loss at the first and last step
(every algorithm must train: the loss goes down).

    python benchmarks/gpu/with_bagua.py [--quick] [--algorithms bytegrad,qadam]
Without CUDA it runs a small CPU smoke version on gloo (not GPU figures).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _common import add_results_options, device, record, started, sync, table
from _pg import init_one_rank, shutdown

ALGORITHMS = ["gradient_allreduce", "bytegrad", "decentralized", "low_precision_decentralized",
              "qadam", "async"]
QADAM_WARMUP = 20   # QAdam's second moment needs a real warmup (Bagua's default is 100)


def mlp(width, depth):
    layers, d = [], 1024
    for _ in range(depth):
        layers += [torch.nn.Linear(d, width), torch.nn.ReLU()]
        d = width
    return torch.nn.Sequential(*layers, torch.nn.Linear(d, 10))


class Transformer(torch.nn.Module):
    def __init__(self, d, layers, vocab=1000):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        layer = torch.nn.TransformerEncoderLayer(d, max(d // 64, 1), 4 * d, batch_first=True)
        self.body = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(d, 10)

    def forward(self, x):
        return self.head(self.body(self.emb(x)).mean(1))


def models(quick, gpu):
    if not gpu:
        return {"mlp": (lambda: mlp(256, 2), lambda g: torch.randn(16, 1024, generator=g))}
    width, depth = (2048, 4) if quick else (4096, 4)
    d, layers = (256, 2) if quick else (512, 6)
    return {f"mlp {width}x{depth}": (lambda: mlp(width, depth),
                                     lambda g: torch.randn(64, 1024, generator=g)),
            f"transformer d{d} x{layers}": (lambda: Transformer(d, layers),
                                            lambda g: torch.randint(0, 1000, (32, 128),
                                                                    generator=g))}


def algorithm(name, opt):
    from bagua_algos import Algorithm, QAdam

    if name == "qadam":
        return QAdam(opt)
    if name == "async":
        return Algorithm.init("async", sync_interval_ms=50)
    return Algorithm.init(name)


def optimizer(name, model):
    from bagua_algos import QAdamOptimizer

    if name == "qadam":
        return QAdamOptimizer(model.parameters(), lr=1e-4, warmup_steps=QADAM_WARMUP)
    return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)


def step(model, opt, x, y, dev):
    t0 = time.perf_counter()
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    sync(dev)
    return time.perf_counter() - t0, loss.item()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--algorithms", default=",".join(ALGORITHMS))
    ap.add_argument("--steps", type=int, default=None)
    add_results_options(ap)
    args = ap.parse_args(argv)
    start = started()
    dev = device(allow_cpu=True)
    gpu = dev.type == "cuda"
    backend = init_one_rank()
    print(f"bagua_comm backend: {backend}")
    from torch.nn.parallel import DistributedDataParallel

    from bagua_algos import with_bagua

    steps = args.steps or (10 if args.quick or not gpu else 30)
    rounds = 3
    rows = []
    for mname, (make, data) in models(args.quick, gpu).items():
        g = torch.Generator().manual_seed(0)
        x, y = data(g).to(dev), torch.randint(0, 10, (data(g).shape[0],), generator=g).to(dev)
        torch.manual_seed(0)
        ddp_model = make().to(dev)
        ddp = DistributedDataParallel(ddp_model, device_ids=[0] if gpu else None)
        ddp_opt = torch.optim.SGD(ddp.parameters(), lr=1e-3, momentum=0.9)
        runs = {"ddp": (ddp, ddp_opt)}
        for name in args.algorithms.split(","):
            torch.manual_seed(0)
            m = make().to(dev)
            opt = optimizer(name, m)
            runs[name] = (with_bagua(m, [opt], algorithm(name, opt)), opt)
        times = {k: [] for k in runs}
        losses = {k: [] for k in runs}
        for k, (m, o) in runs.items():                      # warmup (QAdam: past its warmup)
            for _ in range(QADAM_WARMUP + 2 if k == "qadam" else 6):
                losses[k].append(step(m, o, x, y, dev)[1])
        for _ in range(rounds):                             # alternate: same machine noise
            for k, (m, o) in runs.items():
                for _ in range(steps):
                    t, loss = step(m, o, x, y, dev)
                    times[k].append(t)
                    losses[k].append(loss)
        ddp_t = statistics.median(times["ddp"])
        for k in runs:
            t = statistics.median(times[k])
            trains = "yes" if losses[k][-1] < losses[k][0] else "NO"
            rows.append([mname, k, t * 1e3, t / ddp_t, losses[k][0], losses[k][-1], trains])
        if "async" in runs:
            runs["async"][0].abort()
        for k, (m, _o) in runs.items():
            if k != "ddp":
                m.detach_algorithm()
    header = ["model", "run", "step ms", "x DDP", "loss first", "loss last", "trains"]
    table(rows, header)
    record(args, "with_bagua.py", header, rows, start, argv)
    print("target: gradient_allreduce <= 1.02 x DDP" + ("" if gpu else
                                                       "  (CPU smoke run: not GPU figures)"))
    shutdown()


if __name__ == "__main__":
    main()
