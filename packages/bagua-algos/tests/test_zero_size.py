"""Zero-size parameters train with every registered algorithm at any bucket size (issue #29,
section B): the run equals the same run on the model without them."""

import time

import torch
from _common import batch, loss_fn, make_model

import bagua_comm as bc
from bagua_algos import Algorithm, QAdamOptimizer, with_bagua
from bagua_comm.testing import run_ranks

STEPS = 4
WARMUP = 2


class _WithEmpty(torch.nn.Module):
    """The tiny model, with zero-size parameters between its layers (used in forward)."""

    def __init__(self, empty: bool):
        super().__init__()
        self.net = make_model(seed=5)
        if empty:
            self.e0 = torch.nn.Parameter(torch.randn(0, 3))
            self.e1 = torch.nn.Parameter(torch.randn(4, 0))

    def forward(self, x):
        out = self.net(x)
        if hasattr(self, "e0"):
            out = out + self.e0.sum() + (self.e1 @ self.e1.T).sum()
        return out


def _algorithm(name, opt):
    if name == "qadam":
        return Algorithm.init(name, q_adam_optimizer=opt, hierarchical=False)
    if name == "async":
        return Algorithm.init(name, sync_interval_ms=2, warmup_steps=WARMUP)
    if name in ("bytegrad", "decentralized", "low_precision_decentralized"):
        return Algorithm.init(name, hierarchical=False)
    return Algorithm.init(name)


def _run(name, empty):
    rank = bc.get_rank()
    model = _WithEmpty(empty)
    opt = (QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=2) if name == "qadam"
           else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    model = with_bagua(model, [opt], _algorithm(name, opt), bucket_size=64)
    for step in range(STEPS + (4 if name == "async" else 0)):
        opt.zero_grad()
        loss_fn(model, *batch(step, rank)).backward()
        opt.step()
        if name == "async" and step >= WARMUP:
            time.sleep(0.01)                  # let the background averaging run
    if name == "async":
        model.abort()
    model.detach_algorithm()
    shapes = {n: tuple(p.shape) for n, p in model.module.named_parameters()}
    return shapes, [p.detach().clone() for p in model.module.net.parameters()]


def _every_algorithm():
    out = {}
    for name in Algorithm.registered():
        with_empty = _run(name, True)
        out[name] = (with_empty, _run(name, False) if name != "async" else None)
    return out


def test_zero_size_parameters_train_with_every_algorithm():
    for got in run_ranks(_every_algorithm, 2, timeout=300):
        # every algorithm bagua_algos registers (the parent may hold test-only ones too)
        assert set(got) >= {"gradient_allreduce", "bytegrad", "decentralized",
                            "low_precision_decentralized", "async", "qadam"}, sorted(got)
        for name, ((shapes, p_empty), plain) in got.items():
            assert shapes["e0"] == (0, 3) and shapes["e1"] == (4, 0), name
            assert all(torch.isfinite(p).all() for p in p_empty), name
            if plain is None:        # async: timing-dependent averaging, trained and finite
                continue
            for a, b in zip(p_empty, plain[1]):
                assert torch.equal(a, b), name
