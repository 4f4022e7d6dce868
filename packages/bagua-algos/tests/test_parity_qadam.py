"""QAdam against its own plain run: fused optimizer, GradScaler, activation checkpointing."""

import pytest
import torch
from _common import batch, loss_fn, make_model, params

import bagua_comm as bc
from bagua_algos import QAdam, QAdamOptimizer, with_bagua
from bagua_comm.testing import run_ranks

WARMUP, STEPS = 3, 10


def _qadam_run(fused: bool):
    from bagua_optim import fuse_optimizer

    model = make_model(seed=1)
    opt = QAdamOptimizer(model.parameters(), lr=0.02, warmup_steps=WARMUP)
    if fused:
        opt = fuse_optimizer(opt, do_flatten=True)
    model = with_bagua(model, [opt], QAdam(opt), bucket_size=256)
    rank = bc.get_rank()
    for step in range(STEPS):
        opt.zero_grad()
        loss_fn(model, *batch(step, rank)).backward()
        opt.step()
    out = params(model)
    model.detach_algorithm()
    return out


def _fused_and_unfused():
    return _qadam_run(False), _qadam_run(True)


def test_fused_qadam_equals_unfused_bit_for_bit():
    for plain, fused in run_ranks(_fused_and_unfused, 2, timeout=120):
        assert all(torch.equal(a, b) for a, b in zip(plain, fused))


def _standalone(scaler: bool):
    model = make_model(seed=2)
    opt = QAdamOptimizer(model.parameters(), lr=0.02, warmup_steps=2)
    gs = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2) if scaler else None
    skipped = 0
    for step in range(8):
        opt.zero_grad()
        loss = loss_fn(model, *batch(step, 0))
        if scaler:
            if step == 4:           # an overflow: the scaler must skip this step
                loss = loss * float("inf")
            gs.scale(loss).backward()
            before = params(model)
            gs.step(opt)
            gs.update()
            skipped += all(torch.equal(a, b) for a, b in zip(before, params(model)))
        elif step != 4:
            loss.backward()
            opt.step()
    return params(model), skipped


def test_standalone_qadam_with_grad_scaler_equals_without():
    plain, _ = _standalone(False)
    scaled, skipped = _standalone(True)
    assert skipped == 1
    for a, b in zip(plain, scaled):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _under_qadam_with_scaler():
    model = make_model(seed=1)
    opt = QAdamOptimizer(model.parameters(), lr=0.02, warmup_steps=WARMUP)
    model = with_bagua(model, [opt], QAdam(opt))
    gs = torch.amp.GradScaler("cpu", init_scale=1024.0)
    opt.zero_grad()
    gs.scale(loss_fn(model, *batch(0, bc.get_rank()))).backward()
    before = params(model)
    try:
        gs.step(opt)
    except RuntimeError as err:
        return str(err), all(torch.equal(a, b) for a, b in zip(before, params(model)))
    return None, False


def test_qadam_algorithm_refuses_grad_scaler_on_every_rank_before_any_update():
    for msg, untouched in run_ranks(_under_qadam_with_scaler, 2, timeout=120):
        assert msg is not None and "GradScaler" in msg and "backward" in msg
        assert untouched


@pytest.mark.parametrize("reentrant", [True, False])
def test_qadam_with_checkpointing_equals_plain_model(reentrant):
    plain, ckpt = zip(*run_ranks(_checkpointed_qadam, 2, args=(reentrant,), timeout=120))
    for p, c in zip(plain, ckpt):
        for a, b in zip(p, c):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


class _Checkpointed(torch.nn.Module):
    def __init__(self, inner, reentrant):
        super().__init__()
        self.inner, self.reentrant = inner, reentrant

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(self.inner[:2], x, use_reentrant=self.reentrant)
        return checkpoint(self.inner[2:], h, use_reentrant=self.reentrant)   # the head too


def _qadam_model(reentrant):
    model = make_model(seed=1)
    if reentrant is not None:
        model = _Checkpointed(model, reentrant)
    opt = QAdamOptimizer(model.parameters(), lr=0.02, warmup_steps=WARMUP)
    model = with_bagua(model, [opt], QAdam(opt), bucket_size=256)
    rank = bc.get_rank()
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, rank)
        if reentrant is not None:
            x = x.requires_grad_()      # reentrant checkpoint needs an input that needs grad
        loss_fn(model, x, y).backward()
        opt.step()
    out = params(model)
    model.detach_algorithm()
    return out


def _checkpointed_qadam(reentrant):
    return _qadam_model(None), _qadam_model(reentrant)
