"""torchrun worker of benchmarks/e2e.py: trains the workload with each algorithm in turn.

``--procs-per-host`` processes per emulated host.  For every row (``_e2e_rows``: torch DDP and
its hooks, each bagua algorithm and mode) it builds the same model (same seed), measures
compute-only step time on a private copy, wraps the model, warms up, then times at least
``--steps`` steps (AsyncModelAverage: until the window holds ``--async-min-rounds`` averaging
rounds, so its figures include its communication) and keeps training until the wall budget
(``--wall-seconds``, at least ``--budget-factor`` x DDP's time for ``--steps`` steps), with
the weights snapshotted every ``--eval-every`` steps up to 2N and every N/2 after (default:
every step; the clock paused for the copy, about a millisecond) and their held-out loss evaluated after the run: the
loss-against-time curve that time to DDP's loss is read from.  Evaluating after the run, not
inside it, keeps AsyncModelAverage's background averaging from getting free time while the
clock is paused.  A row other than DDP stops early, once past T and the timed window, at the
first snapshot where its ranks' mean held-out loss (that snapshot evaluated on the spot, the
clock paused) is at or below the deepest target, DDP's loss after its deepest step count
(``--stop-loss``, else taken from the DDP row of the same job; ``--full-budget``: never): what
it would have trained after that changes none of its figures.  Rank 0 writes ``<out>/<row>.json``; progress
goes to ``<out>/progress``.  A row bagua_algos does not provide is written as unavailable
(every rank sees the same registry, so nobody waits on a collective).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _e2e_model import MarkovText, lm_loss, make_model, num_params
from _e2e_rows import (
    ALONE,
    AUTO_ROWS,
    AUTO_WRAP,
    HIDING_ROWS,
    HOOK_ROWS,
    OUTER_BYTES,
    SEPARATE_MODELS,
    SYNC_ROWS,
    TORCH_ROWS,
    AllReduceCounter,
    bagua_spec,
    build_torch,
    hidden_sync_steps,
    jsonable,
    powersgd_start,
    split_row,
    sync_every_for,
    sync_every_of_row,
)

from bagua_algos.tuning.recommend import _restarts_after_idle, _slow_start_after_idle


class Unavailable(Exception):
    """The algorithm cannot be built here (not installed / not registered yet)."""


def _build(name: str, model, args, harness):
    """``(wrapped_model, optimizer)`` for row ``name`` (raises :class:`Unavailable`)."""
    if name == ALONE:      # the floor: the bare model, each rank on its own shard, no bytes
        return model, torch.optim.Adam(model.parameters(), lr=args.lr)
    if split_row(name)[0] == "ft_diloco":   # torchft's DiLoCo, the peer of our diloco row
        from _e2e_ft import FtDiLoCoRow
        from _e2e_ft import Unavailable as FtUnavailable

        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
        try:
            row = FtDiLoCoRow(model, opt, args.chosen_sync_every, harness)
        except FtUnavailable as err:
            raise Unavailable(str(err)) from err
        args.row_close, args.row_steps = row.close, row
        return model, opt
    if name in HOOK_ROWS:
        try:
            import bagua_algos.ddp_hooks
        except ImportError as err:
            raise Unavailable(f"bagua_algos has no ddp_hooks ({err})") from err
    if name in TORCH_ROWS or name in HOOK_ROWS:
        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
        return build_torch(name, model, powersgd_rank=args.powersgd_rank,
                           powersgd_start=powersgd_start(args.warmup)), opt
    try:
        import bagua_algos
    except ImportError as err:
        raise Unavailable(f"bagua_algos is not installed ({err})") from err
    if name == "auto":     # the automatic choice itself: measure the network, pick, train
        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
        t0 = time.perf_counter()
        # recommend() with the step's computation time (the harness measured it, a user
        # times a step): then communicating rarely (DiLoCo) is a candidate too
        # and the run's length in steps (as the DiLoCo rows' rule is told it: the same cap on H)
        rec = bagua_algos.recommend(model, compute_s=args.row_compute_s,
                                    total_steps=_deepest(args))
        probe_s = time.perf_counter() - t0
        wrapped = bagua_algos.with_bagua(model, [opt], rec.algorithm,
                                         bucket_size=rec.bucket_size)
        args.auto_choice = {"algorithm": wrapped.algorithm.name,
                            "kwargs": jsonable(rec.kwargs),
                            "bucket_size": wrapped.bucket_size,
                            "probe_s": round(probe_s, 3),   # recommend(): its measurement
                            "setup_s": round(time.perf_counter() - t0, 3),   # and the wrap
                            "reason": rec.reason}
        return wrapped, opt
    if name == AUTO_WRAP:  # as a user writes it: steps timed, the network measured beside them
        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
        t0 = time.perf_counter()
        wrapped = bagua_algos.with_bagua(model, [opt], "auto")
        args.auto_choice = {"algorithm": None, "bucket_size": None,
                            "setup_s": round(time.perf_counter() - t0, 3)}   # probe + wrap
        return wrapped, opt
    missing = [n for n in ("Algorithm", "with_bagua") if not hasattr(bagua_algos, n)]
    if missing:
        raise Unavailable(f"bagua_algos {bagua_algos.__version__} has no {', '.join(missing)} "
                          f"yet")
    algo_name, kwargs = bagua_spec(name, args.procs_per_host, warmup=args.warmup,
                                   world=dist.get_world_size())
    if algo_name == "qadam":
        if not hasattr(bagua_algos, "QAdamOptimizer"):
            raise Unavailable("bagua_algos has no QAdamOptimizer yet")
        opt = bagua_algos.QAdamOptimizer(model.parameters(), lr=args.lr,
                                         warmup_steps=args.warmup + args.qadam_warmup)
        kwargs["q_adam_optimizer"] = opt
    else:
        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    if algo_name == "async":
        kwargs["sync_interval_ms"] = args.async_interval_ms
    if algo_name in SYNC_ROWS:
        kwargs["sync_every"] = args.chosen_sync_every
    if split_row(name)[0] in HIDING_ROWS:
        kwargs["overlap_steps"] = args.chosen_overlap
    try:
        algo = bagua_algos.Algorithm.init(algo_name, **kwargs)
    except ValueError as err:
        if "unknown algorithm" in str(err):
            raise Unavailable("not in bagua_algos' registry yet (registered: "
                              f"{', '.join(getattr(bagua_algos.Algorithm, 'registered', list)())})"
                              ) from err
        raise
    return bagua_algos.with_bagua(model, [opt], algo), opt


def _choose_sync_every(args, slowest_compute_s: float, *, bytes_scale: float = 1.0,
                       overlap: bool = False) -> int:
    """``--sync-every`` if given, else ``sync_every_for`` DDP's step time in this job (or
    ``--ddp-seconds``), the slowest rank's compute time and the run's length (DDP's steps to
    the deepest target, as the ``auto`` row tells ``recommend``): the same on every rank.
    ``bytes_scale``: the row's outer-gradient bytes as a fraction of float32's (a 4-bit row
    pays 1/8 of the allreduce per sync).  ``overlap``: a hiding row's plan (its syncs
    overlap inner steps)."""
    if args.sync_every:
        return args.sync_every
    return sync_every_for(_ddp_step(args), slowest_compute_s, _deepest(args),
                          bytes_scale=bytes_scale, network=_network(args), overlap=overlap)


def _network(args) -> dict | None:
    """The shaped link as ``sync_every_for`` takes it (None: unshaped, or not known)."""
    if not args.network_mbit:
        return None
    world = dist.get_world_size()
    return {"bandwidth_mbit": args.network_mbit,
            # recommend's latency unit: one tiny exchange, two one-way delays on gloo
            "latency_ms": 2 * args.network_latency_ms,
            "nodes": max(1, world // max(1, args.procs_per_host)),
            "model_bytes": 4 * num_params(make_model(args.size, seed=args.seed)),
            # the hosts restart TCP from its initial window after idle (the switch on and a
            # congestion control other than BBR, as recommend reads it): a sync after H
            # silent steps pays slow start
            "slow_start": _restarts_after_idle(_slow_start_after_idle()) == 1.0}


def _ddp_step(args) -> float:
    """DDP's step time in this job (or from ``--ddp-seconds``); 0 before DDP's row ran."""
    return args.ddp_step_s or (args.ddp_seconds / args.steps if args.ddp_seconds else 0.0)


def _compute_time(model, batches, steps: int = 5) -> float:
    """Seconds per forward+backward+step with no communication at all (a private copy)."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    times = []
    for i in range(steps + 1):
        x, y = batches[i % len(batches)]
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        lm_loss(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t)
    return sorted(times[1:])[len(times[1:]) // 2]


@torch.no_grad()
def _evaluate(model, batches) -> float:
    was = model.training
    model.eval()
    loss = sum(float(lm_loss(model(x), y)) for x, y in batches) / len(batches)
    model.train(was)
    return loss


def _deepest(args) -> int:
    """DDP's step count of the deepest target: DDP trains at least this far."""
    return max([args.steps, *args.depth_steps])


def _snapshot_due(i: int, steps: int, every: int, depth_steps=()) -> bool:
    """Every ``every`` steps up to 2N, where time to DDP's loss is decided (DDP reaches its
    loss at N); every N/2 steps after, so fast rows that train for many steps (async) do not
    spend minutes evaluating their tail; and always at N and at each target's step count
    (DDP's loss there is the target)."""
    if i == steps or i in depth_steps:
        return True
    return i % (every if i <= 2 * steps else max(every, steps // 2)) == 0


def _deepest_loss(recs: list[dict], deepest: int) -> float | None:
    """DDP's held-out loss after ``deepest`` steps, the ranks' mean (the deepest target, as
    the report reads it from the combined curve); None if DDP has no evaluation there."""
    at = [loss for r in recs for step, _t, loss in r["evals"] if step == deepest]
    return sum(at) / len(at) if len(at) == len(recs) else None


def _snapshot(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _evaluate_snapshots(size: str, seed: int, snapshots, evalset, report=None) -> list:
    """[step, training seconds, held-out loss] for each snapshot, in order; ``report(k, n)``
    after each one (the parent's stall detector sees the evaluation progress: a row that
    trained hundreds of steps evaluates for minutes on a loaded machine)."""
    probe = make_model(size, seed=seed)
    evals = []
    for k, (step, elapsed, state) in enumerate(snapshots):
        probe.load_state_dict(state)
        evals.append([step, elapsed, _evaluate(probe, evalset)])
        if report is not None:
            report(k + 1, len(snapshots))
    return evals


def _tx_bytes(ifname: str | None) -> int:
    if not ifname:
        return 0
    return int(Path(f"/sys/class/net/{ifname}/statistics/tx_bytes").read_text())


def _accounted_bytes() -> int:
    try:
        from bagua_comm import traffic
    except ImportError:
        return 0
    return traffic.bytes_sent()


def _progress(args, name: str, step: int, total: int, phase: str = "train") -> None:
    if dist.get_rank() == 0:
        tmp = Path(args.out) / "progress.tmp"
        tmp.write_text(json.dumps({"algorithm": name, "step": step, "of": total,
                                   "phase": phase}))
        tmp.replace(Path(args.out) / "progress")


def _write_json(path: Path, obj) -> None:
    """Whole or not at all: e2e.py reads a row's file as soon as it exists."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    tmp.replace(path)


def _sync_period(name: str, args) -> int | None:
    """H of a row that communicates every H steps (a sync row, or auto when it chose
    DiLoCo); None for the rows that communicate every step."""
    if split_row(name)[0] in SYNC_ROWS:
        return args.chosen_sync_every
    if name in AUTO_ROWS and args.auto_choice:
        h = (args.auto_choice.get("kwargs") or {}).get("sync_every")
        return int(h) if h else None
    return None


def _read_timed_choice(wrapped, args) -> bool:
    """The auto_wrap row: once its timed steps made the choice, note it (what, from which
    step time) and return True; the choice's impl holds it until the next forward."""
    from bagua_algos.tuning.timed_choice import TimedChoice

    impl = getattr(wrapped, "impl", None)
    choice = getattr(impl, "choice", None)
    if choice is None and isinstance(wrapped.algorithm, TimedChoice):
        return False                    # still timing
    name, kwargs = choice if choice is not None else (wrapped.algorithm.name, {})
    args.chosen_overlap = int(kwargs.get("overlap_steps") or 0)   # hidden syncs: the anchor
    m = getattr(impl, "measurement", None)
    args.auto_choice.update({"algorithm": name, "kwargs": jsonable(kwargs),
                             "compute_s": getattr(impl, "compute_s", None),
                             "chosen_at_step": getattr(impl, "chosen_at", None),
                             # measured beside the local steps (a CPU job): no setup time
                             "measured_beside_s": (round(m.elapsed_s, 3) if m is not None
                                                   and getattr(impl, "_probe", None) else None),
                             "bucket_size": wrapped.bucket_size})
    return True


def _async_rounds(wrapped) -> int:
    return int(getattr(getattr(wrapped, "impl", None), "rounds", 0))


def run_one(name: str, args, train, evalset, harness, counter: AllReduceCounter,
            budget_s: float | None) -> dict:
    model = make_model(args.size, seed=args.seed)
    compute_s = _compute_time(copy.deepcopy(model), train)
    slowest = torch.tensor([compute_s], dtype=torch.float64)   # the same on every rank
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=harness)
    args.row_compute_s = float(slowest)
    if split_row(name)[0] in SYNC_ROWS or name == "auto":
        # the step's compute as the first of these rows measured it: the workload's, one
        # figure for the DiLoCo rows' rule and the auto row's recommend() alike
        args.rule_inputs = args.rule_inputs or (args.row_compute_s,)
        args.row_compute_s = args.rule_inputs[0]
    if split_row(name)[0] in SYNC_ROWS:
        if name == "ft_diloco" and "diloco" in args.sync_every_of:
            # the peer at our diloco row's H (an "ft_diloco@H" row fixes its own, below)
            args.chosen_sync_every = args.sync_every_of["diloco"]
        else:   # the rule's H once per job (a sweep row scales it, or fixes its own)
            # fp32's H is the sweep's reference (an "@" row scales or fixes it); a compressed
            # row of its own counts its own bytes
            scale = OUTER_BYTES.get(name, 1.0)
            rule = _choose_sync_every(args, *args.rule_inputs, bytes_scale=scale,
                                      overlap=split_row(name)[0] in HIDING_ROWS)
            args.chosen_sync_every = sync_every_of_row(name, rule)
        args.sync_every_of[name] = args.chosen_sync_every
    hides = split_row(name)[0] in HIDING_ROWS
    args.chosen_overlap = (hidden_sync_steps(
        args.chosen_sync_every, args.rule_inputs[0], _network(args), ddp_step_s=_ddp_step(args),
        bytes_scale=OUTER_BYTES.get(name, 1.0)) if hides else 0)
    args.row_close = args.row_steps = None
    t_build = time.perf_counter()
    wrapped, opt = _build(name, model, args, harness)
    build_s = time.perf_counter() - t_build
    if name == "auto" and args.auto_choice:
        # recommend's DiLoCo may hide its syncs: then the row is scored, as a user keeps
        # it, by the synced model (synced_state_dict()), read when each sync lands
        args.chosen_overlap = int((args.auto_choice.get("kwargs") or {}).get(
            "overlap_steps") or 0)

    def step(x, y) -> float:
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(wrapped(x), y)
        loss.backward()
        opt.step()
        if name == "ddp":
            counter.add_gradients(model)
        return loss.item()

    total = args.warmup + args.steps
    for i in range(args.warmup):
        step(*train[i % len(train)])
        _progress(args, name, i + 1, total)
    dist.barrier(group=harness)
    tx0, acc0, ddp0 = _tx_bytes(args.ifname), _accounted_bytes(), counter.bytes
    rounds0 = _async_rounds(wrapped)
    # Every cost in the row's time: every row's clock starts before its wrap (DDP's
    # constructor, with_bagua's set-up: their broadcasts cost seconds on a slow link), so the
    # auto row's starts before its network probe too
    # (recommend's measurement and with_bagua's setup, timed in _build), so its curve and
    # its time to each target include them; its throughput window does not (once per run).
    setup_s = build_s
    # A sync row's window holds whole sync periods: it ends on a multiple of H (capped by
    # --max-steps: then window_syncs says how many it holds, maybe none)
    period = _sync_period(name, args)
    tau = args.chosen_overlap if period else 0
    t0 = time.perf_counter() - setup_s
    paused = 0.0
    times, losses, snapshots = [], [], []
    rec: dict = {}
    every = max(1, args.eval_every)
    i = 0
    target = None  # steps to run, agreed by every rank once the timed window has ended
    stop_from = None
    stop_probe = (make_model(args.size, seed=args.seed)
                  if name != "ddp" and args.stop_loss is not None else None)
    while True:
        losses.append(step(*train[(args.warmup + i) % len(train)]))
        i += 1
        elapsed = time.perf_counter() - t0 - paused
        times.append(elapsed)
        if name == AUTO_WRAP and args.auto_choice["algorithm"] is None \
                and _read_timed_choice(wrapped, args):
            period = _sync_period(name, args)     # DiLoCo's H, once chosen
            tau = args.chosen_overlap if period else 0
        # A DiLoCo row is read when each sync lands, tau steps after it started, by DiLoCo's
        # own count (warm-up steps in): there its ranks hold the synced model; a step later
        # each has moved on alone (read every 5 steps, a sync at step 106 was read at 110,
        # 0.02 above the target it had reached)
        # torchft's DiLoCo is read the same way, by its row's count (read every 5 steps, its
        # sync at step 126 was read at 130)
        done = getattr(args.row_steps or getattr(wrapped, "impl", None), "steps",
                       None) if period else None
        # auto_wrap's DiLoCo chosen after H steps: its syncs start at the choice, then every H
        phase = getattr(getattr(wrapped, "impl", None), "sync_phase", 0) if period else 0
        landed = (done is not None and done >= period + tau
                  and (done - tau - phase) % period == 0)
        if _snapshot_due(i, args.steps, every, args.depth_steps) or landed:
            # The weights (local, no collective), the clock paused; evaluated after the run.
            # A row whose syncs overlap inner steps: the anchor, also when each sync lands.
            p = time.perf_counter()
            snapshots.append((i, elapsed, wrapped.synced_state_dict() if tau
                              else _snapshot(model)))
            paused += time.perf_counter() - p
        if target is None and i >= args.steps:
            more = bool(period) and (i - phase) % period != 0 and i < args.max_steps
            if name == "async":
                # The window must hold averaging rounds: all ranks agree to go on or stop.
                p = time.perf_counter()
                done = torch.tensor([_async_rounds(wrapped) - rounds0])
                dist.all_reduce(done, op=dist.ReduceOp.MIN, group=harness)
                more = int(done) < args.async_min_rounds and i < args.max_steps
                paused += time.perf_counter() - p
            if not more:
                rec["window_steps"] = i
                rec["steps_s"] = elapsed - setup_s
                rec["setup_s"] = setup_s
                rec["window_syncs"] = i // period if period else None
                rec["tx"] = _tx_bytes(args.ifname) - tx0
                rec["accounted"] = (counter.bytes - ddp0) if name in TORCH_ROWS else (
                    _accounted_bytes() - acc0)
                rec["rounds"] = _async_rounds(wrapped) - rounds0
                # Keep training until the wall budget (every rank the same number of steps:
                # agreed from the slowest rank).
                p = time.perf_counter()
                slowest = torch.tensor([elapsed], dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=harness)
                per_step = float(slowest) / i
                wall = max(args.wall_seconds, budget_s or 0.0)
                rec["budget_s"] = wall
                target = min(args.max_steps, max(i, math.ceil(wall / per_step)))
                stop_from = max(i, math.ceil(args.wall_seconds / per_step))   # past T
                if name == "ddp":      # DDP's losses at depth are the targets: reach them all
                    target = max(target, _deepest(args))
                paused += time.perf_counter() - p
        if (target is not None and i < target and stop_probe is not None
                and i >= stop_from and _snapshot_due(i, args.steps, every, args.depth_steps)):
            # Past T and the window: stop at the deepest target (every rank agrees: the
            # ranks' mean loss of this snapshot, the same rule the curve is read with).
            p = time.perf_counter()
            stop_probe.load_state_dict(snapshots[-1][2])
            mean = torch.tensor([_evaluate(stop_probe, evalset)], dtype=torch.float64)
            dist.all_reduce(mean, group=harness)
            if float(mean) / dist.get_world_size(harness) <= args.stop_loss:
                target = i
                rec["stopped_at_deepest"] = i
            paused += time.perf_counter() - p
        if "eval_at_wall" not in rec and (elapsed >= args.wall_seconds or (
                target is not None and i >= target)):
            # Held-out loss at wall time T (local, no collective: ranks may differ by a step).
            p = time.perf_counter()
            if tau:
                if stop_probe is None:
                    stop_probe = make_model(args.size, seed=args.seed)
                stop_probe.load_state_dict(wrapped.synced_state_dict())
            rec["eval_at_wall"] = _evaluate(stop_probe if tau else model, evalset)
            rec["wall_reached"] = elapsed >= args.wall_seconds
            paused += time.perf_counter() - p
        if i <= args.steps or i % 10 == 0:    # the bar's "time left": steps of the run
            _progress(args, name, args.warmup + i, args.warmup + (target or total))
        if target is not None and i >= target:
            break
    if name == "ddp":
        # every later row's budget: this factor x DDP's time to its deepest target (the rows
        # that can reach it get the time to), at least T
        rec["depth_s"] = times[_deepest(args) - 1]
        rec["budget_s"] = max(args.wall_seconds, args.budget_factor * rec["depth_s"])
    if name == "async" and hasattr(wrapped, "abort"):
        wrapped.abort()
    rec["sync_wait_s"] = getattr(getattr(wrapped, "impl", None), "sync_wait_s", None)
    evals = _evaluate_snapshots(args.size, args.seed, snapshots, evalset,
                                lambda k, n: _progress(args, name, k, n, phase="eval"))
    rec["eval_loss"] = next(loss for step, _, loss in evals if step == args.steps)
    rec.update(times=times, losses=losses, evals=evals, compute_s=compute_s)
    dist.barrier(group=harness)
    if args.row_close is not None:     # after the barrier: rank 0's lighthouse goes last
        args.row_close()
    return rec


def _combine(name: str, recs: list[dict], args, params: int, world: int) -> dict:
    steps_s = max(r["steps_s"] for r in recs)
    window = recs[0]["window_steps"]
    step_s = steps_s / window
    compute_s = max(r["compute_s"] for r in recs)
    local = args.procs_per_host
    # Every rank of a host reads the host's interface: its traffic is the host's / local.
    wire = [r["tx"] / local / window for r in recs] if args.ifname else None
    accounted = sum(r["accounted"] for r in recs) / len(recs) / window
    n = min(len(r["times"]) for r in recs)
    curve = [[max(r["times"][k] for r in recs), sum(r["losses"][k] for r in recs) / len(recs)]
             for k in range(n)]
    m = min(len(r["evals"]) for r in recs)
    evals = [[recs[0]["evals"][k][0], max(r["evals"][k][1] for r in recs),
              sum(r["evals"][k][2] for r in recs) / len(recs)] for k in range(m)]
    return {
        "algorithm": name, "status": "ok", "reason": None, "world_size": world,
        "procs_per_host": local, "params": params,
        "samples_per_s": world * args.batch_size * window / steps_s,
        "step_s": step_s, "compute_s": compute_s, "comm_s": max(0.0, step_s - compute_s),
        "bytes_per_step": (sum(wire) / len(wire)) if wire else accounted,
        "bytes_source": "wire" if wire else "accounted",
        "bytes_per_step_accounted": accounted,
        "window_steps": window, "window_s": steps_s,
        "async_rounds_in_window": recs[0]["rounds"] if name == "async" else None,
        # whole sync periods in the throughput window (None: the row talks every step)
        "window_syncs": recs[0]["window_syncs"],
        # seconds before the first step counted in the row's time: the wrap (auto: and its
        # probe)
        "setup_s": max(r["setup_s"] for r in recs),
        "sync_interval_ms": args.async_interval_ms if name == "async" else None,
        "powersgd_rank": args.powersgd_rank if name == "ddp_powersgd" else None,
        "warmup": args.warmup,
        "sync_every": args.chosen_sync_every if split_row(name)[0] in SYNC_ROWS else None,
        "overlap_steps": args.chosen_overlap if split_row(name)[0] in HIDING_ROWS or (
            name in AUTO_ROWS and args.chosen_overlap) else None,
        # seconds the slowest rank's training waited for DiLoCo's syncs (None: no syncs)
        "sync_wait_s": max((r["sync_wait_s"] for r in recs if r["sync_wait_s"] is not None),
                           default=None),
        "auto_choice": args.auto_choice if name in AUTO_ROWS else None,
        "loss": sum(r["eval_loss"] for r in recs) / len(recs),
        # which model the held-out loss is of: the ranks' different models, averaged
        "loss_over": "the anchor (the synced model, identical on every rank)"
        if split_row(name)[0] in HIDING_ROWS or (name in AUTO_ROWS and args.chosen_overlap) else
        "mean of the ranks' models" if split_row(name)[0] in SEPARATE_MODELS or (
            (args.auto_choice or {}).get("algorithm") in SEPARATE_MODELS and name in AUTO_ROWS)
        else "the model (identical on every rank)",
        "train_loss": sum(c[1] for c in curve[max(0, args.steps - 5):args.steps]) / min(
            5, args.steps),
        "wall_s": args.wall_seconds, "budget_s": max(r["budget_s"] for r in recs),
        "loss_at_wall": sum(r["eval_at_wall"] for r in recs) / len(recs),
        "wall_reached": all(r["wall_reached"] for r in recs),
        "steps": args.steps, "steps_run": n,
        # the step it stopped at, having reached the deepest target (None: its whole budget)
        "stopped_at_deepest": recs[0].get("stopped_at_deepest"),
        "eval_curve": evals,
        "loss_curve": curve[:: max(1, n // 200)],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--algorithms", required=True)
    ap.add_argument("--size", default="base")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--max-steps", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--wall-seconds", type=float, default=30.0)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--qadam-warmup", type=int, default=2)
    ap.add_argument("--procs-per-host", type=int, default=1)
    ap.add_argument("--powersgd-rank", type=int, default=2)
    ap.add_argument("--async-interval-ms", type=float, default=500.0)
    ap.add_argument("--async-min-rounds", type=int, default=2)
    ap.add_argument("--budget-factor", type=float, default=1.5)
    ap.add_argument("--ddp-seconds", type=float, default=0.0,
                    help="DDP's time for --steps steps when DDP ran in an earlier job")
    ap.add_argument("--ddp-budget-seconds", type=float, default=0.0,
                    help="every row's budget when DDP ran in an earlier job")
    ap.add_argument("--depth-steps", default="",
                    help="comma list of DDP's step counts whose held-out loss is a target: "
                         "DDP trains to the deepest")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=1,
                    help="snapshot the weights for the held-out loss curve every this many steps")
    ap.add_argument("--sync-every", type=int, default=0,
                    help="LocalSGD/DiLoCo rows: sync_every (default: chosen for the workload "
                         "by _e2e_rows.sync_every_for from DDP's step time)")
    ap.add_argument("--stop-loss", type=float, default=None,
                    help="a row stops once its ranks' mean held-out loss is at or below this "
                         "(past T; default: DDP's loss after its deepest step count, when DDP "
                         "runs in this job)")
    ap.add_argument("--full-budget", action="store_true",
                    help="every row trains its whole budget (no stop at the deepest target)")
    ap.add_argument("--network-mbit", type=float, default=0.0,
                    help="the cell's shaped bandwidth (0: unshaped): a 4-bit DiLoCo row's sync "
                         "is priced by recommend's model of it")
    ap.add_argument("--network-latency-ms", type=float, default=0.0,
                    help="the cell's one-way delay between hosts")
    ap.add_argument("--ifname", default="")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    args.depth_steps = [int(x) for x in args.depth_steps.split(",") if x.strip()]
    args.ddp_step_s, args.chosen_sync_every, args.sync_every_of = 0.0, None, {}
    args.chosen_overlap = 0
    args.rule_inputs = None   # (compute,) of the first sync or auto row: the rule's input
    args.auto_choice = None
    if args.full_budget:
        args.stop_loss = None
    torch.set_num_threads(1)
    try:
        import bagua_comm as bc
        bc.init_process_group(backend="gloo")
    except ImportError:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # The harness's own collectives never share a group with the algorithms' traffic
    # (AsyncModelAverage communicates from a background thread).
    harness = dist.new_group(backend="gloo")
    data = MarkovText(args.size)
    # Enough distinct batches that no run cycles through them often (no memorising).
    train = data.batches(256, args.batch_size, seed=1000 + rank)
    evalset = data.batches(4, 32, seed=7)
    out = Path(args.out)
    params = num_params(make_model(args.size, seed=args.seed))
    counter = AllReduceCounter()
    budget_s = args.ddp_budget_seconds or None   # DDP ran in an earlier job: its budget
    for name in args.algorithms.split(","):
        if rank == 0:
            (out / f"{name}.started").write_text(str(time.time()))
        try:
            rec = run_one(name, args, train, evalset, harness, counter, budget_s)
        except Unavailable as err:
            if rank == 0:
                _write_json(out / f"{name}.json",
                            {"algorithm": name, "status": "unavailable", "reason": str(err)})
            continue
        except Exception:
            traceback.print_exc()
            raise
        recs = [None] * world
        dist.all_gather_object(recs, rec, group=harness)
        if name == "ddp":  # every later row trains at least this long
            budget_s = max(r["budget_s"] for r in recs)
            if args.stop_loss is None and not args.full_budget:
                args.stop_loss = _deepest_loss(recs, _deepest(args))
            args.ddp_step_s = max(r["steps_s"] for r in recs) / recs[0]["window_steps"]
        if rank == 0:
            result = _combine(name, recs, args, params, world)
            _write_json(out / f"{name}.json", result)
    dist.barrier(group=harness)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
