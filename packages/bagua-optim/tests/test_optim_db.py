"""Every optimizer and CPU config in torch's own optimizer database, fused against unfused.

``torch.testing._internal.common_optimizers.optim_db`` lists each of torch's optimizers with
the configs torch tests it under.  Each config runs on parameters that include 0-dim ones (a
learnable scale or temperature), with the set of parameters that have gradients changing
between steps and ``load_state_dict`` round trips (fused into unfused and back), and must stay
bit-identical to the unfused optimizer: parameters and ``state_dict()`` after every step.
"""

import copy
import warnings

import pytest
import torch

from bagua_optim import fuse_optimizer

pytest.importorskip("expecttest")   # common_optimizers imports torch's test utilities
common = pytest.importorskip("torch.testing._internal.common_optimizers")

# 0-dim parameters first, in the middle and next to a 1-element one: a segment may start with
# one, and its state (``exp_avg`` of shape ()) looks like the ``step`` counter.
SHAPES = [(), (4, 3), (3,), (), (1,), (5,), (2, 2), ()]
MATRICES = [(4, 3), (3, 5), (2, 2)]          # Muon steps 2-D parameters only
# Parameters without a gradient at each step (indices into the parameters): the set changes.
NO_GRAD = {2: {0, 2}, 3: {3, 5}, 5: {7}, 6: {0, 1}}
STEPS = 8
ROUNDTRIP_AT = 3      # after this step each optimizer loads its own state_dict back
CROSS_AT = 5          # after this step fresh optimizers load the other kind's state_dict


def _configs():
    out = []
    for info in common.optim_db:
        name = info.optim_cls.__name__
        # torch's own expansion: every config crossed with differentiable and fused ...
        inputs = common._get_optim_inputs_including_global_cliquey_kwargs(
            "cpu", torch.float32, info)
        # ... plus foreach=True, where the optimizer has a foreach implementation.
        if "foreach" in info.supported_impls:
            inputs += [common.OptimizerInput(params=None, kwargs={**x.kwargs, "foreach": True},
                                             desc=x.desc + " & foreach")
                       for x in info.optim_inputs_func(device="cpu", dtype=torch.float32)]
        for x in inputs:
            out.append(pytest.param(info.optim_cls, x.kwargs, id=f"{name}-{x.desc}"))
    return out


CONFIGS = _configs()


def _params(cls, kwargs, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = MATRICES if cls.__name__ == "Muon" else SHAPES
    # differentiable=True steps with autograd on: torch refuses in-place updates of leaves
    # that require grad, so those configs run on parameters that do not
    grad = not kwargs.get("differentiable", False)
    return [torch.nn.Parameter(torch.randn(s, generator=gen), requires_grad=grad)
            for s in shapes]


def _grads(params, step, cls):
    gen = torch.Generator().manual_seed(1000 + step)
    grads = [torch.randn(p.shape, generator=gen) for p in params]
    if cls is torch.optim.SparseAdam:
        return [g.to_sparse() for g in grads]
    return [None if i in NO_GRAD.get(step, ()) else g for i, g in enumerate(grads)]


def _make(cls, params, kwargs):
    return cls(params, **copy.deepcopy(kwargs))


def _step(opt, params, grads):
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.clone()

    def closure():      # LBFGS re-evaluates: a fixed quadratic whose gradient is p - g
        with torch.enable_grad():
            loss = sum(((p - (0 if g is None else g.to_dense())) ** 2).sum()
                       for p, g in zip(params, grads) if g is not None)
        for p, g in zip(params, grads):
            if g is not None:
                p.grad = 2 * (p.detach() - g.to_dense())
        return loss.detach()

    if isinstance(opt, torch.optim.LBFGS):
        opt.step(closure)
    else:
        opt.step()


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a, b))
    if isinstance(a, dict):
        return (isinstance(b, dict) and a.keys() == b.keys()
                and all(_equal(v, b[k]) for k, v in a.items()))
    if isinstance(a, (list, tuple)):
        return (type(a) is type(b) and len(a) == len(b)
                and all(map(_equal, a, b)))
    return a == b


def _same(pa, pb, oa, ob, where):
    for i, (x, y) in enumerate(zip(pa, pb)):
        assert torch.equal(x, y), f"{where}: parameter {i} differs"
    sa, sb = oa.state_dict(), ob.state_dict()
    assert _equal(sa["state"], sb["state"]), f"{where}: state_dict()['state'] differs"
    assert _equal(sa["param_groups"], sb["param_groups"]), f"{where}: param_groups differ"


@pytest.mark.parametrize(("cls", "kwargs"), CONFIGS)
def test_optim_db_config_bit_identical(cls, kwargs):
    pa, pb = _params(cls, kwargs), _params(cls, kwargs)
    try:
        plain = _make(cls, pa, kwargs)
    except (ValueError, RuntimeError) as err:
        pytest.skip(f"torch refuses this config on CPU: {err}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # the not-elementwise warning, torch's own
        fused = fuse_optimizer(_make(cls, pb, kwargs))
        for step in range(STEPS):
            grads = _grads(pa, step, cls)
            _step(plain, pa, grads)
            _step(fused, pb, grads)
            _same(pa, pb, plain, fused, f"step {step}")
            if step == ROUNDTRIP_AT:
                plain.load_state_dict(copy.deepcopy(plain.state_dict()))
                fused.load_state_dict(copy.deepcopy(fused.state_dict()))
            if step == CROSS_AT:
                sd_plain, sd_fused = plain.state_dict(), fused.state_dict()
                plain = _make(cls, pa, kwargs)
                plain.load_state_dict(copy.deepcopy(sd_fused))
                fused = fuse_optimizer(_make(cls, pb, kwargs))
                fused.load_state_dict(copy.deepcopy(sd_plain))
                _same(pa, pb, plain, fused, "after loading the other kind's state_dict")


def test_optim_db_covers_torch_optimizers():
    names = {c.values[0].__name__ for c in CONFIGS}
    assert {"Adam", "AdamW", "SGD", "Adagrad", "RMSprop", "ASGD", "LBFGS"} <= names
    assert len(CONFIGS) >= 200
