"""Per-optimizer bookkeeping: which parameters are fused how, and what one step feeds the
optimizer's own ``step`` instead of the parameters themselves."""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable
from itertools import repeat

import torch

from . import _layout
from ._probe import FUSED_KERNEL, check_fused_kernel, classify
from ._segments import Segment, build_segments


class GroupLayout:
    """How one param group is laid out: fused runs, and parameters stepped one by one."""

    __slots__ = ("aligns", "loose", "n", "params", "runs")

    def __init__(self, params: list, runs: list[_layout.Run], loose: list, aligns: list):
        self.params = params            # the group's own list object: replaced => lay out again
        self.n = len(params)
        self.runs = runs
        self.loose = loose
        self.aligns = aligns            # per run: the size multiple its segments need, or None

    def current(self, group: dict) -> bool:
        return group["params"] is self.params and len(self.params) == self.n


class Fuser:
    """State that ``fuse_optimizer`` attaches to an optimizer (as ``_bagua_fuse``)."""

    def __init__(self, inner_step: Callable, do_flatten: bool, check_flatten: bool,
                 mode: str = "exact"):
        self.inner_step = inner_step
        self.do_flatten = do_flatten
        self.check_flatten = check_flatten
        self.mode = mode
        # hyper-parameters the step is handed in place of the group's own (mode="fast")
        self.override = FUSED_KERNEL if mode == "fast" else {}
        self.layouts: list[GroupLayout] = []
        self.verdicts: dict[tuple, tuple[str | None, int | None]] = {}
        self.warned = False
        # state key -> TENSOR or SCALAR, learned from probes and stand-ins (_segments.py)
        self.kinds: dict = {}

    # -- layout ---------------------------------------------------------------------------
    def sync_layouts(self, opt: torch.optim.Optimizer) -> None:
        """Lay out every group whose parameters are new or changed since the last call."""
        groups = opt.param_groups
        del self.layouts[len(groups):]
        todo = [i for i, g in enumerate(groups)
                if i >= len(self.layouts) or not self.layouts[i].current(g)]
        if not todo:
            return
        for i in todo:
            lay = self._layout_group(opt, i)
            if i < len(self.layouts):
                self.layouts[i] = lay
            else:
                self.layouts.append(lay)

    def check_fast(self, opt, index: int) -> None:
        """mode="fast": raise ValueError unless torch's fused kernel can step this group."""
        group = opt.param_groups[index]
        for dtype, device in _layout.split_by_key(group["params"]):
            self._verdict(opt, index, group, dtype, device)

    def _layout_group(self, opt, index: int) -> GroupLayout:
        group = opt.param_groups[index]
        params = group["params"]
        if self.override:
            self.check_fast(opt, index)
        loose = [p for p in params if not _layout.fusable(p)]
        runs: list[_layout.Run] = []
        aligns: list = []
        for (dtype, device), ps in _layout.split_by_key(
                p for p in params if _layout.fusable(p)).items():
            why, align = self._verdict(opt, index, group, dtype, device)
            if why is not None:
                loose += ps
                continue
            got, rest = _layout.adopt(ps, move_grads=self.do_flatten)
            runs += got
            small = [p for p in rest if p.numel() < _layout.FLATTEN_MAX_NUMEL]
            loose += [p for p in rest if p.numel() >= _layout.FLATTEN_MAX_NUMEL]
            if self.do_flatten and len(small) > 1:
                runs.append(_layout.flatten(small))
            else:
                loose += small
            aligns += [align] * (len(runs) - len(aligns))
        return GroupLayout(params, runs, loose, aligns)

    def _verdict(self, opt, index, group, dtype, device) -> tuple[str | None, int | None]:
        key = (id(group), dtype, device)
        if key not in self.verdicts and self.mode == "fast":
            why = check_fused_kernel(opt, group, dtype, device, self.inner_step, self.kinds)
            if why is not None:
                raise ValueError(
                    f"fuse_optimizer(mode='fast') cannot be honoured for {type(opt).__name__} "
                    f"param group {index} ({dtype}, {device}): {why}")
            self.verdicts[key] = (None, None)
        if key not in self.verdicts:
            # The probe calls the optimizer's step with other params; should that step ignore
            # param_groups, it must not touch the real parameters: hide their gradients.
            hidden = [(p, p.grad) for g in opt.param_groups for p in g["params"]
                      if p.grad is not None]
            with torch.no_grad():
                for p, _ in hidden:
                    p.grad = None
                try:
                    why, align = classify(opt, group, dtype, device, self.inner_step,
                                          self.kinds)
                finally:
                    for p, g in hidden:
                        p.grad = g
            self.verdicts[key] = (why, align)
            if why is not None and not self.warned:
                self.warned = True
                warnings.warn(
                    f"bagua_optim.fuse_optimizer: {type(opt).__name__} param group {index} "
                    f"({dtype}, {device}) is not updated elementwise: {why}. Its parameters "
                    "are stepped one at a time, as without fusing.", RuntimeWarning,
                    stacklevel=5)
        return self.verdicts[key]

    def reset_segments(self) -> None:
        """Forget fused state: the next step rebuilds it from each parameter's own state."""
        for lay in self.layouts:
            for run in lay.runs:
                run.segments = None

    def fuses_anything(self, opt) -> bool:
        if len(self.layouts) != len(opt.param_groups):
            self.sync_layouts(opt)
        return bool(self.override) or any(lay.runs for lay in self.layouts)

    # -- one step -------------------------------------------------------------------------
    def prepare(self, opt) -> tuple[list[dict], list[Segment]]:
        """The param groups to hand the optimizer's step, and the segments inside them."""
        groups = opt.param_groups
        if len(self.layouts) != len(groups) or not all(
                lay.current(g) for lay, g in zip(self.layouts, groups)):
            self.sync_layouts(opt)
        fused_groups, segs = [], []
        for i, (group, lay) in enumerate(zip(groups, self.layouts)):
            if not lay.runs and not self.override:
                fused_groups.append(group)
                continue
            params = self._group_params(opt, i, segs) if lay.runs else group["params"]
            fg = dict(group)
            fg.update(self.override)
            fg["params"] = params
            fused_groups.append(fg)
        return fused_groups, segs

    def _group_params(self, opt, index: int, segs: list[Segment]) -> list:
        lay = self.layouts[index]
        if self.check_flatten and not all(run.params_in_place() for run in lay.runs):
            # Something replaced a parameter's storage (p.data = ..., module.to(...), a
            # bucket): lay the group out again, adopting what now lies back to back.
            lay = self.layouts[index] = self._layout_group(opt, index)
        params = list(lay.loose)
        for run, align in zip(lay.runs, lay.aligns):
            if not run.grads_in_place():
                before = list(map(operator.is_, run.grad_views, repeat(None)))
                if not run.adopt_grads():
                    run.segments = None
                    params += run.params    # this step: one by one, exactly as unfused
                    continue
                if before != list(map(operator.is_, run.grad_views, repeat(None))):
                    run.segments = None
            if run.segments is None:
                run.segments = build_segments(run, opt.state, self.kinds, align)
            run_segs, single = run.segments
            segs += run_segs
            params += [s.standin for s in run_segs]
            params += single
        return params
