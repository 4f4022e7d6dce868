"""The per-step engine behind :class:`~bagua_algos.BaguaModule` (what torch DDP's C++
``Reducer`` does for DDP).

:class:`StepEngine` owns the buckets and the last bucket's flag slots, counts each gradient's
readiness in backward, launches the buckets in index order (the same on every rank), learns
the bucket order from the first synchronised backward, ends each backward (waits, scatters,
settles the "got a gradient" flags of unused parameters, averages sparse gradients), and runs
CUDA buckets' communication on a side stream.  The per-gradient part (hooks, readiness,
in-order launch, end-of-backward detection, the gather into a bucket) is compiled
(``_hot.ReadyLoop``), so a steady-state backward does not enter Python per parameter; it calls
back here once per step (:meth:`StepEngine._plan`), at the last bucket and at the end.  The
wrapper (``bagua_algos.module``), join
(:mod:`.join`), autotuning and fault tolerance use it only through the members documented
here: :attr:`~StepEngine.buckets`, :attr:`~StepEngine.bucket_size`, :attr:`~StepEngine.sync`,
:attr:`~StepEngine.joining`, :attr:`~StepEngine.tuner`, :attr:`~StepEngine.busy`,
:attr:`~StepEngine.order_due`, :meth:`~StepEngine.rebucket`, :meth:`~StepEngine.start_step`,
:meth:`~StepEngine.start_bucket`, :meth:`~StepEngine.shadow_backward`,
:meth:`~StepEngine.hook_outputs`, :meth:`~StepEngine.name_of`, :meth:`~StepEngine.detach`.
"""

from __future__ import annotations

import functools
import logging

import torch

import bagua_comm as bc

from . import _hot
from .bucket import BaguaBucket
from .checks import dtype_changed_error, late_accumulation_error, sparse_gradient_error
from .comm import broadcast_tensors
from .compiled import eager
from .consistency import check_same_bucket_size
from .join import early_termination, join_round
from .sparse import allreduce_sparse, sparse_parameters

logger = logging.getLogger("bagua_algos")


def _each_grad_tensor(out):
    if isinstance(out, torch.Tensor):
        return [out] if out.requires_grad else []
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]


def frozen_parameters(module: torch.nn.Module, bucketed) -> list[torch.Tensor]:
    """``module``'s parameters (once each) that require no gradient and are not among
    ``bucketed``: watched, so that one unfrozen later joins the buckets."""
    seen = {id(t) for t in bucketed}
    return [p for p in dict.fromkeys(module.parameters())
            if not p.requires_grad and id(p) not in seen]


def missing_grads(slotted, ready: set[int], used_nosync: set[int]) -> list | None:
    """Before the last buckets start: the bucketed tensors (``slotted``, in flag slot order)
    that got no gradient in this step (``ready``) nor in the ``no_sync()`` steps before it
    (``used_nosync``) and whose ``.grad`` is None.  None when every one got a gradient."""
    if len(ready) == len(slotted):
        return None
    used = ready | used_nosync
    return [t for t in slotted if id(t) not in used and t.grad is None]


def used_tensors(slotted, ready: set[int], used_nosync: set[int]) -> set[int] | None:
    """The ids of the bucketed tensors (``slotted``) that got a gradient in this step
    (``ready``) or in the ``no_sync()`` steps before it (``used_nosync``); None when every
    one did."""
    if len(ready) == len(slotted):
        return None
    return ready | used_nosync


def local_flags(out: torch.Tensor, slotted, used: set[int] | None) -> torch.Tensor:
    """Write the flags of :func:`used_tensors`' ``used`` into ``out`` (one per flag slot;
    1: the tensor got a gradient; None: every one did) and return it.  Every tensor has
    one when the last bucket starts during backward; only a step that misses some
    starts it at the end of backward, after :func:`missing_grads`."""
    if used is None:
        return out.fill_(1)
    local = torch.tensor([id(t) in used for t in slotted], dtype=out.dtype)
    if out.device.type == "cuda":   # a pageable host-to-device copy synchronises the host
        return out.copy_(local.pin_memory(), non_blocking=True)
    return out.copy_(local)


def start_unused_check(flags: torch.Tensor, group: bc.ProcessGroup):
    """For an algorithm whose communication cannot carry the flags, after every bucket's
    communication completed (the same order on every rank): reduce this rank's ``flags``
    (:func:`local_flags`) with MAX in a collective of their own, so that each rank knows
    which tensors no rank gave a gradient.  ``(flags, handle)``."""
    if group.size == 1:
        return flags, bc.Work.completed()   # one rank: nothing to reduce
    return flags, bc.allreduce_inplace(flags, bc.ReduceOp.MAX, group=group, async_op=True)


def drop_unused(flags: torch.Tensor, none_before, slotted) -> None:
    """A tensor no rank gave a gradient (its reduced flag is 0) keeps ``.grad`` None (DDP
    with ``find_unused_parameters=True``: the optimizer skips it); one used on some rank
    keeps the average, in which this rank's missing gradient counted as zero."""
    used = (flags.cpu() != 0).tolist()
    slot = {id(t): j for j, t in enumerate(slotted)}
    for t in none_before:
        if not used[slot[id(t)]]:
            t.grad = None


def learnt_order(observed: list[int], tensors, group: bc.ProcessGroup,
                 src: int = 0) -> list[int] | None:
    """The tensors' order (indices into ``tensors``) by when their gradients became ready in
    the first synchronised backward (``observed`` ids), as rank ``src`` saw it (every rank
    takes its order; collective); None when it is the order they have."""
    index = {id(t): i for i, t in enumerate(tensors)}
    order = [index[k] for k in observed if k in index]
    if group.size > 1:
        order = bc.broadcast_object(order if group.rank == src else None, src, group=group)
    seen = set(order)
    order += [i for i in range(len(tensors)) if i not in seen]
    return None if order == list(range(len(tensors))) else order


def make_buckets(impl, tensors, names: list[str], bucket_size: int, *, flatten: bool,
                 first: bool = False) -> list[BaguaBucket]:
    """``tensors`` (named ``names``) in buckets: by ``impl``'s rule for ``bucket_size``, or,
    when ``first``, as DDP's first iteration (one bucket per dtype and device in registration
    order, no size limit).  The last bucket (the last to start, on every rank) has one flag
    slot per bucketed tensor."""
    if first:       # registration order (tensors come reversed), no size limit
        keyed: dict = {}
        for t in reversed(tensors):
            keyed.setdefault((t.dtype, t.device), []).append(t)
        groups = list(keyed.values())
    else:
        groups = impl.tensors_to_buckets(tensors, bucket_size)
    # a group of zero-size tensors only has nothing to communicate (and compressors need
    # a positive length): its tensors stay out of the buckets, as unused ones would
    groups = [g for g in groups if any(t.numel() for t in g)]
    align = impl.bucket_alignment()
    name_of = {id(t): n for t, n in zip(tensors, names)}
    slots = sum(len(g) for g in groups)
    return [BaguaBucket(i, ps, alignment=align, flatten=flatten,
                        flatten_weights=impl.flatten_weights,
                        names=[name_of[id(p)] for p in ps],
                        flag_slots=slots if i == len(groups) - 1 else 0)
            for i, ps in enumerate(groups)]


def shadow_buckets(buckets, start_bucket, carried: bool, group: bc.ProcessGroup,
                   flags) -> None:
    """A joined rank's bucket collectives: every bucket in index order with a zero gradient
    (started by ``start_bucket``), the "got a gradient" flags (written by ``flags(out)``) in
    the last bucket when the algorithm ``carried`` them there, else in the active ranks' own
    flag collective after the buckets."""
    handles = []
    for b in buckets:
        b.grad_and_flags.zero_()
        if b.flags is not None and carried:
            flags(b.flags)
        handles.append(start_bucket(b))
    for h in handles:
        if h is not None:
            h.wait()
    if buckets and not carried:       # the active ranks' own flag collective
        slots = sum(len(b.params) for b in buckets)
        out = flags(torch.empty(slots, dtype=torch.uint8))
        bc.allreduce_inplace(out, bc.ReduceOp.MAX, group=group)


def reduce_sparse(sparse, group: bc.ProcessGroup, average: bool) -> None:
    """Average the sparse gradients of ``sparse``, one weight after another in registration
    order (the same on every rank), after every bucket's communication (a hierarchical
    algorithm's thread is done with the group by then).  A weight no rank gave a gradient
    keeps ``.grad`` None."""
    if group.size == 1:
        return
    for p in sparse:
        p.grad = allreduce_sparse(p.grad, p, group, average)


class StepEngine:
    """Buckets, hooks and overlap of one wrapped model under one algorithm implementation.

    Members for the rest of ``bagua_algos`` (nothing else is read or written from outside):

    - ``buckets``: the current buckets; ``bucket_size``: their size in bytes.
    - ``sync``: False inside ``no_sync()`` (gradients accumulate locally).
    - ``joining``: None, or ``{"throw": bool}`` inside ``join()``.
    - ``tuner``: None, or an object whose ``on_step(owner)`` runs at each step's start.
    - ``hooks``: the handles of every hook the engine registered.
    - :attr:`busy`, :attr:`order_due`, :meth:`rebucket`, :meth:`start_step`,
      :meth:`start_bucket`, :meth:`shadow_backward`, :meth:`hook_outputs`, :meth:`name_of`,
      :meth:`detach`.
    """

    _layout_stale = False

    def __init__(self, owner: torch.nn.Module, ctx, impl, algorithm, bucket_size: int, *,
                 do_flatten: bool, broadcast_buffers: bool):
        self.owner, self.ctx, self.impl, self.algorithm = owner, ctx, impl, algorithm
        self.group, self.optimizers, self.do_flatten = ctx.group, ctx.optimizers, do_flatten
        self.bucket_size = bucket_size
        self.sync = True
        self.joining: dict | None = None
        self.tuner = None
        self.hooks: list = []
        # the per-gradient state and hooks (compiled): readiness, launch, end of backward;
        # bucket order: the gradient-ready order of the first synchronised backward (as DDP)
        self._loop = _hot.ReadyLoop(self)
        self._comm_stream = None
        self._order_pending = False
        module = ctx.module
        # Embedding(sparse=True) weights under an algorithm that averages them by a sparse
        # exchange of their own (GradientAllReduce): kept out of the dense buckets
        self._sparse = (sparse_parameters(owner.module)
                        if algorithm.sparse_allreduce and impl.uses_grad_buckets else [])
        self._sparse_average = getattr(impl, "op", bc.ReduceOp.AVG) is bc.ReduceOp.AVG
        self._names_by_id = {id(p): n for n, p in module.named_parameters()}
        self._tensors = self._bucketed(impl.init_tensors(ctx))
        self._set_names()
        self._frozen = frozen_parameters(owner.module, self._tensors)
        # DDP's broadcast_buffers: the buffers, listed once (as DDP does)
        self._sync_buffers = (list(dict.fromkeys(owner.module.buffers()))
                              if broadcast_buffers and impl.synchronous and self.group.size > 1
                              else [])
        # DDP's timing: a forward broadcasts the buffers when the forward before it was a
        # synchronised one with autograd on (require_forward_param_sync): the first
        # micro-batch of a no_sync() cycle, an evaluation forward right after a step
        self._buffers_due = True
        self._carried = False      # this step's flags ride in the last bucket's allreduce
        # DDP's first iteration: one bucket per dtype in registration order, until the
        # gradient-ready order of the first synchronised backward is known (then DDP's rule)
        self._first_layout = impl.ddp_first_layout
        self._set_buckets(self._make_buckets(self._tensors, bucket_size,
                                             first=self._first_layout))
        impl.init_operations(ctx, self.buckets)
        self._register_hooks()

    # -- names and buckets --------------------------------------------------------------------
    def name_of(self, tensor: torch.Tensor, default: str = "?") -> str:
        """The wrapped model's name of parameter ``tensor`` (``default`` if it has none)."""
        return self._names_by_id.get(id(tensor), default)

    @property
    def busy(self) -> bool:
        """Whether a backward is under way (its end-of-backward callback queued or bucket
        communication in flight): re-bucketing must wait, a fault-tolerant step is dirty."""
        return self._loop.cb_queued or bool(self._loop.handles)

    def _bucketed(self, tensors) -> list[torch.Tensor]:
        """``tensors`` less the sparse-gradient weights averaged on their own."""
        sparse = {id(p) for p in self._sparse}
        return [t for t in tensors if id(t) not in sparse]

    def _set_names(self) -> None:
        self._names = [self.name_of(t, f"tensor{i}") for i, t in enumerate(self._tensors)]

    def _make_buckets(self, tensors, bucket_size, first: bool = False) -> list[BaguaBucket]:
        return make_buckets(self.impl, tensors, self._names, bucket_size,
                            flatten=self.do_flatten, first=first)

    def _set_buckets(self, buckets) -> None:
        self.buckets = buckets
        self.ctx.buckets = buckets
        self._slotted = [p for b in buckets for p in b.params]   # flag slot order
        self._loop.set_buckets(buckets)

    def rebucket(self, bucket_size: int) -> None:
        """Collective: re-group into buckets of ``bucket_size`` bytes, carrying the
        algorithm's state (see :meth:`BaguaModule.rebucket`); ``bucket_size`` is checked."""
        if self.busy:
            raise RuntimeError("rebucket() was called during backward; call it between "
                               "steps (after optimizer.step(), before the next forward)")
        check_same_bucket_size(bucket_size, self.group)   # a size that differs would hang
        if self._order_pending:
            self._fix_order(relayout=False)
        if bucket_size == self.bucket_size and not self._layout_stale:
            return
        self._relayout(bucket_size)

    def _relayout(self, bucket_size: int) -> None:
        state = self.impl.before_rebucket(self.ctx)
        self._first_layout = False
        self._set_buckets(self._make_buckets(self._tensors, bucket_size))
        for b in self.buckets:
            b.adopt_grads()
        self.impl.after_rebucket(self.ctx, self.buckets, state)
        self.bucket_size = bucket_size
        self._layout_stale = False

    def _fix_order(self, relayout: bool = True, src: int = 0) -> None:
        """Once, at the start of the second step: order the tensors by when their gradients
        became ready in the first synchronised backward, as rank ``src`` saw it (every rank
        takes its order; rank 0 unless joining ranks had none), and rebuild the buckets in
        that order.  A rank that has seen no backward yet takes it too, and observes no
        more: the layout is fixed once, on every rank alike."""
        self._order_pending = self._loop.observing = False
        observed, self._loop.observed = self._loop.observed, []
        if not self.impl.uses_grad_buckets:   # weight buckets: readiness order is moot
            return
        order = learnt_order(observed, self._tensors, self.group, src)
        if order is not None:
            self._tensors = [self._tensors[i] for i in order]
            self._names = [self._names[i] for i in order]
        elif not self._first_layout:    # DDP's first buckets are always rebuilt
            return
        self._layout_stale = True
        if relayout:
            self._relayout(self.bucket_size)

    # -- forward ------------------------------------------------------------------------------
    def _register_hooks(self) -> None:
        self.hooks.append(self.owner.register_forward_pre_hook(self._forward_pre_hook))
        for p in self._tensors:
            self.hooks.append(p.register_post_accumulate_grad_hook(_hot.LoopHook(self._loop)))
        for p in self._sparse:
            self.hooks.append(p.register_post_accumulate_grad_hook(_hot.LoopHook(self._loop, True)))
        for opt in self.optimizers:
            self.hooks.append(opt.register_step_post_hook(self._optimizer_stepped))

    def _forward_pre_hook(self, module, inputs) -> None:
        eager(self._forward_pre, module, inputs)

    def _forward_pre(self, _module, _inputs) -> None:
        grad = torch.is_grad_enabled()
        # a step is any synchronised forward with autograd on, in train or eval mode (DDP's
        # rule: fine-tuning with the whole model in eval mode communicates as in train mode)
        step = grad and self.sync
        buffers = self._buffers_due and bool(self._sync_buffers)
        self._buffers_due = grad and self.sync
        if not (step or buffers):
            return
        src = 0                     # buffers: rank 0's; while joining, the highest active
        order = 0 if self._order_pending else -1
        if self.joining is not None:
            ranks, _, order = join_round(self.group, True, buffers, step,
                                         order=self._order_pending)
            if len(ranks) < self.group.size and self.joining["throw"]:
                raise early_termination(self.group)
            src = ranks[-1]
        self.start_step(src, buffers, step, order)

    @property
    def order_due(self) -> bool:
        """Whether this rank's one-time bucket order is due: it has seen its first
        synchronised backward and not yet re-bucketed by it (see :func:`.join.join_round`)."""
        return self._order_pending

    def start_step(self, src: int, buffers: bool = True, step: bool = True,
                   order: int = -1) -> None:
        """A forward's collectives (and a joined rank's shadow of them): the buffers from rank
        ``src`` when ``buffers``; when ``step`` (a synchronised training forward), the
        one-time bucket order (from rank ``order``, when >= 0), the tuner, the algorithm's
        hook."""
        if step and self._frozen and any(p.requires_grad for p in self._frozen):
            self._adopt_unfrozen()
        if buffers and self._sync_buffers:
            broadcast_tensors(self._sync_buffers, self.group, src)
        if not step:
            return
        if order >= 0:
            self._fix_order(src=order)
        self.ctx.step += 1
        if self.tuner is not None:
            self.tuner.on_step(self.owner)     # may switch configuration, on every rank
        self.impl.forward_pre_hook(self.ctx)

    def _adopt_unfrozen(self) -> None:
        """Parameters frozen at ``with_bagua`` that now require a gradient join the buckets
        (collective: every rank unfreezes them before the same forward, as the same training
        code does).  They start from rank 0's values; the algorithm's state is carried."""
        newly = [p for p in self._frozen if p.requires_grad]
        self._frozen = [p for p in self._frozen if not p.requires_grad]
        if self.group.size > 1:
            broadcast_tensors(newly, self.group)
        self._names_by_id = {id(p): n for n, p in self.ctx.module.named_parameters()}
        if self.group.rank == 0:
            logger.warning("bagua_algos: parameters frozen at with_bagua now require a gradient; "
                           f"they take rank 0's values and {type(self.algorithm).__name__} "
                           f"synchronises them from now on: {[self.name_of(p) for p in newly]}")
        known = {id(t) for t in self._tensors}
        if self.algorithm.sparse_allreduce and self.impl.uses_grad_buckets:
            had = {id(p) for p in self._sparse}
            for p in sparse_parameters(self.owner.module):
                if id(p) not in had:      # an Embedding(sparse=True) unfrozen: on its own
                    self._sparse.append(p)
                    self.hooks.append(
                        p.register_post_accumulate_grad_hook(_hot.LoopHook(self._loop, True)))
        self._tensors = self._bucketed(self.impl.init_tensors(self.ctx))
        self._set_names()
        for p in self._tensors:
            if id(p) not in known:
                self.hooks.append(p.register_post_accumulate_grad_hook(_hot.LoopHook(self._loop)))
        self._relayout(self.bucket_size)

    # -- backward -----------------------------------------------------------------------------
    def hook_outputs(self, out) -> None:
        """End-of-backward detection for a synchronised forward's output ``out``: a hook on
        the outputs queues the callback in the backward pass that reaches them, the outermost
        one, so that the inner backward passes of reentrant activation checkpointing do not
        each end a step."""
        for t in _each_grad_tensor(out):
            t.register_hook(self._loop.output_grad)

    # -- called by the compiled loop (``_hot.ReadyLoop``) ------------------------------------
    def _plan(self) -> list:
        """Per bucket, ``(scale, start)`` for this step: the factor its gradients are
        multiplied by while gathered (None: none) and the no-argument callable that starts
        its communication (on the side stream for a CUDA bucket).  Asked once per step."""
        launchers = self.impl.bucket_launchers(self.ctx, self.buckets)
        if launchers is self._plan_of:
            return self._plan_cache
        plan = []
        for b, (divisor, start) in zip(self.buckets, launchers):
            if b.device.type == "cuda":
                start = functools.partial(self._on_stream, b.device, start)
            plan.append((None if divisor is None else 1.0 / divisor, start))
        self._plan_of, self._plan_cache = launchers, plan
        return plan

    _plan_of = _plan_cache = None

    def _last_bucket(self, bucket: BaguaBucket) -> None:
        """Before the last bucket starts (every rank knows its flags now): the flags ride in
        its collective when the algorithm carries them."""
        self._carried = self.impl.carries_unused_flags(self.ctx)
        if self._carried:
            self._local_flags(bucket.flags)

    def _gather_failed(self, bucket: BaguaBucket, err: RuntimeError) -> None:
        changed = dtype_changed_error(bucket, self.name_of)
        if changed is not None:
            raise changed from err

    def _sparse_error(self, param) -> Exception:
        return sparse_gradient_error(self.name_of(param), self.algorithm)

    def _late_error(self, param, n: int, expected: int) -> Exception:
        return late_accumulation_error(self.name_of(param), n, expected)

    def start_bucket(self, bucket: BaguaBucket):
        """Start the algorithm's communication of a ready ``bucket`` (on the side stream for
        a CUDA bucket): its handle (or None)."""
        if bucket.device.type == "cuda":
            return self._launch_on_stream(bucket)
        return self.impl.bucket_ready_hook(self.ctx, bucket)

    def _launch_on_stream(self, bucket):
        return self._on_stream(bucket.device, functools.partial(self.impl.bucket_ready_hook,
                                                                self.ctx, bucket))

    def _on_stream(self, device, start):
        # No host synchronisation: the side stream waits for the gradients on the GPU.
        if self._comm_stream is None:
            self._comm_stream = torch.cuda.Stream(device=device)
        self._comm_stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self._comm_stream):
            return start()

    def shadow_backward(self) -> None:
        """A joined rank's backward (no data): every bucket in index order with a zero
        gradient, the "got a gradient" flags as this rank's last synchronised backward set
        them (all, before any; as DDP's joined rank), in the last bucket or in the active
        ranks' own flag collective, the sparse exchanges, the algorithm's post-backward
        hook: the collectives an active rank's backward issues."""
        shadow_buckets(self.buckets, self.start_bucket,
                       self.impl.carries_unused_flags(self.ctx), self.group,
                       lambda out: local_flags(out, self._slotted, self._last_used))
        for p in self._sparse:
            allreduce_sparse(None, p, self.group, self._sparse_average)
        self.impl.post_backward_hook(self.ctx)

    # -- end of backward ----------------------------------------------------------------------
    def _backward_end(self) -> None:
        check = None
        loop = self._loop
        handles = loop.handles
        try:
            grads = self.impl.uses_grad_buckets
            none_before = (missing_grads(self._slotted, loop.ready, loop.used_nosync)
                           if grads else None)
            loop.launch(True)
            # The flags rode in the last bucket's allreduce (GradientAllReduce: one collective
            # per step), or are reduced in a collective of their own: beside the buckets'
            # communication where the algorithm leaves the group's channel free
            # (unused_check_beside: ByteGrad, QAdam), else only after it is done: an
            # algorithm may run a chain of blocking collectives on the group from its own
            # thread (LowRank's P then Q, the sparse allgathers), and a collective issued
            # beside it would interleave in a different order on different ranks (gloo:
            # "collective mismatch", exit -6).
            own_check = grads and self.buckets and not self._carried
            if own_check and self.impl.unused_check_beside:
                check = self._unused_check()
            for _, handle in handles:
                if handle is not None:
                    handle.wait()
            if own_check and check is None:
                check = self._unused_check()
            if self._comm_stream is not None:     # GPU: order, don't block the host
                torch.cuda.current_stream(self._comm_stream.device).wait_stream(
                    self._comm_stream)
            for b, _ in handles:
                if not b.flatten:
                    b.scatter_grads()
            if check is not None:
                check[1].wait()
            if none_before:
                drop_unused(check[0] if check is not None else self.buckets[-1].flags,
                            none_before, self._slotted)
            if self._sparse:
                reduce_sparse(self._sparse, self.group, self._sparse_average)
        finally:
            self._carried = False
            loop.reset()
            if loop.observing:
                loop.observing = False
                self._order_pending = True
        self.impl.post_backward_hook(self.ctx)

    # a joined rank reports, in the steps it shadows, which tensors its last synchronised
    # backward gave a gradient (None: all of them, also before any), as DDP's joined rank
    # reports its last local-used map: a tensor only it used gets a zero gradient elsewhere
    _last_used: set[int] | None = None

    def _local_flags(self, out: torch.Tensor) -> torch.Tensor:
        self._last_used = used_tensors(self._slotted, self._loop.ready, self._loop.used_nosync)
        return local_flags(out, self._slotted, self._last_used)

    def _unused_check(self):
        flags = self._local_flags(torch.empty(len(self._slotted), dtype=torch.uint8))
        return start_unused_check(flags, self.group)

    def _optimizer_stepped(self, optimizer, _args, _kwargs) -> None:
        self.impl.post_optimizer_step_hook(self.ctx, optimizer)

    def detach(self) -> None:
        """Remove every hook and stop the algorithm (switching algorithm, or closing)."""
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
        self.impl.shutdown()
