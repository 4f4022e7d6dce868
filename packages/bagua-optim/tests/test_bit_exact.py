"""Fused and unfused optimizers give bit-identical parameters and state, step after step."""

import pytest
import torch
from _helpers import assert_same_params, assert_same_state, backward, make_model

from bagua_optim import fuse_optimizer, is_fused_optimizer

CASES = [
    ("SGD", dict(lr=0.1)),
    ("SGD", dict(lr=0.1, momentum=0.9, weight_decay=1e-2)),
    ("SGD", dict(lr=0.1, momentum=0.9, nesterov=True, dampening=0.0)),
    ("Adam", dict(lr=1e-2, weight_decay=1e-3)),
    ("Adam", dict(lr=1e-2, amsgrad=True)),
    ("AdamW", dict(lr=1e-2)),
    ("AdamW", dict(lr=1e-2, amsgrad=True)),
    ("RMSprop", dict(lr=1e-2, centered=True)),
    ("RMSprop", dict(lr=1e-2, centered=True, momentum=0.5)),
    ("Adagrad", dict(lr=0.1, lr_decay=1e-3)),
    ("Adamax", dict(lr=0.1)),
    ("Adadelta", dict(lr=1.0)),
    ("Rprop", dict(lr=1e-2)),
    ("NAdam", dict(lr=1e-2)),
    ("RAdam", dict(lr=1e-2)),
    ("ASGD", dict(lr=1e-2)),
]


class Lion(torch.optim.Optimizer):
    """A user-defined elementwise optimizer (sign of an interpolated momentum) with an int
    step counter and a tensor state entry created lazily: nothing bagua has seen before."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.99)):
        super().__init__(params, dict(lr=lr, betas=betas))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["n"] = 0
                    st["m"] = torch.zeros_like(p)
                st["n"] += 1
                update = st["m"].mul(b1).add_(p.grad, alpha=1 - b1).sign_()
                p.add_(update, alpha=-group["lr"] / st["n"] ** 0.5)
                st["m"].mul_(b2).add_(p.grad, alpha=1 - b2)
        return loss


class EagerAccumulator(torch.optim.Optimizer):
    """An Adagrad-like optimizer that creates its state in ``__init__`` and reads it in
    ``step`` without checking, as torch's Adagrad did before torch 2.5 (the probe used to
    hit its KeyError and leave it unfused)."""

    def __init__(self, params, lr=0.1, initial_accumulator_value=0.5):
        super().__init__(params, dict(lr=lr, initial_accumulator_value=initial_accumulator_value))
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["sum"] = torch.full_like(p, initial_accumulator_value)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    s = self.state[p]["sum"]
                    s.addcmul_(p.grad, p.grad)
                    p.addcdiv_(p.grad, s.sqrt().add_(1e-10), value=-group["lr"])


def _modes(name):
    yield "default", {}
    yield "foreach", {"foreach": True}
    yield "single", {"foreach": False}


def _params():
    for name, kw in CASES:
        for mode, extra in _modes(name):
            yield pytest.param(name, {**kw, **extra}, id=f"{name}-{mode}-{kw}")


def _train(opt_cls, kw, steps=6, set_to_none=True):
    plain_model, fused_model = make_model(), make_model()
    plain = opt_cls(plain_model.parameters(), **kw)
    fused = fuse_optimizer(opt_cls(fused_model.parameters(), **kw))
    assert is_fused_optimizer(fused) and not is_fused_optimizer(plain)
    for step in range(steps):
        for model, opt in ((plain_model, plain), (fused_model, fused)):
            opt.zero_grad(set_to_none=set_to_none)
            backward(model, step)
            opt.step()
        assert_same_params(plain_model, fused_model)
    assert_same_state(plain.state_dict(), fused.state_dict())
    return plain, fused, fused_model


@pytest.mark.parametrize(("name", "kw"), list(_params()))
def test_bit_identical_to_unfused(name, kw):
    _, _fused, model = _train(getattr(torch.optim, name), kw)
    # really fused: every parameter is a view of one flat buffer
    ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(ptrs) == 1


def test_state_created_in_init_is_fused():
    _, _fused, model = _train(EagerAccumulator, dict(lr=0.1))
    assert len({p.untyped_storage().data_ptr() for p in model.parameters()}) == 1


@pytest.mark.parametrize("set_to_none", [True, False])
def test_user_defined_optimizer(set_to_none):
    _, _fused, model = _train(Lion, dict(lr=1e-2), set_to_none=set_to_none)
    grads = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(grads) == 1, "gradients are views of one flat buffer again"


def test_fused_step_and_closure():
    plain_model, fused_model = make_model(), make_model()
    plain = torch.optim.Adam(plain_model.parameters(), lr=1e-2)
    fused = fuse_optimizer(torch.optim.Adam(fused_model.parameters(), lr=1e-2))
    for step in range(3):
        def closure(model=plain_model, opt=plain, step=step):
            opt.zero_grad()
            return backward(model, step)
        loss_a = plain.step(closure)

        def fused_closure(model=fused_model, opt=fused, step=step):
            opt.zero_grad()
            return backward(model, step)
        loss_b = fused.fuse_step(fused_closure) if step % 2 else fused.step(fused_closure)
        assert torch.equal(loss_a, loss_b)
        assert_same_params(plain_model, fused_model)
