"""Tiny collectives in one latency round.

gloo's allgather is a ring (``n - 1`` rounds, each paying the link's latency) and its
allreduce two rings (``2(n - 1)``): between 4 hosts 50 ms apart a 16-byte allgather took
~0.3 s and a MAX of a few floats ~0.6 s.  For a few bytes a rank, sending them straight to
every peer at once (one batch of point-to-point operations: every receive posted, then every
send) costs one round, whatever the group's size.  Used where a handful of values are agreed
before training (with_bagua's consistency check, recommend's measurement).
"""

from __future__ import annotations

import torch

import bagua_comm as bc

#: Up to this many ranks, each rank sends its values to every peer itself; a larger group
#: (or a non-gloo one, whose tensors live on the device) takes the library's allgather
DIRECT_MAX_RANKS = 64


def gather_small(t: torch.Tensor, group: bc.ProcessGroup) -> torch.Tensor:
    """Every rank's ``t`` (a small CPU tensor, the same shape and dtype on every rank), as
    rows by rank: ``out[r]`` is rank ``r``'s (collective)."""
    t = t.contiguous()
    size, rank = group.size, group.rank
    rows = torch.empty((size, *t.shape), dtype=t.dtype)
    if size == 1:
        rows[0].copy_(t)
        return rows
    if group.backend != "gloo" or size > DIRECT_MAX_RANKS:
        bc.allgather(t, rows.view(-1), group=group)
        return rows
    rows[rank].copy_(t)
    peers = [p for p in range(size) if p != rank]
    bc.batch_isend_irecv([bc.P2POp("recv", rows[p], p) for p in peers]
                         + [bc.P2POp("send", t, p) for p in peers], group=group)
    return rows


def max_small(values: list[float], group: bc.ProcessGroup) -> list[float]:
    """The element-wise MAX of every rank's ``values`` (collective, one round)."""
    rows = gather_small(torch.tensor(values, dtype=torch.float64), group)
    return rows.max(dim=0).values.tolist()
