"""LowRank's compiled exchange (``_hot.LowRankRound``): its buffers, views and launcher, made
once per layout, so that a steady-state step runs each bucket's two allreduces and the
products around them as one job on the group's worker thread, with no Python frame.

Taken where the Python path (``LowRankImpl.exchange``) runs without compressor, with warm
start, flat, float32, on gloo CPU; every rank decides the same way (from the configuration
and the layout).  The job runs that path's torch operations in its order on the same
values, so the result is bit for bit that path's.  ``Q`` and the residuals stay in
``LowRankImpl.q`` and ``.residuals`` (keyed by parameter name), updated in place.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._engine import _hot
from ._shared import initial_q


def eligible(impl, buckets) -> bool:
    """Whether ``impl`` (a LowRankImpl) runs the compiled exchange for ``buckets``."""
    algo = impl.algo
    if algo.compressor is not None or not algo.warm_start or impl.group.size < 2 \
            or not buckets:
        return False
    for b in buckets:
        if b.dtype != torch.float32 or b.device.type != "cpu":
            return False
    be = impl.group.backend_for(buckets[0].grad)
    return getattr(be, "name", None) == "gloo" and getattr(be, "aux", None) is not None


def _state(impl, s, dev, q_into, res_into):
    """Slot ``s``'s Q (the kept one, else the first draw) and residual copied into
    ``q_into`` and ``res_into`` (views of the job's flat buffers), which become the tensors
    ``impl`` keeps, updated in place from now on."""
    q = impl.q.get(s.name)
    if q is None or q.shape != (s.m, s.r):
        q = initial_q(s.name, s.m, s.r, impl.algo.seed, 0, dev)
    q_into.copy_(q)
    impl.q[s.name] = q_into
    res = impl.residuals.get(s.name)
    if res is None or res.shape != (s.n, s.m):
        res_into.zero_()
    else:
        res_into.copy_(res)
    impl.residuals[s.name] = res_into


def _job(impl, bucket, plan, allreduce, opts):
    matrices, plain = plan
    tensor, dev = bucket.grad_and_flags, bucket.device

    def buf(numel):
        return torch.empty(numel, dtype=torch.float32, device=dev)

    plain_numel = sum(k for _, k in plain)
    first = buf(plain_numel + sum(s.n * s.r for s in matrices))
    second = buf(sum(s.m * s.r for s in matrices))
    big = sum(s.n * s.m for s in matrices)
    res_flat, m_flat, q_flat = buf(big), buf(big), buf(second.numel())
    take, pairs, pos = None, [], 0
    if len(plain) > 2:      # one take and one put_ instead of a copy each way per run
        take = _positions([(off, k) for off, k in plain], dev)
    for off, k in plain:
        pairs.append((tensor[off:off + k], first[pos:pos + k]))
        pos += k
    gather = gbuf = approx = None
    if len(matrices) > 2:   # M = residual + G and M -= M̂ once over all the matrices
        gather = _positions([(s.offset, s.n * s.m) for s in matrices], dev)
        gbuf, approx = buf(big), buf(big)
    mats, at, at_q = [], 0, 0
    for s in matrices:
        q = q_flat[at_q:at_q + s.m * s.r].view(s.m, s.r)
        res = res_flat[at:at + s.n * s.m].view(s.n, s.m)
        _state(impl, s, dev, q, res)
        m = m_flat[at:at + s.n * s.m].view(s.n, s.m)
        p = first[pos:pos + s.n * s.r].view(s.n, s.r)
        q_new = second[at_q:at_q + s.m * s.r].view(s.m, s.r)
        grad = tensor[s.offset:s.offset + s.n * s.m].view(s.n, s.m)
        out = grad if approx is None else approx[at:at + s.n * s.m].view(s.n, s.m)
        qr = ((None, None) if s.r == 1
              else (buf(s.n * s.r).view(s.n, s.r), buf(s.r * s.r).view(s.r, s.r)))
        mats.append((m, res, grad, p, m.t(), q, q_new, q_new.t(), out, *qr))
        pos += s.n * s.r
        at += s.n * s.m
        at_q += s.m * s.r
    return _hot.LowRankRound(tensor, first, second, take, first[:plain_numel], pairs, mats,
                             res_flat, m_flat, q_flat, gather, gbuf, approx, allreduce, opts,
                             impl.group.size, impl.algo.average)


def _positions(runs, dev) -> torch.Tensor:
    """The indices of the ``(offset, numel)`` runs, in order (int64)."""
    return torch.cat([torch.arange(off, off + k, dtype=torch.int64) for off, k in runs]).to(dev)


def launchers(impl, buckets) -> list:
    """Per bucket, the compiled launcher of its exchange (``_hot.WorkerLauncher``)."""
    be = impl.group.backend_for(buckets[0].grad)
    worker = be.worker()
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM          # AVG: the sum, divided (as bagua_comm's gloo)
    out = []
    n = impl.group.size
    for b, plan in zip(buckets, impl.plans):
        job = _job(impl, b, plan, be.aux.allreduce, opts)
        matrices, plain = plan
        sizes = [4 * (sum(k for _, k in plain) + sum(s.n * s.r for s in matrices))]
        if matrices:
            sizes.append(4 * sum(s.m * s.r for s in matrices))
        nbytes = sum(int(2 * b * (n - 1) / n) for b in sizes)    # as bagua_comm records
        out.append(_hot.WorkerLauncher(worker, job, nbytes, "allreduce"))
    return out
