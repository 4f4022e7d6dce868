"""Which replica the shared state of a rebuilt group comes from, and its broadcast.

with_bagua broadcasts rank 0's parameters and optimizer state, and rank 0 of a new quorum
may be a replica that just joined and whose heal failed (its state is the initial one).
Before the wrap, the replicas agree on an up-to-date source, the one at the highest committed
step that saw no error in the quorum (lowest rank among equals), and every replica that is
not up to date takes the source's whole state: model, optimizer, scheduler, sampler position
and the algorithm's shared state.  A replica whose heal failed still takes part in the step
(its peers' collectives need it) with the source's state, votes it down, and heals at the
next quorum.

The same collective compares digests of every replica's wrap configuration (what
with_bagua checks) and of its parameters, buffers and optimizer state.  Where the states are
equal (survivors of a per-step algorithm: every committed step left them bit-identical),
the source's parameters are not broadcast; the wrap then skips with_bagua's configuration
check and its broadcast of rank 0's parameters and optimizer state whenever both are proven
equal (see :class:`Agreement`).  The algorithm's shared state comes from the source, but
where every member was in the group before and holds what the source would send (the same
algorithm state as far as its foreign load reads it, ``AlgorithmImpl.foreign_view``, and the
same sampler position), nothing is broadcast: each loads its own as it would the source's.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import NamedTuple

import torch

import bagua_comm as bc

from .._engine.comm import broadcast_tensors
from .._engine.consistency import digest, digest_words
from .._engine.small import broadcast_small, gather_small


def authenticate(group: bc.ProcessGroup, secret: bytes,
                 row: torch.Tensor | None = None) -> torch.Tensor | None:
    """Every member of a new group proves it holds the job's secret before anything else
    goes through the group (collective): each rank sends a fresh nonce, then
    ``HMAC(secret, every nonce | its rank)``.  A member that cannot (a stranger admitted by
    the Lighthouse, which authenticates nobody) makes every rank raise, naming it, before
    any state, gradient or pickle is exchanged; the error counts as a failed peer (the step
    is voted down and the next quorum tried).

    ``row`` (a small int64 tensor, the same shape on every rank) travels with the proof, in
    the same round, masked by a keystream only the secret's holders can derive; returned
    is every rank's, unmasked, as rows by rank, once every member is proven (None without
    ``row``).  Each round sends to every peer at once (:func:`gather_small`): two rounds in
    all, whatever the group's size."""
    if group.size == 1:
        return None if row is None else row.reshape(1, -1).clone()
    nonce = torch.frombuffer(bytearray(os.urandom(32)), dtype=torch.uint8)
    seed = gather_small(nonce, group).numpy().tobytes()

    def tag(rank: int) -> bytes:
        return hmac.new(secret, seed + rank.to_bytes(4, "little"), hashlib.sha256).digest()

    def masked(rank: int, data: bytes) -> bytes:
        # XOR with HMAC(secret, seed | rank | "row" | block): fresh for every group (the
        # nonces), distinct from every tag
        stream = b"".join(hmac.new(secret, seed + rank.to_bytes(4, "little") + b"row"
                                   + i.to_bytes(4, "little"), hashlib.sha256).digest()
                          for i in range(-(-len(data) // 32)))
        return bytes(a ^ b for a, b in zip(data, stream))

    body = b"" if row is None else row.contiguous().numpy().tobytes()
    mine = torch.frombuffer(bytearray(tag(group.rank) + masked(group.rank, body)),
                            dtype=torch.uint8)
    got = gather_small(mine, group).numpy()
    bad = [r for r in range(group.size)
           if not hmac.compare_digest(got[r, :32].tobytes(), tag(r))]
    if bad:
        raise RuntimeError(f"bagua_algos.ft: peer rank(s) {bad} of the quorum did not prove the "
                           "job's secret (another job, or a stranger admitted by the "
                           "Lighthouse): nothing was exchanged with them")
    if row is None:
        return None
    rows = [torch.frombuffer(bytearray(masked(r, got[r, 32:].tobytes())), dtype=row.dtype)
            for r in range(group.size)]
    return torch.stack(rows)


class Agreement(NamedTuple):
    """What the members of a rebuilt group agreed (:func:`agree`)."""
    src: int                 # the source's rank
    agreed: bool             # every replica up to date: at the source's step, ok
    old_ranks: list[int]     # every member's rank in the group before (-1: it joins)
    same_config: bool        # every replica's wrap configuration has the same digest
    same_state: bool         # every replica's parameters, buffers, optimizer state too
    # every member was in the group before and holds the same algorithm state (as far as a
    # foreign load reads it) and sampler position: the source's need not be broadcast
    same_shared: bool = False
    own_ranks: tuple[int, ...] = ()   # the rank each member's algorithm state was saved at


def state_digest(module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 drop: str) -> bytes:
    """:func:`digest` of the parameters, buffers and optimizer state (without its ``drop``
    entry, the algorithm's per-rank state)."""
    opt = {k: v for k, v in optimizer.state_dict().items() if k != drop}
    return digest(list(module.parameters()), list(module.buffers()), opt)


def agree(group: bc.ProcessGroup, step: int, ok: bool, old_rank: int = -1,
          config: bytes = b"", state: bytes = b"", secret: bytes | None = None,
          shared: bytes = b"", own_rank: int = -1) -> Agreement:
    """The source and what is equal on every member, in one collective over ``group``.

    ``step``: this replica's committed step; ``ok``: no error in this quorum (a failed heal, a
    failed group configure); ``old_rank``: this replica's rank in the group before (-1: it
    joins); ``config``, ``state``: its :func:`digest` of the wrap configuration and of
    :func:`state_digest` (empty: unknown, counted unequal); ``shared``: its digest of what
    the source would broadcast (the algorithm's state as its foreign load reads it, and the
    sampler's position), ``own_rank`` the rank its algorithm state was saved at.  The
    source is the replica at the highest step that saw no error; among equals a member of
    the old group is preferred (its parameters hold its own local steps, under LocalSGD and
    DiLoCo; a joiner's are another's), lowest rank first.

    Each rank's values go straight to every peer (:func:`gather_small`: one round); with
    ``secret``, inside :func:`authenticate`'s proof (masked, read only once every member
    has proven the secret): the group's authentication and agreement in two rounds."""
    if group.size == 1:
        return Agreement(0, True, [old_rank], True, True, old_rank >= 0, (own_rank,))
    known = digest_words(config) + digest_words(state) + digest_words(shared)
    mine = torch.tensor([step, int(ok), old_rank, *known, own_rank], dtype=torch.int64)
    every = (gather_small(mine, group) if secret is None
             else authenticate(group, secret, mine))
    rows = every.tolist()
    keys = [(row[0], row[1], row[2] >= 0, -r) for r, row in enumerate(rows)]
    best = max(keys)
    return Agreement(-best[3], all(k[:2] == best[:2] for k in keys), [row[2] for row in rows],
                     all(row[3:5] == rows[0][3:5] for row in rows),
                     all(row[5:7] == rows[0][5:7] for row in rows),
                     all(row[2] >= 0 and row[7:9] == rows[0][7:9] for row in rows),
                     tuple(row[9] for row in rows))


def choose_source(group: bc.ProcessGroup, step: int, ok: bool,
                  old_rank: int = -1) -> tuple[int, bool, list[int]]:
    """(the source's rank, whether every replica is up to date, every member's
    ``old_rank``): :func:`agree` without digests."""
    return tuple(agree(group, step, ok, old_rank)[:3])


def share(group: bc.ProcessGroup, src: int, module: torch.nn.Module, state: dict,
          params: bool = True) -> dict:
    """``src``'s parameters and buffers into ``module`` on every rank (when ``params``: not
    where every rank's are proven equal), and ``src``'s ``state`` (plain data and tensors:
    optimizer, scheduler, sampler, algorithm) returned on every rank (collective; one
    broadcast where it pickles small, see :func:`broadcast_small`)."""
    if params:
        broadcast_tensors(list(module.parameters()) + list(module.buffers()), group, src)
    return broadcast_small(state if group.rank == src else None, src, group)
