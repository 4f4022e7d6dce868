"""The main job's targets at depth, its headline, and each row against the physical limit.

A target is DDP's held-out loss after a number of steps (``DEPTHS`` x N: a quarter of N to 4N
by default); every row's steps and time to each come from its evaluation curve.  The headline
target is the first one the ``alone`` row (every rank on its own shard, no communication)
does not reach within its budget: before it, not communicating at all is a contender and
the ranking says little about a whole run.  Against the headline each row gets the
compute-only bound (DDP's steps to the target x the slowest rank's compute time of a step,
no communication: ``cell_compute_s``) and its efficiency, bound / its time (1: as fast as computing alone could
take DDP's path there).
"""

from __future__ import annotations

from _e2e_report import cell, cells
from _e2e_rows import ALONE

#: The targets' depths, as multiples of N (``--steps``).
DEPTHS = (0.25, 0.5, 1, 2, 4)


def depth_steps(n: int, depths) -> list[int]:
    """DDP's step counts of the targets: ``round(d x n)`` for each depth (at least 1), sorted,
    without repeats.  ``depths``: numbers or a comma list of them, each > 0."""
    if isinstance(depths, str):
        try:
            depths = [float(d) for d in depths.split(",") if d.strip()]
        except ValueError:
            raise ValueError(f"--depths must be a comma list of multiples of N (e.g. "
                             f"0.25,0.5,1,2,4), got {depths!r}") from None
    if not depths or any(d <= 0 for d in depths):
        raise ValueError(f"--depths must be one or more multiples of N, each > 0, got "
                         f"{depths!r}")
    return sorted({max(1, round(d * n)) for d in depths})


def target_name(steps: int) -> str:
    """``"ddp@30"``: DDP's held-out loss after 30 steps."""
    return f"ddp@{steps}"


def first_reach(curve, loss: float) -> tuple:
    """``(step, seconds)`` of the first evaluation at or below ``loss``; ``(None, None)``."""
    for step, t, value in curve or []:
        if value <= loss:
            return step, t
    return None, None


def _ddp_targets(ddp: dict, steps: list[int]) -> list[dict]:
    """The targets of one cell: DDP's own evaluation at each step count (None where DDP's
    curve has no evaluation at that step: it stopped short)."""
    at = {step: value for step, _t, value in ddp.get("eval_curve") or []}
    return [{"name": target_name(k), "ddp_steps": k, "loss": at[k]} for k in steps if k in at]


def pick_headline(targets: list[dict], runs: list[dict]) -> tuple[str | None, str]:
    """``(name, why)``: the first target (shallowest first) that no ``alone`` run reached
    within its budget; the deepest where ``alone`` reached them all (say so: deepen the
    targets); the one at N (else the middle one) where no ``alone`` row ran."""
    if not targets:
        return None, "no targets: DDP did not run"
    alone = [r for r in runs if r["algorithm"] == ALONE and r["status"] == "ok"]
    if not alone:
        mid = targets[len(targets) // 2]
        return mid["name"], "no 'alone' row ran: the middle target"
    for t in targets:
        if all((r.get("steps_to_target") or {}).get(t["name"]) is None for r in alone):
            reached = [u["name"] for u in targets[:targets.index(t)]]
            return t["name"], (f"the first target 'alone' does not reach within its budget "
                               f"(it reaches {', '.join(reached) or 'none'})")
    return targets[-1]["name"], ("'alone' reaches every target: the deepest is the "
                                 "headline (train deeper: --depths)")


def cell_compute_s(runs: list[dict]) -> float | None:
    """A cell's compute time of a step: each row measures its slowest rank's (forward,
    backward and optimizer step on a private copy, no communication) before it trains; the
    median over the cell's rows, so that one row's noisy measurement moves no bound."""
    values = sorted(r["compute_s"] for r in runs if r["status"] == "ok" and r.get("compute_s"))
    return values[len(values) // 2] if values else None


def add_bound(runs: list[dict], headline: str | None) -> None:
    """Per run: ``bound_s`` (its cell's DDP steps to the headline x the cell's compute time
    of a step, ``cell_compute_s``: the same for every row of a cell) and ``efficiency``
    (``bound_s / time_to_target_s[headline]``; None where it never got there)."""
    for c in cells(runs):
        rows = [r for r in runs if cell(r) == c]
        ddp = next((r for r in rows if r["algorithm"] == "ddp" and r["status"] == "ok"), None)
        steps = ((ddp or {}).get("steps_to_target") or {}).get(headline)
        compute = cell_compute_s(rows)
        for r in rows:
            r["bound_s"] = r["efficiency"] = None
            if r["status"] != "ok" or steps is None or compute is None:
                continue
            r["bound_s"] = steps * compute
            t = (r.get("time_to_target_s") or {}).get(headline)
            r["efficiency"] = r["bound_s"] / t if t else None


def add_targets(runs: list[dict], steps: list[int]) -> tuple[list[dict], str | None, str]:
    """Add ``steps_to_target`` and ``time_to_target_s`` (``{target name: value or None}``,
    against its own cell's DDP), ``bound_s`` and ``efficiency`` to every run.  Returns the
    targets (the first cell's DDP: DDP's maths is the same in every cell), the headline's
    name and why it is the headline."""
    ddp_of = {cell(r): r for r in runs if r["algorithm"] == "ddp" and r["status"] == "ok"}
    first = None
    for r in runs:
        r["steps_to_target"], r["time_to_target_s"] = {}, {}
        ddp = ddp_of.get(cell(r))
        if ddp is None:
            continue
        targets = _ddp_targets(ddp, steps)
        first = first or targets
        for t in targets:
            k, s = first_reach(r.get("eval_curve"), t["loss"]) if r["status"] == "ok" else (
                None, None)
            r["steps_to_target"][t["name"]], r["time_to_target_s"][t["name"]] = k, s
    targets = first or []
    headline, why = pick_headline(targets, runs)
    for r in runs:
        r["headline"] = headline
    add_bound(runs, headline)
    return targets, headline, why


def figures(report: dict) -> dict:
    """What docs/results.json keeps of a main-job report (benchmarks/_results.py): the
    targets, the headline, and per row (``algorithm``, `` @<bandwidth>/<latency>`` added when
    the report has several cells) its ``steps_to_target`` and ``time_to_target_s``, its time
    as a multiple of its own cell's DDP time (``x_ddp_time``, per target; < 1: sooner),
    ``bound_s`` and ``efficiency``. Times to 0.1 s, ratios to 0.01; rows that did not run are
    left out."""
    runs = [r for r in report["runs"] if r.get("status") == "ok"]
    several = len(cells(runs)) > 1
    ddp_of = {cell(r): r for r in runs if r["algorithm"] == "ddp"}

    def rnd(v, nd):
        return None if v is None else round(v, nd)

    rows = {}
    for r in runs:
        c = cell(r)
        times = r.get("time_to_target_s") or {}
        ddp_times = (ddp_of.get(c) or {}).get("time_to_target_s") or {}
        name = r["algorithm"] + (f" @{c[0]}/{c[1]}" if several else "")
        rows[name] = {
            "steps_to_target": dict(r.get("steps_to_target") or {}),
            "time_to_target_s": {k: rnd(t, 1) for k, t in times.items()},
            "x_ddp_time": {k: (round(t / ddp_times[k], 2) if t is not None and ddp_times.get(k)
                               else None) for k, t in times.items()},
            "bound_s": rnd(r.get("bound_s"), 1), "efficiency": rnd(r.get("efficiency"), 2)}
    return {"targets": report.get("targets") or [], "headline": report.get("headline"),
            "rows": rows}
