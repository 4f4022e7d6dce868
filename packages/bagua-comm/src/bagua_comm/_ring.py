"""LowPrecisionDecentralized's ring round of one bucket as one compiled job on a gloo group's
worker (``_worker.RingJob``): bagua-algos' ``LowPrecisionDecentralizedImpl`` builds one per
bucket and layout, and falls back to its Python path where :func:`low_precision_ring_launcher`
returns None."""

from __future__ import annotations

import torch

from . import _validate as V
from .compression import MinMaxUInt8, record_bytes


def low_precision_ring_launcher(weight, mine, left, right, diff, payload, from_left, from_right,
                                live, compressor, *, group=None):
    """A callable (no argument) that starts one ring round of a bucket on ``group``'s worker
    and returns its handle (``wait()``), or None where the round is not compiled.

    The round: ``diff = weight + left/3 + right/3 - 5/3 mine`` (zero from ``live`` on),
    ``payload = compressor.compress(diff)``, ``mine += decode(payload)``, ``weight = mine``;
    ``payload`` goes to both ring neighbours (rank - 1 and rank + 1 of ``group``; one message
    when they are the same rank, whose payload then arrives in ``from_left``, which must be
    ``from_right``), and ``left`` / ``right`` each add the decoding of their owner's payload.

    Compiled for a plain ``MinMaxUInt8`` (no error feedback) on gloo, with CPU, contiguous,
    one-dimensional float32 tensors of one numel (a multiple of its chunks) and uint8
    payload buffers of its ``payload_numel``, in a group of two or more ranks.  The buffers
    are the caller's, used at every call.
    """
    g = V.group(group)
    floats = (weight, mine, left, right, diff)
    bufs = (payload, from_left, from_right)
    if g.size < 2 or type(compressor) is not MinMaxUInt8 or compressor._ef is not None:
        return None
    n = weight.numel()
    if not n or n % compressor.chunks or not 0 <= live <= n:
        return None
    size = compressor.payload_numel(n)
    if not all(_plain(t, torch.float32, n) for t in floats):
        return None
    if not all(_plain(t, torch.uint8, size) for t in bufs):
        return None
    be = g.backend_for(weight)
    if be.name != "gloo":
        return None
    left_rank, right_rank = (g.rank - 1) % g.size, (g.rank + 1) % g.size
    if (left_rank == right_rank) != (from_left is from_right):
        return None
    chunks = compressor.chunks
    rec = record_bytes(n // chunks)
    kind, lut = MinMaxUInt8._kernel_args(torch.float32)

    def build():
        from ._worker import RingJob

        return RingJob(weight, mine, left, right, diff, payload, from_left, from_right, live,
                       chunks, rec, kind, lut, left_rank, right_rank, be.aux)

    peers = 1 if left_rank == right_rank else 2
    return be.compressed_launcher(build, size * peers, "send")


def _plain(t, dtype, numel) -> bool:
    return (isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dtype == dtype
            and t.dim() == 1 and t.is_contiguous() and t.numel() == numel
            and not t.requires_grad)
