"""LowRank: PowerSGD-style rank-r compression of each weight matrix's gradient, with error
feedback and warm start; its state is keyed by parameter name."""

from __future__ import annotations

import torch

import bagua_comm as bc

from .._engine.checks import check_bool, check_int_at_least, check_number
from .._engine.comm import Reducer
from .._engine.overflow import Scratch
from ..algorithm import Algorithm, AlgorithmImpl
from ._shared import check_chunks, check_compressor, check_no_error_feedback, initial_q


class LowRank(Algorithm, name="low_rank"):
    """Low-rank gradient compression (PowerSGD, Vogels et al. 2019) per weight matrix.

    Each gradient of two or more dimensions is viewed as an ``n x m`` matrix ``M`` (conv
    weights: ``out_channels x rest``) plus this rank's error-feedback residual.  With ``Q``
    (``m x r``, the same on every rank): ``P = M Q``; allreduce ``P``; orthogonalise ``P``;
    ``Q = Mᵀ P``; allreduce ``Q``; the gradient becomes ``M̂ = P Qᵀ`` and ``M - M̂`` is kept for
    the next step.  A matrix is compressed when ``n m >= min_compression_rate * r (n + m)``
    (``r = min(rank, n, m)``); vectors, biases and matrices where rank ``r`` saves too little
    travel uncompressed in the first allreduce.  ``warm_start=True`` reuses last step's ``Q``
    (one power iteration per step, accumulating over steps); ``False`` draws a fresh one
    from ``seed`` each step.  ``start_step`` (torch's ``start_powerSGD_iter``): the first
    ``start_step`` steps send the plain average, uncompressed; early steps are the most
    sensitive to a rank-``r`` gradient (with Adam, 2 such steps decide most of the loss gap
    to torch's hook, which defaults to 1000 of them).

    Every rank computes ``M̂`` from the same allreduced ``P`` and ``Q``, so ranks stay
    bit-identical.  Both allreduces of a bucket run one after the other on a background
    thread while backward continues.  ``Q`` factors (shared) and residuals (per rank) are
    checkpointed by parameter name; a resume at another world size keeps ``Q`` and starts
    the residuals at zero.

    ``compressor`` (a :class:`bagua_comm.compression.Compressor` without error feedback of
    its own, e.g. ``MinMaxUInt8(chunks)`` with ``chunks`` a multiple of the world size):
    ``P`` and ``Q`` travel through ``compressed_allreduce`` instead of a float32 allreduce,
    and the warm-started ``Q`` is orthonormalised before ``P = M Q`` so that ``P``'s columns
    share one scale for the quantiser.  The residual ``M - M̂`` is taken with the decoded
    factors, so it keeps the quantisation error too.  The uncompressed tensors (vectors,
    biases, small matrices) then go in an exact allreduce of their own.
    """

    dense_gradients = True

    def __init__(self, rank: int = 2, warm_start: bool = True,
                 min_compression_rate: float = 2.0, average: bool = True, seed: int = 0,
                 start_step: int = 0, compressor=None):
        check_int_at_least("rank", rank, 1)
        check_bool("warm_start", warm_start)
        check_bool("average", average)
        check_number("min_compression_rate", min_compression_rate, ">= 0 (compress a matrix "
                     "only where it shrinks at least this much)", lambda v: v >= 0, finite=True)
        check_int_at_least("seed", seed, 0)
        check_int_at_least("start_step", start_step, 0)
        check_compressor(compressor)
        check_no_error_feedback(compressor, "LowRank", "its residual M - P Qᵀ")
        self.rank = rank
        self.warm_start = warm_start
        self.min_compression_rate = float(min_compression_rate)
        self.average = average
        self.seed = seed
        self.start_step = start_step
        self.compressor = compressor

    def reify(self, group):
        if self.compressor is not None:     # every rank, before any communication
            check_chunks(self.compressor, group.size, "LowRank(compressor=)")
        return LowRankImpl(group, self)


def matrix_shape(p: torch.Tensor) -> tuple[int, int] | None:
    """``(n, m)`` of the matrix a parameter's gradient is viewed as (None: a vector)."""
    if p.dim() < 2 or p.numel() == 0:       # vectors, and zero-size tensors: nothing to factor
        return None
    return p.shape[0], p.numel() // p.shape[0]


def orthogonalize(p: torch.Tensor) -> None:
    """Orthonormalise ``p``'s columns in place: Householder QR (stable where P is
    ill-conditioned, as it is near full rank); one column is just normalised (a zero
    column stays zero).  Deterministic, so identical input gives identical output on every
    rank."""
    if p.shape[1] == 1:
        norm = torch.linalg.vector_norm(p)
        p.mul_(torch.where(norm > 0, 1 / norm, torch.zeros_like(norm)))
    else:
        p.copy_(torch.linalg.qr(p).Q)


class _Slot:
    __slots__ = ("m", "n", "name", "offset", "r")

    def __init__(self, name, offset, n, m, r):
        self.name, self.offset, self.n, self.m, self.r = name, offset, n, m, r


class LowRankImpl(AlgorithmImpl):
    # every rank decodes the same exchanged data: identical models after each step, so
    # broadcast_buffers=True starts each training step from rank 0's buffers (as DDP)
    synchronous = True

    def __init__(self, group, algo: LowRank):
        super().__init__(group)
        self.algo = algo
        self.op = bc.ReduceOp.AVG if algo.average else bc.ReduceOp.SUM
        self.reducer = Reducer(group, False, "bagua-low-rank")
        self.plans: list[tuple[list[_Slot], list[tuple[int, int]]]] = []
        self.q: dict[str, torch.Tensor] = {}           # shared by every rank
        self.residuals: dict[str, torch.Tensor] = {}   # this rank's
        self.rounds = 0                                # synchronised steps so far
        self.device = torch.device("cpu")
        self.scratch = Scratch()        # the next residuals (a skipped step drops them)
        self.buckets: list = []
        # (buckets, plans, q, residuals, compiled launchers or None), made once per layout
        self._compiled: tuple | None = None
        self._compiled_plan: tuple | None = None

    def init_operations(self, ctx, buckets):
        self.buckets = buckets
        self.plans = [self.plan(b) for b in buckets]
        self.scratch.clear()
        self.device = buckets[0].device if buckets else torch.device("cpu")

    def plan(self, bucket):
        """The bucket's compressed matrices and its uncompressed ``(offset, numel)`` runs
        (on the last bucket, the module's "got a gradient" flags after the gradients: they
        ride in the first, exact allreduce)."""
        matrices, plain = [], []
        for name, p, off in zip(bucket.names, bucket.params, bucket.offsets):
            shape = matrix_shape(p)
            if shape is not None:
                n, m = shape
                r = min(self.algo.rank, n, m)
                if n * m >= self.algo.min_compression_rate * r * (n + m):
                    matrices.append(_Slot(name, off, n, m, r))
                    continue
            plain.append((off, p.numel()))
        if bucket.flags is not None:
            plain.append((bucket.padded_numel, bucket.flags.numel()))
        return matrices, plain

    def carries_unused_flags(self, ctx):
        # the first allreduce (exact, elementwise) holds the flags: no collective of their own
        return True

    def _launchers(self) -> list | None:
        """This layout's compiled exchanges (``_low_rank_round``), or None where the Python
        path runs (the same answer on every rank: it depends on the configuration only).
        Remade when the layout or the state's tensors change (a load)."""
        from . import _low_rank_round

        key = (self.buckets, self.plans, self.q, self.residuals)
        cached = self._compiled
        if cached is None or any(a is not b for a, b in zip(cached, key)):
            got = (_low_rank_round.launchers(self, self.buckets)
                   if _low_rank_round.eligible(self, self.buckets) else None)
            cached = self._compiled = (*key, got)
        return cached[-1]

    def bucket_launchers(self, ctx, buckets):
        compiled = (self._launchers() if self.rounds >= self.algo.start_step
                    and self.group.size > 1 else None)
        if compiled is None or buckets is not self.buckets:
            return super().bucket_launchers(ctx, buckets)
        out = self._compiled_plan
        if out is None or out[0] is not compiled:
            out = self._compiled_plan = (compiled, [(None, c) for c in compiled])
        return out[1]

    def bucket_ready_hook(self, ctx, bucket):
        if self.group.size == 1:
            return None
        tensor, plan = bucket.grad_and_flags, self.plans[bucket.index]
        if self.rounds >= self.algo.start_step:     # a joined rank's start too: the same path
            compiled = self._launchers()
            if compiled is not None:
                return compiled[bucket.index]()
        if self.rounds < self.algo.start_step:      # warm-up: the exact average
            return self.reducer.exchange(
                lambda: bc.allreduce_inplace(tensor, self.op, group=self.group))
        return self.reducer.exchange(lambda: self.exchange(tensor, plan, bucket.name))

    def _factor(self, s: _Slot, device) -> torch.Tensor:
        q = self.q.get(s.name)
        if q is None or not self.algo.warm_start or q.shape != (s.m, s.r):
            draw = 0 if self.algo.warm_start else self.rounds
            q = initial_q(s.name, s.m, s.r, self.algo.seed, draw, device)
        return q

    def _allreduce_factors(self, t: torch.Tensor, key: str) -> None:
        if self.algo.compressor is None:
            bc.allreduce_inplace(t, self.op, group=self.group)
        elif t.numel():
            bc.compressed_allreduce(t, t, self.op, self.algo.compressor, key=key,
                                    group=self.group)

    def exchange(self, tensor: torch.Tensor, plan, key: str = "low-rank") -> None:
        """Blocking: ``tensor`` <- its low-rank average (matrices) and exact average (rest)."""
        matrices, plain = plan
        quantised = self.algo.compressor is not None
        dev, g = tensor.device, self.group
        plain_numel = sum(k for _, k in plain)
        p_numel = plain_numel + sum(s.n * s.r for s in matrices)
        first = torch.empty(p_numel, dtype=torch.float32, device=dev)
        pos = 0
        for off, k in plain:
            first[pos:pos + k].copy_(tensor[off:off + k])
            pos += k
        ms, ps, qs, prevs = [], [], [], []
        scratch = self.scratch.get("m", sum(s.n * s.m for s in matrices), dev)
        at = 0
        for s in matrices:
            res = self.residuals.get(s.name)
            if res is None or res.shape != (s.n, s.m):
                res = torch.zeros(s.n, s.m, dtype=torch.float32, device=dev)
                self.residuals[s.name] = res
            # M, in scratch: the next residual, kept unless GradScaler skips the step
            m = torch.add(res, tensor[s.offset:s.offset + s.n * s.m].view(s.n, s.m),
                          out=scratch[at:at + s.n * s.m].view(s.n, s.m))
            at += s.n * s.m
            p = first[pos:pos + s.n * s.r].view(s.n, s.r)
            q = self._factor(s, dev)
            prevs.append(q)               # Q kept when this step's result is not finite
            if quantised:       # P's columns on one scale (the basis does not change M̂)
                q = q.clone()
                orthogonalize(q)
            torch.matmul(m, q, out=p)
            pos += s.n * s.r
            ms.append(m)
            ps.append(p)
        if not quantised:
            bc.allreduce_inplace(first, self.op, group=g)      # exact runs and P together
        else:
            if plain_numel:
                bc.allreduce_inplace(first[:plain_numel], self.op, group=g)
            self._allreduce_factors(first[plain_numel:], f"{key}/p")
        pos = 0
        for off, k in plain:
            tensor[off:off + k].copy_(first[pos:pos + k])
            pos += k
        if not matrices:
            return
        second = torch.empty(sum(s.m * s.r for s in matrices), dtype=torch.float32, device=dev)
        pos = 0
        for s, m, p in zip(matrices, ms, ps):
            orthogonalize(p)
            q = second[pos:pos + s.m * s.r].view(s.m, s.r)
            torch.matmul(m.t(), p, out=q)
            qs.append(q)
            pos += s.m * s.r
        self._allreduce_factors(second, f"{key}/q")
        # The same on every rank: an overflow on any rank made the allreduced factors
        # non-finite, GradScaler skips this step everywhere, and the residuals and Q stay as
        # they were (as DDP keeps nothing of a skipped step; kept, the NaN would skip every
        # later step too).
        # Decided on the device (no host synchronisation per bucket).
        ok = torch.isfinite(second).all()
        for s, m, p, q, prev in zip(matrices, ms, ps, qs, prevs):
            approx = p @ q.t()
            m.sub_(approx)                       # residual: what this rank's M̂ missed
            res = self.residuals[s.name]
            torch.where(ok, m, res, out=res)
            self.q[s.name] = torch.where(ok, q, prev)
            tensor[s.offset:s.offset + s.n * s.m].view(s.n, s.m).copy_(approx)

    def post_backward_hook(self, ctx):
        self.rounds += 1

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self):
        return {"q": {k: v.clone() for k, v in self.q.items()},
                "residuals": {k: v.clone() for k, v in self.residuals.items()},
                "rounds": self.rounds}

    def load_state_dict(self, state):
        self._load_shared(state)
        self.residuals = {k: v.detach().float().to(self.device, copy=True)
                          for k, v in state["residuals"].items()}

    def _load_shared(self, state):
        self.rounds = int(state["rounds"])
        self.q = {k: v.detach().float().to(self.device, copy=True)
                  for k, v in state["q"].items()}

    def foreign_view(self, state):
        return {"rounds": state.get("rounds"), "q": state.get("q"),
                "residuals": any(t.any() for t in state.get("residuals", {}).values())}

    def load_foreign_state_dict(self, state, *, world_size, rank):
        # Q is the same on every rank; a residual is one rank's unsent error.
        self._load_shared(state)
        self.residuals = {}
        if any(t.any() for t in state.get("residuals", {}).values()):
            return "error-feedback residuals are per rank and restart at zero (Q is kept)"
        return None

    def shutdown(self):
        self.reducer.close()
