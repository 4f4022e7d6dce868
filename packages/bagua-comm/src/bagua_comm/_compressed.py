"""compressed_allreduce: scatter-reduce-gather over compressed chunks (ByteGrad's collective).

With ``n`` ranks and a compressor of ``chunks = n * K`` chunks, each rank

1. compresses its whole input into ``n * K`` records and sends records ``[j K, (j+1) K)`` to
   rank ``j`` (one alltoall of bytes);
2. decodes the ``n * K`` records it received (its own segment, from every rank) into float32
   and reduces them;
3. re-compresses its reduced segment into ``K`` records and allgathers them;
4. decodes all ``n * K`` gathered records into ``recv``.

Every rank ends with the same bytes, so the same ``recv``.  The input is zero-padded to a
multiple of ``chunks`` elements internally.  On gloo the whole sequence runs on the group's
worker thread over its auxiliary gloo group, so ``async_op=True`` overlaps it with the
caller's work and other primitives.

On gloo, both exchanges are point-to-point with every receive posted before any send
(:func:`_exchange`), not gloo's ``all_to_all``/``all_gather``.  A gloo sender waits for its
peer's "ready to receive" notice, which travels on the same TCP connection as that peer's own
outgoing data; when gloo's collective queues a large send first, the notice waits behind the
whole message, so the two directions of a link take turns instead of running together.  On a
2-host 100 Mbit/s link that made each phase take up to twice the wire time (see the
bagua-comm CHANGELOG).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import _validate as V
from . import traffic
from .compression import MinMaxUInt8
from .ops import ReduceOp, reduce_rows
from .work import finish

_OPS = (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MIN, ReduceOp.MAX)
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


class _FutureHandle:
    def __init__(self, fut):
        self._fut = fut

    def wait(self):
        self._fut.result()

    def is_completed(self):
        return self._fut.done()


def compressed_allreduce(send, recv, op=ReduceOp.AVG, compressor=None, *, key="allreduce",
                         group=None, async_op=False):
    """Allreduce of ``send`` into ``recv`` through 8-bit compressed chunks.

    Args:
        send, recv: contiguous float32/float16/bfloat16 tensors with the same numel and
            dtype (``recv`` may be ``send`` itself).
        op: ``SUM``, ``AVG`` (default), ``MIN`` or ``MAX``; reduced in float32.
        compressor: a :class:`~bagua_comm.compression.MinMaxUInt8` (or a compressor with the
            same ``chunks``/``compress``/``decompress`` interface) whose ``chunks`` is a
            multiple of the group size; default ``MinMaxUInt8(group size)``.  With error
            feedback, its residuals are kept under ``key + "/scatter"`` (this rank's input)
            and ``key + "/gather"`` (its reduced segment).
        key: names this call's error-feedback residuals; use one key per tensor.

    The tensors must not be touched until the call (or its work handle) completes.
    """
    g = V.group(group)
    V.pair(send, recv, g)
    if send.dtype not in _FLOATS:
        raise ValueError(f"compressed_allreduce needs float32, float16 or bfloat16 tensors, "
                         f"got {send.dtype}")
    try:
        op = ReduceOp(op)
    except ValueError as err:
        raise ValueError(f"op must be a bagua_comm.ReduceOp, got {op!r}") from err
    if op not in _OPS:
        raise ValueError(f"compressed_allreduce supports op SUM, AVG, MIN or MAX, got {op.name}")
    if compressor is None:
        compressor = MinMaxUInt8(g.size)
    chunks = getattr(compressor, "chunks", None)
    if not isinstance(chunks, int) or chunks % g.size:
        raise ValueError(f"compressor.chunks ({chunks!r}) must be a multiple of the group size "
                         f"({g.size})")
    if send.numel() == 0:
        return finish([], async_op=async_op)
    k = chunks // g.size
    seg = -(-send.numel() // chunks) * k  # elements per rank's segment, after padding
    sent = (compressor.payload_numel(seg * g.size, chunks=chunks) * (g.size - 1) // g.size
            + compressor.payload_numel(seg, chunks=k) * (g.size - 1))
    traffic.record("compressed_allreduce", sent)
    if send.is_cuda:
        from ._backends import nccl as _nccl_ops

        return _nccl_ops.compressed_allreduce(send, recv, op, compressor, k, seg, key, g,
                                              async_op)
    fut = g._submit(_run, g, send, recv, op, compressor, k, seg, key)
    return finish([_FutureHandle(fut)], async_op=async_op)


def _scratch(g, tag, numel, dtype):
    """A reusable buffer of the group's worker thread (fresh large allocations cost a page
    fault per 4 KiB on every call; these are reused by the next call of the same size)."""
    cache = g._scratch
    k = (tag, numel, dtype)
    buf = cache.get(k)
    if buf is None:
        if len(cache) >= 32:  # many distinct sizes: start over rather than grow
            cache.clear()
        buf = cache[k] = torch.empty(numel, dtype=dtype)
    return buf


def _run(g, send, recv, op, compressor, k, seg, key):
    n = g.size
    chunks = n * k
    padded = seg * n
    numel = send.numel()
    x = send.detach().view(-1)
    if padded != numel:
        x = torch.cat([x, x.new_zeros(padded - numel)])
    ours = isinstance(compressor, MinMaxUInt8)  # other compressors may not take out=
    # 1. scatter: my records for rank j go to rank j
    size = compressor.payload_numel(padded, chunks=chunks)
    payload = compressor.compress(x, chunks=chunks, key=f"{key}/scatter",
                                  **({"out": _scratch(g, "payload", size, torch.uint8)}
                                     if ours else {}))
    received = _scratch(g, "received", payload.numel(), torch.uint8)
    _exchange(g, received.view(n, -1), payload.view(n, -1))
    # 2. reduce my segment in float32
    parts = _scratch(g, "parts", padded, torch.float32)
    compressor.decompress(received, parts, chunks=chunks, dtype=send.dtype)
    mine = reduce_rows(parts.view(n, seg), op)
    # 3. gather: every rank's re-compressed segment
    own = compressor.compress(mine.to(send.dtype), chunks=k, key=f"{key}/gather")
    gathered = _scratch(g, "gathered", n * own.numel(), torch.uint8)
    _exchange(g, gathered.view(n, -1), [own] * n)
    # 4. decode everything
    out = recv.detach().view(-1)
    if padded != numel:
        full = _scratch(g, "full", padded, recv.dtype)
        compressor.decompress(gathered, full, chunks=chunks)
        out.copy_(full[:numel])
    else:
        compressor.decompress(gathered, out, chunks=chunks)


def _exchange(g, recv_rows, send_rows):
    """Send ``send_rows[j]`` to group rank ``j`` and receive ``recv_rows[j]`` from it, for every
    ``j`` (an alltoall; an allgather when every send row is the same tensor).

    Every receive is posted before the first send, so each rank's "ready to receive" notice
    leaves ahead of its bulk data and both directions of every link carry data at once.
    """
    me, pg = g.rank, g.aux_torch_group
    peers = [j for j in range(g.size) if j != me]
    works = [dist.irecv(recv_rows[j], g.global_rank(j), group=pg) for j in peers]
    works += [dist.isend(send_rows[j], g.global_rank(j), group=pg) for j in peers]
    recv_rows[me].copy_(send_rows[me])
    for w in works:
        w.wait()
