"""Reduction operators."""

from __future__ import annotations

import enum

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


def to_torch(op: ReduceOp):
    """torch.distributed's op; AVG maps to SUM (the caller divides afterwards)."""
    op = ReduceOp(op)
    return dist.ReduceOp.SUM if op is ReduceOp.AVG else _TORCH[op]


def reduce_rows(rows, op: ReduceOp):
    """Reduce a (ranks, n) float tensor over its first dimension (SUM, AVG, MIN or MAX)."""
    op = ReduceOp(op)
    if op is ReduceOp.MIN:
        return rows.amin(0)
    if op is ReduceOp.MAX:
        return rows.amax(0)
    out = rows.sum(0)
    return out.div_(rows.shape[0]) if op is ReduceOp.AVG else out
