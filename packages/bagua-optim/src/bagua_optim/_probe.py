"""Is an optimizer's update elementwise?  Known answers first, then a probe.

The probe runs the optimizer's own (unhooked) ``step`` on a shallow copy of the optimizer, with
the param group's hyper-parameters, on a few small parameters of different shapes: once one by
one and once as a single flat stand-in.  The update is taken as elementwise only when both give
bit-identical parameters and state for several steps, the state is parameter-shaped or scalar,
and the step changed the parameters at all.  That catches optimizers that read a parameter's
shape or dimension, reduce over a parameter (norms, trust ratios), factor their state, draw
random numbers, or ignore ``param_groups``.

Some kernels round an element differently depending on where it lies in its tensor: torch's CPU
``fused=True`` kernels run a vectorised body and a scalar tail (the last ``numel % width``
elements) with different rounding.  Those fail the probe above, and get a second one
(:func:`classify`): parameters whose sizes are multiples of :data:`ALIGN` elements, with one
size that is not at the end.  Laid back to back, such parameters keep every element in the
same part (body or tail) of the kernel as when stepped one by one, so a flat stand-in over
them is exact if the second probe agrees bit for bit; the segments then end at the first
member whose size is not a multiple of :data:`ALIGN` (see ``_segments.py``).
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Callable

import torch

from ._segments import SCALAR, TENSOR

_SHAPES = ((3, 5), (7,), (2, 3, 2), (1,))
_STEPS = 3

# Sizes (in elements) that are multiples of this keep each element's place in a vectorised
# kernel's body or tail when laid back to back: a multiple of every SIMD width (up to 512-bit
# vectors of 8-bit types) and of the cache-line chunks torch's CPU kernels split work into.
ALIGN = 64
_ALIGNED_SHAPES = ((2, ALIGN), (ALIGN,), (4, ALIGN // 2), (5, 15))   # the last one: unaligned


def _known_not_elementwise() -> tuple[type, ...]:
    names = ("LBFGS", "SparseAdam", "Adafactor", "Muon")
    return tuple(c for c in (getattr(torch.optim, n, None) for n in names) if c is not None)


def _state_equal(fused: dict, singles: list[dict], shapes) -> str | None:
    if any(st.keys() != fused.keys() for st in singles):
        return "its state keys differ between small parameters and a flat one"
    for key, v in fused.items():
        vals = [st[key] for st in singles]
        if isinstance(v, torch.Tensor):
            if v.dim() == 0:
                if not all(isinstance(x, torch.Tensor) and torch.equal(x, v) for x in vals):
                    return f"state[{key!r}] of a flat parameter differs from small ones'"
            elif not all(isinstance(x, torch.Tensor) and tuple(x.shape) == s
                         for x, s in zip(vals, shapes)):
                return f"state[{key!r}] is not shaped like its parameter"
            elif not torch.equal(torch.cat([x.reshape(-1) for x in vals]), v):
                return (f"state[{key!r}] of a flat parameter is not bit-identical to small "
                        "ones' (rounding that depends on an element's position, as in torch's "
                        "CPU fused=True kernels, or a reduction over the parameter)")
        elif any(x != v for x in vals):
            return f"state[{key!r}] of a flat parameter differs from small ones'"
    return None


def _eager_state(optimizer: torch.optim.Optimizer, group: dict, params: list) -> dict:
    """The state ``optimizer``'s class gives ``params`` in its constructor, before any step.

    Most optimizers create their state lazily, in the first step; some create it in
    ``__init__`` and read it unconditionally in ``step`` (Adagrad before torch 2.5 reads
    ``state["sum"]``).  A fresh instance built on the probe parameters with the group's
    hyper-parameters shows which; a constructor that does not take them gives no state.
    """
    cls = type(optimizer)
    cls = getattr(cls, "_bagua_unfused_class", cls)     # a fused optimizer's own class
    try:
        accepted = inspect.signature(cls.__init__).parameters
        kwargs = {k: v for k, v in group.items() if k != "params" and k in accepted}
        fresh = cls(params, **kwargs)
    except Exception:   # a constructor we cannot call with the group: lazy state it is
        return {}
    return {p: dict(fresh.state[p]) for p in params if fresh.state.get(p)}


def classify(optimizer: torch.optim.Optimizer, group: dict, dtype: torch.dtype,
             device: torch.device, step: Callable,
             kinds: dict | None = None) -> tuple[str | None, int | None]:
    """``(why, align)``: why ``group`` cannot be fused exactly (None if it can), and the size
    multiple its fused members need (None: any layout; :data:`ALIGN`: see the module doc)."""
    why = probe(optimizer, group, dtype, device, step, kinds)
    if why is None or isinstance(optimizer, _known_not_elementwise()):
        return why, None
    if probe(optimizer, group, dtype, device, step, kinds, _ALIGNED_SHAPES) is None:
        return None, ALIGN
    return why, None


def check_fused_kernel(optimizer: torch.optim.Optimizer, group: dict, dtype: torch.dtype,
                       device: torch.device, step: Callable, kinds: dict) -> str | None:
    """Why ``group`` cannot be stepped by torch's fused kernel (``mode="fast"``); None if it can.

    One step on a flat probe parameter with ``fused=True``, which also teaches ``kinds``.
    """
    gen = torch.Generator().manual_seed(0x6A6)
    flat = torch.nn.Parameter(torch.randn(35, generator=gen).to(dtype=dtype, device=device))
    flat.grad = torch.randn(35, generator=gen).to(dtype=dtype, device=device)
    twin = object.__new__(type(optimizer))
    twin.__dict__.update(optimizer.__dict__)
    twin.param_groups = [{**group, "params": [flat], **FUSED_KERNEL}]
    twin.state = defaultdict(dict)
    twin.state.update(_eager_state(optimizer, group, [flat]))
    try:
        step(twin)
    except Exception as err:
        return f"its step with fused=True failed ({type(err).__name__}: {err})"
    for key, v in twin.state[flat].items():
        if isinstance(v, torch.Tensor):
            kinds[key] = TENSOR if v.dim() > 0 else SCALAR
    return None


# what mode="fast" sets in the param groups it hands the optimizer's step
FUSED_KERNEL = {"fused": True, "foreach": False}


def probe(optimizer: torch.optim.Optimizer, group: dict, dtype: torch.dtype,
          device: torch.device, step: Callable, kinds: dict | None = None,
          shapes: tuple = _SHAPES) -> str | None:
    """Why ``group``'s update is not elementwise for ``dtype``/``device``; None if it is.

    When it is, ``kinds`` (if given) learns which state keys are parameter-shaped (``TENSOR``)
    and which are per-parameter scalars (``SCALAR``), from the flat probe parameter's state.
    """
    if isinstance(optimizer, _known_not_elementwise()):
        return f"{type(optimizer).__name__} is not elementwise"
    # An optimizer class may say why it must see its own parameters (bagua_algos'
    # QAdamOptimizer: its momentum is computed per parameter during backward).
    why = getattr(optimizer, "_bagua_fuse_refusal", None)
    if isinstance(why, str):
        return why
    gen = torch.Generator().manual_seed(0x6A6)
    init = [torch.randn(s, generator=gen).to(dtype=dtype, device=device) for s in shapes]
    grads = [[torch.randn(s, generator=gen).to(dtype=dtype, device=device) for s in shapes]
             for _ in range(_STEPS)]
    singles = [torch.nn.Parameter(x.clone()) for x in init]
    flat = torch.nn.Parameter(torch.cat([x.reshape(-1) for x in init]))

    def clone_opt(params):
        twin = object.__new__(type(optimizer))
        twin.__dict__.update(optimizer.__dict__)
        g = dict(group)
        g["params"] = params
        if isinstance(g.get("lr"), (int, float)) and g["lr"] == 0:
            g["lr"] = 1e-2              # a warm-up may start at 0: probe a real update
        twin.param_groups = [g]
        twin.state = defaultdict(dict)
        twin.state.update(_eager_state(optimizer, group, params))
        return twin

    a, b = clone_opt(singles), clone_opt([flat])
    devices = [device] if device.type != "cpu" else []
    try:
        with torch.random.fork_rng(devices=devices, device_type=device.type):
            for k in range(_STEPS):
                for p, g in zip(singles, grads[k]):
                    p.grad = g.clone()
                flat.grad = torch.cat([g.reshape(-1) for g in grads[k]])
                rng = torch.random.get_rng_state()
                step(a)
                torch.random.set_rng_state(rng)
                step(b)
                got = torch.cat([p.detach().reshape(-1) for p in singles])
                if not torch.equal(got, flat.detach()):
                    return ("a flat parameter is not updated bit-identically to small ones "
                            "(an update that reads shapes or norms, or rounding that depends on "
                            "an element's position, as in torch's CPU fused=True kernels)")
                why = _state_equal(b.state[flat], [a.state[p] for p in singles], shapes)
                if why:
                    return why
    except Exception as err:  # any failure means: do not fuse
        return f"its step failed on a probe ({type(err).__name__}: {err})"
    if torch.equal(flat.detach(), torch.cat([x.reshape(-1) for x in init])):
        return "its step did not change the probe parameters, so it could not be verified"
    if kinds is not None:
        for key, v in b.state[flat].items():
            if isinstance(v, torch.Tensor):
                kinds[key] = TENSOR if v.dim() > 0 else SCALAR
    return None
