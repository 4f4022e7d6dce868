"""compressed_allreduce: scatter-reduce-gather over compressed chunks (ByteGrad's collective).

With ``n`` ranks and a compressor of ``chunks = n * K`` chunks, each rank

1. compresses its whole input into ``n * K`` records and sends records ``[j K, (j+1) K)`` to
   rank ``j`` (an alltoall of bytes);
2. decodes the ``n * K`` records it received (its own segment, from every rank) into float32
   and reduces them;
3. re-compresses its reduced segment into ``K`` records and allgathers them;
4. decodes all ``n * K`` gathered records into ``recv``.

Every rank ends with the same bytes, so the same ``recv``.  The input is zero-padded
internally to the compressor's ``alignment`` (for ``chunks`` and for ``K``).  The sequence is
written once, over the backend interface (``_backends``): it runs in the backend's ``run``
context (gloo: the group's worker thread and auxiliary group, so ``async_op=True`` overlaps
it with the caller's work and other primitives; NCCL: the group's CUDA stream), exchanges
with the backend's ``exchange`` and keeps its buffers in the group's scratch pool, reused
call after call.
"""

from __future__ import annotations

import functools
import math

import torch

from . import _validate as V
from . import traffic
from .compression import Compressor, MinMaxUInt8, record_bytes
from .ops import ReduceOp, as_op, reduce_rows
from .work import finish

_OPS = (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MIN, ReduceOp.MAX)
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def compressed_allreduce(send, recv, op=ReduceOp.AVG, compressor=None, *, key="allreduce",
                         group=None, async_op=False):
    """Allreduce of ``send`` into ``recv`` through 8-bit compressed chunks.

    Args:
        send, recv: contiguous float32/float16/bfloat16 tensors with the same numel and
            dtype (``recv`` may be ``send`` itself).
        op: ``SUM``, ``AVG`` (default), ``MIN`` or ``MAX``; reduced in float32.
        compressor: any :class:`~bagua_comm.compression.Compressor` whose ``chunks`` is a
            multiple of the group size; default ``MinMaxUInt8(group size)``.  With error
            feedback, its residuals are kept under ``key + "/scatter"`` (this rank's input)
            and ``key + "/gather"`` (its reduced segment).
        key: names this call's error-feedback residuals; use one key per tensor.

    The tensors must not be touched until the call (or its work handle) completes.
    """
    g, send, recv, op, compressor = _checked(send, recv, op, compressor, group)
    if send.numel() == 0:
        return finish([], async_op=async_op)
    k, seg, sent = _sizes(compressor, send.numel(), g.size)
    traffic.record("compressed_allreduce", sent)
    be = g.backend_for(send)
    return be.run(lambda: _run(be, send, recv, op, compressor, k, seg, key), (send, recv),
                  async_op)


def compressed_allreduce_launcher(send, recv, op=ReduceOp.AVG, compressor=None, *,
                                  key="allreduce", group=None):
    """A callable that starts ``compressed_allreduce(send, recv, op, compressor, key=key,
    group=group, async_op=True)`` each time it is called (no argument) and returns its handle
    (``wait()``, ``is_completed()``), for buffers reduced again and again (a gradient
    bucket): the arguments are checked, the sizes worked out and the buffers made once,
    here.  For ``MinMaxUInt8`` without error feedback on gloo (CPU tensors) a call costs no
    Python: the compiled collective is handed to the group's worker thread, in call order
    with every other multi-phase collective of the group.  The results are those of
    :func:`compressed_allreduce`, bit for bit."""
    g, send, recv, op, compressor = _checked(send, recv, op, compressor, group)
    fast = _compiled_launcher(g, send, recv, op, compressor, send.numel())
    if fast is not None:
        return fast
    return functools.partial(compressed_allreduce, send, recv, op, compressor, key=key,
                             group=g, async_op=True)


def _compiled_launcher(g, send, recv, op, compressor, live, tail=None):
    """The compiled launcher of checked arguments (``_checked``), or None where the call
    takes the general path (or cannot carry ``tail``).  It zeroes ``send[live:]`` before each
    call (a bucket's padding, which the previous call's result overwrote)."""
    if not send.numel() or not _compiled(g, compressor, send):
        return None
    if tail is not None and not _tail_fits(tail, op):
        return None
    k, seg, sent = _sizes(compressor, send.numel(), g.size)
    if tail is not None:
        sent += tail.numel() * 4 * (g.size - 1)
    be = g.backend_for(send)
    return be.compressed_launcher(
        lambda: _job(be, send, recv, op, compressor, k, seg, live, tail), sent)


def _inplace_launcher(tensor, op, compressor, group, live, tail=None):
    """The compiled launcher of ``compressed_allreduce(tensor, tensor, op, compressor,
    group=group)`` zeroing ``tensor[live:]`` before each call (bagua-algos' buckets, padded to
    the compressor's alignment), or None where it would take the general path.

    ``tail`` (a float32 CPU tensor, op SUM or AVG): reduced exactly, uncompressed, in place,
    in the same call (each rank's values ride at the end of its gathered row): bagua-algos'
    "got a gradient" flags; None where they cannot ride."""
    g, send, recv, op, compressor = _checked(tensor, tensor, op, compressor, group)
    return _compiled_launcher(g, send, recv, op, compressor, live, tail)


def _tail_fits(tail, op) -> bool:
    return (isinstance(tail, torch.Tensor) and tail.dtype == torch.float32
            and tail.device.type == "cpu" and tail.dim() == 1 and tail.is_contiguous()
            and tail.numel() > 0 and not tail.requires_grad
            and op in (ReduceOp.SUM, ReduceOp.AVG))


def _checked(send, recv, op, compressor, group):
    """The arguments checked (ValueError before anything is sent), the tensors detached."""
    g = V.group(group)
    V.pair(send, recv, g)
    if send.dtype not in _FLOATS:
        raise ValueError(f"compressed_allreduce needs float32, float16 or bfloat16 tensors, "
                         f"got {send.dtype}")
    op = as_op(op)
    if op not in _OPS:
        raise ValueError(f"compressed_allreduce supports op SUM, AVG, MIN or MAX, got {op.name}")
    if compressor is None:
        compressor = MinMaxUInt8(g.size)
    if not isinstance(compressor, Compressor):
        raise ValueError(f"compressor must be a bagua_comm.compression.Compressor, got "
                         f"{type(compressor).__name__}")
    chunks = getattr(compressor, "chunks", None)
    if not isinstance(chunks, int) or chunks % g.size:
        raise ValueError(f"compressor.chunks ({chunks!r}) must be a multiple of the group size "
                         f"({g.size})")
    if send.requires_grad:
        send = send.detach()
    if recv.requires_grad:
        recv = recv.detach()
    return g, send, recv, op, compressor


def _sizes(compressor, numel, n):
    """(chunks per rank, padded elements per rank, bytes this rank sends)."""
    chunks = compressor.chunks
    k = chunks // n
    seg = padded_numel(compressor, numel, n) // n
    sent = (compressor.payload_numel(seg * n, chunks=chunks) * (n - 1) // n
            + compressor.payload_numel(seg, chunks=k) * (n - 1))
    return k, seg, sent


def padded_numel(compressor, numel: int, group_size: int) -> int:
    """Elements :func:`compressed_allreduce` compresses for an input of ``numel`` over
    ``group_size`` ranks (the input zero-padded to a multiple of :func:`_unit`): the one
    formula for the collective and for whoever lays out its error-feedback residuals (the
    ``<key>/scatter`` residual has this many elements, ``<key>/gather`` this over
    ``group_size``)."""
    chunks = compressor.chunks
    unit = _unit(compressor, chunks, chunks // group_size, group_size)
    return -(-numel // unit) * unit


def _unit(compressor, chunks, k, n):
    """The element multiple the input is padded to: whole inputs in ``chunks`` chunks and
    per-rank segments in ``k`` chunks must both meet the compressor's ``alignment``."""
    whole, part = compressor.alignment(chunks), compressor.alignment(k)
    for c, a in ((chunks, whole), (k, part)):
        if isinstance(a, bool) or not isinstance(a, int) or a < 1 or a % c:
            raise ValueError(f"{type(compressor).__name__}.alignment({c}) must return a "
                             f"positive multiple of {c}, got {a!r}")
    return math.lcm(whole, n * part)


_OP_CODES = {ReduceOp.SUM: 0, ReduceOp.AVG: 1, ReduceOp.MIN: 2, ReduceOp.MAX: 3}


def _fused(compressor) -> bool:
    """MinMaxUInt8 (with its own ``decompress``) decodes and reduces the rows in one call."""
    return (isinstance(compressor, MinMaxUInt8)
            and type(compressor).decompress is MinMaxUInt8.decompress)


def _check_payload(compressor, payload, size, numel, chunks) -> None:
    """A compressor's output must be the uint8 tensor its ``payload_numel`` promised (every rank
    runs the same compressor on the same sizes, so every rank raises together)."""
    if (not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8
            or payload.numel() != size):
        got = (f"{payload.dtype} tensor of {payload.numel()} elements"
               if isinstance(payload, torch.Tensor) else type(payload).__name__)
        raise ValueError(f"{type(compressor).__name__}.compress() of {numel} elements in "
                         f"{chunks} chunks returned a {got}, but its payload_numel() promised "
                         f"a uint8 tensor of {size}: compress() and payload_numel() must agree")


def _compiled(g, compressor, send) -> bool:
    """Whether the compiled collective (``_worker.CompressedJob``) runs this call: plain
    MinMaxUInt8 (no subclass, no error feedback) on gloo CPU tensors."""
    return (type(compressor) is MinMaxUInt8 and compressor._ef is None
            and send.device.type == "cpu" and g.backend_for(send).name == "gloo")


def _job(be, send, recv, op, compressor, k, seg, live=None, tail=None):
    """The :class:`~bagua_comm._worker.CompressedJob` of a call: its buffers from the
    group's scratch pool (on the worker thread, as every use of the pool)."""
    from ._worker import CompressedJob

    n, dev, dtype = be.group.size, send.device, send.dtype
    padded, numel = seg * n, send.numel()
    rec = record_bytes(seg // k)
    pad = be.scratch("padded", padded, dtype, dev) if padded != numel else None
    payload, payload_rows = be.scratch_rows("payload", n * k * rec, torch.uint8, dev, n)
    received, received_rows = be.scratch_rows("received", n * k * rec, torch.uint8, dev, n)
    mine = be.scratch("mine", seg, torch.float32, dev)
    half = dtype is not torch.float32
    own_in = be.scratch("own_in", seg, dtype, dev) if half else None
    row = k * rec + (tail.numel() * 4 if tail is not None else 0)   # + the exact tail
    own = be.scratch("own", row, torch.uint8, dev)
    gathered, gathered_rows = be.scratch_rows("gathered", n * row, torch.uint8, dev, n)
    dec = be.scratch("decoded", padded, torch.float32, dev) if half else None
    return CompressedJob(send.view(-1), recv.view(-1), pad, payload, received, mine, own_in,
                         own, gathered, dec, list(payload_rows), list(received_rows),
                         list(gathered_rows), be.aux, be.group.rank, k, rec,
                         *MinMaxUInt8._kernel_args(dtype), _OP_CODES[op],
                         numel if live is None else live, tail)


def _run(be, send, recv, op, compressor, k, seg, key):
    if _compiled(be.group, compressor, send):
        _job(be, send, recv, op, compressor, k, seg).run()
        return
    n = be.group.size
    chunks = n * k
    padded = seg * n
    numel = send.numel()
    dev = send.device
    x = send if send.dim() == 1 else send.view(-1)
    if padded != numel:
        x = be.scratch("padded", padded, send.dtype, dev)
        x[:numel].copy_(send.view(-1))
        x[numel:].zero_()
    # 1. scatter: my records for rank j go to rank j
    size = compressor.payload_numel(padded, chunks=chunks)
    out, out_rows = be.scratch_rows("payload", size, torch.uint8, dev, n)
    payload = compressor.compress(x, chunks=chunks, key=f"{key}/scatter", out=out)
    _check_payload(compressor, payload, size, padded, chunks)
    received, received_rows = be.scratch_rows("received", size, torch.uint8, dev, n)
    be.exchange(received_rows, out_rows if payload is out else payload.view(n, -1))
    # 2. reduce my segment in float32
    mine = be.scratch("mine", seg, torch.float32, dev)
    if _fused(compressor):      # decode the n rows and reduce them in one kernel call
        compressor._decompress_reduce(received, mine, chunks=chunks, dtype=send.dtype, rows=n,
                                      op=_OP_CODES[op])
    else:
        parts = be.scratch("parts", padded, torch.float32, dev)
        compressor.decompress(received, parts, chunks=chunks, dtype=send.dtype)
        mine = reduce_rows(parts.view(n, seg), op, out=mine)
    # 3. gather: every rank's re-compressed segment
    own_size = compressor.payload_numel(seg, chunks=k)
    own = compressor.compress(mine.to(send.dtype), chunks=k, key=f"{key}/gather",
                              out=be.scratch("own", own_size, torch.uint8, dev))
    _check_payload(compressor, own, own_size, seg, k)
    gathered, gathered_rows = be.scratch_rows("gathered", n * own_size, torch.uint8, dev, n)
    be.exchange(gathered_rows, [own] * n)
    # 4. decode everything
    out = recv if recv.dim() == 1 else recv.view(-1)
    if padded != numel:
        full = be.scratch("full", padded, recv.dtype, dev)
        compressor.decompress(gathered, full, chunks=chunks)
        out.copy_(full[:numel])
    else:
        compressor.decompress(gathered, out, chunks=chunks)
