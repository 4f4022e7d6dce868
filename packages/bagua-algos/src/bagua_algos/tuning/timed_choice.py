"""``with_bagua(model, [opt], "auto")``: time the step's compute, then choose.

:func:`~bagua_algos.tuning.recommend.recommend` weighs DiLoCo (train locally, average every H
steps) only against a known computation time, which ``with_bagua(..., "auto")`` is not told.
So where the network measurement leaves DiLoCo a chance (ranks on several nodes, the exact
allreduce's communication not negligible), the wrapped model starts as DiLoCo's inner steps
(nothing is communicated) for :data:`TIMED_STEPS` optimizer steps and times them.  At the end
of that step every rank agrees on the slowest rank's median step time (one small
collective) and applies the rule (:func:`~bagua_algos.tuning.recommend.choose`) to the
network measured at the wrap and that time:

- DiLoCo: training goes on as DiLoCo with the rule's H (and ``overlap_steps``, where hiding
  each sync behind inner steps costs less: keep ``model.synced_state_dict()`` then), whose
  first inner steps were these (the anchor is the wrapped model's start, as if DiLoCo had
  been chosen at the wrap);
- a per-step algorithm: the ranks average their models (one allreduce, as a LocalSGD sync
  after these steps), and the module switches to that algorithm at its next synchronised
  training forward (rank 0's optimizer state then, as with any switch).

One log line (logger ``bagua_algos.recommend``, and stderr on rank 0) says what was timed and
what was chosen.  ``model.algorithm`` is the choice from then on.
"""

from __future__ import annotations

import logging
import statistics
import time

import torch

import bagua_comm as bc

from .._engine.checks import check_int_at_least
from .._engine.small import max_small
from ..algorithm import Algorithm
from ..algorithms.diloco import DiLoCo, DiLoCoImpl
from .recommend import (
    NEGLIGIBLE_S,
    NetworkMeasurement,
    Recommendation,
    bucket_size_for,
    choose,
    diloco_kwargs,
    recommend,
)

log = logging.getLogger("bagua_algos.recommend")

#: Optimizer steps timed before the choice (at least 2): the first pays first-use costs, so
#: the median of the next ones' times is the step's computation
TIMED_STEPS = 5
#: DiLoCo's H while timing: no sync before the choice sets the real one
_UNSET = 2 ** 31 - 1


class TimedChoice(DiLoCo):
    """DiLoCo's inner steps while the step is timed, then the rule's choice (not registered:
    ``with_bagua(..., "auto")`` builds it from its network measurement)."""

    def __init__(self, measurement: NetworkMeasurement, model_bytes: float, *,
                 bucket_given: bool = False, timed_steps: int = TIMED_STEPS):
        check_int_at_least("timed_steps", timed_steps, 2)
        hier = measurement.nodes < measurement.world_size
        super().__init__(**diloco_kwargs(
            _UNSET, 0, hier, measurement.nodes if hier else measurement.world_size))
        self._measurement = measurement
        self._model_bytes = model_bytes
        self._bucket_given = bucket_given
        self._timed_steps = timed_steps

    def reify(self, group):
        return TimedChoiceImpl(group, self)


class TimedChoiceImpl(DiLoCoImpl):
    def __init__(self, group, algo: TimedChoice):
        super().__init__(group, algo)
        self._stamps: list[float] = []
        #: the slowest rank's median step time (seconds), once timed
        self.compute_s: float | None = None
        #: (name, kwargs) of the rule's choice, once made
        self.choice: tuple[str, dict] | None = None

    def on_step(self, t: int) -> None:
        if self.choice is None:
            if self.device.type == "cuda":   # the step's kernels, not their launches
                torch.cuda.synchronize(self.device)
            self._stamps.append(time.perf_counter())
            # the steps this wrap took (a run resumed from a checkpoint times its own)
            if len(self._stamps) >= self.algo._timed_steps:
                self._choose()
        super().on_step(t)

    def _choose(self) -> None:
        algo, m = self.algo, self.algo._measurement
        gaps = [b - a for a, b in zip(self._stamps, self._stamps[1:])]
        (compute,) = max_small([statistics.median(gaps)], self.group)
        name, kwargs, why, _ = choose(m.bandwidth_mbit, m.latency_ms, m.world_size,
                                      algo._model_bytes, compute_s=compute, nodes=m.nodes,
                                      codec_s_per_byte=m.codec_s_per_byte,
                                      slow_start=bool(m.tcp_restarts_after_idle))
        self.compute_s, self.choice = compute, (name, kwargs)
        if name == "diloco":     # no sync has started: H and T take effect from here
            self.H = algo.sync_every = kwargs["sync_every"]
            self.tau = algo.overlap_steps = kwargs.get("overlap_steps", 0)
            then = f"DiLoCo goes on with H = {self.H}" + (
                f", each sync hidden behind {self.tau} steps" if self.tau else "")
        else:
            self._average()
            bucket = None if algo._bucket_given else bucket_size_for(
                name, m.bandwidth_mbit, m.latency_ms, m.nodes, algo._model_bytes)
            self.switch_to = (Algorithm.init(name, **kwargs), bucket)
            then = (f"models averaged, {name} from the next training forward"
                    + (f" (buckets of {bucket / 2**20:.0f} MiB)" if bucket else ""))
        line = (f"bagua auto: {name}{kwargs} -- a step took {1e3 * compute:.1f} ms "
                f"(the slowest rank's median over the {len(gaps)} timed after the first, "
                f"trained locally); {then}; {why}")
        log.info(line)
        if self.group.rank == 0:
            print(line, flush=True)

    def _average(self) -> None:
        """Every rank's model replaced by the ranks' average (blocking)."""
        with torch.no_grad():
            for f in range(self.P):
                x = self.gather(f)
                self.reducer.allreduce(x, bc.ReduceOp.AVG).wait()
                self.scatter(f, x)


def resolve_algorithm(spec: str, model, group=None, *, optimizers=None,
                      bucket_given: bool = False) -> Recommendation:
    """``with_bagua(model, opts, "auto")``: :func:`recommend`'s answer (collective).
    ``BAGUA_ALGORITHM`` overrules it; an explicit Algorithm never reaches here.  With
    ``optimizers`` given, where the measurement leaves DiLoCo a chance (several nodes, the
    exact allreduce's communication not negligible) and DiLoCo can run this model, the
    answer is a :class:`~bagua_algos.tuning.timed_choice.TimedChoice`: the first steps are
    timed and then the rule chooses, told their computation time."""
    if spec != "auto":
        raise ValueError(f"algorithm as a string must be 'auto', got {spec!r}")
    if not bc.is_initialized() and torch.distributed.is_initialized():
        bc.init_process_group()  # adopt torch's default process group, as with_bagua does
    if not bc.is_initialized():
        raise RuntimeError("bagua_comm is not initialised: call bagua_comm.init_process_group() "
                           "before with_bagua(..., 'auto')")
    rec = recommend(model, group=group)
    m = rec.measurement
    if (optimizers is None or m is None or m.nodes < 2
            or (rec.name == "gradient_allreduce"
                and rec.scores.get("gradient_allreduce", 0.0) < NEGLIGIBLE_S)):
        return rec
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters()
                      if p.requires_grad)
    timed = TimedChoice(m, model_bytes, bucket_given=bucket_given)
    try:
        timed.check_wrap(model, list(optimizers))
    except ValueError as err:     # the same model on every rank: the same answer
        log.info(f"bagua auto: {rec.name} without timing the step (DiLoCo cannot run "
                 f"this model: {err})")
        return rec
    line = (f"bagua auto: timing the first {TIMED_STEPS} steps (trained locally) before "
            f"choosing: DiLoCo is a candidate on this network against a known step time")
    log.info(line)
    if (bc.get_default_group() if group is None else group).rank == 0:
        print(line, flush=True)
    return Recommendation(rec.name, rec.kwargs, timed, m, f"{rec.reason}; {line}",
                          rec.scores, None)
