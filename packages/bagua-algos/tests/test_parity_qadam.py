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


OVERFLOW = {1: 1, 5: 1, 7: 0}    # step -> the rank whose loss overflows (warmup, after it)


def _qadam_scaled(scaler: bool):
    """QAdam with error feedback, under GradScaler (overflow on one rank at OVERFLOW's steps)
    or plain with those steps left out on every rank: the scale is a power of two, so
    unscaling is exact and the two runs must agree bit for bit."""
    from bagua_comm.compression import MinMaxUInt8

    rank = bc.get_rank()
    model = make_model(seed=1)
    opt = QAdamOptimizer(model.parameters(), lr=0.02, warmup_steps=WARMUP)
    model = with_bagua(model, [opt], QAdam(opt, compressor=MinMaxUInt8(2, error_feedback=True)),
                       bucket_size=256)
    gs = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    skipped, scales = [], []
    for step in range(STEPS):
        opt.zero_grad()
        loss = loss_fn(model, *batch(step, rank))
        if not scaler:
            if step not in OVERFLOW:
                loss.backward()
                opt.step()
            continue
        if OVERFLOW.get(step) == rank:
            loss = loss * float("inf")
        gs.scale(loss).backward()
        before = params(model)
        gs.step(opt)
        gs.update()
        if all(torch.equal(a, b) for a, b in zip(before, params(model))):
            skipped.append(step)
        scales.append(gs.get_scale())
    out = params(model)
    model.detach_algorithm()
    return out, skipped, scales


def _scaled_and_plain():
    return _qadam_scaled(True), _qadam_scaled(False)


def test_qadam_algorithm_under_grad_scaler_equals_plain_and_skips_together():
    """Before: refused (RuntimeError).  Now the momentum fold waits for step() (unscaled
    gradients), an overflow on one rank skips the step on every rank (warmup or not), the
    scalers keep one scale, and the residuals stay in unscaled units (the scale changes
    several times, yet the run equals the plain one)."""
    (s0, p0), (s1, p1) = run_ranks(_scaled_and_plain, 2, timeout=180)
    for (scaled, skipped, scales), (plain, _, _) in ((s0, p0), (s1, p1)):
        assert skipped == sorted(OVERFLOW)
        assert all(torch.equal(a, b) for a, b in zip(scaled, plain))
        assert len(set(scales)) > 2
    assert s0[2] == s1[2]
    assert all(torch.equal(a, b) for a, b in zip(s0[0], s1[0]))


def _scaler_after_warmup():
    model = make_model(seed=1)
    opt = QAdamOptimizer(model.parameters(), lr=0.02, warmup_steps=1)
    model = with_bagua(model, [opt], QAdam(opt))
    for step in range(2):
        opt.zero_grad()
        loss_fn(model, *batch(step, bc.get_rank())).backward()
        opt.step()
    gs = torch.amp.GradScaler("cpu", init_scale=1024.0)
    opt.zero_grad()
    gs.scale(loss_fn(model, *batch(2, bc.get_rank()))).backward()
    with pytest.raises(RuntimeError, match="from the first step"):
        gs.step(opt)
    return True


def test_grad_scaler_first_met_after_warmup_is_refused_on_every_rank():
    assert run_ranks(_scaler_after_warmup, 2, timeout=120) == [True, True]


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


def _reference_qadam_step(opt: QAdamOptimizer):
    """QAdamOptimizer.step as one Python loop of torch calls per parameter (its code before it
    went multi-tensor): the reference the multi-tensor step must equal bit for bit."""
    import math

    with torch.no_grad():
        for group in opt.param_groups:
            group["step_id"] += 1
            t = group["step_id"]
            beta1, beta2 = group["betas"]
            warm = t <= opt.warmup_steps
            bias1 = 1 - beta1 ** t
            bias2 = 1 - beta2 ** min(t, opt.warmup_steps)
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = opt.init_state(p)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                if warm or id(p) not in opt.momentum_ready:
                    grad = p.grad
                    if group["weight_decay"]:
                        grad = grad.add(p, alpha=group["weight_decay"])
                    m.mul_(beta1).add_(grad, alpha=1 - beta1)
                    if warm:
                        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = (v.sqrt() / math.sqrt(bias2)).add_(group["eps"])
                p.addcdiv_(m, denom, value=-group["lr"] / bias1)
        opt.momentum_ready.clear()


def test_the_multi_tensor_step_is_the_per_parameter_loop_bit_for_bit():
    """Two groups (one with weight decay), a parameter without a gradient, warmup then the
    frozen second moment, and momenta QAdam already folded in backward (momentum_ready)."""
    runs = []
    for step_fn in (QAdamOptimizer.step, _reference_qadam_step):
        model = make_model(seed=3)
        ps = list(model.parameters())
        opt = QAdamOptimizer([{"params": ps[:2], "weight_decay": 0.01},
                              {"params": ps[2:], "lr": 0.05}], lr=0.02, warmup_steps=3)
        for step in range(8):
            opt.zero_grad()
            loss_fn(model, *batch(step, 0)).backward()
            ps[1].grad = None                  # a parameter this step did not reach
            if step >= 3:                      # after warmup QAdam folds some momenta itself
                for p in ps[::2]:
                    opt.init_state(p)["exp_avg"].mul_(0.9).add_(p.grad, alpha=0.1)
                    opt.momentum_ready.add(id(p))
            step_fn(opt)
        runs.append((params(model), [s["exp_avg"].clone() for s in opt.state.values()]))
    (a, ma), (b, mb) = runs
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert len(ma) == len(mb) and all(torch.equal(x, y) for x, y in zip(ma, mb))
