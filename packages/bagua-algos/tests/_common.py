"""Shared pieces of the multi-rank tests: a tiny model, deterministic data, a reference."""

from __future__ import annotations

import torch

import bagua_comm as bc

IN, HIDDEN, BATCH = 6, 12, 8


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(),
                               torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(),
                               torch.nn.Linear(HIDDEN, 1))


_TRUE_W = torch.linspace(-1.0, 1.0, IN)


def batch(step: int, rank: int, micro: int = 0, n: int = BATCH):
    """Rank ``rank``'s batch at ``step``: the same on every run, different on every rank."""
    g = torch.Generator().manual_seed(100_003 * step + 1_009 * rank + 7 * micro + 1)
    x = torch.randn(n, IN, generator=g)
    y = torch.sin(x @ _TRUE_W).unsqueeze(1)
    return x, y


def global_batch(step: int, world: int, micro: int = 0):
    xs, ys = zip(*(batch(step, r, micro) for r in range(world)))
    return torch.cat(xs), torch.cat(ys)


def loss_fn(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def eval_loss(model, world: int, steps=range(1000, 1004)) -> float:
    with torch.no_grad():
        return sum(loss_fn(model, *global_batch(s, world)).item() for s in steps) / len(steps)


def train(model, optimizer, steps: int, start: int = 0):
    rank = bc.get_rank()
    for step in range(start, start + steps):
        optimizer.zero_grad()
        loss_fn(model, *batch(step, rank)).backward()
        optimizer.step()


def reference_full_batch(steps: int, world: int, lr: float, opt="sgd", seed: int = 0):
    """Single-process training on the concatenation of every rank's batch."""
    model = make_model(seed)
    opt_ = (torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9) if opt == "sgd"
            else torch.optim.Adam(model.parameters(), lr=lr))
    for step in range(steps):
        opt_.zero_grad()
        loss_fn(model, *global_batch(step, world)).backward()
        opt_.step()
    return params(model)
