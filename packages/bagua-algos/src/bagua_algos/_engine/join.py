"""Uneven inputs: :meth:`BaguaModule.join`, DDP's ``join()`` for GradientAllReduce.

Inside the context, every forward of a rank that still has data and communicates (a training
step, or a buffer broadcast) starts with a tiny allgather of "I have data" flags, which also
say what that forward does.  A rank whose loop has ended leaves the context and *shadows* the
others' forwards: it adds 0 to that count, then issues the same collectives in the same order
(the buffer broadcast; for a training step the one-time bucket reordering, each bucket's
allreduce with a zero gradient and no "got a gradient" flag, the sparse exchanges), so nobody
waits for a rank that has stopped.  Gradients are averaged over the initial world size, as
DDP's default ``divide_by_initial_world_size=True``.  When the count reaches 0 every rank takes
the model of the highest rank among those that ran out last (their optimizers stepped the
most), as DDP.  While joining, the buffers come from the highest rank with data instead of
rank 0 (DDP's authoritative rank under ``join()``, all ranks active or not).
"""

from __future__ import annotations

import torch

import bagua_comm as bc

from .checks import check_bool
from .comm import broadcast_tensors


def check_joinable(algo, autotuning: bool, divide_by_initial_world_size, enable,
                   throw) -> None:
    """``ValueError`` naming the rule, on the calling rank before any communication:
    ``algo`` is the wrapped model's algorithm, ``autotuning`` whether it has a tuner."""
    check_bool("divide_by_initial_world_size", divide_by_initial_world_size)
    check_bool("enable", enable)
    check_bool("throw_on_early_termination", throw)
    if not getattr(algo, "joinable", False):
        raise ValueError(f"join() shadows GradientAllReduce's collectives; "
                         f"{type(algo).__name__} keeps per-rank state (residuals, momenta, "
                         f"peer exchanges) that a rank without data cannot shadow. Give every "
                         f"rank the same number of batches (DistributedSampler(drop_last=True))")
    if autotuning:
        raise ValueError("join() with autotune: the tuner's collectives follow the active "
                         "ranks' steps; autotune first, then train with join() without it")
    if not divide_by_initial_world_size:
        raise ValueError("divide_by_initial_world_size=False is not supported: the gradients "
                         "are averaged over the initial world size (DDP's default)")


def join_round(group: bc.ProcessGroup, active: bool, buffers: bool = False,
               step: bool = False, order: bool = False
               ) -> tuple[list[int], tuple[bool, bool], int]:
    """Collective, one allgather of a byte per rank: the ranks that still have data (this one
    among them if ``active``; the highest of them is whose buffers every rank takes while
    joining, DDP's authoritative rank under ``join()``), what their forward does (whether it
    broadcasts the buffers and whether it starts a synchronised step: what a joined rank
    shadows), and the lowest rank whose one-time bucket order is due (``order``: it has seen
    its first synchronised backward), -1 if none: every rank, active or joined, takes that
    rank's order at this forward (a rank that never ran a synchronised backward, for want of
    batches or under ``no_sync()``, has none to give, and must not be waited for)."""
    flags = torch.empty(group.size, dtype=torch.uint8)
    code = (1 if active else 0) | (2 if buffers else 0) | (4 if step else 0) | (8 if order else 0)
    bc.allgather(torch.tensor([code], dtype=torch.uint8), flags, group=group)
    codes = flags.tolist()
    ranks = [r for r, f in enumerate(codes) if f & 1]
    stepping = any(f & 4 for f in codes)
    src = next((r for r, f in enumerate(codes) if f & 8), -1) if stepping else -1
    return ranks, (any(f & 2 for f in codes), stepping), src


def early_termination(group: bc.ProcessGroup) -> RuntimeError:
    return RuntimeError(f"rank {group.rank}: a rank ran out of inputs and "
                        "throw_on_early_termination=True stops every rank")


def shadow_step(engine, src: int, buffers: bool = True, step: bool = True,
                order: int = -1) -> None:
    """One forward's collectives, in the order an active rank issues them, with no data:
    the buffer broadcast (``buffers``) and a synchronised step's (``step``); ``src``: the
    highest rank with data, whose buffers every rank takes; ``order``: the rank whose bucket
    order every rank takes now (-1: none).  ``engine``: the
    :class:`~bagua_algos._engine.engine.StepEngine`."""
    engine.start_step(src, buffers, step, order)   # forward: as an active rank after the count
    if step:
        engine.shadow_backward()


def shadow_until_done(engine, throw: bool) -> None:
    """After this rank's loop ended inside ``join()``: shadow the other ranks' forwards until
    every rank's loop has ended (``throw``: raise as soon as one ran out instead), then take
    the model of the highest rank among the last to finish (collective)."""
    last = True                           # reached only when the loop ended normally
    while True:
        ranks, (buffers, step), order = join_round(engine.group, False,
                                                   order=engine.order_due)
        if not ranks:
            break
        if throw:
            raise early_termination(engine.group)
        shadow_step(engine, ranks[-1], buffers, step, order)
        last = False
    final_sync(engine, last)


def final_sync(engine, last_joiner: bool) -> None:
    """Every rank takes the parameters and buffers of the highest rank among the last to
    run out of data (collective)."""
    g = engine.group
    t = torch.tensor([g.rank if last_joiner else -1], dtype=torch.int64)
    bc.allreduce_inplace(t, bc.ReduceOp.MAX, group=g)
    src = int(t.item())
    mod = engine.ctx.module
    broadcast_tensors(list(dict.fromkeys(mod.parameters())) + list(dict.fromkeys(mod.buffers())),
                      g, src)
