"""Which replica the shared state of a rebuilt group comes from, and its broadcast.

with_bagua broadcasts rank 0's parameters and optimizer state, and rank 0 of a new quorum
may be a replica that just joined and whose heal failed (its state is the initial one).
Before the wrap, the replicas agree on an up-to-date source, the one at the highest committed
step that saw no error in the quorum (lowest rank among equals), and every replica that is
not up to date takes the source's whole state: model, optimizer, scheduler, sampler position
and the algorithm's shared state.  with_bagua's own broadcast from rank 0 then moves equal
values.  A replica whose heal failed still takes part in the step (its peers' collectives
need it) with the source's state, votes it down, and heals at the next quorum.
"""

from __future__ import annotations

import hashlib
import hmac
import os

import torch

import bagua_comm as bc

from .._engine.comm import broadcast_tensors


def authenticate(group: bc.ProcessGroup, secret: bytes) -> None:
    """Every member of a new group proves it holds the job's secret before anything else
    goes through the group (collective): each rank sends a fresh nonce, then
    ``HMAC(secret, every nonce | its rank)``.  A member that cannot (a stranger admitted by
    the Lighthouse, which authenticates nobody) makes every rank raise, naming it, before
    any state, gradient or pickle is exchanged; the error counts as a failed peer (the step
    is voted down and the next quorum tried)."""
    if group.size == 1:
        return
    nonce = torch.frombuffer(bytearray(os.urandom(32)), dtype=torch.uint8)
    nonces = torch.empty(32 * group.size, dtype=torch.uint8)
    bc.allgather(nonce, nonces, group=group)
    seed = nonces.numpy().tobytes()

    def tag(rank: int) -> bytes:
        return hmac.new(secret, seed + rank.to_bytes(4, "little"), hashlib.sha256).digest()

    mine = torch.frombuffer(bytearray(tag(group.rank)), dtype=torch.uint8)
    tags = torch.empty(32 * group.size, dtype=torch.uint8)
    bc.allgather(mine, tags, group=group)
    got = tags.numpy().tobytes()
    bad = [r for r in range(group.size)
           if not hmac.compare_digest(got[32 * r:32 * r + 32], tag(r))]
    if bad:
        raise RuntimeError(f"bagua_algos.ft: peer rank(s) {bad} of the quorum did not prove the "
                           "job's secret (another job, or a stranger admitted by the "
                           "Lighthouse): nothing was exchanged with them")


def choose_source(group: bc.ProcessGroup, step: int, ok: bool,
                  old_rank: int = -1) -> tuple[int, bool, list[int]]:
    """(the source's rank, whether every replica is up to date: at the source's step, ok,
    every member's ``old_rank``).

    Collective over ``group``.  ``step``: this replica's committed step; ``ok``: no error in
    this quorum (a failed heal, a failed group configure); ``old_rank``: this replica's rank
    in the group before (-1: it joins).  Among equals a member of the old group is preferred:
    its parameters hold its own local steps (LocalSGD, DiLoCo), a joiner's another's."""
    if group.size == 1:
        return 0, True, [old_rank]
    mine = torch.tensor([step, int(ok), old_rank], dtype=torch.int64)
    every = torch.empty(3 * group.size, dtype=torch.int64)
    bc.allgather(mine, every, group=group)
    rows = every.view(group.size, 3).tolist()
    keys = [(s, k, o >= 0, -r) for r, (s, k, o) in enumerate(rows)]
    best = max(keys)
    return -best[3], all(k[:2] == best[:2] for k in keys), [o for _, _, o in rows]


def share(group: bc.ProcessGroup, src: int, module: torch.nn.Module, state: dict) -> dict:
    """``src``'s parameters and buffers into ``module`` on every rank, and ``src``'s
    ``state`` (plain data and tensors: optimizer, scheduler, sampler, algorithm) returned on
    every rank (collective)."""
    broadcast_tensors(list(module.parameters()) + list(module.buffers()), group, src)
    return bc.broadcast_object(state if group.rank == src else None, src, group=group)
