#!/usr/bin/env python3
"""QAdam on sklearn's digits: is the occasional divergence after warmup the frozen-variance
design or a defect of ours?

    python benchmarks/studies/qadam_digits.py --seeds 15              # simulations (one process)
    python benchmarks/studies/qadam_digits.py --seeds 15 --ranks      # + our QAdam on 2 real ranks

The scenario of the original Bagua MNIST example, ported to 8x8 digits: 2 ranks, batch 64 per
rank, ``QAdamOptimizer(lr=0.01)`` (warmup 100 steps), 14 epochs, the example's conv net. For
each seed, every variant starts from the same weights and sees the same batches:

- ``adam``: torch Adam on the global batch (no freeze, no compression).
- ``frozen``: the uncompressed reference with the same frozen variance: QAdamOptimizer alone on
  the global batch (what QAdam computes if the momentum average were exact).
- ``qadam_sim``: QAdam's maths in one process (each rank's momentum, then the MinMaxUInt8
  scatter-reduce-gather average with one chunk per rank, as compressed_allreduce does).
- ``qadam_ef``: the same with error feedback on both compressions (as 1-bit Adam, Tang et al.
  2021, does with its 1-bit compressor).
- ``qadam_floor``: ``qadam_sim`` with the frozen variance floored at 1e-3 of its mean (so a
  quantisation error cannot be divided by a near-zero ``sqrt(v)``).
- ``ours`` (``--ranks``): with_bagua(QAdam) on 2 gloo ranks, the code under test.

Prints, per seed and variant: final test loss, correct out of 450, and the worst training loss
after the switch from warmup; then how many runs diverged (final accuracy < 90 %, or a training
loss after the switch above both 1.0 and 5x the loss at the switch).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
BATCH, EPOCHS, LR, WARMUP, WORLD = 64, 14, 0.01, 100, 2


def data():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    y = torch.tensor(y)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    mean, std = xtr.mean(), xtr.std()
    return (xtr - mean) / std, ytr, (xte - mean) / std, yte


class Net(torch.nn.Module):
    """Bagua's MNIST example net, sized for 8x8 inputs."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 32, 3, 1)
        self.conv2 = torch.nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = torch.nn.Dropout(0.25)
        self.dropout2 = torch.nn.Dropout(0.5)
        self.fc1 = torch.nn.Linear(256, 128)
        self.fc2 = torch.nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = self.dropout1(torch.flatten(x, 1))
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


def batches(seed, n):
    """Per epoch, per step: each rank's index batch (a DistributedSampler-like split)."""
    out = []
    for epoch in range(EPOCHS):
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch))
        shards = [perm[r::WORLD] for r in range(WORLD)]
        steps = min(len(s) for s in shards) // BATCH
        out.extend([s[i * BATCH:(i + 1) * BATCH] for s in shards] for i in range(steps))
    return out


def evaluate(model, xte, yte):
    model.eval()
    with torch.no_grad():
        out = model(xte)
    model.train()
    return F.nll_loss(out, yte).item(), int((out.argmax(1) == yte).sum())


# -- simulated QAdam --------------------------------------------------------------------------
def _qavg(ms, comp, ef_state=None):
    """compressed_allreduce's AVG of per-rank tensors: scatter (WORLD chunks), float32
    reduce per segment, gather (1 chunk per segment); optional error feedback on both."""
    n = ms[0].numel()
    pad = -(-n // WORLD) * WORLD
    xs = [torch.cat([m, m.new_zeros(pad - n)]) for m in ms]
    decoded = []
    for r, x in enumerate(xs):
        if ef_state is not None:
            x = x + ef_state.setdefault(("s", r), torch.zeros_like(x))
        d = torch.empty_like(x)
        comp.decompress(comp.compress(x, chunks=WORLD), d, chunks=WORLD)
        if ef_state is not None:
            ef_state[("s", r)] = x - d
        decoded.append(d)
    seg = pad // WORLD
    mean = torch.stack(decoded).mean(0)
    out = torch.empty(pad)
    for r in range(WORLD):
        s = mean[r * seg:(r + 1) * seg]
        if ef_state is not None:
            s = s + ef_state.setdefault(("g", r), torch.zeros_like(s))
        d = torch.empty_like(s)
        comp.decompress(comp.compress(s.contiguous(), chunks=1), d, chunks=1)
        if ef_state is not None:
            ef_state[("g", r)] = s - d
        out[r * seg:(r + 1) * seg] = d
    return out[:n]


def run_sim(variant, seed, xtr, ytr, xte, yte):
    from bagua_algos import QAdamOptimizer
    from bagua_comm.compression import MinMaxUInt8

    torch.manual_seed(seed)
    model = Net()
    params = list(model.parameters())
    if variant == "adam":
        opt = torch.optim.Adam(params, lr=LR)
    else:
        opt = QAdamOptimizer(params, lr=LR, warmup_steps=WARMUP)
    comp, ef = MinMaxUInt8(WORLD), ({} if variant == "qadam_ef" else None)
    beta1, beta2 = 0.9, 0.999
    losses, switch_loss = [], None
    for step, idx in enumerate(batches(seed, len(xtr)), start=1):
        compressed = variant.startswith("qadam") and step > WARMUP
        if not compressed:
            opt.zero_grad()
            xb, yb = torch.cat([xtr[i] for i in idx]), torch.cat([ytr[i] for i in idx])
            loss = F.nll_loss(model(xb), yb)
            loss.backward()
            opt.step()
        else:
            if variant == "qadam_floor" and step == WARMUP + 1:
                for p in params:
                    v = opt.state[p]["exp_avg_sq"]
                    v.clamp_(min=1e-3 * v.mean().item())
            per_rank, loss = [], 0.0
            for i in idx:                      # each rank's gradient from its own batch
                opt.zero_grad()
                li = F.nll_loss(model(xtr[i]), ytr[i])
                li.backward()
                loss += li.item() / WORLD
                per_rank.append(torch.cat([p.grad.reshape(-1) for p in params]))
            m_prev = torch.cat([opt.state[p]["exp_avg"].reshape(-1) for p in params])
            ms = [m_prev * beta1 + g * (1 - beta1) for g in per_rank]
            m = _qavg(ms, comp, ef)
            t = step
            bias1 = 1 - beta1 ** t
            bias2 = 1 - beta2 ** WARMUP
            off = 0
            with torch.no_grad():
                for p in params:
                    st = opt.state[p]
                    st["exp_avg"].copy_(m[off:off + p.numel()].view_as(p))
                    off += p.numel()
                    denom = (st["exp_avg_sq"].sqrt() / math.sqrt(bias2)).add_(1e-8)
                    p.addcdiv_(st["exp_avg"], denom, value=-LR / bias1)
                opt.param_groups[0]["step_id"] = step
            loss = torch.tensor(loss)
        losses.append(float(loss))
        if step == WARMUP:
            switch_loss = sum(losses[-10:]) / 10
    test_loss, correct = evaluate(model, xte, yte)
    after = max(losses[WARMUP:]) if len(losses) > WARMUP else float("nan")
    return test_loss, correct, after, switch_loss


# -- our QAdam on real ranks ------------------------------------------------------------------
def _rank_main(seeds):
    import bagua_comm as bc
    from bagua_algos import QAdam, QAdamOptimizer, with_bagua

    xtr, ytr, xte, yte = data()
    rank = bc.get_rank()
    out = {}
    for seed in seeds:
        torch.manual_seed(seed)
        model = Net()
        opt = QAdamOptimizer(model.parameters(), lr=LR, warmup_steps=WARMUP)
        model = with_bagua(model, [opt], QAdam(opt, hierarchical=False))
        torch.manual_seed(seed * 7 + rank)       # dropout differs per rank
        losses = []
        for _step, idx in enumerate(batches(seed, len(xtr)), start=1):
            opt.zero_grad()
            loss = F.nll_loss(model(xtr[idx[rank]]), ytr[idx[rank]])
            loss.backward()
            opt.step()
            t = loss.detach().clone()
            bc.allreduce_inplace(t, bc.ReduceOp.AVG)
            losses.append(t.item())
        model.detach_algorithm()
        test_loss, correct = evaluate(model.module, xte, yte)
        out[seed] = (test_loss, correct, max(losses[WARMUP:]),
                     sum(losses[WARMUP - 10:WARMUP]) / 10)
    return out


def diverged(res):
    test_loss, correct, after, switch = res
    return correct < 0.9 * 450 or after > max(1.0, 5 * switch) or not math.isfinite(test_loss)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=15)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--ranks", action="store_true", help="also run our QAdam on 2 gloo ranks")
    ap.add_argument("--variants", default="adam,frozen,qadam_sim,qadam_ef,qadam_floor")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    xtr, ytr, xte, yte = data()
    variants = [v for v in args.variants.split(",") if v]
    table = {v: {} for v in variants}
    for seed in seeds:
        for v in variants:
            table[v][seed] = run_sim(v, seed, xtr, ytr, xte, yte)
        print(f"seed {seed}: " + "  ".join(
            f"{v} {table[v][seed][0]:.3f}/{table[v][seed][1]}/{table[v][seed][2]:.2f}"
            for v in variants), flush=True)
    if args.ranks:
        from bagua_comm.testing import run_ranks

        sys.path.insert(0, HERE)
        table["ours"] = run_ranks(_rank_main, WORLD, args=(seeds,), timeout=3600)[0]
        variants.append("ours")
    print("\nvariant       test loss (mean)  correct/450 (min..max)  diverged  seeds diverged")
    for v in variants:
        rows = table[v]
        bad = [s for s in seeds if diverged(rows[s])]
        losses = [rows[s][0] for s in seeds]
        correct = [rows[s][1] for s in seeds]
        print(f"{v:12s}  {sum(losses) / len(losses):16.3f}  {min(correct):5d}..{max(correct):<5d}"
              f"           {len(bad):2d}/{len(seeds)}  {bad}")
    print("\nper seed: test loss / correct / worst train loss after the switch (loss at switch)")
    for s in seeds:
        print(f"{s:3d} " + "  ".join(f"{v}: {table[v][s][0]:.3f}/{table[v][s][1]}/"
                                     f"{table[v][s][2]:.2f}({table[v][s][3]:.2f})"
                                     for v in variants))


if __name__ == "__main__":
    main()
