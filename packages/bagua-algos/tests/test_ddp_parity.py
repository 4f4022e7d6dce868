"""with_bagua against torch's DistributedDataParallel on the same seeds (2 gloo ranks):
activation checkpointing, parameters without a gradient, buffers (issue #29, section A)."""

import pytest
import torch
from _common import batch, make_model, params
from torch.nn.parallel import DistributedDataParallel as DDP

import bagua_comm as bc
from bagua_algos import Algorithm, GradientAllReduce, with_bagua
from bagua_comm.testing import run_ranks

STEPS = 6


# -- activation checkpointing: one communication per backward ---------------------------------
class _Ckpt(torch.nn.Module):
    def __init__(self, inner, reentrant):
        super().__init__()
        self.inner, self.reentrant = inner, reentrant

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        if self.reentrant is None:
            return self.inner(x)
        h = checkpoint(self.inner[:2], x, use_reentrant=self.reentrant)
        return checkpoint(self.inner[2:], h, use_reentrant=self.reentrant)   # the head too


def _bytes_per_step(name, reentrant):
    rank = bc.get_rank()
    model = _Ckpt(make_model(seed=1), reentrant)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    kwargs = {"hierarchical": False} if name in ("bytegrad", "decentralized") else {}
    algo = Algorithm.init(name, **kwargs)
    model = with_bagua(model, [opt], algo, bucket_size=256)
    sent = []
    for step in range(4):
        bc.traffic.reset()
        opt.zero_grad()
        x, y = batch(step, rank)
        out = model(x.requires_grad_())
        torch.nn.functional.mse_loss(out, y).backward()
        opt.step()
        sent.append(bc.traffic.bytes_sent())
    model.detach_algorithm()
    return sent[1:], params(model)          # step 0 fixes the bucket order


def _plain_and_reentrant(name):
    return _bytes_per_step(name, None), _bytes_per_step(name, True)


@pytest.mark.parametrize("name", ["gradient_allreduce", "bytegrad", "decentralized"])
def test_reentrant_checkpointing_communicates_once_per_backward(name):
    for (b_plain, p_plain), (b_reent, p_reent) in run_ranks(_plain_and_reentrant, 2,
                                                            args=(name,), timeout=120):
        assert b_reent == b_plain
        for a, b in zip(p_plain, p_reent):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


# -- parameters without a gradient ------------------------------------------------------------
class _Branchy(torch.nn.Module):
    """``a`` always used; ``b`` used on rank 0 at even steps only; ``c`` never used."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.a = torch.nn.Linear(6, 6)
        self.b = torch.nn.Linear(6, 6)
        self.c = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 1)
        self.use_b = False

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.use_b:
            h = h + torch.tanh(self.b(h))
        return self.head(h)


def _branchy_run(wrapper):
    rank = bc.get_rank()
    model = _Branchy()
    model.a.weight.requires_grad_(False) if wrapper == "unfreeze" else None
    if wrapper == "ddp":
        wrapped = DDP(model, find_unused_parameters=True)
    else:
        wrapped = None
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
    if wrapped is None:
        wrapped = with_bagua(model, [opt], GradientAllReduce(), bucket_size=128)
    grads_none, frozen_before = [], None
    for step in range(STEPS):
        if step == 3 and wrapper != "unfreeze":
            model.head.bias.requires_grad_(False)       # frozen after wrapping
            frozen_before = model.head.bias.detach().clone()
        if step == 3 and wrapper == "unfreeze":
            model.a.weight.requires_grad_(True)         # frozen at wrapping, unfrozen now
        model.use_b = rank == 0 and step % 2 == 0
        opt.zero_grad(set_to_none=True)
        x, y = batch(step, rank)
        torch.nn.functional.mse_loss(wrapped(x), y).backward()
        grads_none.append([p.grad is None for p in model.parameters()])
        opt.step()
    return params(model), grads_none, frozen_before


def _branchy_runs():
    return {w: _branchy_run(w) for w in ("bagua", "ddp", "unfreeze")}


@pytest.fixture(scope="module")
def branchy():
    return run_ranks(_branchy_runs, 2, timeout=180)


def test_unused_parameters_as_ddp_find_unused_parameters(branchy):
    ours, ddp = [r["bagua"] for r in branchy], [r["ddp"] for r in branchy]
    for (p_ours, none_ours, frozen), (p_ddp, none_ddp, _) in zip(ours, ddp):
        assert none_ours == none_ddp            # c never has a gradient; b only when used
        for a, b in zip(p_ours, p_ddp):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        assert torch.equal(frozen, p_ours[-1])   # head.bias frozen after wrapping stays
    assert all(torch.equal(a, b) for a, b in zip(ours[0][0], ours[1][0]))


def test_parameter_unfrozen_after_wrapping_is_synchronised(branchy):
    ours = [r["unfreeze"] for r in branchy]
    a0, a1 = ours[0][0][0], ours[1][0][0]        # a.weight on each rank
    assert torch.equal(a0, a1)
    assert not torch.equal(a0, _Branchy().a.weight.detach())     # it did train


# -- buffers: every forward starts from rank 0's ----------------------------------------------
def _bn_run(wrapper, name):
    rank = bc.get_rank()
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    if wrapper == "ddp":
        wrapped = DDP(model)
    else:
        kwargs = {"bytegrad": {"hierarchical": False},
                  # every entry sent / full rank: GradientAllReduce's gradients up to rounding
                  "topk": {"density": 1.0},
                  "low_rank": {"rank": 8, "min_compression_rate": 0.0}}.get(name, {})
        wrapped = with_bagua(model, [opt], Algorithm.init(name, **kwargs))
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, rank)
        x = x * (1 + rank) + rank                 # rank-different statistics
        torch.nn.functional.mse_loss(wrapped(x), y).backward()
        opt.step()
    return [b.clone() for b in model.buffers()], params(model)


def _bn_runs():
    return {"ddp": _bn_run("ddp", None), "gradient_allreduce": _bn_run("bagua", "gradient_allreduce"),
            "bytegrad": _bn_run("bagua", "bytegrad"), "topk": _bn_run("bagua", "topk"),
            "low_rank": _bn_run("bagua", "low_rank")}


@pytest.fixture(scope="module")
def bn_runs():
    return run_ranks(_bn_runs, 2, timeout=180)


@pytest.mark.parametrize("name", ["gradient_allreduce", "bytegrad", "topk", "low_rank"])
def test_buffers_broadcast_from_rank_zero_as_ddp(bn_runs, name):
    _check_buffers(bn_runs, name)


def _check_buffers(runs, name):
    ours, ddp = [r[name] for r in runs], [r["ddp"] for r in runs]
    # ByteGrad's compressed gradients move the weights (hence the statistics) a little;
    # TopK's sum of gathered entries and LowRank's P Qᵀ round differently from an allreduce
    atol = {"gradient_allreduce": 1e-6, "bytegrad": 1e-3}.get(name, 1e-5)
    for (b_ours, p_ours), (b_ddp, p_ddp) in zip(ours, ddp):
        for a, b in zip(b_ours, b_ddp):
            torch.testing.assert_close(a, b, rtol=0, atol=atol)
        if name != "bytegrad":
            for a, b in zip(p_ours, p_ddp):
                torch.testing.assert_close(a, b, rtol=0, atol=atol)
