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


# -- a block shared by several reentrant-checkpointed segments ------------------------------
class _SharedBlock(torch.nn.Module):
    """One block applied ``uses`` times, each application checkpointed (reentrant): its
    gradient is accumulated once per segment, in separate inner backwards."""

    def __init__(self, uses=2):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.block, self.head = (torch.nn.Linear(6, 64), torch.nn.Linear(64, 64),
                                           torch.nn.Linear(64, 1))
        self.uses = uses

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = torch.tanh(self.inp(x))
        for _ in range(self.uses):
            h = checkpoint(lambda t: torch.tanh(self.block(t)), h, use_reentrant=True)
        return self.head(h)


SHARED = {"gradient_allreduce": GradientAllReduce,
          "topk_dense": lambda: Algorithm.init("topk", density=1.0),
          "low_rank_full": lambda: Algorithm.init("low_rank", rank=64, min_compression_rate=0.0)}


def _shared_block(kind):
    rank = bc.get_rank()
    model = _SharedBlock()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # the block's weight in a bucket of its own, which would start after its first segment
    net = (DDP(model, static_graph=True) if kind == "ddp"
           else with_bagua(model, [opt], SHARED[kind](), bucket_size=64 * 64 * 4))
    for step in range(4):
        opt.zero_grad()
        x, y = batch(step, rank)
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _shared_block_runs():
    return {k: _shared_block(k) for k in ("ddp", *SHARED)}


def test_block_shared_by_reentrant_checkpointed_segments_equals_ddp():
    """Before the fix the block's bucket started after its first segment's gradient and the
    second was added into it in flight: GradientAllReduce left the ranks different, TopK and
    LowRank (lossless settings) lost the second segment's gradient on every rank."""
    r0, r1 = run_ranks(_shared_block_runs, 2, timeout=180)
    assert torch.equal(r0["ddp"], r1["ddp"])
    for kind in SHARED:
        assert torch.equal(r0[kind], r1[kind]), kind
        atol = 0.0 if kind != "low_rank_full" else 1e-6
        diff = (r0[kind] - r0["ddp"]).abs().max().item()
        assert diff <= atol, f"{kind} differs from DDP(static_graph=True) by {diff:.3g}"


def _more_segments_later():
    rank = bc.get_rank()
    model = _SharedBlock(uses=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    net = with_bagua(model, [opt], GradientAllReduce(), bucket_size=64 * 64 * 4)
    for step in range(3):
        model.uses = 1 if step < 2 else 2     # a second segment only from the third step
        opt.zero_grad()
        x, y = batch(step, rank)
        try:
            torch.nn.functional.mse_loss(net(x), y).backward()
        except RuntimeError as err:
            return step, str(err)
        opt.step()
    return None


def test_more_reentrant_segments_than_before_raise_instead_of_a_wrong_average():
    for step, msg in run_ranks(_more_segments_later, 2, timeout=120):
        assert step == 2
        assert "parameter 'block." in msg and "received gradient accumulation 2" in msg
        assert "use_reentrant=False" in msg


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
