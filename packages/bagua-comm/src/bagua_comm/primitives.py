"""Communication primitives.

Every primitive validates its arguments before communicating (:mod:`._validate`), records
the bytes it sends (:mod:`bagua_comm.traffic`), then hands the work to the group's backend
for the tensors' device (:mod:`._backends`: gloo for CPU tensors, NCCL for CUDA tensors on
the ``nccl`` backend).  With ``async_op=True`` it returns a :class:`~bagua_comm.work.Work`;
otherwise it returns once the result is in place.
"""

from __future__ import annotations

import functools
import pickle
from typing import Any, NamedTuple

import torch

from . import _validate as V
from . import traffic
from .ops import ReduceOp
from .work import Work


def _data(t):
    """``t`` without autograd: primitives write into parameters (and leaves that require
    grad) like ``torch.no_grad()`` code does, never through autograd."""
    return t.detach() if t is not None and t.requires_grad else t


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


# -- point to point ------------------------------------------------------------------------
def send(tensor, dst, *, group=None, async_op=False):
    """Send ``tensor`` to group rank ``dst`` (which calls :func:`recv`)."""
    g = V.group(group)
    V.tensor("tensor", tensor, g)
    dst = V.rank("dst", dst, g, not_self=True)
    traffic.record("send", _nbytes(tensor))
    return g.backend_for(tensor).send(tensor, dst, async_op)


def recv(tensor, src, *, group=None, async_op=False):
    """Receive into ``tensor`` from group rank ``src``."""
    g = V.group(group)
    V.tensor("tensor", tensor, g)
    src = V.rank("src", src, g, not_self=True)
    tensor = _data(tensor)
    return g.backend_for(tensor).recv(tensor, src, async_op)


class P2POp(NamedTuple):
    """One half of a point-to-point exchange for :func:`batch_isend_irecv`: ``op`` is
    ``"send"`` or ``"recv"`` (or the functions :func:`send` / :func:`recv`), ``peer`` a
    group rank."""

    op: Any
    tensor: Any
    peer: int


def batch_isend_irecv(ops, *, group=None, async_op=False):
    """Every send and receive of ``ops`` (a list of :class:`P2POp`) as one operation.

    Use it whenever a rank both sends and receives in one exchange: on the ``nccl`` backend
    NCCL's send and recv block the GPU until the peer's matching call runs, so a ``recv``
    and a ``send`` issued as two calls deadlock two ranks that each received first; here
    they are grouped (``ncclGroupStart``/``ncclGroupEnd``).  On gloo every receive is
    posted before the first send.  Messages between two ranks match in the order they are
    listed.  Returns one work handle with ``async_op=True`` (unlike torch's list), else
    None once every receive is complete.
    """
    g = V.group(group)
    if isinstance(ops, P2POp) or not isinstance(ops, (list, tuple)) or not ops:
        raise ValueError("ops must be a non-empty list of bagua_comm.P2POp")
    sends, recvs = [], []
    for i, p in enumerate(ops):
        if not isinstance(p, P2POp):
            raise ValueError(f"ops[{i}] must be a bagua_comm.P2POp, got {type(p).__name__}")
        kind = p.op if isinstance(p.op, str) else getattr(p.op, "__name__", None)
        if p.op not in ("send", "recv", send, recv):
            kind = None
        if kind is None:
            raise ValueError(f"ops[{i}].op must be 'send' or 'recv', got {p.op!r}")
        V.tensor(f"ops[{i}].tensor", p.tensor, g)
        if p.tensor.device != ops[0].tensor.device:
            raise ValueError(f"every tensor of ops must be on one device: ops[0] is on "
                             f"{ops[0].tensor.device}, ops[{i}] on {p.tensor.device}")
        peer = V.rank(f"ops[{i}].peer", p.peer, g, not_self=True)
        (sends if kind == "send" else recvs).append((peer, _data(p.tensor)))
    traffic.record("send", sum(_nbytes(t) for _, t in sends))
    return g.backend_for(ops[0].tensor).send_recv(sends, recvs, async_op)


# -- broadcast -----------------------------------------------------------------------------
def broadcast(tensor, src=0, *, group=None, async_op=False):
    """Every rank's ``tensor`` becomes rank ``src``'s."""
    g = V.group(group)
    V.tensor("tensor", tensor, g)
    src = V.rank("src", src, g)
    tensor = _data(tensor)
    if g.rank == src:
        traffic.record("broadcast", _nbytes(tensor))
    return g.backend_for(tensor).broadcast(tensor, src, async_op)


def broadcast_object(obj, src=0, *, group=None, async_op=False):
    """Rank ``src``'s picklable ``obj``, returned on every rank.  It runs synchronously; with
    ``async_op=True`` the result comes as a completed handle whose ``wait()`` returns it.
    An ``obj`` that does not pickle raises ValueError on every rank (the source tells the
    others instead of leaving them waiting)."""
    g = V.group(group)
    src = V.rank("src", src, g)
    if g.size == 1:
        return Work.completed(obj) if async_op else obj
    # Through the group's own gloo backend (not torch's broadcast_object_list, which needs a
    # group registered in torch's world: a reconfigured torchft group is not).
    payload, error = None, None
    if g.rank == src:
        try:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        except Exception as err:       # pickle raises TypeError, AttributeError, ...
            error = err
    size = torch.tensor([-1 if error is not None else 0 if payload is None else payload.numel()],
                        dtype=torch.int64)
    g._gloo.broadcast(size, src, False)
    if int(size[0]) < 0:
        raise ValueError(f"broadcast_object: obj on rank {src} cannot be pickled "
                         f"({type(error).__name__ if error else 'see that rank'}: {error or ''})"
                         ) from error
    if payload is None:
        payload = torch.empty(int(size[0]), dtype=torch.uint8)
    g._gloo.broadcast(payload, src, False)
    out = obj if g.rank == src else pickle.loads(payload.numpy().tobytes())
    return Work.completed(out) if async_op else out


# -- reduce --------------------------------------------------------------------------------
def reduce(send, recv, dst, op=ReduceOp.SUM, *, group=None, async_op=False):
    """Reduce every rank's ``send`` into ``recv`` on rank ``dst`` (``recv`` may be None
    elsewhere)."""
    g = V.group(group)
    dst = V.rank("dst", dst, g)
    if g.rank == dst or recv is not None:
        V.pair(send, recv, g)
    else:
        V.tensor("send", send, g)
    op = V.op(op, send.dtype)
    recv = _data(recv)
    if g.rank == dst:
        recv.copy_(send)
        buf = recv
    else:
        buf = _data(send).clone()
    return _reduce_inplace(buf, dst, op, g, async_op)


def reduce_inplace(tensor, dst, op=ReduceOp.SUM, *, group=None, async_op=False):
    """Reduce every rank's ``tensor`` into ``tensor`` on rank ``dst``."""
    g = V.group(group)
    V.tensor("tensor", tensor, g)
    dst = V.rank("dst", dst, g)
    op = V.op(op, tensor.dtype)
    return _reduce_inplace(_data(tensor), dst, op, g, async_op)


def _reduce_inplace(tensor, dst, op, g, async_op):
    traffic.record("reduce", _nbytes(tensor) * (g.size - 1) / g.size)
    return g.backend_for(tensor).reduce(tensor, dst, op, async_op)


def allreduce(send, recv, op=ReduceOp.SUM, *, group=None, async_op=False):
    """``recv`` = the reduction of every rank's ``send``."""
    g = V.group(group)
    V.pair(send, recv, g)
    op = V.op(op, send.dtype)
    recv = _data(recv)
    traffic.record("allreduce", 2 * _nbytes(send) * (g.size - 1) / g.size)
    return g.backend_for(send).allreduce(send, recv, op, async_op)


def allreduce_inplace(tensor, op=ReduceOp.SUM, *, group=None, async_op=False):
    """``tensor`` = the reduction of every rank's ``tensor``."""
    g = V.group(group)
    V.tensor("tensor", tensor, g)
    op = V.op(op, tensor.dtype)
    if tensor.requires_grad:
        tensor = tensor.detach()
    n = g.size
    traffic.record("allreduce", 2 * tensor.numel() * tensor.element_size() * (n - 1) / n)
    return g.backend_for(tensor).allreduce(tensor, tensor, op, async_op)



def allreduce_launcher(tensor, op=ReduceOp.SUM, *, group=None):
    """A callable that starts ``allreduce_inplace(tensor, op, group=group, async_op=True)``
    each time it is called (no argument) and returns its handle, for a buffer reduced again
    and again (a gradient bucket): the arguments are checked once, here.  On gloo, for a
    reduction gloo runs natively (not AVG, not 16-bit floats), a call costs no Python: it
    returns torch's own ``Work`` (``wait()``, ``is_completed()``)."""
    g = V.group(group)
    V.tensor("tensor", tensor, g)
    op = V.op(op, tensor.dtype)
    tensor = _data(tensor)
    n = g.size
    nbytes = 2 * tensor.numel() * tensor.element_size() * (n - 1) / n
    fast = g.backend_for(tensor).allreduce_launcher(tensor, op, nbytes)
    if fast is not None:
        return fast
    return functools.partial(allreduce_inplace, tensor, op, group=g, async_op=True)

# -- gather / scatter ----------------------------------------------------------------------
def allgather(send, recv, *, group=None, async_op=False):
    """``recv`` = every rank's ``send`` concatenated in rank order."""
    g = V.group(group)
    V.pair(send, recv, g, ratio_send=g.size)
    recv = _data(recv)
    traffic.record("allgather", _nbytes(send) * (g.size - 1))
    return g.backend_for(send).allgather(send, recv, async_op)


def allgather_inplace(tensor, *, group=None, async_op=False):
    """Each rank contributes its own ``numel / size`` slice of ``tensor``; all get all."""
    g = V.group(group)
    V.tensor("tensor", tensor, g)
    V.divisible("tensor", tensor, g)
    tensor = _data(tensor).view(-1)   # parts are counted in elements, whatever the shape
    mine = tensor.chunk(g.size)[g.rank].clone()
    return allgather(mine, tensor, group=g, async_op=async_op)


def gather(send, recv, dst, *, group=None, async_op=False):
    """Rank ``dst``'s ``recv`` = every rank's ``send`` in rank order (``recv`` may be None
    elsewhere)."""
    g = V.group(group)
    dst = V.rank("dst", dst, g)
    if g.rank == dst or recv is not None:  # every rank checks what it was given
        V.pair(send, recv, g, ratio_send=g.size)
    else:
        V.tensor("send", send, g)
    recv = _data(recv)
    if g.rank != dst:
        traffic.record("gather", _nbytes(send))
    return g.backend_for(send).gather(send, recv, dst, async_op)


def gather_inplace(tensor, count, dst, *, group=None, async_op=False):
    """Rank ``dst`` gathers every rank's ``tensor[rank * count:(rank + 1) * count]`` into
    ``tensor[:size * count]``."""
    g = V.group(group)
    V.tensor("tensor", tensor, g)
    count = V.count(tensor, count, g)
    tensor = _data(tensor).view(-1)   # ``count`` is in elements, whatever the shape
    send_ = tensor[g.rank * count:(g.rank + 1) * count].clone()
    return gather(send_, tensor[:count * g.size], dst, group=g, async_op=async_op)


def scatter(send, recv, src, *, group=None, async_op=False):
    """Rank ``src``'s ``send`` split in ``size`` parts; rank ``i`` gets part ``i`` in
    ``recv`` (``send`` may be None on other ranks)."""
    g = V.group(group)
    src = V.rank("src", src, g)
    if g.rank == src or send is not None:  # every rank checks what it was given
        V.pair(send, recv, g, ratio_recv=g.size)
    else:
        V.tensor("recv", recv, g)
    recv = _data(recv)
    if g.rank == src:
        traffic.record("scatter", _nbytes(send) * (g.size - 1) / g.size)
    return g.backend_for(recv).scatter(send, recv, src, async_op)


def scatter_inplace(tensor, count, src, *, group=None, async_op=False):
    """Rank ``i`` receives ``tensor[i * count:(i + 1) * count]`` of rank ``src``, in place."""
    g = V.group(group)
    V.tensor("tensor", tensor, g)
    count = V.count(tensor, count, g)
    tensor = _data(tensor).view(-1)   # ``count`` is in elements, whatever the shape
    out = tensor[g.rank * count:(g.rank + 1) * count]
    send_ = tensor[:count * g.size].clone() if g.rank == src else None
    return scatter(send_, out, src, group=g, async_op=async_op)


# -- reduce_scatter / alltoall -------------------------------------------------------------
def reduce_scatter(send, recv, op=ReduceOp.SUM, *, group=None, async_op=False):
    """``recv`` on rank ``i`` = the reduction of part ``i`` of every rank's ``send``."""
    g = V.group(group)
    V.pair(send, recv, g, ratio_recv=g.size)
    op = V.op(op, send.dtype)
    recv = _data(recv)
    traffic.record("reduce_scatter", _nbytes(send) * (g.size - 1) / g.size)
    return g.backend_for(send).reduce_scatter(send, recv, op, async_op)


def reduce_scatter_inplace(tensor, op=ReduceOp.SUM, *, group=None, async_op=False):
    """Rank ``i``'s part ``i`` of ``tensor`` becomes the reduction of every rank's part."""
    g = V.group(group)
    V.tensor("tensor", tensor, g)
    V.divisible("tensor", tensor, g)
    tensor = _data(tensor).view(-1)   # parts are counted in elements, whatever the shape
    out = tensor.chunk(g.size)[g.rank]
    return reduce_scatter(tensor.clone(), out, op, group=g, async_op=async_op)


def alltoall(send, recv, *, group=None, async_op=False):
    """Part ``j`` of rank ``i``'s ``send`` becomes part ``i`` of rank ``j``'s ``recv``."""
    g = V.group(group)
    V.pair(send, recv, g)
    V.divisible("send", send, g)
    recv = _data(recv)
    traffic.record("alltoall", _nbytes(send) * (g.size - 1) / g.size)
    return g.backend_for(send).alltoall(send, recv, async_op)


def alltoall_inplace(tensor, *, group=None, async_op=False):
    """:func:`alltoall` with ``tensor`` as both send and recv."""
    g = V.group(group)
    V.tensor("tensor", tensor, g)
    V.divisible("tensor", tensor, g)
    tensor = _data(tensor)
    return alltoall(tensor.clone(), tensor, group=g, async_op=async_op)


def alltoall_v(send, send_counts, send_displs, recv, recv_counts, recv_displs, *, group=None,
               async_op=False):
    """Rank ``i`` sends ``send[send_displs[j]:][:send_counts[j]]`` to rank ``j``, which
    receives it at ``recv[recv_displs[i]:][:recv_counts[i]]``."""
    g = V.group(group)
    V.tensor("send", send, g)
    V.tensor("recv", recv, g)
    if send.dtype != recv.dtype:
        raise ValueError(f"send and recv must have the same dtype, got {send.dtype} and {recv.dtype}")
    if send.device != recv.device:
        raise ValueError(f"send and recv must be on the same device, got {send.device} and "
                         f"{recv.device}")
    send_counts, send_displs = V.counts_displs("send", send_counts, send_displs, send, g)
    recv_counts, recv_displs = V.counts_displs("recv", recv_counts, recv_displs, recv, g)
    V.self_count(send_counts, recv_counts, g)
    send, recv = send.view(-1), _data(recv).view(-1)   # counts and displacements in elements
    traffic.record("alltoall_v", (sum(send_counts) - send_counts[g.rank]) * send.element_size())
    return g.backend_for(send).alltoall_v(send, send_counts, send_displs, recv, recv_counts,
                                               recv_displs, async_op)


def barrier(*, group=None, async_op=False):
    """Returns once every rank of the group has called it."""
    g = V.group(group)
    return g._gloo.barrier(async_op)
