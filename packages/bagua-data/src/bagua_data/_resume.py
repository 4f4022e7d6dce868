"""An epoch's position as the job sees it, and resuming it at another world size.

A sampler hands out an epoch as a *plan*: one list of items (sample indices, or batches of
them) per rank, all of the same length; the ranks step through their lists in lockstep, so
after ``k`` steps the job has consumed row ``0..k-1`` of every rank's list.  An epoch's
*history* is the list of ``[num_replicas, rows consumed]`` of each plan it ran under: one
entry while the world size stays the same, one more each time a checkpoint is loaded at
another world size.  The first plan is the sampler's own epoch order; each later one
re-balances the samples still unseen (once each) over the new ranks.  From the history,
every rank recomputes the same plans locally: nothing is communicated.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

STATE_VERSION = 2
# Settings that fix an epoch's order: a checkpoint only resumes into a sampler that shares
# them.  The world size may differ (the unseen samples are re-balanced).
ORDER_KEYS = ("seed", "shuffle", "drop_last", "random_level", "dataset_len")


def unseen(consumed: set[int], rest: Iterable[int]) -> list[int]:
    """Indices of ``rest`` not in ``consumed``, each once, in first-seen order."""
    out: list[int] = []
    seen = set(consumed)
    for i in rest:
        if i not in seen:
            seen.add(i)
            out.append(i)
    return out


def first_seen(values: torch.Tensor, space: int) -> torch.Tensor:
    """A mask over ``values`` (int64 in ``[0, space)``): True at each value's first
    appearance.  One scatter over the index space and one gather, no sort: a re-deal after
    a membership change under FaultTolerant runs this on the survivors' critical path
    (``torch.unique`` sorted, which at a million samples cost a few hundred ms)."""
    where = torch.arange(values.numel())
    first = torch.full((space,), values.numel(), dtype=torch.long)
    first.scatter_reduce_(0, values, where, "amin")
    return first[values] == where


def unseen_of(consumed: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
    """:func:`unseen` on tensors: the indices of ``rest`` (int64) whose entry in the mask
    ``consumed`` is False, each once, in first-seen order (no Python loop over samples)."""
    rest = rest[~consumed[rest]]
    return rest[first_seen(rest, consumed.numel())]


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_history(history: Any) -> list[list[int]]:
    if (not isinstance(history, (list, tuple)) or not history
            or not all(isinstance(e, (list, tuple)) and len(e) == 2
                       and _is_int(e[0]) and e[0] >= 1 and _is_int(e[1]) and e[1] >= 0
                       for e in history)):
        raise ValueError(f"state['history'] must be a non-empty list of [num_replicas >= 1, "
                         f"rows >= 0] pairs (from state_dict()), got {history!r}")
    return [[int(w), int(k)] for w, k in history]


def check_state(state: Any, settings: dict[str, Any], what: str) -> list[list[int]]:
    """Validate a saved state against this sampler's settings; return its epoch history.

    ``settings`` holds the values that fix the epoch's order (``ORDER_KEYS`` for the
    load-balancing samplers); each must be in ``state`` with the same value.

    Accepts version 1 states (one world size: ``num_replicas`` and a per-rank ``consumed``).
    """
    if not isinstance(state, dict):
        raise ValueError(f"state must be a dict from {what}.state_dict(), got "
                         f"{type(state).__name__}")
    missing = [k for k in ("version", "epoch", "consumed", "num_replicas", *settings)
               if k not in state]
    if missing:
        raise ValueError(f"state is missing {missing}: pass a dict from {what}.state_dict()")
    if state["version"] not in (1, STATE_VERSION):
        raise ValueError(f"state version {state['version']!r} is not supported (expected "
                         f"1 or {STATE_VERSION})")
    for key in settings:
        if state[key] != settings[key]:
            raise ValueError(f"cannot resume: the checkpoint was saved with {key}="
                             f"{state[key]!r} but this {what} has {key}={settings[key]!r}; "
                             f"build it with the same settings (or start a new epoch instead)")
    if not _is_int(state["epoch"]):
        raise ValueError(f"state['epoch'] must be an int, got {state['epoch']!r}")
    if state["version"] == 1:
        if not _is_int(state["consumed"]) or state["consumed"] < 0:
            raise ValueError(f"state['consumed'] must be an int >= 0, got {state['consumed']!r}")
        return check_history([[state["num_replicas"], state["consumed"]]])
    history = check_history(state.get("history"))
    total = sum(w * k for w, k in history)
    if state["consumed"] != total or state["num_replicas"] != history[-1][0]:
        raise ValueError(f"state['consumed'] ({state['consumed']!r}) and "
                         f"state['num_replicas'] ({state['num_replicas']!r}) must agree with "
                         f"state['history'] ({total} consumed, last world "
                         f"{history[-1][0]}): pass a dict from {what}.state_dict() unchanged")
    return history


def check_rows(rows: int, length: int, what: str) -> None:
    if rows > length:
        raise ValueError(f"state['consumed'] is past the end of the epoch: {rows} {what} per "
                         f"rank consumed of {length}; pass a dict from state_dict() unchanged")


def make_state(epoch: int, history: list[list[int]], settings: dict[str, Any]) -> dict:
    return {"version": STATE_VERSION, "epoch": epoch,
            "consumed": sum(w * k for w, k in history), "num_replicas": history[-1][0],
            "history": [list(e) for e in history], **settings}


def check_consumed(consumed: int | None, default: int, length: int) -> int:
    if consumed is None:
        return default
    if not _is_int(consumed) or not 0 <= consumed <= length:
        raise ValueError(f"consumed must be an int in [0, {length}] (what this rank's loop has "
                         f"used of this epoch), got {consumed!r}")
    return consumed
