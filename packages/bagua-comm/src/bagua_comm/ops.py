"""Reduction operators."""

from __future__ import annotations

import enum

import torch
import torch.distributed as dist


class ReduceOp(enum.IntEnum):
    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    BAND = 4
    BOR = 5
    BXOR = 6
    AVG = 10


_TORCH = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.BAND: dist.ReduceOp.BAND,
    ReduceOp.BOR: dist.ReduceOp.BOR,
    ReduceOp.BXOR: dist.ReduceOp.BXOR,
}


def as_op(o) -> ReduceOp:
    """``o`` as a :class:`ReduceOp`: one of its members, or torch.distributed's op of the same
    name (``dist.ReduceOp.AVG``); ``ValueError`` for anything else.  Plain numbers, bools and
    torch's ops are not read as enum values (torch numbers them differently: its AVG is our
    PRODUCT's 1), which once reduced with another operator than asked."""
    if isinstance(o, ReduceOp):
        return o
    name = getattr(o, "name", None)
    if isinstance(o, (dist.ReduceOp, dist.ReduceOp.RedOpType)) and name in ReduceOp.__members__:
        return ReduceOp[name]
    raise ValueError(f"op must be a bagua_comm.ReduceOp (SUM PRODUCT MIN MAX AVG BAND BOR BXOR) "
                     f"or torch.distributed.ReduceOp of those names, got {o!r}")


def to_torch(op: ReduceOp):
    """torch.distributed's op; AVG maps to SUM (the caller divides afterwards)."""
    op = ReduceOp(op)
    return dist.ReduceOp.SUM if op is ReduceOp.AVG else _TORCH[op]


_BITWISE = {ReduceOp.BAND: torch.bitwise_and, ReduceOp.BOR: torch.bitwise_or,
            ReduceOp.BXOR: torch.bitwise_xor}


def reduce_rows(rows, op: ReduceOp, out=None):
    """Reduce a (ranks, n) tensor over its first dimension (rows in rank order), into
    ``out`` (n elements, reused by the caller) when given."""
    op = ReduceOp(op)
    if op is ReduceOp.MIN:
        return torch.amin(rows, 0, out=out)
    if op is ReduceOp.MAX:
        return torch.amax(rows, 0, out=out)
    if op is ReduceOp.PRODUCT:
        return torch.prod(rows, 0, dtype=rows.dtype, out=out)
    if op in _BITWISE:
        fn = _BITWISE[op]
        acc = rows[0].clone() if out is None else out.copy_(rows[0])
        for row in rows[1:]:
            fn(acc, row, out=acc)
        return acc
    out = torch.sum(rows, 0, out=out)
    return out.div_(rows.shape[0]) if op is ReduceOp.AVG else out
