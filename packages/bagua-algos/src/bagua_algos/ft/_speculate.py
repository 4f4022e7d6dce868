"""The optimizer step of an algorithm that communicates in it, run before the commit vote.

LowPrecisionDecentralized, LocalSGD and DiLoCo exchange weights in the optimizer-step hook.
Run after ``should_commit()``, that exchange was outside the step's error handling: a peer
killed in it took the survivors down, and an exchange that completed on some ranks only left
them different.  Under ``FaultTolerant`` the step of such an algorithm is taken before the
vote, on a copy of the state to go back to: a failure in its exchange votes the step down,
and a step voted down restores the model, the optimizer and the algorithm's state as they
were before it.  A sync in flight (DiLoCo's ``overlap_steps``) is waited for before the vote
(it is no longer overlapped with the next inner steps under ``FaultTolerant``).
"""

from __future__ import annotations

import copy

import torch

from ..algorithm import AlgorithmImpl


def communicates_in_step(impl) -> bool:
    """Whether the algorithm's optimizer-step hook may communicate."""
    return type(impl).post_optimizer_step_hook is not AlgorithmImpl.post_optimizer_step_hook


def snapshot(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple:
    """The model's and the optimizer's state (with the algorithm's), copied."""
    return (copy.deepcopy(module.state_dict()), copy.deepcopy(optimizer.state_dict()))


def restore(module: torch.nn.Module, optimizer: torch.optim.Optimizer, saved: tuple,
            state_key: str):
    """Put the model and the optimizer back; return the algorithm's saved state (for the
    rebuild that follows: the live algorithm may hold a failed exchange)."""
    model_state, optimizer_state = saved
    optimizer_state = dict(optimizer_state)
    algorithm_state = optimizer_state.pop(state_key, None)
    module.load_state_dict(model_state)
    optimizer.load_state_dict(optimizer_state)
    return algorithm_state


def alive(group) -> None:
    """A one-element allreduce: fails when a member of ``group`` is gone."""
    if group is not None and group.size > 1:
        import bagua_comm as bc

        bc.allreduce_inplace(torch.zeros(1), group=group)


def drain(impl) -> None:
    """Wait for the algorithm's exchanges in flight (DiLoCo's ``finish``)."""
    finish = getattr(impl, "finish", None)
    if callable(finish):
        finish()


def synced_fragments(model) -> tuple[tuple[int, ...], int]:
    """(the fragments a committed step synced, how many there are): a DiLoCo (LocalSGD)
    fragment syncs at its offset in every ``sync_every`` steps; any other algorithm's
    committed step is a sync of the whole model."""
    impl = getattr(model, "impl", None)
    if impl is None or not all(hasattr(impl, a) for a in ("H", "P", "steps")):
        return (0,), 1
    from ..algorithms.diloco import sync_offset

    return tuple(p for p in range(impl.P)
                 if impl.steps % impl.H == sync_offset(p, impl.P, impl.H)), impl.P
