"""Decentralized's exchange of one round as one compiled job on a gloo group's worker
(``_worker.AverageJob``): bagua-algos' ``DecentralizedImpl`` builds one per layout, and falls
back to its Python path where :func:`peer_average_launcher` returns None."""

from __future__ import annotations

import torch

from . import _validate as V
from .ops import ReduceOp


def peer_average_launcher(weights, bufs, theirs, mode, *, group=None):
    """A launcher, or None where the exchange is not compiled.  Calling it with a round
    number starts the round on ``group``'s worker and returns its handle (``wait()``); its
    ``copy_out()`` then writes each ``bufs[i]`` into ``weights[i]``.

    The round: ``bufs[i] = weights[i]`` (in the call), then, on the worker, averaged with the
    peers: ``mode="all"``: the allreduce sum over ``group`` divided by its size;
    ``mode="shift_one"``: received from this round's ``shift_one`` peer into ``theirs[i]``
    while sent to it, then ``(bufs[i] + theirs[i]) / 2``.

    Compiled on gloo for CPU, contiguous, one-dimensional float32 tensors (``bufs[i]`` and,
    with ``shift_one``, ``theirs[i]`` of ``weights[i]``'s numel) in a group of two or more
    ranks (an even number with ``shift_one``).  The buffers are the caller's, used at every
    call.
    """
    g = V.group(group)
    shift = mode == "shift_one"
    if mode not in ("all", "shift_one") or g.size < 2 or (shift and g.size % 2):
        return None
    if not weights or len(bufs) != len(weights):
        return None
    if shift and len(theirs) != len(weights):
        return None
    for i, w in enumerate(weights):
        n = w.numel() if isinstance(w, torch.Tensor) else -1
        mates = (w, bufs[i], theirs[i]) if shift else (w, bufs[i])
        if not n or not all(_plain(t, n) for t in mates):
            return None
    be = g.backend_for(weights[0])
    if be.name != "gloo":
        return None
    from ._worker import AverageJob, RoundLauncher

    job = AverageJob(list(weights), list(bufs), list(theirs) if shift else [], shift,
                     g.rank, g.size, be.aux, be._reduce_opts[ReduceOp.SUM])
    numel = sum(w.numel() for w in weights)
    if shift:       # what batch_isend_irecv records: the bytes sent
        return RoundLauncher(be.worker(), job, numel * 4, "send")
    # what allreduce_inplace records, bucket by bucket
    nbytes = sum(int(2 * w.numel() * 4 * (g.size - 1) / g.size) for w in weights)
    return RoundLauncher(be.worker(), job, nbytes, "allreduce")


def _plain(t, numel) -> bool:
    return (isinstance(t, torch.Tensor) and t.device.type == "cpu"
            and t.dtype == torch.float32 and t.dim() == 1 and t.is_contiguous()
            and t.numel() == numel and not t.requires_grad)
