"""Which parameters get fused, and that odd layouts still step exactly as unfused."""

import torch
from _helpers import assert_same_params, assert_same_state, backward, make_model

from bagua_optim import fuse_optimizer


class ReplacingMomentum(torch.optim.Optimizer):
    """A user-defined optimizer that replaces its state tensors every step (not in place)."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                st["buf"] = st["buf"] * 0.9 + p.grad if "buf" in st else p.grad.clone()
                st["t"] = st.get("t", torch.tensor(0.0)) + 1
                p.add_(st["buf"], alpha=-group["lr"] / float(st["t"]))


class LoggingSGD(torch.optim.Optimizer):
    """Keeps a mutable (list) entry in its state, appended to in place each step."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    st = self.state[p]
                    st.setdefault("lrs", []).append(group["lr"])
                    p.add_(p.grad, alpha=-sum(st["lrs"]) / len(st["lrs"]))


def _train_pair(make_params, opt_cls, kw, steps=4, **fuse_kw):
    pa, pb = make_params(), make_params()
    plain = opt_cls(pa, **kw)
    fused = fuse_optimizer(opt_cls(pb, **kw), **fuse_kw)
    for s in range(steps):
        for ps, opt in ((pa, plain), (pb, fused)):
            opt.zero_grad()
            sum(((p.double() - 0.1 * s) ** 2 * (i + 1)).sum() for i, p in enumerate(ps)).backward()
            opt.step()
        for x, y in zip(pa, pb):
            assert torch.equal(x, y)
    assert_same_state(plain.state_dict(), fused.state_dict())
    return pb, fused


def _mixed():
    g = torch.Generator().manual_seed(3)
    return [torch.nn.Parameter(torch.randn(4, 3, generator=g)),
            torch.nn.Parameter(torch.randn(5, generator=g, dtype=torch.float64)),
            torch.nn.Parameter(torch.randn(6, generator=g)),
            torch.nn.Parameter(torch.randn(3, 4, generator=g).t()),     # not contiguous
            torch.nn.Parameter(torch.randn(2, generator=g, dtype=torch.float64)),
            torch.nn.Parameter(torch.randn(3, generator=g), requires_grad=False)]


def test_mixed_dtypes_noncontiguous_and_frozen_parameters():
    ps, fused = _train_pair(_mixed, torch.optim.Adam, dict(lr=0.1))
    layout = fused._bagua_fuse.layouts[0]
    assert sorted(len(r.params) for r in layout.runs) == [2, 3]   # float64 pair, float32 trio
    assert [p is ps[3] for p in layout.loose] == [True]
    assert ps[5].grad is None


def test_optimizer_replacing_its_state_tensors():
    _train_pair(_mixed, ReplacingMomentum, dict(lr=0.1), steps=5)


def test_mutable_state_values_are_per_parameter():
    _, fused = _train_pair(_mixed, LoggingSGD, dict(lr=0.1), steps=3)
    lists = [st["lrs"] for st in fused.state.values()]
    assert all(x == [0.1] * 3 for x in lists)
    assert len({id(x) for x in lists}) == len(lists)


def test_do_flatten_false_fused_before_first_backward():
    # a bucket-like layout made before any gradient exists; gradients laid out by the owner
    ma, mb = make_model(), make_model()
    params = list(mb.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    flat_grad = torch.zeros_like(flat)
    off = 0
    views = []
    for p in params:
        n = p.numel()
        p.data = flat[off:off + n].view_as(p)
        views.append(flat_grad[off:off + n].view_as(p))
        off += n
    plain = torch.optim.SGD(ma.parameters(), lr=0.1, momentum=0.9)
    fused = fuse_optimizer(torch.optim.SGD(mb.parameters(), lr=0.1, momentum=0.9),
                           do_flatten=False)
    for p, v in zip(params, views):
        p.grad = v
    for s in range(3):
        plain.zero_grad()
        backward(ma, s)
        plain.step()
        fused.zero_grad(set_to_none=False)
        backward(mb, s)
        fused.step()
        assert_same_params(ma, mb)
        assert all(p.grad is v for p, v in zip(params, views)), "gradients were not moved"
    run = fused._bagua_fuse.layouts[0].runs[0]
    assert run.flat_grad.data_ptr() == flat_grad.data_ptr()


def test_do_flatten_false_leaves_scattered_parameters_alone():
    ma, mb = make_model(), make_model()
    before = [p.data_ptr() for p in mb.parameters()]
    plain = torch.optim.Adagrad(ma.parameters(), lr=0.1)
    fused = fuse_optimizer(torch.optim.Adagrad(mb.parameters(), lr=0.1), do_flatten=False)
    for s in range(3):
        for model, opt in ((ma, plain), (mb, fused)):
            opt.zero_grad()
            backward(model, s)
            opt.step()
        assert_same_params(ma, mb)
    assert [p.data_ptr() for p in mb.parameters()] == before


def test_gradients_moved_to_other_flat_storage_are_followed():
    # Gradients that move, still back to back, into another buffer between steps (as when
    # a bucket is rebuilt): the fused step must read them from their new place.
    ma, mb = make_model(), make_model()
    plain = torch.optim.SGD(ma.parameters(), lr=0.1, momentum=0.9)
    fused = fuse_optimizer(torch.optim.SGD(mb.parameters(), lr=0.1, momentum=0.9))
    for s in range(4):
        for model, opt in ((ma, plain), (mb, fused)):
            opt.zero_grad()
            backward(model, s)
        if s >= 2:
            params = list(mb.parameters())
            bucket = torch.cat([p.grad.reshape(-1) for p in params])
            off = 0
            for p in params:
                p.grad = bucket[off:off + p.numel()].view_as(p)
                off += p.numel()
        plain.step()
        fused.step()
        assert_same_params(ma, mb)
        if s >= 2:
            assert fused._bagua_fuse.layouts[0].runs[0].flat_grad.data_ptr() == bucket.data_ptr()


def test_buckets_made_after_fusing_are_adopted_not_moved():
    # As bagua-algos does after fuse_optimizer: parameters and gradients are re-pointed into
    # the buckets' flat storage. The fused optimizer must follow them there, not copy back.
    ma, mb = make_model(), make_model()
    plain = torch.optim.Adam(ma.parameters(), lr=1e-2)
    fused = fuse_optimizer(torch.optim.Adam(mb.parameters(), lr=1e-2))
    for s in range(2):
        for model, opt in ((ma, plain), (mb, fused)):
            opt.zero_grad()
            backward(model, s)
            opt.step()
    params = list(mb.parameters())[::-1]        # buckets in another order
    bucket = torch.cat([p.detach().reshape(-1) for p in params])
    bucket_grad = torch.zeros_like(bucket)
    off = 0
    for p in params:
        n = p.numel()
        p.data = bucket[off:off + n].view_as(p)
        p.grad = bucket_grad[off:off + n].view_as(p)
        off += n
    views = [p.grad for p in params]
    for s in range(2, 5):
        plain.zero_grad()
        backward(ma, s)
        plain.step()
        fused.zero_grad(set_to_none=False)
        backward(mb, s)
        fused.step()
        assert_same_params(ma, mb)
    assert all(p.untyped_storage().data_ptr() == bucket.untyped_storage().data_ptr()
               for p in params)
    assert all(p.grad is v for p, v in zip(params, views))
    assert [len(r.params) for r in fused._bagua_fuse.layouts[0].runs] == [len(params)]
    assert_same_state(plain.state_dict(), fused.state_dict())
