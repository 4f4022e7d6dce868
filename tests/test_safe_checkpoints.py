"""Every algorithm's checkpoint (model, optimizer with the algorithm's state inside) and every
sampler's state load with ``torch.load(..., weights_only=True)`` -- the safe default the docs
teach, which never runs code from the file -- and load back into a run exactly."""

from __future__ import annotations

import io

import pytest
import torch

import bagua_comm as bc
from bagua_algos import Algorithm, QAdam, QAdamOptimizer, with_bagua
from bagua_algos.algorithm import _REGISTRY
from bagua_comm.compression import MinMaxUInt8
from bagua_comm.testing import run_ranks

# Settings that put real per-rank state into the checkpoint (residuals, replicas, counters).
SETTINGS = {
    "bytegrad": {"hierarchical": False, "compressor": MinMaxUInt8(2, error_feedback=True)},
    "decentralized": {"hierarchical": False},
    "low_precision_decentralized": {"hierarchical": False},
    "async": {"sync_interval_ms": 50},
}
SKIP = {"test_sign_sgd", "test_probe"}         # algorithms test modules register


def _names():
    import bagua_algos  # noqa: F401  (registers the built-in algorithms)
    return sorted(n for n in _REGISTRY if n not in SKIP and not n.startswith("test_"))


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _every_algorithm(names):
    rank = bc.get_rank()
    out = {}
    for name in names:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                                    torch.nn.Linear(16, 1))
        if name == "qadam":
            opt = QAdamOptimizer(model.parameters(), lr=1e-3, warmup_steps=2)
            algo = QAdam(opt, hierarchical=False)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            algo = Algorithm.init(name, **SETTINGS.get(name, {}))
        model = with_bagua(model, [opt], algo)
        g = torch.Generator().manual_seed(rank)
        for _ in range(4):
            opt.zero_grad()
            model(torch.randn(16, 8, generator=g)).pow(2).mean().backward()
            opt.step()
        if name == "async":
            model.abort()
        ck = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        try:
            back = _roundtrip(ck)
        except Exception as err:  # the failure is the result
            out[name] = f"{type(err).__name__}: {err}"
            continue
        same = _equal(ck, back)
        opt.load_state_dict(back["optimizer"])        # and it loads into the run
        model.load_state_dict(back["model"])
        out[name] = "ok" if same else "differs after the round trip"
    return out


@pytest.mark.timeout(300)
def test_every_algorithms_checkpoint_loads_with_weights_only():
    names = _names()
    assert {"gradient_allreduce", "bytegrad", "decentralized", "low_precision_decentralized",
            "async", "qadam"} <= set(names)
    for rank, result in enumerate(run_ranks(_every_algorithm, 2, args=(names,), timeout=240)):
        bad = {n: r for n, r in result.items() if r != "ok"}
        assert not bad, f"rank {rank}: {bad}"


def test_every_samplers_state_loads_with_weights_only():
    import bagua_data

    data = list(range(103))
    lengths = [(i * 37) % 50 + 1 for i in data]
    samplers = []
    for cls_name in bagua_data.__all__:
        cls = getattr(bagua_data, cls_name)
        if not isinstance(cls, type) or not hasattr(cls, "state_dict"):
            continue
        if cls_name == "LoadBalancingDistributedSampler":
            samplers.append(cls(data, lambda x: lengths[x], num_replicas=2, rank=0))
        elif cls_name == "LoadBalancingDistributedBatchSampler":
            inner = bagua_data.LoadBalancingDistributedSampler(
                data, lambda x: lengths[x], num_replicas=2, rank=0)
            samplers.append(cls(inner, batch_fn=lambda idx: [idx[i:i + 4]
                                                              for i in range(0, len(idx), 4)]))
        else:
            samplers.append(cls(data, lengths, batch_size=4, num_replicas=2, rank=0))
    assert len(samplers) >= 3, [type(s).__name__ for s in samplers]
    for s in samplers:
        it = iter(s)
        for _ in range(3):
            next(it)
        state = s.state_dict()
        back = _roundtrip(state)
        assert _equal(state, back), type(s).__name__
        s.load_state_dict(back)
