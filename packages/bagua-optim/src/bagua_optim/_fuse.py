"""``fuse_optimizer``: the optimizer's own ``step``, once per contiguous run of parameters.

The optimizer object keeps its identity, ``param_groups`` and ``state`` (unfused layout).  Its
class is swapped for a thin subclass whose ``step`` runs torch's step hooks as usual and, inside
them, calls the original (unhooked) ``step`` with ``param_groups`` temporarily holding one
stand-in parameter per segment of fused parameters (see ``_segments.py``).
"""

from __future__ import annotations

import weakref

import torch
from torch.optim import Optimizer

from ._fuser import Fuser

_CLASSES: dict[type, type] = {}


def _inner_step(cls: type):
    """The class's ``step`` without torch's hook wrapper around it."""
    step = cls.step
    if getattr(step, "hooked", False):
        step = step.__wrapped__
    return step


def _run_step(opt: Optimizer, args: tuple, kwargs: dict):
    fuser: Fuser = opt._bagua_fuse
    if not fuser.fuses_anything(opt):     # e.g. LBFGS: its own step, closure and all
        return fuser.inner_step(opt, *args, **kwargs)
    closure = None
    if args and callable(args[0]):
        closure, args = args[0], (None, *args[1:])
    elif callable(kwargs.get("closure")):
        closure, kwargs = kwargs["closure"], {**kwargs, "closure": None}
    loss = None
    if closure is not None:
        # Evaluate it first, as torch's optimizers do, so that the gradients it produces are
        # the ones fused below.
        with torch.enable_grad():
            loss = closure()
    groups = opt.param_groups
    fused_groups, segs = fuser.prepare(opt)
    state = opt.state
    for seg in segs:
        state[seg.standin] = seg.state
    opt.param_groups = fused_groups
    try:
        out = fuser.inner_step(opt, *args, **kwargs)
    finally:
        opt.param_groups = groups
        for seg in segs:
            state.pop(seg.standin, None)
        for g, fg in zip(groups, fused_groups):
            if fg is not g:     # hyper-parameters a step may have written into its group
                for k, v in fg.items():
                    if k != "params" and k not in fuser.override and g.get(k) is not v:
                        g[k] = v
    for seg in segs:
        seg.sync()
    return loss if closure is not None else out


def _fused_class(cls: type) -> type:
    if cls in _CLASSES:
        return _CLASSES[cls]

    def step(self, *args, **kwargs):
        return _run_step(self, args, kwargs)

    step.__doc__ = cls.step.__doc__
    step = Optimizer.profile_hook_step(step)
    step.hooked = True

    def fuse_step(self, closure=None):
        """Bagua's name for :meth:`step` (which is already fused)."""
        return self.step(closure)

    def add_param_group(self, param_group: dict) -> None:
        cls.add_param_group(self, param_group)
        try:
            self._bagua_fuse.sync_layouts(self)
        except ValueError:      # a group mode="fast" cannot step: not added
            self.param_groups.pop()
            self._bagua_fuse.sync_layouts(self)
            raise

    def load_state_dict(self, state_dict: dict) -> None:
        cls.load_state_dict(self, state_dict)
        self._bagua_fuse.reset_segments()

    def __reduce_ex__(self, protocol):
        # pickle/deepcopy: rebuild the unfused optimizer from torch's own state, then fuse it
        fuser = self._bagua_fuse
        return _restore, (cls, self.__getstate__(), fuser.do_flatten, fuser.check_flatten,
                          fuser.mode)

    add_param_group.__doc__ = cls.add_param_group.__doc__
    load_state_dict.__doc__ = cls.load_state_dict.__doc__
    ns = {"step": step, "fuse_step": fuse_step, "add_param_group": add_param_group,
          "load_state_dict": load_state_dict, "__reduce_ex__": __reduce_ex__,
          "_bagua_unfused_class": cls,
          "__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__}
    new = type(cls.__name__, (cls,), ns)
    _CLASSES[cls] = new
    return new


def _restore(cls: type, state: dict, do_flatten: bool, check_flatten: bool,
             mode: str = "exact") -> Optimizer:
    opt = cls.__new__(cls)
    opt.__setstate__(state)
    return fuse_optimizer(opt, do_flatten=do_flatten, check_flatten=check_flatten, mode=mode)


def _repoint_lr_scheduler_wrapper(opt: Optimizer) -> None:
    """An LR scheduler made before fusing wrapped the old bound ``step``: wrap the new one."""
    wrapped = opt.__dict__.get("step")
    if wrapped is None:
        return
    if not getattr(wrapped, "_wrapped_by_lr_sched", False):
        raise ValueError(
            "optimizer.step was replaced on the instance before fuse_optimizer, so the fused "
            "step could not take its place; call fuse_optimizer(optimizer) before wrapping step")
    ref = weakref.ref(opt)

    def wrapper(*args, **kwargs):
        o = ref()
        o._opt_called = True
        return type(o).step(o, *args, **kwargs)

    wrapper._wrapped_by_lr_sched = True
    opt.step = wrapper


MODES = ("exact", "fast")


def _check_fast_class(optimizer: Optimizer, step) -> None:
    name = type(optimizer).__name__
    if not all("fused" in g for g in optimizer.param_groups):
        raise ValueError(
            f"fuse_optimizer(mode='fast') cannot be honoured for {name}: it steps with torch's "
            "fused kernel, which only optimizers with a 'fused' option have (torch's Adam, "
            "AdamW, SGD, Adagrad); use mode='exact'")
    if not getattr(step, "__module__", "").startswith("torch.optim"):
        raise ValueError(
            f"fuse_optimizer(mode='fast') cannot be honoured for {name}: its step is not "
            "torch's own, so torch's fused kernel cannot stand in for it; use mode='exact'")


def fuse_optimizer(optimizer: Optimizer, do_flatten: bool = True,
                   check_flatten: bool = True, *, mode: str = "exact") -> Optimizer:
    """Make ``optimizer.step()`` update contiguous runs of parameters at once.

    Parameters of one param group, dtype and device are copied into one flat buffer
    (``do_flatten=True``), and so are their gradients and every tensor in the optimizer's
    state; each parameter, gradient and state tensor becomes a view of that storage.
    ``step()`` then runs the optimizer's own update once per run instead of once per
    parameter, with bit-identical results. Works for any :class:`torch.optim.Optimizer`
    whose update is elementwise, including user-defined ones: each param group is checked on
    a small probe first, and a group that is not elementwise (LBFGS, layer-wise norms,
    shape-dependent updates) is stepped one parameter at a time, with one warning.

    Args:
        optimizer: the optimizer to fuse; the same object is returned.
        do_flatten: copy parameters into flat storage now. With ``False`` only parameters
            that already lie back to back (with their gradients) are fused, and nothing is
            moved: for parameters whose storage another component owns (bagua-algos buckets).
        check_flatten: before each step, check that no parameter's storage was replaced
            behind the optimizer's back (``p.data = ...``, ``module.to()``) and flatten
            again if it was.
        mode: ``"exact"`` (the default): bit-identical to the unfused optimizer.  torch's
            ``fused=True`` kernels are fused too: their CPU kernels round the vectorised body
            and the tail of a tensor differently, so a segment ends at the first parameter
            whose size is not a multiple of 64 elements, which keeps every element where it
            is in its own tensor.  ``"fast"`` (opt-in): every segment and every parameter left
            out of them (large ones) is stepped by torch's fused kernel whatever the
            optimizer's own ``foreach``/``fused`` setting and whatever the sizes; results are
            no longer bit-identical to the unfused optimizer, but each step stays within
            4 float32 epsilons of ``|x| + |dx|`` of a float64 step from the same inputs (for
            SGD, within torch's own loop's error plus that).  Only for optimizers whose step
            is torch's Adam, AdamW, SGD or Adagrad; any other is refused with a ValueError.

    ``state_dict()`` keeps the unfused layout, so checkpoints move freely between fused and
    unfused optimizers; LR schedulers, ``add_param_group``, ``zero_grad(set_to_none=True)``
    (gradients become views again at the next step) and ``torch.amp.GradScaler`` work as
    without fusing.

    Example::

        optimizer = fuse_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
        loss.backward()
        optimizer.step()
    """
    if not isinstance(optimizer, Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer)!r}")
    for name, v in (("do_flatten", do_flatten), ("check_flatten", check_flatten)):
        if not isinstance(v, bool):
            raise ValueError(f"{name} must be a bool, got {v!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if is_fused_optimizer(optimizer):
        fuser = optimizer._bagua_fuse
        if (fuser.do_flatten, fuser.check_flatten, fuser.mode) != (
                do_flatten, check_flatten, mode):
            raise ValueError("optimizer is already fused with other do_flatten/check_flatten/"
                             f"mode (do_flatten={fuser.do_flatten}, "
                             f"check_flatten={fuser.check_flatten}, mode={fuser.mode!r})")
        return optimizer
    cls = type(optimizer)
    fuser = Fuser(_inner_step(cls), do_flatten, check_flatten, mode)
    if mode == "fast":      # refuse before anything is changed
        _check_fast_class(optimizer, fuser.inner_step)
        for i in range(len(optimizer.param_groups)):
            fuser.check_fast(optimizer, i)
    optimizer._bagua_fuse = fuser
    optimizer.__class__ = _fused_class(cls)
    _repoint_lr_scheduler_wrapper(optimizer)
    optimizer._bagua_fuse.sync_layouts(optimizer)
    return optimizer


def is_fused_optimizer(optimizer) -> bool:
    """Whether ``optimizer`` was returned by :func:`fuse_optimizer`."""
    return getattr(type(optimizer), "_bagua_unfused_class", None) is not None
