"""Uneven inputs: ``with model.join():`` against DDP's ``join()`` (2 gloo ranks).

Rank 0 has 5 batches, rank 1 has 3: rank 1 shadows the last two steps with zero gradients.
After the loop the parameters (and BatchNorm's statistics) must equal DDP's, bit for bit,
on both ranks; with a sparse embedding too.  ``throw_on_early_termination=True`` raises on
both ranks as DDP does; algorithms with per-rank state are refused before any communication.
"""

from __future__ import annotations

import pytest
import torch

import bagua_comm as bc
from bagua_algos import ByteGrad, GradientAllReduce, with_bagua
from bagua_comm.testing import run_ranks

BATCHES = {0: 5, 1: 3}


class _Model(torch.nn.Module):
    def __init__(self, sparse):
        super().__init__()
        torch.manual_seed(0)
        self.tok = torch.nn.Embedding(40, 8, sparse=sparse)
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                                        torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def forward(self, i):
        return self.body(self.tok(i).mean(1)).squeeze(1)


def _batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, 40, (6, 3), generator=g), torch.randn(6, generator=g)


def _uneven(sparse):
    from torch.nn.parallel import DistributedDataParallel

    rank = bc.get_rank()
    out = {}
    for kind in ("ddp", "bagua"):
        model = _Model(sparse)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        net = (DistributedDataParallel(model) if kind == "ddp"
               else with_bagua(model, [opt], GradientAllReduce()))
        with net.join():
            for step in range(BATCHES[rank]):
                opt.zero_grad()
                x, y = _batch(step, rank)
                ((net(x) - y) ** 2).mean().backward()
                opt.step()
        out[kind] = torch.cat([t.detach().flatten().float()
                               for t in [*model.parameters(), *model.buffers()]])
    return (out["ddp"] - out["bagua"]).abs().max().item(), out["bagua"]


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse-embedding"])
def test_uneven_inputs_under_join_equal_ddp(sparse):
    results = run_ranks(_uneven, 2, args=(sparse,), timeout=120)
    for worst, _ in results:
        assert worst == 0.0, worst
    assert torch.equal(results[0][1], results[1][1])


def _epochs():
    """Two epochs, each its own join() (uneven the other way round in the second), with a
    no_sync() micro-batch before each step and an evaluation pass after each epoch: the
    buffer broadcasts follow DDP's timing (the forward after a synchronised one), which the
    joined rank shadows too."""
    from torch.nn.parallel import DistributedDataParallel

    rank = bc.get_rank()
    out = {}
    for kind in ("ddp", "bagua"):
        model = _Model(False)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        net = (DistributedDataParallel(model) if kind == "ddp"
               else with_bagua(model, [opt], GradientAllReduce()))
        evals = []
        for epoch, batches in enumerate(({0: 5, 1: 3}, {0: 2, 1: 4})):
            with net.join():
                for step in range(batches[rank]):
                    opt.zero_grad()
                    x, y = _batch(50 + step + 10 * epoch, rank)
                    with net.no_sync():
                        ((net(x) - y) ** 2).mean().backward()
                    x, y = _batch(step + 10 * epoch, rank)
                    ((net(x) - y) ** 2).mean().backward()
                    opt.step()
            net.eval()
            with torch.no_grad():
                evals.append(net(_batch(99, rank)[0]))
            net.train()
        out[kind] = torch.cat([t.detach().flatten().float()
                               for t in [*model.parameters(), *model.buffers(), *evals]])
    return (out["ddp"] - out["bagua"]).abs().max().item()


def test_epochs_of_accumulation_and_evaluation_under_join_equal_ddp():
    assert run_ranks(_epochs, 2, timeout=120) == [0.0, 0.0]


def _throws():
    rank = bc.get_rank()
    model = _Model(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    net = with_bagua(model, [opt], GradientAllReduce())
    try:
        with net.join(throw_on_early_termination=True):
            for step in range(BATCHES[rank]):
                opt.zero_grad()
                x, y = _batch(step, rank)
                ((net(x) - y) ** 2).mean().backward()
                opt.step()
    except RuntimeError as err:
        return step, str(err)
    return None


def test_throw_on_early_termination_raises_on_every_rank():
    (step0, msg0), (step1, msg1) = run_ranks(_throws, 2, timeout=120)
    assert step0 == 3 and step1 == 2           # rank 0 in its 4th forward; rank 1 had ended
    assert "ran out of inputs" in msg0 and "ran out of inputs" in msg1


def _refused():
    model = _Model(False)
    net = with_bagua(model, [torch.optim.SGD(model.parameters(), lr=0.1)], ByteGrad())
    with pytest.raises(ValueError) as info, net.join():
        pass
    plain = with_bagua(_Model(False), [], GradientAllReduce())
    with pytest.raises(ValueError, match="divide_by_initial_world_size=False"), \
            plain.join(divide_by_initial_world_size=False):
        pass
    with pytest.raises(ValueError, match="throw_on_early_termination must be True or False"), \
            plain.join(throw_on_early_termination=1):
        pass
    return str(info.value)


def test_join_refuses_what_it_cannot_shadow_before_communicating():
    for message in run_ranks(_refused, 2, timeout=120):
        assert "join() shadows GradientAllReduce" in message
        assert "ByteGrad" in message
