"""Segments: the stand-in parameters the optimizer's own ``step`` updates.

A segment is a stretch of consecutive members of a run that all have a gradient and the same
kind of optimizer state (same keys, same dtypes, equal scalar values).  Its stand-in is a
parameter over ``run.flat[a:b]`` with gradient ``run.flat_grad[a:b]``; its state holds one flat
tensor per tensor-valued state entry.  Every member's own state (``optimizer.state[p]``, what
``state_dict()`` reads) stays in the unfused layout: tensor entries are views of the segment's
flat tensors, 0-dim entries (``step``) are elements of a small per-segment buffer copied from
the stand-in's scalar after each step, other values are copied after each step.

The members' state is the truth: a segment is rebuilt from it whenever the layout changes.
For a 0-dim parameter (a learnable scale or temperature) its own state cannot tell a
parameter-shaped entry (``exp_avg``, shape ``()``) from a counter (``step``, shape ``()``): the
*kinds* map, learned from the probe and from every stand-in's state (stand-ins are 1-D, so
there the two differ), says which is which; a 0-dim member with an entry of unknown kind is
stepped on its own.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ._layout import MAX_SEGMENT_NUMEL, Run

_IMMUTABLE = (int, float, complex, bool, str, bytes, tuple, frozenset, type(None))


class NotElementwiseError(RuntimeError):
    """The optimizer created state that is neither parameter-shaped nor a scalar."""


# kinds of state entries: parameter-shaped tensors and per-parameter scalars (counters)
TENSOR, SCALAR = "t", "s"


def _kind(key, v: torch.Tensor, p: torch.Tensor, kinds: dict) -> str | None:
    """Whether ``v = state[p][key]`` is parameter-shaped or a scalar; None if unknowable."""
    if v.dim() > 0:
        return TENSOR
    if p.dim() > 0:
        return SCALAR
    return kinds.get(key)        # 0-dim parameter: both look alike, ask what was learned


def _signature(state: dict, p: torch.Tensor, kinds: dict):
    """What must agree for members to share a stand-in; None when ``p`` cannot be fused."""
    sig = []
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            kind = _kind(k, v, p, kinds)
            if kind is None:
                return None
            if kind == SCALAR:
                sig.append((k, "s", v.dtype, v.device, v.item()))
            elif v.shape == p.shape and v.layout == torch.strided:
                sig.append((k, "t", v.dtype, v.device))
            else:
                return None
        else:
            try:
                hash(v)
                sig.append((k, "o", type(v), v))
            except TypeError:
                sig.append((k, "x", type(v), repr(v)))
    return tuple(sorted(sig, key=lambda e: repr(e[0])))


class Segment:
    """One stand-in parameter over consecutive members of a run, and its fused state."""

    __slots__ = (
        "kinds",
        "members",
        "numels",
        "offsets",
        "opt_state",
        "others",
        "scalars",
        "standin",
        "state",
        "states",
        "tensors",
    )

    def __init__(self, run: Run, lo: int, hi: int, opt_state, kinds: dict):
        a = run.offsets[lo]
        b = run.offsets[hi - 1] + run.numels[hi - 1]
        self.members = run.params[lo:hi]
        self.offsets = [o - a for o in run.offsets[lo:hi]]
        self.numels = run.numels[lo:hi]
        self.standin = torch.nn.Parameter(run.flat[a:b], requires_grad=True)
        self.standin.grad = run.flat_grad[a:b]
        self.opt_state = opt_state
        self.kinds = kinds
        # no entry in optimizer.state until the optimizer creates some (as unfused)
        self.states = [opt_state.get(p, {}) for p in self.members]
        self.state: dict[Any, Any] = {}
        self.tensors: dict[Any, torch.Tensor] = {}
        self.scalars: dict[Any, torch.Tensor] = {}
        self.others: dict[Any, Any] = {}
        first = self.states[0]
        for key, v in first.items():
            if (isinstance(v, torch.Tensor)
                    and _kind(key, v, self.members[0], kinds) == TENSOR):
                self.state[key] = torch.cat([st[key].reshape(-1) for st in self.states])
            elif isinstance(v, torch.Tensor):
                self.state[key] = v.clone()
            else:
                self.state[key] = v
        self.sync()

    # -- members' views -------------------------------------------------------------------
    def _view(self, key, flat: torch.Tensor) -> None:
        if flat.shape != self.standin.shape:
            raise NotElementwiseError(
                f"state[{key!r}] of a fused parameter has shape {tuple(flat.shape)}, not the "
                f"parameter's {tuple(self.standin.shape)} or a scalar: this optimizer is not "
                "elementwise; do not wrap it with fuse_optimizer")
        self.tensors[key] = flat
        self.kinds[key] = TENSOR
        for st, p, o, n in zip(self.states, self.members, self.offsets, self.numels):
            st[key] = flat[o:o + n].view(p.shape)

    def _scalar(self, key, v: torch.Tensor) -> None:
        buf = v.detach().reshape(1).repeat(len(self.members))
        self.scalars[key] = buf
        self.kinds[key] = SCALAR
        for i, st in enumerate(self.states):
            st[key] = buf[i]

    def _other(self, key, v) -> None:
        self.others[key] = v
        # each member gets its own copy of a mutable value, as it would unfused
        shared = isinstance(v, _IMMUTABLE)
        for st in self.states:
            st[key] = v if shared else copy.deepcopy(v)

    def sync(self) -> None:
        """Bring the members' state up to date with the stand-in's, after a step."""
        state = self.state
        if state.keys() != self.tensors.keys() | self.scalars.keys() | self.others.keys():
            self._rekey()
        for key, flat in self.tensors.items():
            if state[key] is not flat:
                self._view(key, state[key])
        for key, buf in self.scalars.items():
            buf.copy_(state[key])
        for key, old in self.others.items():
            v = state[key]
            if v is not old or not isinstance(v, _IMMUTABLE):    # mutable: may change in place
                self._other(key, v)

    def _rekey(self) -> None:
        known = self.tensors.keys() | self.scalars.keys() | self.others.keys()
        for key in known - self.state.keys():
            for d in (self.tensors, self.scalars, self.others):
                d.pop(key, None)
            for st in self.states:
                st.pop(key, None)
        added = self.state.keys() - known
        if added:
            self.states = [self.opt_state[p] for p in self.members]
        for key in added:
            v = self.state[key]
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                self._view(key, v)
            elif isinstance(v, torch.Tensor):
                self._scalar(key, v)
            else:
                self._other(key, v)


def build_segments(run: Run, opt_state, kinds: dict,
                   align: int | None = None) -> tuple[list[Segment], list[torch.Tensor]]:
    """Split ``run`` into segments; returns them and the members to step one by one.

    ``kinds`` maps state keys to ``TENSOR`` or ``SCALAR`` (see the module docstring).  With
    ``align``, a segment ends after its first member whose size is not a multiple of ``align``:
    for kernels whose rounding depends on an element's place in the body or the tail of a
    tensor, every element then lies where it lies in its own parameter (``_probe.py``).
    """
    segments: list[Segment] = []
    single: list[torch.Tensor] = []
    lo = None
    lo_sig = None
    size = 0

    def close(hi):
        nonlocal lo
        if lo is not None:
            segments.append(Segment(run, lo, hi, opt_state, kinds))
        lo = None

    for i, p in enumerate(run.params):
        if run.grad_views[i] is None:
            close(i)
            single.append(p)            # no gradient: the optimizer sees it as it is
            continue
        sig = _signature(opt_state[p], p, kinds) if p in opt_state else ()
        if sig is None:
            close(i)
            single.append(p)
            continue
        n = run.numels[i]
        if lo is not None and (sig != lo_sig or size + n > MAX_SEGMENT_NUMEL):
            close(i)
        if lo is None:
            lo, lo_sig, size = i, sig, 0
        size += n
        if align and n % align:
            close(i + 1)
    close(len(run.params))
    return segments, single
