"""Tiny collectives in one latency round.

gloo's allgather is a ring (``n - 1`` rounds, each paying the link's latency) and its
allreduce two rings (``2(n - 1)``): between 4 hosts 50 ms apart a 16-byte allgather took
~0.3 s and a MAX of a few floats ~0.6 s.  For a few bytes a rank, sending them straight to
every peer at once (one batch of point-to-point operations: every receive posted, then every
send) costs one round, whatever the group's size.  Used where a handful of values are agreed
before training (with_bagua's consistency check, recommend's measurement) and when a
fault-tolerant group is rebuilt (bagua_algos.ft).
"""

from __future__ import annotations

import pickle

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


#: bytes of a pickled object that :func:`broadcast_small` carries in its first broadcast
#: (a larger object takes a second one for the rest)
INLINE_BYTES = 1 << 16


def broadcast_small(obj, src: int, group: bc.ProcessGroup):
    """Rank ``src``'s picklable ``obj``, returned on every rank (collective), as
    ``bagua_comm.broadcast_object`` but in one broadcast where it pickles to at most
    :data:`INLINE_BYTES` (its size travels in the same buffer, not in a broadcast of its
    own).  An ``obj`` that does not pickle raises ValueError on every rank."""
    if group.size == 1:
        return obj
    buf = torch.zeros(8 + INLINE_BYTES, dtype=torch.uint8)
    data, error = b"", None
    if group.rank == src:
        try:
            data = pickle.dumps(obj)
        except Exception as err:       # pickle raises TypeError, AttributeError, ...
            error = err
        head = torch.tensor([-1 if error is not None else len(data)], dtype=torch.int64)
        buf[:8] = head.view(torch.uint8)
        inline = data[:INLINE_BYTES]
        if inline:
            buf[8:8 + len(inline)] = torch.frombuffer(bytearray(inline), dtype=torch.uint8)
    bc.broadcast(buf, src, group=group)
    size = int(buf[:8].view(torch.int64)[0])
    if size < 0:
        raise ValueError(f"broadcast_small: obj on rank {src} cannot be pickled "
                         f"({type(error).__name__ if error else 'see that rank'}: {error or ''})"
                         ) from error
    rest = b""
    if size > INLINE_BYTES:
        more = (torch.frombuffer(bytearray(data[INLINE_BYTES:]), dtype=torch.uint8)
                if group.rank == src else torch.empty(size - INLINE_BYTES, dtype=torch.uint8))
        bc.broadcast(more, src, group=group)
        rest = more.numpy().tobytes()
    if group.rank == src:
        return obj
    return pickle.loads(buf[8:8 + min(size, INLINE_BYTES)].numpy().tobytes() + rest)
