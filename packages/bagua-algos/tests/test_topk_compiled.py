"""TopK's compiled exchange (one job per bucket on the gloo worker, issue #46) gives bit for
bit the gradients of a numpy simulation of every rank's top-k with error feedback, and of its
Python path, at 2 and 3 ranks, over several steps: with parameters that share a size at even
and uneven offsets, one that sends every entry, a parameter one rank leaves unused, and an
overflow on one rank (the residuals of that bucket stay as they were, on every rank)."""

import math

import numpy as np
import pytest
import torch

import bagua_comm as bc
from bagua_algos import TopK, with_bagua
from bagua_comm.testing import run_ranks

STEPS, DENSITY = 6, 0.1
# registration order; buckets take them reversed: equal sizes at uneven offsets (a, c, e),
# a one-element parameter (f: every entry sent), vectors of one size (b, g)
SHAPES = {"k": (6, 6), "i": (5, 5), "j": (4,), "a": (12, 10), "b": (10,), "c": (12, 10), "d": (3,), "e": (12, 10), "f": (1,),
          "g": (10,), "h": (7, 9)}
UNUSED = ("b", 1, 2)      # parameter b has no gradient on rank 1 at step 2
OVERFLOW = ("h", 1, 3)    # an infinity in h's gradient on rank 1 at step 3


class Probe(torch.nn.Module):
    """``forward(cs)`` = sum of ``(p * c).sum()``: each parameter's gradient is its ``c``
    (None: the parameter is not used)."""

    def __init__(self):
        super().__init__()
        for name, shape in SHAPES.items():
            self.register_parameter(name, torch.nn.Parameter(torch.zeros(shape)))

    def forward(self, cs):
        return sum((getattr(self, n) * c).sum() for n, c in cs.items() if c is not None)


def grads(step: int, rank: int) -> dict:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    out = {n: torch.randn(s, generator=gen) * (1 + step) for n, s in SHAPES.items()}
    if (rank, step) == UNUSED[1:]:
        out[UNUSED[0]] = None
    if (rank, step) == OVERFLOW[1:]:
        out[OVERFLOW[0]].view(-1)[5] = float("inf")
    return out


def _run(compiled: bool):
    from bagua_algos.algorithms import _topk_round

    rank = bc.get_rank()
    eligible = _topk_round.eligible
    if not compiled:                 # the Python path (TopKImpl.exchange)
        _topk_round.eligible = lambda impl, buckets: False
    try:
        model = Probe()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        wrapped = with_bagua(model, [opt], TopK(density=DENSITY), bucket_size=1800)
        impl = wrapped.impl
        out, layout = [], [list(b.names) for b in wrapped.buckets]
        for step in range(STEPS):
            opt.zero_grad()
            wrapped(grads(step, rank)).backward()
            out.append({n: None if p.grad is None else p.grad.clone()
                        for n, p in model.named_parameters()})
        took = impl._compiled is not None and impl._compiled[2] is not None
        wrapped.detach_algorithm()
    finally:
        _topk_round.eligible = eligible
    return took, out, layout


def _both():
    return {compiled: _run(compiled) for compiled in (True, False)}


def reference(world: int, layout) -> list[dict]:
    """numpy, float32: per rank ``c = residual + g`` per parameter, its ``k`` largest
    ``|c|`` sent, the rest kept; the sent vectors added in rank order and divided by the
    world size; a bucket whose result is not finite keeps its residuals as they were."""
    residual = [{n: np.zeros(math.prod(s), np.float32) for n, s in SHAPES.items()}
                for _ in range(world)]
    history = []
    for step in range(STEPS):
        gs = [grads(step, r) for r in range(world)]
        result = {}
        for names in layout:
            nxt = [{} for _ in range(world)]
            for n in names:
                total = np.zeros(math.prod(SHAPES[n]), np.float32)
                for r in range(world):
                    g = gs[r][n]
                    g = np.zeros_like(total) if g is None else g.reshape(-1).numpy()
                    c = residual[r][n] + g
                    k = min(c.size, max(1, math.ceil(DENSITY * c.size)))
                    keep = np.argsort(-np.abs(c), kind="stable")[:k]
                    total[keep] += c[keep]
                    rest = c.copy()
                    with np.errstate(invalid="ignore"):     # inf - inf: the overflow
                        rest[keep] -= c[keep]
                    nxt[r][n] = rest
                result[n] = total / np.float32(world)
            if all(np.isfinite(result[n]).all() for n in names):
                for r in range(world):
                    residual[r].update(nxt[r])
        history.append(result)
    return history


@pytest.mark.parametrize("world", [2, 3])
def test_compiled_exchange_is_the_numpy_reference_and_the_python_path_bit_for_bit(world):
    results = run_ranks(_both, world, timeout=240)
    layout = results[0][True][2]
    assert len(layout) == 2 and len(layout[0]) == 9    # a, c, e in one: uneven offsets
    want = reference(world, layout)
    for r in results:
        took, fast, _ = r[True]
        took_slow, slow, _ = r[False]
        assert took and not took_slow
        for step in range(STEPS):
            for n in SHAPES:
                got, py = fast[step][n], slow[step][n]
                w = torch.from_numpy(want[step][n]).reshape(SHAPES[n])
                assert torch.equal(got.view(torch.int32), py.view(torch.int32)), (step, n)
                assert torch.equal(got.view(torch.int32), w.view(torch.int32)), (step, n)
    # ranks identical, and the overflow reached every rank (its step is skipped everywhere)
    for r in results[1:]:
        for a, b in zip(r[True][1], results[0][True][1]):
            assert all(torch.equal(a[n].view(torch.int32), b[n].view(torch.int32))
                       for n in SHAPES)
    assert not torch.isfinite(results[0][True][1][OVERFLOW[2]][OVERFLOW[0]]).all()
