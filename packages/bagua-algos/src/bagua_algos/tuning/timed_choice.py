"""``with_bagua(model, [opt], "auto")``: time the step's compute, then choose.

:func:`~bagua_algos.tuning.recommend.recommend` weighs DiLoCo (train locally, average every H
steps) only against a known computation time, which ``with_bagua(..., "auto")`` is not told.
So where the network measurement leaves DiLoCo a chance (ranks on several nodes, the exact
allreduce's communication not negligible), the wrapped model starts as DiLoCo's inner steps
(nothing is communicated) for at least :data:`TIMED_STEPS` optimizer steps and times them.
On a CPU (gloo) job whose nodes are far apart (two tiny exchanges say the exact allreduce's
latency alone is not negligible) the network is measured meanwhile, on a thread of its own
(its exchanges are point-to-point, which the local steps leave the group free for), so the
measurement costs the run no time: the choice is made at the first step, :data:`TIMED_STEPS`
at least, that every rank knows comes after every rank's measurement ended (one small
collective agrees on it).  Elsewhere the network is measured at the wrap, as
:func:`recommend` does (a near network in a fraction of a second, where the exact allreduce
may win from the first step; a GPU job's probes wait for the device, which training keeps
busy).  At the choice every
rank agrees on the slowest rank's median step time (one small collective) and applies the
rule (:func:`~bagua_algos.tuning.recommend.choose`) to the network and that time:

- DiLoCo: training goes on as DiLoCo with the rule's H (and ``overlap_steps``, where hiding
  each sync behind inner steps costs less: keep ``model.synced_state_dict()`` then), whose
  first inner steps were these (the anchor is the wrapped model's start, as if DiLoCo had
  been chosen at the wrap; where the choice comes after H steps, the first sync starts at
  it, and the next ones every H steps after);
- a per-step algorithm: the ranks average their models (one allreduce, as a LocalSGD sync
  after these steps), and the module switches to that algorithm at its next synchronised
  training forward (rank 0's optimizer state then, as with any switch).

One log line (logger ``bagua_algos.recommend``, and stderr on rank 0) says what was timed and
what was chosen.  ``model.algorithm`` is the choice from then on.
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
import threading
import time

import torch

import bagua_comm as bc

from .._engine.checks import check_int_at_least
from .._engine.small import DIRECT_MAX_RANKS, max_small
from ..algorithm import Algorithm
from ..algorithms.diloco import DiLoCo, DiLoCoImpl
from . import recommend as _rec
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
#: Steps between the last rank's end of measurement and the choice: each rank learns the
#: choice's step (one small collective) within them, so none reaches it unknowing
_MARGIN = 3
#: recommend's time limit for the measurement made beside the timed steps
_PROBE_LIMIT_S = 3.0
#: the interpreter's thread switch interval while measuring beside the steps (seconds)
_SWITCH_S = 5e-5


class TimedChoice(DiLoCo):
    """DiLoCo's inner steps while the step is timed, then the rule's choice (not registered:
    ``with_bagua(..., "auto")`` builds it from its network measurement)."""

    def __init__(self, measurement: NetworkMeasurement | tuple[int, int], model_bytes: float,
                 *, bucket_given: bool = False, timed_steps: int = TIMED_STEPS):
        """``measurement``: the network measured at the wrap, or ``(nodes, world_size)`` to
        measure it beside the timed steps (a CPU job)."""
        check_int_at_least("timed_steps", timed_steps, 2)
        nodes, world = ((measurement.nodes, measurement.world_size)
                        if isinstance(measurement, NetworkMeasurement) else measurement)
        hier = nodes < world
        super().__init__(**diloco_kwargs(_UNSET, 0, hier, nodes if hier else world))
        self._measurement = measurement if isinstance(measurement, NetworkMeasurement) else None
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
        #: the network measurement the choice used (at the wrap, or beside the timed steps)
        self.measurement: NetworkMeasurement | None = algo._measurement
        #: the stamped step that made the choice (steps since the wrap)
        self.chosen_at: int | None = None
        self._probe: threading.Thread | None = None
        self._probe_error: BaseException | None = None
        self._measured_at: int | None = None   # this rank's stamped steps when it was done
        self._due_at: int | None = None        # the choice's step, agreed by every rank
        #: DiLoCo's syncs start after the steps t with (t - sync_phase) % H at its offset
        self.sync_phase = 0

    def on_step(self, t: int) -> None:
        if self.choice is None:
            if self.device.type == "cuda":   # the step's kernels, not their launches
                torch.cuda.synchronize(self.device)
            self._stamps.append(time.perf_counter())
            # the steps this wrap took (a run resumed from a checkpoint times its own)
            n = len(self._stamps)
            if self.measurement is None and self._probe is None:
                self._start_probe()    # after the wrap's collectives: none of ours till the choice
            if n >= self.algo._timed_steps and self._due(n):
                self._choose(t, n)
        super().on_step(t)

    def sync_due(self, fragment: int, t: int) -> bool:
        return super().sync_due(fragment, t - self.sync_phase)

    def shutdown(self) -> None:
        # a measurement still running sends on the group: it ends before the group's next
        # user (a re-wrap), every rank's alike (each rank's thread exchanges with the others)
        if self._probe is not None:
            self._probe.join()
        super().shutdown()

    def _start_probe(self) -> None:
        """Measure the network on a thread of its own while the training thread takes
        local steps (which communicate nothing), then agree with every rank on the step of
        the choice: the latest rank's step at its end, plus :data:`_MARGIN`."""
        def run():
            switch = sys.getswitchinterval()
            # a probe's timing ends when this thread holds the GIL again: by default the
            # training thread keeps it up to 5 ms (measured: a 0.1-ms loopback exchange read
            # as 5.6 ms beside 0.5-ms steps)
            sys.setswitchinterval(_SWITCH_S)
            try:
                m, _ = _rec._measure(self.group, _PROBE_LIMIT_S, self.device, [])
                self._measured_at = len(self._stamps)
                (last,) = max_small([float(self._measured_at)], self.group)
                self.measurement = m
                self._due_at = max(self.algo._timed_steps, int(last) + _MARGIN)
            except BaseException as err:     # raised on the training thread, at the choice
                self._probe_error = err
            finally:
                sys.setswitchinterval(switch)

        self._probe = threading.Thread(target=run, name="bagua-auto-measure", daemon=True)
        self._probe.start()

    def _due(self, n: int) -> bool:
        """Whether the choice is made at the ``n``-th stamped step (the same answer on every
        rank).  While this rank measures, the agreed step is at least its step at the end
        plus the margin, so later than ``n``; once it is done, the training thread waits for
        the agreement no later than that step."""
        if self._probe is None:
            return True                      # measured at the wrap
        if self._due_at is None:
            done = self._measured_at
            if done is not None and n < done + _MARGIN:
                return False
            if done is None and self._probe.is_alive():
                return False                 # measuring: the agreed step is later
            self._probe.join()
            if self._probe_error is not None:
                raise RuntimeError("bagua auto: measuring the network beside the timed steps "
                                   f"failed: {self._probe_error}") from self._probe_error
        return n >= self._due_at

    def _choose(self, t: int, n: int) -> None:
        algo, m = self.algo, self.measurement
        gaps = [b - a for a, b in zip(self._stamps, self._stamps[1:])]
        (compute,) = max_small([statistics.median(gaps)], self.group)
        name, kwargs, why, _ = choose(m.bandwidth_mbit, m.latency_ms, m.world_size,
                                      algo._model_bytes, compute_s=compute, nodes=m.nodes,
                                      codec_s_per_byte=m.codec_s_per_byte,
                                      slow_start=bool(m.tcp_restarts_after_idle))
        self.compute_s, self.choice, self.chosen_at = compute, (name, kwargs), n
        if name == "diloco":     # no sync has started: H and T take effect from here
            self.H = algo.sync_every = kwargs["sync_every"]
            self.tau = algo.overlap_steps = kwargs.get("overlap_steps", 0)
            now = n >= self.H    # a period's steps are local already: the first sync now
            if now:
                self.sync_phase = t % self.H
            then = f"DiLoCo goes on with H = {self.H}" + (
                f", each sync hidden behind {self.tau} steps" if self.tau else "") + (
                ", its first sync now" if now else "")
        else:
            self._average()
            bucket = None if algo._bucket_given else bucket_size_for(
                name, m.bandwidth_mbit, m.latency_ms, m.nodes, algo._model_bytes)
            self.switch_to = (Algorithm.init(name, **kwargs), bucket)
            then = (f"models averaged, {name} from the next training forward"
                    + (f" (buckets of {bucket / 2**20:.0f} MiB)" if bucket else ""))
        measured = (f"measured {m.bandwidth_mbit:.0f} Mbit/s, {m.latency_ms:.2f} ms a tiny "
                    f"exchange between {m.nodes} nodes in {m.elapsed_s:.2f}s"
                    + (" beside the local steps" if self._probe is not None else ""))
        line = (f"bagua auto: {name}{kwargs} -- a step took {1e3 * compute:.1f} ms "
                f"(the slowest rank's median over the {len(gaps)} timed after the first, "
                f"trained locally); {measured}; {then}; {why}")
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
    ``optimizers`` given, ranks on several nodes and a model DiLoCo can run, the answer is a
    :class:`~bagua_algos.tuning.timed_choice.TimedChoice` where the network leaves DiLoCo a
    chance (the exact allreduce's communication not negligible): the first steps are timed
    and then the rule chooses, told their computation time.  A CPU (gloo) job whose nodes are
    far apart (:func:`~bagua_algos.tuning.recommend.far_apart`) measures the network beside
    those steps; otherwise it is measured here first."""
    if spec != "auto":
        raise ValueError(f"algorithm as a string must be 'auto', got {spec!r}")
    if not bc.is_initialized() and torch.distributed.is_initialized():
        bc.init_process_group()  # adopt torch's default process group, as with_bagua does
    if not bc.is_initialized():
        raise RuntimeError("bagua_comm is not initialised: call bagua_comm.init_process_group() "
                           "before with_bagua(..., 'auto')")
    g = bc.get_default_group() if group is None else group
    nodes, _ = _rec._nodes(g)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    forced = os.environ.get("BAGUA_ALGORITHM", "").strip() not in ("", "auto")
    if (optimizers is not None and nodes >= 2 and device.type == "cpu" and not forced
            and g.backend == "gloo" and g.size <= DIRECT_MAX_RANKS and _rec.far_apart(g)):
        # the probes' exchanges are point-to-point on the group, where direct_small's are;
        # on a near network the measurement is quick and may keep the exact allreduce
        # from the first step: it is made here
        timed = _timed(TimedChoice((nodes, g.size), _model_bytes(model),
                                   bucket_given=bucket_given), model, optimizers, "diloco")
        if timed is not None:
            line = (f"bagua auto: timing the first {TIMED_STEPS} or more steps (trained "
                    f"locally) and measuring the network beside them, then choosing: DiLoCo "
                    f"is a candidate between {nodes} nodes against a known step time")
            _say(line, g)
            return Recommendation("diloco", {}, timed, None, line, {}, None)
    rec = recommend(model, group=group)
    m = rec.measurement
    if (optimizers is None or m is None or m.nodes < 2
            or (rec.name == "gradient_allreduce"
                and rec.scores.get("gradient_allreduce", 0.0) < NEGLIGIBLE_S)):
        return rec
    timed = _timed(TimedChoice(m, _model_bytes(model), bucket_given=bucket_given), model,
                   optimizers, rec.name)
    if timed is None:
        return rec
    line = (f"bagua auto: timing the first {TIMED_STEPS} steps (trained locally) before "
            f"choosing: DiLoCo is a candidate on this network against a known step time")
    _say(line, g)
    return Recommendation(rec.name, rec.kwargs, timed, m, f"{rec.reason}; {line}",
                          rec.scores, None)


def _model_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def _timed(timed: TimedChoice, model, optimizers, otherwise: str) -> TimedChoice | None:
    """``timed``, or None where DiLoCo cannot run the model (the same model on every rank:
    the same answer)."""
    try:
        timed.check_wrap(model, list(optimizers))
    except ValueError as err:
        log.info(f"bagua auto: {otherwise} without timing the step (DiLoCo cannot run "
                 f"this model: {err})")
        return None
    return timed


def _say(line: str, group) -> None:
    log.info(line)
    if group.rank == 0:
        print(line, flush=True)
