"""Optimizers whose update is not elementwise are stepped one parameter at a time, once warned."""

import warnings

import pytest
import torch
from _helpers import assert_same_params, backward, make_model

from bagua_optim import fuse_optimizer


class LayerwiseSGD(torch.optim.Optimizer):
    """LARS-like: the step is scaled by each parameter's own norm (not elementwise)."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    trust = p.norm() / (p.grad.norm() + 1e-6)
                    p.add_(p.grad, alpha=-group["lr"] * float(trust))


class ShapeReader(torch.optim.Optimizer):
    """Scales matrices and vectors differently: reads the parameter's shape."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] * (2.0 if p.dim() > 1 else 1.0))


@pytest.mark.parametrize("cls", [LayerwiseSGD, ShapeReader])
def test_not_elementwise_falls_back_with_one_warning(cls):
    ma, mb = make_model(), make_model()
    plain = cls(ma.parameters())
    with pytest.warns(RuntimeWarning, match="not updated elementwise") as record:
        fused = fuse_optimizer(cls(mb.parameters()))
    assert len(record) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for s in range(3):
            for model, opt in ((ma, plain), (mb, fused)):
                opt.zero_grad()
                backward(model, s)
                opt.step()
            assert_same_params(ma, mb)


def test_lbfgs_is_refused_and_still_works():
    ma, mb = make_model(), make_model()
    plain = torch.optim.LBFGS(ma.parameters(), lr=0.5, max_iter=3)
    with pytest.warns(RuntimeWarning, match="LBFGS"):
        fused = fuse_optimizer(torch.optim.LBFGS(mb.parameters(), lr=0.5, max_iter=3))
    for s in range(2):
        for model, opt in ((ma, plain), (mb, fused)):
            def closure(model=model, opt=opt, s=s):
                opt.zero_grad()
                return backward(model, s)
            opt.step(closure)
        assert_same_params(ma, mb)
