"""Communication primitives (DESIGN.md section 4) on the gloo backend.

Every primitive validates its arguments before communicating, records the bytes it sends
(:mod:`bagua_comm.traffic`) and returns a :class:`~bagua_comm.work.Work` when
``async_op=True``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import traffic
from .ops import ReduceOp, to_torch
from .process_group import ProcessGroup, get_default_group
from .work import finish


def _group(group) -> ProcessGroup:
    g = get_default_group() if group is None else group
    if not isinstance(g, ProcessGroup):
        raise ValueError(f"group must be a bagua_comm.ProcessGroup or None, got {type(g).__name__}")
    if not g.is_member():
        raise ValueError(f"this rank is not a member of group {g.ranks}")
    return g


def _check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")
    if t.device.type != "cpu":
        raise ValueError(f"{name} is on {t.device}, but the gloo backend needs CPU tensors")


def _check_pair(send, recv, *, ratio_recv=1, ratio_send=1) -> None:
    _check_tensor("send", send)
    _check_tensor("recv", recv)
    if send.dtype != recv.dtype:
        raise ValueError(f"send and recv must have the same dtype, got {send.dtype} and {recv.dtype}")
    if send.numel() * ratio_send != recv.numel() * ratio_recv:
        raise ValueError(
            f"size mismatch: recv.numel() ({recv.numel()}) must be "
            f"{ratio_send}/{ratio_recv} x send.numel() ({send.numel()})")


def _check_rank(name: str, r: int, g: ProcessGroup) -> None:
    if not isinstance(r, int) or not 0 <= r < g.size:
        raise ValueError(f"{name} must be a rank in [0, {g.size}) of the group, got {r!r}")


def _avg(tensor, g, op):
    if ReduceOp(op) is ReduceOp.AVG:
        if not tensor.is_floating_point():
            raise ValueError(f"ReduceOp.AVG needs a floating-point tensor, got {tensor.dtype}")
        return lambda: tensor.div_(g.size)
    return None


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


# -- point to point ------------------------------------------------------------------------
def send(tensor, dst, *, group=None, async_op=False):
    g = _group(group)
    _check_tensor("tensor", tensor)
    _check_rank("dst", dst, g)
    traffic.record("send", _nbytes(tensor))
    return finish([dist.isend(tensor, group=g.torch_group, group_dst=dst)], async_op=async_op)


def recv(tensor, src, *, group=None, async_op=False):
    g = _group(group)
    _check_tensor("tensor", tensor)
    _check_rank("src", src, g)
    return finish([dist.irecv(tensor, group=g.torch_group, group_src=src)], async_op=async_op)


# -- broadcast -----------------------------------------------------------------------------
def broadcast(tensor, src=0, *, group=None, async_op=False):
    g = _group(group)
    _check_tensor("tensor", tensor)
    _check_rank("src", src, g)
    if g.rank == src:
        traffic.record("broadcast", _nbytes(tensor))
    h = dist.broadcast(tensor, group=g.torch_group, group_src=src, async_op=True)
    return finish([h], async_op=async_op)


def broadcast_object(obj, src=0, *, group=None, async_op=False):
    g = _group(group)
    _check_rank("src", src, g)
    box = [obj if g.rank == src else None]
    dist.broadcast_object_list(box, group=g.torch_group, group_src=src)
    return box[0]


# -- reduce --------------------------------------------------------------------------------
def reduce(send, recv, dst, op=ReduceOp.SUM, *, group=None, async_op=False):
    g = _group(group)
    _check_pair(send, recv)
    _check_rank("dst", dst, g)
    if g.rank == dst:
        recv.copy_(send)
        buf = recv
    else:
        buf = send.clone()
    return reduce_inplace(buf, dst, op, group=g, async_op=async_op)


def reduce_inplace(tensor, dst, op=ReduceOp.SUM, *, group=None, async_op=False):
    g = _group(group)
    _check_tensor("tensor", tensor)
    _check_rank("dst", dst, g)
    then = _avg(tensor, g, op)  # validates AVG on every rank; only dst divides
    then = then if g.rank == dst else None
    traffic.record("reduce", _nbytes(tensor) * (g.size - 1) / g.size)
    h = dist.reduce(tensor, op=to_torch(op), group=g.torch_group, group_dst=dst, async_op=True)
    return finish([h], then, async_op)


def allreduce(send, recv, op=ReduceOp.SUM, *, group=None, async_op=False):
    _check_pair(send, recv)
    recv.copy_(send)
    return allreduce_inplace(recv, op, group=group, async_op=async_op)


def allreduce_inplace(tensor, op=ReduceOp.SUM, *, group=None, async_op=False):
    g = _group(group)
    _check_tensor("tensor", tensor)
    then = _avg(tensor, g, op)
    traffic.record("allreduce", 2 * _nbytes(tensor) * (g.size - 1) / g.size)
    h = dist.all_reduce(tensor, op=to_torch(op), group=g.torch_group, async_op=True)
    return finish([h], then, async_op)


# -- gather / scatter ----------------------------------------------------------------------
def allgather(send, recv, *, group=None, async_op=False):
    g = _group(group)
    _check_pair(send, recv, ratio_send=g.size)
    traffic.record("allgather", _nbytes(send) * (g.size - 1))
    h = dist.all_gather(list(recv.chunk(g.size)), send, group=g.torch_group, async_op=True)
    return finish([h], async_op=async_op)


def allgather_inplace(tensor, *, group=None, async_op=False):
    g = _group(group)
    _check_tensor("tensor", tensor)
    _check_divisible("tensor", tensor, g)
    mine = tensor.chunk(g.size)[g.rank].clone()
    return allgather(mine, tensor, group=g, async_op=async_op)


def gather(send, recv, dst, *, group=None, async_op=False):
    g = _group(group)
    _check_rank("dst", dst, g)
    if g.rank == dst:
        _check_pair(send, recv, ratio_send=g.size)
        chunks = list(recv.chunk(g.size))
    else:
        _check_tensor("send", send)
        chunks = None
        traffic.record("gather", _nbytes(send))
    h = dist.gather(send, chunks, group=g.torch_group, group_dst=dst, async_op=True)
    return finish([h], async_op=async_op)


def gather_inplace(tensor, count, dst, *, group=None, async_op=False):
    g = _group(group)
    _check_tensor("tensor", tensor)
    _check_count(tensor, count, g)
    send_ = tensor[g.rank * count:(g.rank + 1) * count].clone()
    recv_ = tensor[:count * g.size]
    return gather(send_, recv_, dst, group=g, async_op=async_op)


def scatter(send, recv, src, *, group=None, async_op=False):
    g = _group(group)
    _check_rank("src", src, g)
    if g.rank == src:
        _check_pair(send, recv, ratio_recv=g.size)
        chunks = list(send.chunk(g.size))
        traffic.record("scatter", _nbytes(send) * (g.size - 1) / g.size)
    else:
        _check_tensor("recv", recv)
        chunks = None
    h = dist.scatter(recv, chunks, group=g.torch_group, group_src=src, async_op=True)
    return finish([h], async_op=async_op)


def scatter_inplace(tensor, count, src, *, group=None, async_op=False):
    g = _group(group)
    _check_tensor("tensor", tensor)
    _check_count(tensor, count, g)
    out = tensor[g.rank * count:(g.rank + 1) * count]
    send_ = tensor[:count * g.size].clone() if g.rank == src else tensor[:count * g.size]
    return scatter(send_, out, src, group=g, async_op=async_op)


# -- reduce_scatter / alltoall -------------------------------------------------------------
def reduce_scatter(send, recv, op=ReduceOp.SUM, *, group=None, async_op=False):
    """Each rank gets the reduction of its own chunk: an alltoall then a local reduction."""
    g = _group(group)
    _check_pair(send, recv, ratio_recv=g.size)
    staged = torch.empty_like(send)
    traffic.record("reduce_scatter", _nbytes(send) * (g.size - 1) / g.size)
    h = dist.all_to_all_single(staged, send, group=g.torch_group, async_op=True)

    def then():
        parts = staged.view(g.size, -1)
        op_ = ReduceOp(op)
        if op_ in (ReduceOp.SUM, ReduceOp.AVG):
            torch.sum(parts, dim=0, out=recv.view(-1)) if parts.is_floating_point() else \
                recv.view(-1).copy_(parts.sum(dim=0))
            if op_ is ReduceOp.AVG:
                recv.div_(g.size)
        elif op_ is ReduceOp.PRODUCT:
            recv.view(-1).copy_(parts.prod(dim=0))
        elif op_ is ReduceOp.MIN:
            recv.view(-1).copy_(parts.amin(dim=0))
        elif op_ is ReduceOp.MAX:
            recv.view(-1).copy_(parts.amax(dim=0))
        else:
            fn = {ReduceOp.BAND: torch.bitwise_and, ReduceOp.BOR: torch.bitwise_or,
                  ReduceOp.BXOR: torch.bitwise_xor}[op_]
            acc = parts[0].clone()
            for p in parts[1:]:
                acc = fn(acc, p)
            recv.view(-1).copy_(acc)

    if ReduceOp(op) is ReduceOp.AVG and not send.is_floating_point():
        raise ValueError(f"ReduceOp.AVG needs a floating-point tensor, got {send.dtype}")
    return finish([h], then, async_op)


def reduce_scatter_inplace(tensor, op=ReduceOp.SUM, *, group=None, async_op=False):
    g = _group(group)
    _check_tensor("tensor", tensor)
    _check_divisible("tensor", tensor, g)
    send_ = tensor.clone()
    out = tensor.chunk(g.size)[g.rank]
    return reduce_scatter(send_, out, op, group=g, async_op=async_op)


def alltoall(send, recv, *, group=None, async_op=False):
    g = _group(group)
    _check_pair(send, recv)
    _check_divisible("send", send, g)
    traffic.record("alltoall", _nbytes(send) * (g.size - 1) / g.size)
    h = dist.all_to_all_single(recv, send, group=g.torch_group, async_op=True)
    return finish([h], async_op=async_op)


def alltoall_inplace(tensor, *, group=None, async_op=False):
    return alltoall(tensor.clone(), tensor, group=group, async_op=async_op)


def alltoall_v(send, send_counts, send_displs, recv, recv_counts, recv_displs, *, group=None,
               async_op=False):
    g = _group(group)
    _check_tensor("send", send)
    _check_tensor("recv", recv)
    if send.dtype != recv.dtype:
        raise ValueError(f"send and recv must have the same dtype, got {send.dtype} and {recv.dtype}")
    for name, seq, buf in (("send", (send_counts, send_displs), send),
                           ("recv", (recv_counts, recv_displs), recv)):
        counts, displs = (list(map(int, s)) for s in seq)
        if len(counts) != g.size or len(displs) != g.size:
            raise ValueError(f"{name}_counts and {name}_displs need one entry per rank ({g.size})")
        for c, d in zip(counts, displs):
            if c < 0 or d < 0 or d + c > buf.numel():
                raise ValueError(f"{name}_counts/{name}_displs reach outside {name} "
                                 f"(numel {buf.numel()}): count {c} at offset {d}")
    send_counts, send_displs = list(map(int, send_counts)), list(map(int, send_displs))
    recv_counts, recv_displs = list(map(int, recv_counts)), list(map(int, recv_displs))
    packed_send = torch.cat([send[d:d + c] for c, d in zip(send_counts, send_displs)])
    packed_recv = torch.empty(sum(recv_counts), dtype=recv.dtype)
    traffic.record("alltoall_v", (sum(send_counts) - send_counts[g.rank]) * send.element_size())
    h = dist.all_to_all_single(packed_recv, packed_send, recv_counts, send_counts,
                               group=g.torch_group, async_op=True)

    def then():
        off = 0
        for c, d in zip(recv_counts, recv_displs):
            recv[d:d + c].copy_(packed_recv[off:off + c])
            off += c

    return finish([h], then, async_op)


def barrier(*, group=None, async_op=False):
    g = _group(group)
    return finish([dist.barrier(group=g.torch_group, async_op=True)], async_op=async_op)


def _check_divisible(name, tensor, g):
    if tensor.numel() % g.size:
        raise ValueError(f"{name}.numel() ({tensor.numel()}) must be divisible by the group "
                         f"size ({g.size})")


def _check_count(tensor, count, g):
    if not isinstance(count, int) or count < 0 or count * g.size > tensor.numel():
        raise ValueError(f"count must be an int with count * group size ({g.size}) <= "
                         f"tensor.numel() ({tensor.numel()}), got {count!r}")
