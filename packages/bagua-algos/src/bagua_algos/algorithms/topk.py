"""TopK: each rank sends only its largest-magnitude gradient entries (with error feedback);
the sparse vectors are exchanged by allgather and summed identically on every rank."""

from __future__ import annotations

import math

import torch

import bagua_comm as bc

from .._engine.checks import check_bool, check_int_at_least, check_number
from .._engine.comm import Reducer
from .._engine.overflow import Scratch, keep_if_finite
from .._engine.state import export_flat, import_flat
from ..algorithm import Algorithm, AlgorithmImpl
from . import _topk_round
from ._shared import check_compressor, check_no_error_feedback


def check_density(density) -> float:
    check_number("density", density, "in (0, 1] (the fraction of gradient entries each rank "
                 "sends, e.g. 0.01)", lambda d: 0 < d <= 1)
    return float(density)


class TopK(Algorithm, name="topk"):
    """Sparse gradient allreduce: each rank sends the ``density`` fraction of its gradient
    entries with the largest magnitude; what it did not send is kept (error feedback) and
    added to its next gradient.

    Selection is per parameter (``ceil(density * numel)`` entries of each, at least one), so
    the maths does not depend on the bucket size.  Indices (int32) and values travel by
    allgather, one pair per bucket; every rank adds the gathered vectors in rank order into
    the same dense average, so ranks stay bit-identical.  ``density=1.0`` is the plain
    average (bit for bit GradientAllReduce's at two ranks).

    ``compressor`` (any ``bagua_comm.compression.Compressor`` without its own error
    feedback, e.g. ``MinMaxUInt8(1)``) quantises the values; ``None`` sends them in the
    gradient's dtype.  The error feedback then keeps the quantisation error too.
    ``hierarchical=True`` averages inside each node in full precision and runs TopK among
    node leaders.

    ``start_step`` (as LowRank's): the first ``start_step`` steps send the plain average,
    uncompressed (GradientAllReduce's result, residuals untouched).  At density ``d`` an entry
    waits about ``1 / d`` steps between sends, so a short run, or one with Adam (which turns
    each delayed burst into a single normalised step), loses accuracy that a dense start
    recovers; each warm-up step costs DDP's bytes.

    ``momentum`` (0 <= m < 1; default 0: off) is Deep Gradient Compression's momentum
    correction (Lin et al., ICLR 2018): SGD's momentum moves into TopK, before the selection.
    Each rank keeps a velocity ``u <- m u + g`` and accumulates ``u`` (not ``g``) into its
    residual; the entries it sends are cleared from both (momentum factor masking), and the
    optimizer steps on the average of what was sent.  Give it an optimizer without momentum
    of its own (``torch.optim.SGD(params, lr, momentum=0)``): an optimizer with momentum or
    Adam's betas is refused at :func:`with_bagua`.  Plain error feedback delays an entry's
    gradient about ``1 / density`` steps and SGD's momentum then replays that burst about
    ``1 / (1 - m)`` times; accumulating the velocity sends each entry's momentum once.
    During ``start_step`` warm-up it is SGD's momentum exactly (the plain average of every
    rank's velocity, which is the velocity of the average).
    """

    dense_gradients = True

    def compresses(self):
        return self.compressor is not None

    def __init__(self, density: float = 0.01, hierarchical: bool = False,
                 average: bool = True, compressor=None, start_step: int = 0,
                 momentum: float = 0.0):
        self.density = check_density(density)
        check_number("momentum", momentum, "in [0, 1) (DGC's momentum correction; 0 turns it "
                     "off)", lambda m: 0 <= m < 1)
        check_bool("hierarchical", hierarchical)
        check_bool("average", average)
        check_int_at_least("start_step", start_step, 0)
        check_compressor(compressor)
        check_no_error_feedback(compressor, "TopK", "TopK's residual")
        self.hierarchical = hierarchical
        self.average = average
        self.compressor = compressor
        self.start_step = start_step
        self.momentum = float(momentum)

    def check_wrap(self, module, optimizers):
        if not self.momentum:
            return
        for i, opt in enumerate(optimizers):
            for group in opt.param_groups:
                if group.get("momentum", 0) or "betas" in group:
                    what = ("Adam-style betas" if "betas" in group
                            else f"momentum={group['momentum']}")
                    raise ValueError(
                        f"optimizers[{i}] ({type(opt).__name__}) has {what}, but "
                        f"TopK(momentum={self.momentum}) applies the momentum itself (DGC's "
                        "momentum correction): use torch.optim.SGD(params, lr, momentum=0), "
                        "or TopK(momentum=0) to keep the optimizer's")

    def reify(self, group):
        return TopKImpl(group, self)


def plan(bucket, density: float) -> list[tuple[int, int, int]]:
    """``(offset, numel, k)`` per parameter of ``bucket``: its top-``k`` entries are sent."""
    return [(off, p.numel(), min(p.numel(), max(1, math.ceil(density * p.numel()))))
            for off, p in zip(bucket.offsets, bucket.params)]


def select(corrected: torch.Tensor, slots, indices: torch.Tensor) -> None:
    """Write into ``indices`` the positions of each slot's ``k`` largest ``|corrected|``."""
    pos = 0
    for off, n, k in slots:
        if k == n:
            torch.arange(off, off + n, out=indices[pos:pos + k])
        else:
            idx = torch.topk(corrected[off:off + n].abs(), k, sorted=False).indices
            indices[pos:pos + k].copy_(idx.add_(off))
        pos += k


class TopKImpl(AlgorithmImpl):
    # every rank decodes the same exchanged data: identical models after each step, so
    # broadcast_buffers=True starts each training step from rank 0's buffers (as DDP)
    synchronous = True

    def __init__(self, group, algo: TopK):
        super().__init__(group)
        self.density = algo.density
        self.start_step = algo.start_step
        self.momentum = algo.momentum
        self.rounds = 0                                # synchronised steps so far
        self.op_average = algo.average
        self.op = bc.ReduceOp.AVG if algo.average else bc.ReduceOp.SUM
        self.compressor = algo.compressor
        self.reducer = Reducer(group, algo.hierarchical, "bagua-topk")
        self.buckets = []
        self.residuals: list[torch.Tensor] = []
        self.velocities: list[torch.Tensor] = []      # momentum correction's u (momentum > 0)
        self.slots: list[list[tuple[int, int, int]]] = []
        self.scratch = Scratch()    # the next residual / velocity (a skipped step drops them)
        # (buckets, residuals, compiled launchers or None), made once per layout
        self._compiled: tuple | None = None

    def init_operations(self, ctx, buckets):
        self.buckets = buckets
        self._compiled = None
        self.scratch.clear()
        self.slots = [plan(b, self.density) for b in buckets]
        self.residuals = [torch.zeros(b.padded_numel, dtype=torch.float32, device=b.device)
                          for b in buckets]
        self.velocities = [torch.zeros(b.padded_numel, dtype=torch.float32, device=b.device)
                           for b in buckets] if self.momentum else []

    def _velocity(self, t: torch.Tensor, i: int) -> torch.Tensor:
        """Bucket ``i``'s next velocity ``m u + t``, in scratch: copied into the velocity once
        the step is known not to be skipped."""
        u = self.scratch.get("velocity", t.numel(), t.device)
        torch.mul(self.velocities[i], self.momentum, out=u)
        return u.add_(t)

    def _momentum_step(self, t: torch.Tensor, i: int, g: bc.ProcessGroup | None,
                       whole: torch.Tensor | None = None) -> None:
        """``t <- u <- m u + t``, then averaged over ``g`` when given (allreducing ``whole``,
        ``t`` followed by the flags, when given); the new ``u`` is kept unless the result is
        not finite (an overflow on some rank: GradScaler skips the step everywhere)."""
        u = self._velocity(t, i)
        t.copy_(u)
        if g is not None:
            bc.allreduce_inplace(t if whole is None else whole, self.op, group=g)
        keep_if_finite(t, [(self.velocities[i], u)])

    def carries_unused_flags(self, ctx):
        # flat: the warm-up allreduce holds them, the sparse exchange sends them beside its
        # indices (exact integers, whatever the values' compressor); hierarchical: the
        # node-level reduce and broadcast do not cover them, so the module checks them itself
        return self.group.size > 1 and not self.reducer.hierarchical

    def _launchers(self) -> list | None:
        """This layout's compiled exchanges (``_topk_round``), or None where the Python path
        runs (the same answer on every rank: it depends on the configuration only)."""
        cached = self._compiled
        if cached is None or cached[0] is not self.buckets or cached[1] is not self.residuals:
            got = (_topk_round.launchers(self, self.buckets)
                   if _topk_round.eligible(self, self.buckets) else None)
            cached = self._compiled = (self.buckets, self.residuals, got)
        return cached[2]

    def bucket_launchers(self, ctx, buckets):
        compiled = self._launchers() if self.rounds >= self.start_step else None
        if compiled is None or buckets is not self.buckets:
            return super().bucket_launchers(ctx, buckets)
        out = self._compiled_plan
        if out is None or out[0] is not compiled:
            out = self._compiled_plan = (compiled, [(None, c) for c in compiled])
        return out[1]

    _compiled_plan: tuple | None = None

    def bucket_ready_hook(self, ctx, bucket):
        tensor, i = bucket.grad, bucket.index
        if self.rounds >= self.start_step:     # a joined rank's start too: the same path
            compiled = self._launchers()
            if compiled is not None:
                return compiled[i]()
        # the last bucket's flags, when this step carries them (the module asked just now)
        flags = bucket.flags if bucket.flags is not None and self.carries_unused_flags(ctx) \
            else None
        warm = self.rounds < self.start_step
        if self.momentum and self.group.size == 1:
            # one rank (with_bagua runs a one-node hierarchical mode flat): nothing is
            # exchanged or sparsified, the velocity is the update
            self._momentum_step(tensor, i, None)
            return None
        if self.momentum and warm:
            # SGD's momentum exactly: every rank's velocity averaged is the average's velocity
            def among(t, g):
                self._momentum_step(t, i, g, None if flags is None else bucket.grad_and_flags)

            return self.reducer.runner.submit(
                lambda: self.reducer.reduce_with(tensor, among, self.op_average))
        if warm:                                       # warm-up: the exact average
            return self.reducer.allreduce(tensor if flags is None else bucket.grad_and_flags,
                                          self.op)

        def among(t, g):
            self.exchange(t, i, g, flags)

        return self.reducer.runner.submit(
            lambda: self.reducer.reduce_with(tensor, among, self.op_average))

    # -- the sparse exchange ------------------------------------------------------------------
    def _values_payload(self, values: torch.Tensor, dtype, key: str):
        """Quantise ``values`` with the compressor: (payload, what the peers will decode)."""
        c = self.compressor
        chunks = getattr(c, "chunks", 1)
        chunks = chunks if isinstance(chunks, int) and chunks >= 1 else 1
        unit = c.alignment(chunks)
        padded = -(-values.numel() // unit) * unit
        x = values.new_zeros(padded, dtype=dtype)
        x[:values.numel()] = values
        size = c.payload_numel(padded, chunks=chunks)
        payload = c.compress(x, chunks=chunks, key=key)
        if (not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8
                or payload.numel() != size):
            raise ValueError(f"compressor {type(c).__name__}.compress() of {padded} values "
                             f"did not return the uint8 tensor of payload_numel()={size} "
                             "bytes it promised; every rank must send the same size")
        return payload, (chunks, padded)

    def _decode(self, payload, shape, dtype, device) -> torch.Tensor:
        chunks, padded = shape
        out = torch.empty(padded, dtype=torch.float32, device=device)
        return self.compressor.decompress(payload, out, chunks=chunks, dtype=dtype)

    def exchange(self, tensor: torch.Tensor, i: int, g: bc.ProcessGroup,
                 flags: torch.Tensor | None = None) -> None:
        """Blocking: ``tensor`` <- the average (sum) over ``g`` of every member's top-k.

        ``flags`` (the last bucket's "got a gradient" flags, 0 or 1): sent after the indices
        and replaced by their sum over ``g``, so that no collective of their own is needed."""
        b, slots = self.buckets[i], self.slots[i]
        n, numel, dev, dtype = g.size, b.numel, tensor.device, tensor.dtype
        k = sum(s[2] for s in slots)
        f = 0 if flags is None else flags.numel()
        # the corrected gradient (momentum correction: the velocity), which becomes the
        # residual: computed in scratch, kept at the end unless the step is skipped
        velocity = self._velocity(tensor, i) if self.momentum else None
        residual = self.scratch.get("residual", self.residuals[i].numel(), dev)
        torch.add(self.residuals[i], tensor if velocity is None else velocity, out=residual)
        index_dtype = torch.int32 if numel < 2 ** 31 else torch.int64
        sent_idx = torch.empty(k + f, dtype=index_dtype, device=dev)
        indices = sent_idx[:k]
        select(residual, slots, indices)
        if f:
            sent_idx[k:].copy_(flags)
        values = residual[indices]
        all_idx = torch.empty(n * (k + f), dtype=index_dtype, device=dev)
        works = [bc.allgather(sent_idx, all_idx, group=g, async_op=True)]
        if self.compressor is None:
            sent = values.to(dtype)
            all_vals = torch.empty(n * k, dtype=dtype, device=dev)
            works.append(bc.allgather(sent, all_vals, group=g, async_op=True))
            sent = sent.float()
        else:
            payload, shape = self._values_payload(values, dtype, b.name)
            all_vals = torch.empty(n * payload.numel(), dtype=torch.uint8, device=dev)
            works.append(bc.allgather(payload, all_vals, group=g, async_op=True))
            sent = self._decode(payload, shape, dtype, dev)[:k]
        residual.index_add_(0, indices, sent, alpha=-1)   # error feedback: keep what was not sent
        if velocity is not None:                       # momentum factor masking
            velocity.index_fill_(0, indices.long(), 0.0)
        dense = torch.zeros(numel, dtype=torch.float32, device=dev)
        for w in works:
            w.wait()
        all_idx = all_idx.view(n, k + f)
        if f:
            flags.copy_(all_idx[:, k:].sum(0))
        all_idx = all_idx[:, :k]
        for r in range(n):                             # rank order: the same sum everywhere
            if self.compressor is None:
                vals = all_vals[r * k:(r + 1) * k].float()
            else:
                size = all_vals.numel() // n
                vals = self._decode(all_vals[r * size:(r + 1) * size], shape, dtype, dev)[:k]
            dense.index_add_(0, all_idx[r], vals)
        if self.op_average:
            dense.div_(n)
        # An overflow on any rank reached every rank (top-k picks NaN and infinity first):
        # GradScaler skips this step everywhere, and the residual and velocity stay as they
        # were, as DDP keeps nothing of a skipped step (kept, the overflow would be sent, and
        # skip the step, forever after).
        keep_if_finite(dense, [(self.residuals[i], residual)]
                       + ([(self.velocities[i], velocity)] if velocity is not None else []))
        tensor[:numel].copy_(dense)
        tensor[numel:].zero_()

    def post_backward_hook(self, ctx):
        self.rounds += 1

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self):
        state = {"residuals": export_flat(self.buckets, self.residuals), "rounds": self.rounds}
        if self.momentum:
            state["velocities"] = export_flat(self.buckets, self.velocities)
        return state

    def load_state_dict(self, state):
        self.rounds = int(state.get("rounds", 0))
        for name, mine in (("residuals", self.residuals), ("velocities", self.velocities)):
            for r in mine:
                r.zero_()
            if mine:
                import_flat(self.buckets, mine, state.get(name, {}), f"TopK {name}")

    def foreign_view(self, state):
        return {"rounds": int(state.get("rounds", 0)),
                "residuals": any(t.any() for key in ("residuals", "velocities")
                                 for t in state.get(key, {}).values())}

    def load_foreign_state_dict(self, state, *, world_size, rank):
        # A residual is one rank's unsent gradient: another rank's would be sent twice.
        self.rounds = int(state.get("rounds", 0))      # the same on every rank
        for r in self.residuals + self.velocities:
            r.zero_()
        if any(t.any() for key in ("residuals", "velocities")
               for t in state.get(key, {}).values()):
            return "error-feedback residuals (and velocities) are per rank and restart at zero"
        return None

    def shutdown(self):
        self.reducer.close()
