"""In-process performance autotuning of a :class:`~bagua_algos.BaguaModule`.

No server, no port, no thread: the tuner runs inside the module's forward-pre hook.  Every
rank times its training steps (forward-pre to forward-pre); at the end of each trial the
per-step times are reduced across ranks (MAX, so a step counts as long as its slowest rank)
on a process group of the tuner's own, and every rank feeds the same reduced score to the same
deterministic search (:mod:`.search`).  So every rank applies the same configuration
at the same step, and never runs a step on a configuration another rank does not.

Knobs are those that leave the algorithm's maths unchanged: the bucket size (every
algorithm), plus whatever the algorithm implementation declares through
``autotune_knobs() -> {attribute: (values, changes_maths)}`` (GradientAllReduce:
``hierarchical`` when the group spans several nodes with several ranks each).  Knobs that
change the maths are tuned only when named in ``autotune={"knobs": [...]}``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

import bagua_comm as bc

from .._engine.checks import check_bucket_size
from .search import Search, log_spaced_sizes

if TYPE_CHECKING:
    from ..module import BaguaModule

logger = logging.getLogger("bagua_algos.autotune")

ENV = "BAGUA_AUTOTUNE"
LOG_ENV = "BAGUA_AUTOTUNE_LOG"
CACHE_ENV = "BAGUA_CACHE_DIR"
# option -> (default, environment variable overriding the default)
OPTIONS = {
    "max_steps": (200, "BAGUA_AUTOTUNE_MAX_STEPS"),
    "warmup_steps": (2, "BAGUA_AUTOTUNE_WARMUP_STEPS"),
    "trial_steps": (8, "BAGUA_AUTOTUNE_TRIAL_STEPS"),
    "cache": (True, "BAGUA_AUTOTUNE_CACHE"),
    "knobs": (None, None),
}
KNOWN_KNOBS = ("bucket_size", "hierarchical")
MIN_BUCKET, MAX_BUCKET = 4 * 1024, 1 << 30
FIRST_EXTRA_WARMUP = 3   # the first steps of a run are slow (allocations, lazy state)
CACHE_VERSION = 1


# -- options ------------------------------------------------------------------------------------
def _env_int(var: str) -> int | None:
    text = os.environ.get(var, "").strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"environment variable {var} must be an integer, got {text!r}; "
                         f"unset it or give a whole number") from None


def resolve_options(autotune) -> dict | None:
    """The tuner's options from ``with_bagua(autotune=...)`` and the environment, or ``None``
    when autotuning is off.  Raises ``ValueError`` for bad values (before any communication).

    ``autotune`` is ``False``, ``True`` or a dict of options (``max_steps``, ``warmup_steps``,
    ``trial_steps``, ``cache``, ``knobs``).  ``BAGUA_AUTOTUNE=1`` turns tuning on when the code
    says ``False``; ``BAGUA_AUTOTUNE=0`` turns it off whatever the code says.
    """
    env = os.environ.get(ENV, "").strip()
    if env not in ("", "0", "1"):
        raise ValueError(f"environment variable {ENV} must be 0 or 1, got {env!r}; "
                         f"set {ENV}=1 to autotune, 0 (or unset) not to")
    if isinstance(autotune, bool):
        given: dict = {}
        on = autotune
    elif isinstance(autotune, dict):
        given, on = dict(autotune), True
        unknown = sorted(set(given) - set(OPTIONS), key=str)
        if unknown:
            raise ValueError(f"autotune has unknown options {unknown}; the options are "
                             f"{sorted(OPTIONS)}")
    else:
        raise ValueError(f"autotune must be True, False or a dict of options "
                         f"({sorted(OPTIONS)}), got {autotune!r}")
    if env == "1":
        on = True
    elif env == "0":
        on = False
    if not on:
        return None
    opts = {}
    for name, (default, var) in OPTIONS.items():
        value = given.get(name, default)
        if name not in given and var is not None and name != "cache":
            env_value = _env_int(var)
            value = default if env_value is None else env_value
        opts[name] = value
    if "cache" not in given and os.environ.get(OPTIONS["cache"][1], "").strip() == "0":
        opts["cache"] = False
    for name in ("max_steps", "warmup_steps", "trial_steps"):
        v = opts[name]
        low = 0 if name == "warmup_steps" else 1
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"autotune option {name} must be an integer >= {low}, got {v!r}")
    first = opts["warmup_steps"] + opts["trial_steps"] + FIRST_EXTRA_WARMUP
    if opts["max_steps"] < first:
        raise ValueError(f"autotune option max_steps ({opts['max_steps']}) must be at least "
                         f"warmup_steps + trial_steps + {FIRST_EXTRA_WARMUP} ({first}): the "
                         f"budget must hold the first trial")
    if not isinstance(opts["cache"], bool):
        raise ValueError(f"autotune option cache must be True or False, got {opts['cache']!r}")
    knobs = opts["knobs"]
    if knobs is not None and (isinstance(knobs, str) or not all(
            isinstance(k, str) for k in knobs)):
        raise ValueError(f"autotune option knobs must be a list of knob names such as "
                         f"['bucket_size', 'hierarchical'], got {knobs!r}")
    if knobs is not None and set(knobs) - set(KNOWN_KNOBS):
        raise ValueError(f"autotune option knobs names unknown knobs "
                         f"{sorted(set(knobs) - set(KNOWN_KNOBS))}; known: {list(KNOWN_KNOBS)}")
    opts["knobs"] = None if knobs is None else list(knobs)
    return opts


# -- knobs and configurations -------------------------------------------------------------------
def declared_knobs(module: BaguaModule, wanted: list[str] | None) -> dict[str, list]:
    """Categorical knobs to tune: the implementation's declared ones that keep the maths,
    plus those that change it if named in ``wanted``.  Raises for unknown names."""
    fn = getattr(module.impl, "autotune_knobs", None)
    declared = fn() if fn is not None else {}
    if wanted is not None:
        unknown = [k for k in wanted if k != "bucket_size" and k not in declared]
        if unknown:
            raise ValueError(f"autotune knobs {unknown} are not tunable for "
                             f"{module.algorithm.name} here; tunable: "
                             f"{['bucket_size', *sorted(declared)]}")
    out = {}
    for name, (values, changes_maths) in declared.items():
        if (wanted is None and not changes_maths) or (wanted is not None and name in wanted):
            out[name] = list(values)
    return out


def _tensors(module: BaguaModule) -> list[torch.Tensor]:
    return [p for b in module.buckets for p in b.params]


def _layout(module: BaguaModule, tensors, size: int) -> tuple:
    return tuple(tuple(id(t) for t in b) for b in module.impl.tensors_to_buckets(tensors, size))


def candidate_sizes(module: BaguaModule, start: int) -> list[int]:
    """Log-spaced bucket sizes from 4 KiB up to the whole model, one per distinct bucket
    layout (sizes that cut the model the same way are the same configuration), plus
    ``start`` (which represents its own layout)."""
    tensors = _tensors(module)
    total = sum(t.numel() * t.element_size() for t in tensors) or MIN_BUCKET
    hi = min(MAX_BUCKET, max(MIN_BUCKET, total))
    sizes = log_spaced_sizes(MIN_BUCKET, hi)
    try:
        start_layout = _layout(module, tensors, start)
        seen = {start_layout: start}
        for s in sizes:
            seen.setdefault(_layout(module, tensors, s), s)
        return sorted(set(seen.values()))
    except Exception:  # an unusual tensors_to_buckets: keep every size
        return sorted(set(sizes) | {start})


def _apply(module: BaguaModule, config: dict) -> None:
    """Make ``config`` current (every rank, same step, between steps)."""
    for name, value in config.items():
        if name != "bucket_size" and getattr(module.impl, name) != value:
            setattr(module.impl, name, value)
    if config["bucket_size"] != module.bucket_size:
        module.rebucket(config["bucket_size"])   # collective; keeps the algorithm's state


# -- cache --------------------------------------------------------------------------------------
def _jsonable(value):
    return value if isinstance(value, (bool, int, float, str, type(None))) else type(
        value).__name__


def cache_key(module: BaguaModule, knobs: dict) -> tuple[str, dict]:
    """The cache key (hex digest) and what it was made of."""
    algo = module.algorithm
    material = {
        "version": CACHE_VERSION,
        "params": [[list(p.shape), str(p.dtype)] for p in _tensors(module)],
        "world_size": module.group.size,
        "nodes": module.group.num_nodes,
        "algorithm": algo.name,
        "algorithm_args": {k: _jsonable(v) for k, v in sorted(vars(algo).items())
                           if not k.startswith("_")},
        "backend": module.group.backend,
        "device": str(_tensors(module)[0].device.type) if _tensors(module) else "cpu",
        "knobs": sorted(knobs),
    }
    digest = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:32]
    return digest, material


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "bagua") / "autotune"


def _read_cache(path: Path, knobs: dict) -> dict | None:
    try:
        entry = json.loads(path.read_text())
        best = entry["best"]
        check_bucket_size(best["bucket_size"])
        if set(best) != {"bucket_size", *knobs} or any(
                best[k] not in v for k, v in knobs.items()):
            return None
        return entry
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as err:
        logger.warning("autotune: ignoring unreadable cache entry %s (%s)", path, err)
        return None


def _write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


# -- the tuner ----------------------------------------------------------------------------------
class Autotuner:
    """Drives the search from :meth:`on_step` (called by the module's forward-pre hook,
    after the step counter moved on).  Construction is collective (every rank of the
    module's group, as ``with_bagua`` is)."""

    def __init__(self, module: BaguaModule, options: dict):
        self.opts = options
        self.rank = module.group.rank
        self.world = module.group.size
        self.knobs = declared_knobs(module, options["knobs"])
        self.group = bc.new_group(module.group.ranks) if self.world > 1 else None
        if options["knobs"] is not None and "bucket_size" not in options["knobs"]:
            self.sizes = [module.bucket_size]
        else:
            self.sizes = candidate_sizes(module, module.bucket_size)
        self.start = {"bucket_size": module.bucket_size,
                      **{k: getattr(module.impl, k) for k in self.knobs}}
        trial = options["warmup_steps"] + options["trial_steps"]
        self.search = Search(self.sizes, self.start, self.knobs, max_trials=max(
            1, (options["max_steps"] - FIRST_EXTRA_WARMUP) // trial))
        self.key, self.key_material = cache_key(module, self.knobs)
        self.cache_path = cache_dir() / f"{self.key}.json"
        self.log_path = os.environ.get(LOG_ENV) or None
        self.done = False
        self.cached = False
        self.steps = 0
        self.settled_step: int | None = None
        self.best = dict(self.start)
        self.trials: list[dict] = []
        self.history: list[tuple[int, dict]] = []   # (first step, config)
        self._trial_start: int | None = None
        self._last: float | None = None
        self._times: dict[int, float] = {}
        self._cuda = any(t.is_cuda for t in _tensors(module))
        self._to_apply: dict | None = None
        entry = None
        if options["cache"]:
            entry = _read_cache(self.cache_path, self.knobs) if self.rank == 0 else None
            if self.group is not None:
                entry = bc.broadcast_object(entry, 0, group=self.group)
        if entry is not None:
            self.done = self.cached = True
            self.best = dict(entry["best"])
            self.trials = list(entry.get("trials", []))
            self._to_apply = self.best
            self._log({"event": "cached", "best": self.best, "cache": str(self.cache_path)})
            self._summary(entry.get("steps", 0), from_cache=True)

    # -- per step -------------------------------------------------------------------------------
    def on_step(self, module: BaguaModule) -> None:
        step = module.step
        if self.done:
            if self._to_apply is not None:    # a cached result: apply before the first step
                config, self._to_apply = self._to_apply, None
                _apply(module, config)
                self.history.append((step, dict(config)))
            return
        if self._cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        if self._trial_start is None:         # first training step: the start config runs
            self._trial_start, self._last = step, now
            self.history.append((step, dict(self.start)))
            return
        self._times[step - 1] = now - self._last
        self._last = now
        self.steps = step - 1
        w, m = self.opts["warmup_steps"], self.opts["trial_steps"]
        if not self.trials:
            w += FIRST_EXTRA_WARMUP
        if step - self._trial_start < w + m:
            return
        first = self._trial_start + w
        times = torch.tensor([self._times[s] for s in range(first, first + m)],
                             dtype=torch.float64)
        self._times.clear()
        if self.group is not None:
            if self.group.backend == "nccl":
                times = times.cuda()
            bc.allreduce_inplace(times, bc.ReduceOp.MAX, group=self.group)
            times = times.cpu()
        score = _robust_mean(times.tolist())
        config = self.search.ask()
        self.search.tell(score)
        trial = {"config": config, "score": score}
        self.trials.append(trial)
        self._log({"event": "trial", "step": step, **trial, "step_times": times.tolist()})
        nxt = self.search.ask()
        if nxt is None:
            nxt = self.search.best
            self.best = nxt
            self.done = True
            self.settled_step = step
        _apply(module, nxt)
        self.history.append((step, dict(nxt)))
        self._trial_start = step
        if self.done:
            self._finish()

    def _finish(self) -> None:
        base = self.search.mean(self.start)
        best = self.search.mean(self.best)
        self._log({"event": "done", "steps": self.steps, "best": self.best, "score": best,
                   "start": self.start, "start_score": base})
        self._summary(self.steps)
        if self.rank == 0 and self.opts["cache"]:
            try:
                _write_json(self.cache_path, {
                    "best": self.best, "steps": self.steps, "trials": self.trials,
                    "key": self.key_material, "created": time.time()})
            except OSError as err:
                logger.warning("autotune: could not write the cache %s (%s)",
                               self.cache_path, err)

    # -- output ---------------------------------------------------------------------------------
    def _log(self, record: dict) -> None:
        if self.rank != 0 or not self.log_path:
            return
        try:
            with open(self.log_path, "a") as f:
                f.write(json.dumps({"time": time.time(), **record}) + "\n")
        except OSError as err:
            logger.warning("autotune: could not write %s=%s (%s)", LOG_ENV, self.log_path, err)

    def _summary(self, steps: int, from_cache: bool = False) -> None:
        if self.rank != 0:
            return
        best = ", ".join(f"{k}={v}" for k, v in self.best.items())
        if from_cache:
            logger.info("autotune: %s from the cache (%s), tuned earlier in %d steps", best,
                        self.cache_path, steps)
            return
        base, score = self.search.mean(self.start), self.search.mean(self.best)
        speed = f", {base / score:.2f}x the start" if base and score else ""
        logger.info("autotune: settled after %d steps and %d trials on %s (%.2f ms/step%s)",
                    steps, len(self.trials), best, 1e3 * (score or math.nan), speed)

    def report(self) -> dict:
        return {
            "done": self.done, "steps": self.steps, "best": dict(self.best),
            "trials": [dict(t) for t in self.trials], "cached": self.cached,
            "settled_step": self.settled_step, "start": dict(self.start),
            "candidates": list(self.sizes), "knobs": {k: list(v) for k, v in self.knobs.items()},
            "cache_file": str(self.cache_path),
        }


def _robust_mean(times: list[float]) -> float:
    """Mean of the faster half of the step times: a configuration's own cost, with the
    stalls a shared, loaded machine adds to some steps left out."""
    times = sorted(times)
    kept = times[:max(1, (len(times) + 1) // 2)]
    return sum(kept) / len(kept)
