"""DiLoCo (arXiv 2311.08105) and Streaming DiLoCo (arXiv 2501.18512): communicate rarely.

Each rank's own (inner) optimizer steps its parameters θ_i; no gradient is communicated.
Every rank also keeps an anchor θ_a (the parameters at ``with_bagua``, identical on every
rank) and an outer momentum m.  Every ``sync_every`` optimizer steps the ranks average their
outer gradient Δ = θ_a - θ_i, take one outer step on θ_a with Δ exactly as
``torch.optim.SGD(lr=outer_lr, momentum=outer_momentum, nesterov=nesterov)`` would (an actual
``torch.optim.SGD`` over the anchor runs it), and restart from the new anchor.

Streaming: ``fragments=P`` cuts the flat parameter vector (registration order) into P
contiguous ranges of equal size (±1 element); fragment p syncs after steps t with
``t % sync_every == (p + 1) * sync_every // P % sync_every``, so about 1/P of the model
travels in any one step.  ``overlap_steps=τ`` starts a fragment's allreduce after step t and
applies it after step t + τ: the inner steps in between overlap the communication.  Local
progress made meanwhile is kept: the correction the rank would have applied at t is applied
at t + τ, ``θ_i ← θ_i(t + τ) + (θ_a_new - θ_i(t))`` (with τ = 0 this is ``θ_i ← θ_a_new``).

Outer-momentum warm-up: ``outer_warmup=W`` ramps the outer momentum over each fragment's first
W outer steps: its k-th outer step (k = 1, 2, ...) uses ``μ_k = outer_momentum · min(1, k/W)``
in both places torch's SGD uses it, ``m ← μ_k·m + Δ`` and (Nesterov) ``u = Δ + μ_k·m``.  Early
outer gradients are large and change direction quickly; a full momentum carries them into
the next outer steps.  ``W = 0`` (default) is the constant momentum of the DiLoCo paper.
"""

from __future__ import annotations

import itertools
import logging
import math
import time

import torch

import bagua_comm as bc

from .._engine.checks import check_bool, check_int_at_least, check_number
from .._engine.comm import Handle, Reducer
from .._engine.overflow import all_finite
from ..algorithm import Algorithm, AlgorithmImpl
from ._shared import check_chunks, check_compressor, trainable


def fragment_bounds(numel: int, fragments: int) -> list[tuple[int, int]]:
    """``fragments`` contiguous ranges of ``[0, numel)`` whose sizes differ by at most one."""
    cuts = [p * numel // fragments for p in range(fragments + 1)]
    return list(itertools.pairwise(cuts))


def sync_offset(fragment: int, fragments: int, sync_every: int) -> int:
    """Fragment ``fragment`` syncs after the steps t with ``t % sync_every`` equal to this."""
    return (fragment + 1) * sync_every // fragments % sync_every


class DiLoCo(Algorithm, name="diloco"):
    """Local inner steps, an outer Nesterov step on the averaged parameter change every
    ``sync_every`` optimizer steps (see the module docstring for the exact maths).

    Args:
        sync_every: inner optimizer steps between syncs (H).
        outer_lr, outer_momentum, nesterov: the outer ``torch.optim.SGD``.
        outer_warmup: W, each fragment's outer steps over which the outer momentum ramps
            linearly up to ``outer_momentum`` (0: constant; see the module docstring).
        fragments: Streaming DiLoCo's P (at most the number of trainable tensors).
        overlap_steps: τ, inner steps a sync overlaps (< ``sync_every``).
        compressor: None (full precision) or a ``bagua_comm.compression.Compressor`` for the
            outer gradient (e.g. ``MinMaxUInt8(world)`` or ``MinMaxUInt4(world,
            error_feedback=True)``); its ``chunks`` must be a multiple of the ranks
            exchanging it.
        hierarchical: average inside each node first, exchange among node leaders.
        anchor_device: where the anchor and outer momentum live (default: the parameters'
            device); ``"cpu"`` keeps these 2x parameters (float32) off a GPU.
    """

    def __init__(self, sync_every: int = 32, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 nesterov: bool = True, fragments: int = 1, overlap_steps: int = 0,
                 compressor=None, hierarchical: bool = False, *, anchor_device=None,
                 outer_warmup: int = 0):
        check_int_at_least("sync_every", sync_every, 1)
        check_number("outer_lr", outer_lr, "> 0 and < inf", lambda v: 0 < v < math.inf)
        check_number("outer_momentum", outer_momentum, ">= 0 and < 1", lambda v: 0 <= v < 1)
        check_bool("nesterov", nesterov)
        if nesterov and outer_momentum == 0:
            raise ValueError("nesterov=True needs outer_momentum > 0 (as torch.optim.SGD)")
        check_int_at_least("outer_warmup", outer_warmup, 0)
        if outer_warmup and outer_momentum == 0:
            raise ValueError("outer_warmup ramps the outer momentum: it needs "
                             "outer_momentum > 0")
        check_int_at_least("fragments", fragments, 1)
        check_int_at_least("overlap_steps", overlap_steps, 0)
        if overlap_steps >= sync_every:
            raise ValueError(f"overlap_steps ({overlap_steps}) must be < sync_every "
                             f"({sync_every}): a fragment's sync must land before its next one")
        check_compressor(compressor)
        check_bool("hierarchical", hierarchical)
        if anchor_device is not None:
            try:
                anchor_device = torch.device(anchor_device)
            except (RuntimeError, TypeError) as err:
                raise ValueError(f"anchor_device must be None or a torch device such as 'cpu', "
                                 f"got {anchor_device!r}") from err
            if anchor_device.type not in ("cpu", "cuda"):
                raise ValueError(f"anchor_device must be a 'cpu' or 'cuda' device (the anchor "
                                 f"holds real values), got {anchor_device}")
            if anchor_device.type == "cuda" and not (
                    torch.cuda.is_available() and (anchor_device.index is None
                                                   or anchor_device.index
                                                   < torch.cuda.device_count())):
                raise ValueError(f"anchor_device={anchor_device} is not available here "
                                 f"(torch.cuda.is_available() is "
                                 f"{torch.cuda.is_available()}, "
                                 f"{torch.cuda.device_count()} devices)")
        self.sync_every = sync_every
        self.outer_lr = outer_lr
        self.outer_momentum = outer_momentum
        self.nesterov = nesterov
        self.outer_warmup = outer_warmup
        self.fragments = fragments
        self.overlap_steps = overlap_steps
        self.compressor = compressor
        self.hierarchical = hierarchical
        self.anchor_device = anchor_device

    def check_wrap(self, module: torch.nn.Module, optimizers: list) -> None:
        params = trainable(module)
        if not optimizers:
            raise ValueError(f"optimizers: {type(self).__name__} counts and follows the inner "
                             "optimizer's steps; pass it: with_bagua(model, [optimizer], ...)")
        given = {id(p) for opt in optimizers for g in opt.param_groups for p in g["params"]}
        missing = [n for n, p in params if id(p) not in given]
        if missing:
            raise ValueError(f"optimizers: parameters {missing[:5]} are not in any optimizer "
                             f"given to with_bagua; {type(self).__name__} syncs after the given "
                             "optimizers' steps, so every trainable parameter must be in one")
        if self.fragments > len(params):
            raise ValueError(f"fragments ({self.fragments}) must be <= the number of trainable "
                             f"parameter tensors ({len(params)})")
        devices = {p.device for _, p in params}
        if len(devices) > 1:
            raise ValueError(f"{type(self).__name__} needs every trainable parameter on one "
                             f"device, got {sorted(map(str, devices))}")

    def reify(self, group):
        return DiLoCoImpl(group, self)


class _Sync:
    """A fragment's sync in flight: the averaged outer gradient, the parameters it started
    from (only when it overlaps inner steps), and when it is applied."""

    __slots__ = ("apply_at", "delta", "handle", "start")

    def __init__(self, delta, start, handle, apply_at):
        self.delta, self.start, self.handle, self.apply_at = delta, start, handle, apply_at


class DiLoCoImpl(AlgorithmImpl):
    uses_grad_buckets = False

    def __init__(self, group, algo: DiLoCo):
        super().__init__(group)
        self.algo = algo
        self.H, self.P, self.tau = algo.sync_every, algo.fragments, algo.overlap_steps
        self.reducer = Reducer(group, algo.hierarchical, "bagua-diloco",
                               own_stream=True)   # syncs start on the training stream
        self.compressor = algo.compressor
        if self.compressor is not None:
            check_chunks(self.compressor, self.reducer.peers.size, "DiLoCo compressor")
        self.steps = 0                 # completed inner steps (every given optimizer stepped)
        self._counted = False          # this backward's step was counted (not finite)
        self._counts: dict[int, int] = {}
        self.pending: dict[int, _Sync] = {}
        self.outer_steps = [0] * self.P  # outer steps taken, per fragment (the warm-up's k)
        #: seconds the training thread waited for syncs to land (the part of the syncs'
        #: time no inner step hid: all of it without overlap)
        self.sync_wait_s = 0.0
        self._buffers_sync = None      # the buffers' average in flight (_start_buffers)
        self.params = None

    # -- layout ---------------------------------------------------------------------------------
    def init_tensors(self, ctx):
        return []                      # no gradient buckets: nothing is communicated per step

    def init_operations(self, ctx, buckets):
        if self.params is not None:
            return                     # re-bucketing: our state does not depend on buckets
        self._lay_out(trainable(ctx.module))
        self.device = self.params[0].device
        self.anchor_device = self.algo.anchor_device or self.device
        self.counts_of = {id(o): 0 for o in ctx.optimizers}
        named = [(n, b) for n, b in ctx.module.named_buffers() if b.is_floating_point()]
        self.buffer_names = [n for n, _ in named]
        self.buffers = [b for _, b in named]
        #: the buffers as every rank last agreed on them (rank 0's at the wrap, then each
        #: sync's average): synced_state_dict()'s
        self.synced_buffers = self._flat_buffers() if self.buffers else None
        with torch.no_grad():
            self._new_outer([self.gather(p).to(self.anchor_device, copy=True)
                             for p in range(self.P)])

    def _lay_out(self, named) -> None:
        """The flat vector's parameters (``named``, in this order) and its fragments."""
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.offsets, off = [], 0
        for p in self.params:
            self.offsets.append(off)
            off += p.numel()
        self.numel = off
        self.bounds = fragment_bounds(off, self.P)

    def _new_outer(self, anchors, momentum=None) -> None:
        self.anchors = anchors
        self.outer = torch.optim.SGD(self.anchors, lr=self.algo.outer_lr,
                                     momentum=self.algo.outer_momentum,
                                     nesterov=self.algo.nesterov)
        for a, m in zip(self.anchors, momentum or ()):
            self.outer.state[a] = {"momentum_buffer": m.to(self.anchor_device)}

    def _take_unfrozen(self, module) -> None:
        """Parameters frozen at the wrap that require a gradient now (the module gave them
        rank 0's values, every rank does this at the same forward) join the flat vector: their
        anchor is that value, their outer momentum zero (as a first sync: SGD treats a zero
        buffer as none).  The fragments are cut anew; syncs in flight land first, and the
        outer gradient's error-feedback residuals (per fragment) restart at zero."""
        known = {id(p) for p in self.params}
        named = [(n, p) for n, p in module.named_parameters()
                 if id(p) in known or p.requires_grad]
        if len(named) == len(self.params):
            return
        with torch.no_grad():
            for f in sorted(self.pending):
                self.apply(f)
            anchor = self._by_name(self.anchors)
            momentum = self._momentum()
            momentum = None if momentum is None else self._by_name(momentum)
            self._lay_out(named)
            for n, p in named:
                if id(p) not in known:
                    anchor[n] = p.detach().reshape(-1).float().cpu()
                    if momentum is not None:
                        momentum[n] = torch.zeros(p.numel())
            self._new_outer([t.to(self.anchor_device) for t in self._from_names(anchor, "anchor")],
                            None if momentum is None else self._from_names(momentum, "momentum"))
        if self.compressor is not None and hasattr(self.compressor, "reset_residuals"):
            self.compressor.reset_residuals()

    def pieces(self, fragment: int):
        """(parameter, start, end, position in the fragment) covering the fragment."""
        lo, hi = self.bounds[fragment]
        for p, off in zip(self.params, self.offsets):
            a, z = max(lo, off), min(hi, off + p.numel())
            if a < z:
                yield p, a - off, z - off, a - lo

    def gather(self, fragment: int) -> torch.Tensor:
        """The fragment's current parameters as one float32 vector (on their device)."""
        lo, hi = self.bounds[fragment]
        out = torch.empty(hi - lo, dtype=torch.float32, device=self.device)
        for p, a, z, at in self.pieces(fragment):
            out[at:at + z - a].copy_(p.detach().reshape(-1)[a:z])
        return out

    def scatter(self, fragment: int, flat: torch.Tensor) -> None:
        """Write a float32 vector into the fragment's parameters."""
        for p, a, z, at in self.pieces(fragment):
            if p.is_contiguous():
                p.detach().view(-1)[a:z].copy_(flat[at:at + z - a])
            else:
                whole = p.detach().reshape(-1).clone()
                whole[a:z].copy_(flat[at:at + z - a])
                p.detach().copy_(whole.view_as(p))

    # -- steps ----------------------------------------------------------------------------------
    # Inner steps are counted by the optimizers' step hooks, except a step whose gradients
    # are not finite on this rank: torch.amp.GradScaler skips it here (maybe here only), its
    # hooks never run, and the other ranks, which stepped, would wait at the next sync for
    # this rank forever.  Such a step is counted at the end of its backward instead, and the
    # hooks of any optimizer that steps anyway (no GradScaler) are ignored until the next
    # backward, so that every rank counts every step once.
    def post_backward_hook(self, ctx):
        self._counted = False
        if not all_finite([p.grad for p in self.params]):
            self._counted = True
            self._advance(self.steps + 1)

    def post_optimizer_step_hook(self, ctx, optimizer):
        if self._counted:
            return
        # An inner step is complete once every given optimizer has stepped (in any order).
        self.counts_of[id(optimizer)] = self.counts_of.get(id(optimizer), 0) + 1
        self._advance(min(self.counts_of.values()))

    def _advance(self, done: int) -> None:
        for k, c in self.counts_of.items():
            self.counts_of[k] = max(c, done)
        while self.steps < done:
            self.steps += 1
            self.on_step(self.steps)

    def on_step(self, t: int) -> None:
        with torch.no_grad():
            for p in sorted(f for f, s in self.pending.items() if s.apply_at <= t):
                self.apply(p)
            for p in range(self.P):
                if self.sync_due(p, t):
                    self.start(p, t)

    def sync_due(self, fragment: int, t: int) -> bool:
        """Whether ``fragment``'s sync starts after inner step ``t``."""
        return t % self.H == sync_offset(fragment, self.P, self.H)

    def start(self, fragment: int, t: int) -> None:
        x = self.gather(fragment)
        delta = self.anchors[fragment].to(self.device, copy=True).sub_(x)
        if self.group.size == 1:
            handle = Handle.completed()
        elif self.compressor is not None:
            handle = self.reducer.compressed_allreduce(delta, self.compressor,
                                                       f"fragment{fragment}")
        else:
            handle = self.reducer.allreduce(delta, bc.ReduceOp.AVG)
        self.pending[fragment] = _Sync(delta, x if self.tau else None, handle, t + self.tau)
        if fragment == self.P - 1:
            self._buffers_sync = self._start_buffers()
        if self.tau == 0:
            self.apply(fragment)

    def apply(self, fragment: int) -> None:
        s = self.pending.pop(fragment)
        if s.handle is not None:
            t0 = time.perf_counter()
            s.handle.wait()
            self.sync_wait_s += time.perf_counter() - t0
        anchor = self.anchors[fragment]
        for a in self.anchors:
            a.grad = None
        anchor.grad = s.delta.to(self.anchor_device)
        kept = self._frozen_slices(fragment, anchor)
        self.outer_steps[fragment] += 1
        self.outer.param_groups[0]["momentum"] = self.momentum_at(self.outer_steps[fragment])
        self.outer.step()
        anchor.grad = None
        for at, n, old, m in kept:
            # a parameter frozen after the wrap takes no outer step (SGD skips a tensor without
            # a gradient; DDP leaves it alone): its momentum stays; it takes the ranks'
            # average (anchor - delta, LocalSGD's), so that ranks agree, then never moves
            anchor[at:at + n].copy_(old.sub_(s.delta[at:at + n].to(old.device)))
            buf = self.outer.state[anchor].get("momentum_buffer")
            if buf is not None:
                buf[at:at + n].copy_(m) if m is not None else buf[at:at + n].zero_()
        new = anchor.to(self.device)
        if s.start is not None:       # keep the inner steps made while the sync was in flight
            new = self.gather(fragment).add_(new).sub_(s.start)
        self.scatter(fragment, new)
        if fragment == self.P - 1:
            self.average_buffers()

    def momentum_at(self, k: int) -> float:
        """The outer momentum of a fragment's k-th outer step (1-based): the warm-up's ramp."""
        warmup = self.algo.outer_warmup
        return self.algo.outer_momentum * (min(1.0, k / warmup) if warmup else 1.0)

    def _frozen_slices(self, fragment: int, anchor: torch.Tensor) -> list:
        """(position, length, anchor values, outer momentum) of the fragment's parameters that
        require no gradient now, before the outer step."""
        out = []
        buf = self.outer.state.get(anchor, {}).get("momentum_buffer")
        for p, a, z, at in self.pieces(fragment):
            if not p.requires_grad:
                n = z - a
                out.append((at, n, anchor[at:at + n].clone(),
                            None if buf is None else buf[at:at + n].clone()))
        return out

    def _flat_buffers(self) -> torch.Tensor:
        return torch.cat([b.detach().reshape(-1).double() for b in self.buffers])

    def _start_buffers(self):
        """The floating-point buffers' average, started with the last fragment's sync on a
        flat gloo group (where the training thread already issues the group's collectives):
        it then travels beside the outer gradient instead of after it, and a sync that
        overlaps inner steps lands without a collective of its own (a ring allreduce: at
        50 ms between 4 hosts a 0.65 s step at every landing).  None elsewhere: NCCL
        communicators keep one issuing thread each, so those groups average at the landing."""
        if (self.group.size == 1 or not self.buffers or self.reducer.hierarchical
                or self.group.backend != "gloo"):
            return None
        flat = self._flat_buffers()
        start = flat.clone() if self.tau else None
        return flat, start, bc.allreduce_inplace(flat, bc.ReduceOp.AVG, group=self.group,
                                                 async_op=True)

    def average_buffers(self) -> None:
        started, self._buffers_sync = self._buffers_sync, None
        if self.group.size == 1 or not self.buffers:
            return
        if started is not None:
            flat, start, handle = started
            handle.wait()
            self.synced_buffers = flat.clone()
            if start is not None:
                # keep a buffer's own progress while the sync was in flight (as the
                # parameters' inner steps); an unchanged one (a constant mask, -inf
                # included) takes the average as it is
                now = self._flat_buffers()
                moved = now != start
                flat[moved] += now[moved] - start[moved]
        else:
            flat = self._flat_buffers()
            if self.reducer.hierarchical:
                # the syncs run on the runner's thread: this collective goes there too, after
                # them, so that the rank's NCCL calls keep one order (a second thread driving
                # another communicator at the same time has none agreed between ranks)
                self.reducer.exchange(
                    lambda: bc.allreduce_inplace(flat, bc.ReduceOp.AVG, group=self.group)).wait()
            else:
                bc.allreduce_inplace(flat, bc.ReduceOp.AVG, group=self.group)
            self.synced_buffers = flat.clone()
        off = 0
        for b in self.buffers:
            b.copy_(flat[off:off + b.numel()].view_as(b))
            off += b.numel()

    def finish(self) -> None:
        """Wait for syncs in flight (their allreduce), without applying them early."""
        for s in self.pending.values():
            if s.handle is not None:
                s.handle.wait()
                s.handle = None
        if self._buffers_sync is not None:
            self._buffers_sync[2].wait()

    def synced_state(self, ctx, state: dict) -> dict:
        """``state`` with the anchor in place of this rank's parameters and the buffers of the
        last sync (new tensors, the others copied as they are now; the model is not
        touched)."""
        state = {k: v.detach().clone() for k, v in state.items()}
        anchor = self._by_name(self.anchors)
        buffers, off = {}, 0
        for name, b in zip(self.buffer_names, self.buffers):
            buffers[name] = self.synced_buffers[off:off + b.numel()]
            off += b.numel()
        for name, value in (*anchor.items(), *buffers.items()):
            if name in state:
                old = state[name]
                state[name] = value.reshape(old.shape).to(old.device, old.dtype)
        return state

    # -- state ----------------------------------------------------------------------------------
    def _by_name(self, flats: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        whole = torch.cat([f.detach().reshape(-1).cpu() for f in flats])
        return {n: whole[o:o + p.numel()].clone()
                for n, p, o in zip(self.names, self.params, self.offsets)}

    def _from_names(self, state: dict, what: str) -> list[torch.Tensor]:
        whole = torch.empty(self.numel, dtype=torch.float32)
        for n, p, o in zip(self.names, self.params, self.offsets):
            if n not in state or state[n].numel() != p.numel():
                raise ValueError(f"DiLoCo's {what}: no state of the right size for parameter "
                                 f"{n!r}; load a checkpoint of the same model")
            whole[o:o + p.numel()] = state[n].reshape(-1)
        return [whole[lo:hi].clone() for lo, hi in self.bounds]

    def _momentum(self) -> list[torch.Tensor] | None:
        """Every fragment's outer momentum, or None before any sync (or without momentum).
        A fragment that has not synced yet has no buffer: given as zeros, which the outer
        SGD's first step treats exactly as none (0 x momentum + delta = delta)."""
        momentum = [self.outer.state.get(a, {}).get("momentum_buffer") for a in self.anchors]
        if not (self.algo.outer_momentum and any(m is not None for m in momentum)):
            return None
        return [torch.zeros_like(a) if m is None else m for a, m in zip(self.anchors, momentum)]

    def state_dict(self):
        self.finish()
        momentum = self._momentum()
        pending = {f: {"apply_at": s.apply_at, "delta": s.delta.cpu().clone(),
                       "start": None if s.start is None else s.start.cpu().clone()}
                   for f, s in self.pending.items()}
        out = {"steps": self.steps, "fragments": self.P, "sync_every": self.H,
               "anchor": self._by_name(self.anchors), "pending": pending,
               "outer_steps": list(self.outer_steps)}
        if momentum is not None:
            out["momentum"] = self._by_name(momentum)
        if self.compressor is not None:
            out["compressor"] = self.compressor.state_dict()
        return out

    def load_state_dict(self, state):
        self._load(state, with_compressor=True)

    def _load(self, state, *, with_compressor: bool) -> None:
        if (state.get("fragments"), state.get("sync_every")) != (self.P, self.H) \
                and state.get("pending"):
            raise ValueError("DiLoCo: a checkpoint with syncs in flight loads only with the "
                             "same fragments and sync_every")
        self.finish()
        self.pending.clear()
        with torch.no_grad():
            for a, t in zip(self.anchors, self._from_names(state["anchor"], "anchor")):
                a.copy_(t)
            # a resumed run's buffers are the checkpoint's (not part of the algorithm's state)
            self.synced_buffers = self._flat_buffers() if self.buffers else None
            self.outer.state.clear()
            if "momentum" in state:
                for a, t in zip(self.anchors, self._from_names(state["momentum"], "momentum")):
                    self.outer.state[a] = {"momentum_buffer": t.to(self.anchor_device)}
        for f, s in state.get("pending", {}).items():
            start = None if s["start"] is None else s["start"].to(self.device)
            self.pending[int(f)] = _Sync(s["delta"].to(self.device), start, None,
                                         int(s["apply_at"]))
        self.steps = int(state["steps"])
        # each fragment's outer steps (the warm-up's position); a checkpoint from before they
        # were saved, or of another fragments count: the most any fragment took
        saved = [int(k) for k in state.get("outer_steps", ())]
        if len(saved) != self.P:
            taken = max(saved, default=0 if "momentum" not in state else
                        self.algo.outer_warmup)
            saved = [taken] * self.P
        self.outer_steps = saved
        for k in self.counts_of:
            self.counts_of[k] = self.steps
        if with_compressor and "compressor" in state and self.compressor is not None:
            if state.get("fragments") == self.P:
                self.compressor.load_state_dict(state["compressor"])
            elif state["compressor"].get("residuals"):
                # residuals are kept per fragment: another split has other sizes
                logging.getLogger(__name__).warning(
                    "bagua DiLoCo: the checkpoint has fragments=%s, this run %s: the outer "
                    "gradient's error-feedback residuals restart at zero",
                    state.get("fragments"), self.P)

    def load_foreign_state_dict(self, state, *, world_size, rank):
        # Anchor, momentum, step counter and the averaged outer gradients in flight are the
        # same on every rank; a sync's starting point and error-feedback residuals are the
        # saving rank's: every rank continues as that rank would (the model it loaded is that
        # rank's too), and residuals restart at zero.
        self._load(state, with_compressor=False)
        note = None
        if state.get("compressor", {}).get("residuals"):
            note = "the outer gradient's error-feedback residuals are per rank and restart at 0"
        if self.pending:
            what = "syncs in flight land on the saving rank's starting point"
            note = f"{note}; {what}" if note else what
        return note

    def before_rebucket(self, ctx):
        return {}

    def after_rebucket(self, ctx, buckets, state):
        self._take_unfrozen(ctx.module)      # the module re-lays out when one is unfrozen

    def shutdown(self):
        self.finish()
        self.reducer.close()
