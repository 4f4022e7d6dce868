"""torch's ``fused=True`` kernels: fused exactly (aligned segments), and ``mode="fast"``.

torch's CPU fused kernels round an element differently in the vectorised body of a tensor and in
its scalar tail.  The default mode fuses them anyway, bit-identically, by ending each segment at
the first member whose size is not a multiple of ``ALIGN``; ``mode="fast"`` steps every segment
(and every parameter left out of them) with the fused kernel whatever the sizes, with a bound
against a float64 reference of the same step instead of bit-identity.
"""

import copy
import warnings

import pytest
import torch
from _helpers import assert_same_state

from bagua_optim import fuse_optimizer, is_fused_optimizer
from bagua_optim._layout import FLATTEN_MAX_NUMEL
from bagua_optim._probe import ALIGN

# aligned and odd sizes, a 0-dim parameter, one too large to flatten
SHAPES = [(ALIGN,), (3, ALIGN), (77,), (2, ALIGN), (5, 7), (), (ALIGN,), (2, 32), (1000,),
          (FLATTEN_MAX_NUMEL + 5,), (13,), (4, ALIGN)]
CASES = [(torch.optim.Adam, dict(lr=1e-2)),
         (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
         (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=1e-2)),
         (torch.optim.Adagrad, dict(lr=0.1))]
IDS = [c.__name__ for c, _ in CASES]


def _params(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]


def _grads(params, step, drop=()):
    g = torch.Generator().manual_seed(1000 + step)
    for i, p in enumerate(params):
        gr = torch.randn(p.shape, generator=g).to(p.dtype)
        p.grad = None if i in drop else gr


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("cls", "kw"), CASES, ids=IDS)
def test_fused_true_is_fused_bit_identically(cls, kw, dtype):
    pa, pb = _params(dtype), _params(dtype)
    plain = cls(pa, fused=True, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")      # no "not elementwise" warning any more
        fused = fuse_optimizer(cls(pb, fused=True, **kw))
    for step in range(8):
        drop = (1, 4) if step in (3, 4) else ()     # the set of gradients changes
        for ps in (pa, pb):
            _grads(ps, step, drop)
        plain.step()
        fused.step()
        for i, (x, y) in enumerate(zip(pa, pb)):
            assert torch.equal(x, y), f"step {step}: parameter {i} {tuple(x.shape)} differs"
        assert_same_state(plain.state_dict(), fused.state_dict())
        if step == 0:   # really fused: 11 flattened parameters in 6 stand-ins
            runs = [run for lay in fused._bagua_fuse.layouts for run in lay.runs]
            segs = [s for run in runs for s in run.segments[0]]
            aligned = fused._bagua_fuse.layouts[0].aligns == [ALIGN]
            # Adagrad's fused kernel rounds alike everywhere: one stand-in for all
            expect = [3, 2, 1, 3, 1, 1] if aligned else [11]
            assert [len(s.members) for s in segs] == expect
            assert aligned or cls is torch.optim.Adagrad
        if step == 5:   # a checkpoint round trip through the unfused layout
            fused.load_state_dict(copy.deepcopy(fused.state_dict()))


def test_segments_end_at_the_first_odd_size():
    ps = _params()
    opt = fuse_optimizer(torch.optim.Adam(ps, lr=1e-2, fused=True))
    _grads(ps, 0)
    opt.step()
    (run,) = opt._bagua_fuse.layouts[0].runs
    for seg in run.segments[0]:
        sizes = [m.numel() for m in seg.members]
        assert all(n % ALIGN == 0 for n in sizes[:-1]), sizes


# -- mode="fast" ----------------------------------------------------------------------------

def _float64_step(cls, kw, params, opt):
    """The float64 result of this step from the same float32 inputs (torch's own loop)."""
    p64 = [torch.nn.Parameter(p.detach().double()) for p in params]
    for a, b in zip(p64, params):
        a.grad = None if b.grad is None else b.grad.double()
    ref = cls(p64, foreach=False, **kw)
    sd = copy.deepcopy(opt.state_dict())
    for st in sd["state"].values():
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                st[k] = v.double()
    sd["param_groups"][0].update(foreach=False, fused=None)
    ref.load_state_dict(sd)
    ref.step()
    return p64, ref


def _err(x, ref, before):
    """|x - ref| in units of eps * (|before| + |ref - before|), worst element."""
    eps = torch.finfo(torch.float32).eps
    scale = eps * (before.abs() + (ref - before).abs())
    return ((x.double() - ref).abs() / scale.clamp_min(1e-300)).max().item()


def _step_errors(cls, kw, opt, params) -> dict:
    """One step of ``opt``; each tensor's worst error against float64 (see ``_err``)."""
    p64, ref = _float64_step(cls, kw, params, opt)
    before = {(i, None): p.detach().double().clone() for i, p in enumerate(params)}
    for i, p in enumerate(params):
        for k, v in opt.state[p].items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                before[i, k] = v.double().clone()
    opt.step()
    errs = {}
    for i, (p, r) in enumerate(zip(params, p64)):
        errs[i, None] = _err(p.detach(), r.detach(), before[i, None])
        for k, v in opt.state[p].items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                w = ref.state[r][k]
                errs[i, k] = _err(v, w, before.get((i, k), torch.zeros_like(w)))
    return errs


@pytest.mark.parametrize(("cls", "kw"), CASES, ids=IDS)
def test_fast_mode_bound_against_float64(cls, kw):
    """The stated bound: per step, every element of parameters and state within
    4 eps (|x| + |dx|) of a float64 step from the same inputs; for SGD, whose weight decay and
    momentum can cancel, within torch's own unfused loop's error plus that."""
    pf, pp = _params(), _params()
    fast = fuse_optimizer(cls(pf, **kw), mode="fast")
    plain = cls(pp, foreach=False, **kw)
    for step in range(8):
        _grads(pf, step)
        _grads(pp, step)
        errs_fast = _step_errors(cls, kw, fast, pf)
        errs_plain = _step_errors(cls, kw, plain, pp)
        assert errs_fast.keys() == errs_plain.keys()
        for key, e in errs_fast.items():
            limit = 4 + (errs_plain[key] if cls is torch.optim.SGD else 0)
            assert e <= limit, f"step {step}: parameter {key[0]}, state {key[1]}: {e:.2f}"
    # the user's hyper-parameters are untouched, so state_dict() loads into a plain optimizer
    assert fast.param_groups[0]["fused"] in (None, False)
    other = cls(_params(), **kw)
    other.load_state_dict(fast.state_dict())


def test_fast_mode_steps_large_parameters_with_the_fused_kernel():
    # no flat run at all: every parameter is too large, so only the kernel changes
    big = [(FLATTEN_MAX_NUMEL + 3,), (2, FLATTEN_MAX_NUMEL)]
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=g) for s in big]
    pa = [torch.nn.Parameter(x.clone()) for x in init]
    pb = [torch.nn.Parameter(x.clone()) for x in init]
    ref = torch.optim.Adam(pa, lr=1e-2, fused=True)
    fast = fuse_optimizer(torch.optim.Adam(pb, lr=1e-2, foreach=True), mode="fast")
    for step in range(3):
        for ps in (pa, pb):
            _grads(ps, step)
        ref.step()
        fast.step()
        assert all(torch.equal(x, y) for x, y in zip(pa, pb))
    assert fast.param_groups[0]["foreach"] is True


class _Lion(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-2):
        super().__init__(params, dict(lr=lr, fused=None))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])


@pytest.mark.parametrize(("make", "match"), [
    (lambda ps: torch.optim.RMSprop(ps), "mode='fast'.*RMSprop.*'fused' option"),
    (lambda ps: _Lion(ps), "mode='fast'.*_Lion.*not torch's own"),
    (lambda ps: torch.optim.Adam(ps, differentiable=True), "mode='fast'.*differentiable"),
])
def test_fast_mode_that_cannot_be_honoured_is_refused(make, match):
    ps = _params()
    opt = make(ps)
    with pytest.raises(ValueError, match=match):
        fuse_optimizer(opt, mode="fast")
    # refused before anything changed: not fused, nothing flattened
    assert not is_fused_optimizer(opt) and not hasattr(opt, "_bagua_fuse")
    assert ps[0].untyped_storage().data_ptr() != ps[1].untyped_storage().data_ptr()


def test_fast_mode_refuses_a_param_group_added_later():
    opt = fuse_optimizer(torch.optim.Adam(_params(), lr=1e-2), mode="fast")
    with pytest.raises(ValueError, match=r"mode='fast'.*param group 1.*differentiable"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(3))],
                             "differentiable": True})
    assert len(opt.param_groups) == 1
    _grads(opt.param_groups[0]["params"], 0)
    opt.step()


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(mode="fused"), "mode must be one of"),
    (dict(mode=None), "mode must be one of"),
    (dict(do_flatten=1), "do_flatten must be a bool"),
    (dict(check_flatten="yes"), "check_flatten must be a bool"),
])
def test_bad_arguments_name_themselves(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fuse_optimizer(torch.optim.Adam(_params()), **kwargs)


def test_refusing_a_second_mode():
    opt = fuse_optimizer(torch.optim.Adam(_params()))
    assert fuse_optimizer(opt) is opt
    with pytest.raises(ValueError, match=r"already fused.*mode='exact'"):
        fuse_optimizer(opt, mode="fast")


def test_fast_mode_survives_deepcopy():
    opt = fuse_optimizer(torch.optim.AdamW(_params(), lr=1e-2), mode="fast")
    twin = copy.deepcopy(opt)
    assert twin._bagua_fuse.mode == "fast"
