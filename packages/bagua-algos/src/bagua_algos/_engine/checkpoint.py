"""Checkpoint plumbing of :class:`~bagua_algos.BaguaModule`: the algorithm's state saved
inside the first optimizer's ``state_dict()`` (under :data:`STATE_KEY`), restored exactly on
the rank that saved it or re-derived on another rank / world size, and the wrapped model's
own ``state_dict`` without ``module.`` or ``_orig_mod.`` prefixes.

The functions take the wrapper (``owner``) and read only its public members: ``algorithm``,
``impl``, ``group``, ``step``, ``bagua_state_dict()`` and ``load_bagua_state_dict()``.
"""

from __future__ import annotations

import logging
import warnings

import torch

STATE_KEY = "bagua_algos"
logger = logging.getLogger("bagua_algos")


def bagua_state(owner) -> dict:
    """``owner``'s algorithm state, with the world size and rank that saved it."""
    return {"algorithm": owner.algorithm.name, "step": owner.step,
            "world_size": owner.group.size, "rank": owner.group.rank,
            "impl": owner.impl.state_dict()}


def load_bagua_state(owner, state: dict, stacklevel: int = 3) -> None:
    """Restore :func:`bagua_state`'s output into ``owner`` (see
    :meth:`BaguaModule.load_bagua_state_dict`)."""
    if not isinstance(state, dict) or "step" not in state:
        raise ValueError("state must be a dict from BaguaModule.bagua_state_dict()")
    algorithm, impl = owner.algorithm, owner.impl
    owner.step = int(state["step"])
    if state.get("algorithm") != algorithm.name:
        warnings.warn(f"checkpoint holds the state of algorithm {state.get('algorithm')!r}"
                      f" but this module runs {algorithm.name!r}: only the step "
                      "counter is restored", stacklevel=stacklevel)
        return
    world, rank = owner.group.size, owner.group.rank
    saved_world = int(state.get("world_size", world))
    saved_rank = int(state.get("rank", rank))
    try:
        if saved_world == world and saved_rank == rank:
            impl.load_state_dict(state["impl"])          # exact
            return
        note = impl.load_foreign_state_dict(state["impl"], world_size=saved_world,
                                            rank=saved_rank)
    except (KeyError, TypeError, IndexError) as err:
        saved = state.get("impl")
        keys = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
        raise ValueError(
            f"the checkpoint's {algorithm.name} state is incomplete or not from "
            f"bagua_algos ({type(err).__name__}: {err}; it holds {keys}): load the "
            f"optimizer state_dict saved by this algorithm, or drop its "
            f"{STATE_KEY!r} entry to start the algorithm's state afresh") from err
    if saved_world != world and not note:
        note = "nothing is per rank; the step counter and optimizer state are restored"
    # One line per job: the lowest rank that resets anything says it.
    speaker = 0 if (saved_world != world or saved_rank != 0) else 1
    if note and rank == speaker:
        where = (f"at world size {saved_world}, now {world}" if saved_world != world
                 else f"by rank {saved_rank} and loaded on other ranks too")
        logger.warning(f"bagua_algos: {algorithm.name} resumes from a checkpoint "
                       f"saved {where}: {note}")


def register_optimizer_hooks(owner, optimizer: torch.optim.Optimizer) -> list:
    """Save ``owner``'s algorithm state inside ``optimizer.state_dict()`` and restore it from
    ``optimizer.load_state_dict()``: the hooks' handles."""

    def save(_optimizer, state_dict):
        state_dict[STATE_KEY] = owner.bagua_state_dict()
        return state_dict

    def load(_optimizer, state_dict):
        state_dict = dict(state_dict)
        saved = state_dict.pop(STATE_KEY, None)
        if saved is not None:
            owner.load_bagua_state_dict(saved)
        return state_dict

    return [optimizer.register_state_dict_post_hook(save),
            optimizer.register_load_state_dict_pre_hook(load)]


def load_model_state(module: torch.nn.Module, state_dict, strict: bool, assign: bool):
    """``module.load_state_dict``; keys saved from a ``torch.compile``-d model
    (``_orig_mod.`` prefix) load too; ``assign=True`` is refused (flattened parameters)."""
    if assign:
        raise ValueError("assign=True would replace parameters that bagua has flattened; "
                         "load with assign=False")
    if state_dict and all(k.startswith("_orig_mod.") for k in state_dict):
        state_dict = type(state_dict)(state_dict)    # keeps _metadata on an OrderedDict
        torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(state_dict,
                                                                       "_orig_mod.")
    return module.load_state_dict(state_dict, strict=strict)
