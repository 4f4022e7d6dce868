"""Checkpoints, LR schedulers, add_param_group, GradScaler, storage repair, do_flatten=False."""

import copy
import io
import warnings

import pytest
import torch
from _helpers import assert_same_params, assert_same_state, backward, make_model

from bagua_optim import fuse_optimizer, is_fused_optimizer


def _pair(cls=torch.optim.AdamW, **kw):
    kw.setdefault("lr", 1e-2)
    a, b = make_model(), make_model()
    return a, cls(a.parameters(), **kw), b, fuse_optimizer(cls(b.parameters(), **kw))


def _step(model, opt, step):
    opt.zero_grad()
    backward(model, step)
    opt.step()


def _roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf)


@pytest.mark.parametrize("direction", ["fused_to_plain", "plain_to_fused"])
def test_checkpoints_are_interchangeable(direction):
    ma, plain, mb, fused = _pair(amsgrad=True)
    for s in range(3):
        _step(ma, plain, s)
        _step(mb, fused, s)
    src, src_model = (fused, mb) if direction == "fused_to_plain" else (plain, ma)
    sd = _roundtrip(src.state_dict())
    # the receiving side starts from the same weights but a fresh optimizer of the other kind
    mc = make_model()
    mc.load_state_dict(src_model.state_dict())
    if direction == "fused_to_plain":
        dst = torch.optim.AdamW(mc.parameters(), lr=1e-2, amsgrad=True)
    else:
        dst = fuse_optimizer(torch.optim.AdamW(mc.parameters(), lr=1e-2, amsgrad=True))
    dst.load_state_dict(sd)
    for s in range(3, 6):
        _step(src_model, src, s)
        _step(mc, dst, s)
        assert_same_params(src_model, mc)
    assert_same_state(src.state_dict(), dst.state_dict())


def test_state_dict_step_tensors_are_independent():
    # 'step' entries are distinct storage elements: an unfused optimizer loading them in the
    # same process must not increment one shared counter once per parameter.
    _, _, mb, fused = _pair()
    _step(mb, fused, 0)
    plain_model = copy.deepcopy(mb)
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    plain.load_state_dict(copy.deepcopy(fused.state_dict()))
    _step(plain_model, plain, 1)
    steps = [st["step"].item() for st in plain.state_dict()["state"].values()]
    assert steps == [2.0] * len(steps)


@pytest.mark.parametrize("before", [True, False])
def test_lr_scheduler(before):
    ma, plain, mb, fused = _pair(torch.optim.SGD, lr=0.5, momentum=0.9)
    sched_a = torch.optim.lr_scheduler.StepLR(plain, step_size=2, gamma=0.5)
    if before:   # scheduler made before fusing: fuse a fresh optimizer wrapped by it
        fused_opt = torch.optim.SGD(mb.parameters(), lr=0.5, momentum=0.9)
        sched_b = torch.optim.lr_scheduler.StepLR(fused_opt, step_size=2, gamma=0.5)
        fused = fuse_optimizer(fused_opt)
    else:
        sched_b = torch.optim.lr_scheduler.StepLR(fused, step_size=2, gamma=0.5)
    with __import__("warnings").catch_warnings():
        __import__("warnings").simplefilter("error")   # no "scheduler before step" warning
        for s in range(6):
            _step(ma, plain, s)
            _step(mb, fused, s)
            sched_a.step()
            sched_b.step()
    assert fused.param_groups[0]["lr"] == plain.param_groups[0]["lr"] == 0.5 * 0.5 ** 3
    assert_same_params(ma, mb)


def test_add_param_group_later():
    ma, plain, mb, fused = _pair(torch.optim.Adam)
    extra_a, extra_b = (torch.nn.Parameter(torch.linspace(-1, 1, 9).reshape(3, 3))
                        for _ in range(2))
    extra_c, extra_d = (torch.nn.Parameter(torch.ones(4)) for _ in range(2))
    for s in range(4):
        if s == 2:
            plain.add_param_group({"params": [extra_a, extra_c], "lr": 0.1})
            fused.add_param_group({"params": [extra_b, extra_d], "lr": 0.1})
            assert extra_b.untyped_storage().data_ptr() == extra_d.untyped_storage().data_ptr()
        for model, opt, extras in ((ma, plain, (extra_a, extra_c)), (mb, fused, (extra_b, extra_d))):
            opt.zero_grad()
            loss = model(torch.randn(4, 7, generator=torch.Generator().manual_seed(s)))
            (loss.sum() + sum((e ** 3).sum() for e in extras)).backward()
            opt.step()
        assert_same_params(ma, mb)
        assert torch.equal(extra_a, extra_b) and torch.equal(extra_c, extra_d)
    assert_same_state(plain.state_dict(), fused.state_dict())


@pytest.mark.parametrize("fused_kernel", [False, True])
def test_grad_scaler(fused_kernel):
    # GradScaler on CPU (torch.amp.GradScaler("cpu")): unscale, inf skipping, scale updates.
    if fused_kernel:    # torch's CPU fused kernel, fused exactly (aligned segments, no warning)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ma, plain, mb, fused = _pair(torch.optim.Adam, fused=True)
    else:
        ma, plain, mb, fused = _pair(torch.optim.Adam)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
               for _ in range(2)]
    for s in range(6):
        for model, opt, scaler in ((ma, plain, scalers[0]), (mb, fused, scalers[1])):
            opt.zero_grad()
            loss = model(torch.randn(4, 7, generator=torch.Generator().manual_seed(s))).sum()
            if s == 3:
                loss = loss * float("inf")      # an overflow: this step must be skipped
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        assert scalers[0].get_scale() == scalers[1].get_scale()
        assert_same_params(ma, mb)
    assert_same_state(plain.state_dict(), fused.state_dict())


def test_check_flatten_repairs_replaced_storage():
    ma, plain, mb, fused = _pair(torch.optim.SGD, lr=0.1, momentum=0.9)
    for s in range(2):
        _step(ma, plain, s)
        _step(mb, fused, s)
    # someone replaces parameters' storage behind the optimizer's back
    with torch.no_grad():
        for m in (ma, mb):
            m[0].weight.data = m[0].weight.data.clone() * 0.5
            m[2].weight.data = m[2].weight.data.clone() * 0.5
    def storage(p):
        return p.untyped_storage().data_ptr()

    assert storage(mb[0].weight) != storage(mb[0].bias)
    for s in range(2, 5):
        _step(ma, plain, s)
        _step(mb, fused, s)
        assert_same_params(ma, mb)
    # repaired: the replaced ones were flattened again, the others stayed where they were
    layout = fused._bagua_fuse.layouts[0]
    assert not layout.loose
    assert storage(mb[0].weight) == storage(mb[2].weight)
    assert_same_state(plain.state_dict(), fused.state_dict())


def test_do_flatten_false_uses_existing_flat_storage():
    # Parameters and gradients someone else laid out back to back (a bucket): fused in place.
    ma, mb = make_model(), make_model()
    params = list(mb.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    flat_grad = torch.zeros_like(flat)
    off = 0
    for p in params:
        n = p.numel()
        p.data = flat[off:off + n].view_as(p)
        p.grad = flat_grad[off:off + n].view_as(p)
        off += n
    plain = torch.optim.RMSprop(ma.parameters(), lr=1e-2, centered=True)
    fused = fuse_optimizer(torch.optim.RMSprop(mb.parameters(), lr=1e-2, centered=True),
                           do_flatten=False)
    for s in range(4):
        plain.zero_grad()
        backward(ma, s)
        plain.step()
        fused.zero_grad(set_to_none=False)
        backward(mb, s)
        fused.step()
        assert_same_params(ma, mb)
    assert all(p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
               for p in mb.parameters())
    assert fused._bagua_fuse.layouts[0].runs, "the bucket was fused"
    assert_same_state(plain.state_dict(), fused.state_dict())


def test_params_without_grads_are_left_alone():
    ma, plain, mb, fused = _pair(torch.optim.Adam, weight_decay=0.1)
    for s in range(5):
        for model, opt in ((ma, plain), (mb, fused)):
            opt.zero_grad()
            backward(model, s)
            if s % 2:           # every other step one layer gets no gradient
                model[2].weight.grad = None
            opt.step()
        assert_same_params(ma, mb)
    assert_same_state(plain.state_dict(), fused.state_dict())


def test_bad_arguments():
    with pytest.raises(ValueError, match="optimizer"):
        fuse_optimizer(object())
    opt = torch.optim.SGD(make_model().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="do_flatten"):
        fuse_optimizer(opt, do_flatten="yes")
    assert fuse_optimizer(fuse_optimizer(opt)) is opt


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_of_a_fused_optimizer_stay_fused(how):
    ma, plain, mb, fused = _pair(torch.optim.Adam)
    _step(ma, plain, 0)
    _step(mb, fused, 0)
    if how == "deepcopy":
        mc, fc = copy.deepcopy((mb, fused))
    else:
        buf = io.BytesIO()
        torch.save((mb, fused), buf)
        buf.seek(0)
        mc, fc = torch.load(buf, weights_only=False)
    assert is_fused_optimizer(fc) and fc.param_groups[0]["params"][0] is mc[0].weight
    for s in range(1, 4):
        _step(ma, plain, s)
        _step(mc, fc, s)
        assert_same_params(ma, mc)
    assert_same_state(plain.state_dict(), fc.state_dict())


def test_step_hooks_see_the_real_parameters_and_fresh_state():
    ma, plain, mb, fused = _pair(torch.optim.Adam)
    seen = []

    def post_hook(opt, args, kwargs):
        params = [p for g in opt.param_groups for p in g["params"]]
        assert set(map(id, opt.state)) <= set(map(id, params)), "a stand-in leaked"
        seen.append({k: opt.state[p]["exp_avg"].clone() for k, p in enumerate(params)})

    pre = fused.register_step_pre_hook(lambda opt, a, k: seen.append("pre"))
    post = fused.register_step_post_hook(post_hook)
    for s in range(2):
        _step(ma, plain, s)
        _step(mb, fused, s)
    pre.remove()
    post.remove()
    assert seen[0] == "pre" and seen[2] == "pre"
    for k, p in enumerate(ma.parameters()):
        assert torch.equal(seen[3][k], plain.state[p]["exp_avg"])
