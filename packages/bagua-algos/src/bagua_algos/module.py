"""``with_bagua`` and :class:`BaguaModule`: buckets, hooks and overlap for any algorithm."""

from __future__ import annotations

import contextlib
import copy
import logging
import warnings
from collections.abc import Iterable

import torch
from torch.autograd import Variable

import bagua_comm as bc

from ._engine import consistency as _consistency
from ._engine.bucket import BaguaBucket
from ._engine.checks import check_bucket_size, check_model
from ._engine.comm import broadcast_tensors
from ._engine.compiled import eager as _eager
from ._engine.compiled import uncompiled as _uncompiled
from ._engine.join import check_joinable, early_termination, final_sync, join_round, shadow_step
from ._engine.sparse import allreduce_sparse, sparse_parameters
from .algorithm import Algorithm, AlgorithmImpl, BaguaContext
from .tuning import autotune as _autotune

DEFAULT_BUCKET_SIZE = 10 * 1024 * 1024
_STATE_KEY = "bagua_algos"
logger = logging.getLogger("bagua_algos")


def with_bagua(model: torch.nn.Module, optimizers=(), algorithm: Algorithm | None = None, *,
               group: bc.ProcessGroup | None = None, do_flatten: bool = True,
               bucket_size: int | None = None, autotune: bool | dict = False,
               broadcast_buffers: bool = True) -> BaguaModule:
    """Wrap ``model`` for data-parallel training with ``algorithm``.

    Every rank ends up with rank 0's parameters, buffers and optimizer state.  Gradients (or
    weights) are grouped into buckets of ``bucket_size`` bytes (default 10 MiB) per dtype, in
    reverse registration order; with ``do_flatten`` the gradients become views of the bucket
    buffers.  Each bucket's communication starts as soon as its last gradient is accumulated
    and is waited for at the end of backward.  Calling ``with_bagua`` again on the returned
    module switches it to another algorithm.

    ``broadcast_buffers=True`` (DDP's default): with a synchronous algorithm
    (GradientAllReduce, ByteGrad, QAdam, TopK, LowRank) rank 0's buffers (BatchNorm running
    statistics) are broadcast at the start of the forward after a synchronised one with
    autograd on (DDP's timing: every training step starts from them, a no_sync() cycle in
    its first micro-batch, an evaluation forward right after a step sees them too); the
    other algorithms leave each rank its own buffers (their pages say how they treat them).

    ``autotune=True`` (or ``BAGUA_AUTOTUNE=1``) tunes the bucket size (and other knobs that
    leave the algorithm's maths unchanged) during the first steps of training, starting from
    ``bucket_size``; see :meth:`BaguaModule.autotune_report`.
    """
    bucket_given = bucket_size is not None
    bucket_size = DEFAULT_BUCKET_SIZE if bucket_size is None else bucket_size
    if not isinstance(broadcast_buffers, bool):
        raise ValueError(f"broadcast_buffers must be True or False, got {broadcast_buffers!r}")
    check_bucket_size(bucket_size)
    autotune = _autotune.resolve_options(autotune)     # validated before any communication
    rewrap = isinstance(model, BaguaModule)
    if rewrap:
        model.detach_algorithm()
        model = model.module
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    optimizers = list(optimizers or [])
    for i, opt in enumerate(optimizers):
        if not isinstance(opt, torch.optim.Optimizer):
            raise ValueError(f"optimizers[{i}] must be a torch.optim.Optimizer, got "
                             f"{type(opt).__name__}")
    if isinstance(algorithm, str) and algorithm == "auto":  # measure the network, choose
        from .tuning.recommend import resolve_algorithm
        rec = resolve_algorithm(algorithm, model, group)
        algorithm = rec.algorithm
        if rec.bucket_size and not bucket_given:   # the same on every rank (broadcast)
            bucket_size = rec.bucket_size
    if not isinstance(algorithm, Algorithm):
        raise ValueError("algorithm must be a bagua_algos.Algorithm (e.g. GradientAllReduce() or "
                         f"Algorithm.init('gradient_allreduce')), got {type(algorithm).__name__}")
    check_model(model, algorithm)              # every rank, before any communication
    algorithm.check_wrap(model, optimizers)
    if not bc.is_initialized() and torch.distributed.is_initialized():
        bc.init_process_group()  # adopt torch's default process group (DDP users' habit)
    if not bc.is_initialized():
        raise RuntimeError("bagua_comm is not initialised: call bagua_comm.init_process_group() "
                           "before with_bagua()")
    group = bc.get_default_group() if group is None else group
    if not isinstance(group, bc.ProcessGroup) or not group.is_member():
        raise ValueError(f"group must be a bagua_comm.ProcessGroup containing this rank, "
                         f"got {group!r}")
    if not rewrap and group.rank == 0 and any(opt.state for opt in optimizers):
        logger.warning(
            "with_bagua: the optimizer already holds state. If it came from "
            "optimizer.load_state_dict() of a checkpoint, the algorithm's state saved in it "
            "(step counter, error-feedback residuals, replicas) was dropped: load checkpoints "
            "after with_bagua: model = with_bagua(model, [optimizer], algorithm); "
            "model.load_state_dict(ck['model']); optimizer.load_state_dict(ck['optimizer'])")
    _consistency.check_same_on_every_rank(_consistency.configuration(
        model, optimizers, algorithm,
        {"do_flatten": do_flatten, "bucket_size": bucket_size, "autotune": autotune}), group)
    return BaguaModule(model, optimizers, algorithm, group, do_flatten, bucket_size,
                       autotune=autotune, broadcast_buffers=broadcast_buffers)


def _broadcast_tensors(tensors: Iterable[torch.Tensor], group: bc.ProcessGroup) -> None:
    if group.size > 1:
        broadcast_tensors(tensors, group)


def _flat_on_one_level(algorithm: Algorithm, group: bc.ProcessGroup) -> Algorithm:
    """The algorithm to run: a hierarchical mode needs several nodes with several processes
    each.  On one node there is no inter-node link to save, and a hierarchical mode would
    reduce everything in full precision inside the node (ByteGrad, QAdam and
    LowPrecisionDecentralized would compress nothing); with one process per node it is the
    flat mode with extra groups.  Either way the flat mode runs, said in one log line."""
    if getattr(algorithm, "hierarchical", False) is not True:
        return algorithm
    nodes, size = group.num_nodes, group.size
    if 1 < nodes < size:
        return algorithm
    if getattr(algorithm, "peer_selection_mode", None) == "shift_one" and size % 2:
        return algorithm              # flat shift_one needs an even number of ranks
    flat = copy.copy(algorithm)
    flat.hierarchical = False
    if group.rank == 0 and size > 1:
        where = "one node" if nodes == 1 else "one process per node"
        logger.warning(f"bagua_algos: {type(algorithm).__name__}(hierarchical=True) runs flat "
                       f"(hierarchical=False) on {where} ({size} processes): hierarchical "
                       "modes pay off only between nodes of several processes each")
    return flat


class BaguaModule(torch.nn.Module):
    """A model wrapped by :func:`with_bagua`. ``forward`` passes through to ``.module``."""

    def __init__(self, module, optimizers, algorithm, group, do_flatten, bucket_size, *,
                 autotune: dict | None = None, broadcast_buffers: bool = True):
        super().__init__()
        self.module = module
        self.algorithm = algorithm
        self.optimizers = optimizers
        self.group = group
        self.do_flatten = do_flatten
        self.ctx = BaguaContext(_uncompiled(module), optimizers, group)
        self._bucket_size = bucket_size
        self._sync = True
        self._handles: list = []
        self._hooks: list = []
        self._cb_queued = False
        self._ready: set[int] = set()
        self._fires: dict[int, int] = {}           # this backward's accumulations per tensor
        self._expected_fires: dict[int, int] = {}  # the most seen in one backward (if > 1)
        self._comm_stream = None
        # bucket order: the gradient-ready order of the first synchronised backward (as DDP)
        self._observing = True
        self._observed: list[int] = []
        self._order_pending = False

        _broadcast_tensors(list(module.parameters()) + list(module.buffers()), group)
        for opt in optimizers if group.size > 1 else ():
            state = bc.broadcast_object(opt.state_dict() if group.rank == 0 else None, 0,
                                        group=group)
            if group.rank != 0:
                opt.load_state_dict(state)

        self.impl: AlgorithmImpl = _flat_on_one_level(algorithm, group).reify(group)
        # Embedding(sparse=True) weights under an algorithm that averages them by a sparse
        # exchange of their own (GradientAllReduce): kept out of the dense buckets
        self._sparse = (sparse_parameters(module)
                        if algorithm.sparse_allreduce and self.impl.uses_grad_buckets else [])
        self._sparse_average = getattr(self.impl, "op", bc.ReduceOp.AVG) is bc.ReduceOp.AVG
        self._tensors = self._bucketed(self.impl.init_tensors(self.ctx))
        self._set_names()
        # parameters frozen now: watched, so that one unfrozen later joins the buckets
        seen = {id(t) for t in self._tensors}
        self._frozen = [p for p in dict.fromkeys(module.parameters())
                        if not p.requires_grad and id(p) not in seen]
        # DDP's broadcast_buffers: the buffers, listed once (as DDP does)
        self._sync_buffers = (list(dict.fromkeys(module.buffers()))
                              if broadcast_buffers and self.impl.synchronous and group.size > 1
                              else [])
        # DDP's timing: a forward broadcasts the buffers when the forward before it was a
        # synchronised one with autograd on (require_forward_param_sync): the first
        # micro-batch of a no_sync() cycle, an evaluation forward right after a step
        self._buffers_due = True
        self._used_nosync: set[int] = set()    # gradients accumulated under no_sync()
        self._carried = False      # this step's flags ride in the last bucket's allreduce
        self._join: dict | None = None      # inside join(): {"throw": bool}
        # DDP's first iteration: one bucket per dtype in registration order, until the
        # gradient-ready order of the first synchronised backward is known (then DDP's rule)
        self._first_layout = self.impl.ddp_first_layout
        self._set_buckets(self._make_buckets(self._tensors, bucket_size,
                                             first=self._first_layout))
        self.impl.init_operations(self.ctx, self.buckets)
        self._register_hooks()
        # autotuning (bagua_algos.tuning.autotune): collective, after the buckets exist
        self._autotuner = _autotune.Autotuner(self, autotune) if autotune else None

    def _bucketed(self, tensors) -> list[torch.Tensor]:
        """``tensors`` less the sparse-gradient weights averaged on their own."""
        sparse = {id(p) for p in self._sparse}
        return [t for t in tensors if id(t) not in sparse]

    def _set_names(self) -> None:
        names = {id(p): n for n, p in self.ctx.module.named_parameters()}
        self._names = [names.get(id(t), f"tensor{i}") for i, t in enumerate(self._tensors)]

    # -- buckets ------------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """Synchronised training forwards so far."""
        return self.ctx.step

    @step.setter
    def step(self, value: int) -> None:
        self.ctx.step = int(value)

    @property
    def bucket_size(self) -> int:
        """The current bucket size in bytes (see :meth:`rebucket`)."""
        return self._bucket_size

    def _make_buckets(self, tensors, bucket_size, first: bool = False) -> list[BaguaBucket]:
        if first:       # registration order (tensors come reversed), no size limit
            keyed: dict = {}
            for t in reversed(tensors):
                keyed.setdefault((t.dtype, t.device), []).append(t)
            groups = list(keyed.values())
        else:
            groups = self.impl.tensors_to_buckets(tensors, bucket_size)
        # a group of zero-size tensors only has nothing to communicate (and compressors need
        # a positive length): its tensors stay out of the buckets, as unused ones would
        groups = [g for g in groups if any(t.numel() for t in g)]
        align = self.impl.bucket_alignment()
        name_of = {id(t): n for t, n in zip(self._tensors, self._names)}
        # the last bucket (the last to start, on every rank) has one flag slot per tensor
        slots = sum(len(g) for g in groups)
        return [BaguaBucket(i, ps, alignment=align, flatten=self.do_flatten,
                            flatten_weights=self.impl.flatten_weights,
                            names=[name_of[id(p)] for p in ps],
                            flag_slots=slots if i == len(groups) - 1 else 0)
                for i, ps in enumerate(groups)]

    def _set_buckets(self, buckets) -> None:
        self.buckets = buckets
        self.ctx.buckets = buckets
        self._bucket_of = {id(p): b.index for b in buckets for p in b.params}
        self._slotted = [p for b in buckets for p in b.params]   # flag slot order
        self._pending = [len(b.params) for b in buckets]
        self._next = 0

    def rebucket(self, bucket_size: int) -> None:
        """Re-group the gradients (and weights) into buckets of ``bucket_size`` bytes.

        Collective: every rank calls it with the same value, between steps (not inside
        forward/backward).  The algorithm's state (residuals, replicas, momenta, pending
        averages) is carried into the new buckets, so training continues as before;
        GradientAllReduce gives the same results as a run that never re-bucketed.
        """
        check_bucket_size(bucket_size)
        if self._cb_queued or self._handles:
            raise RuntimeError("rebucket() was called during backward; call it between "
                               "steps (after optimizer.step(), before the next forward)")
        if self.group.size > 1:                      # a size that differs would hang later
            sizes = torch.tensor([bucket_size, -bucket_size], dtype=torch.int64)
            bc.allreduce_inplace(sizes, bc.ReduceOp.MAX, group=self.group)
            if int(sizes[0]) != -int(sizes[1]):
                raise ValueError(f"rebucket() got different bucket_size values on different "
                                 f"ranks (from {-int(sizes[1])} to {int(sizes[0])}); call it "
                                 "with the same value on every rank")
        if self._order_pending:
            self._fix_order(relayout=False)
        if bucket_size == self._bucket_size and not self._layout_stale:
            return
        self._relayout(bucket_size)

    _layout_stale = False

    def _relayout(self, bucket_size: int) -> None:
        state = self.impl.before_rebucket(self.ctx)
        self._first_layout = False
        self._set_buckets(self._make_buckets(self._tensors, bucket_size))
        for b in self.buckets:
            b.adopt_grads()
        self.impl.after_rebucket(self.ctx, self.buckets, state)
        self._bucket_size = bucket_size
        self._layout_stale = False

    def _fix_order(self, relayout: bool = True, src: int = 0) -> None:
        """Once, at the start of the second step: order the tensors by when their gradients
        became ready in the first synchronised backward, as rank ``src`` saw it (every rank
        takes its order; rank 0 unless joining ranks had none), and rebuild the buckets in
        that order.  A rank that has seen no backward yet takes it too, and observes no
        more: the layout is fixed once, on every rank alike."""
        self._order_pending = self._observing = False
        observed, self._observed = self._observed, []
        if not self.impl.uses_grad_buckets:   # weight buckets: readiness order is moot
            return
        index = {id(t): i for i, t in enumerate(self._tensors)}
        order = [index[k] for k in observed if k in index]
        if self.group.size > 1:
            order = bc.broadcast_object(order if self.group.rank == src else None, src,
                                        group=self.group)
        seen = set(order)
        order += [i for i in range(len(self._tensors)) if i not in seen]
        if order == list(range(len(self._tensors))):
            if self._first_layout:
                self._layout_stale = True
                if relayout:
                    self._relayout(self._bucket_size)
            return
        self._tensors = [self._tensors[i] for i in order]
        self._names = [self._names[i] for i in order]
        self._layout_stale = True
        if relayout:
            self._relayout(self._bucket_size)

    # -- hooks --------------------------------------------------------------------------------
    def _register_hooks(self) -> None:
        self._hooks.append(self.register_forward_pre_hook(self._forward_pre_hook))
        for p in self._tensors:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_ready))
        for p in self._sparse:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._sparse_ready))
        for opt in self.optimizers:
            self._hooks.append(opt.register_step_post_hook(self._optimizer_stepped))
        if self.optimizers:
            opt = self.optimizers[0]
            self._hooks.append(opt.register_state_dict_post_hook(self._save_into_optimizer))
            self._hooks.append(opt.register_load_state_dict_pre_hook(self._load_from_optimizer))

    def _forward_pre_hook(self, module, inputs) -> None:
        _eager(self._forward_pre, module, inputs)

    def _forward_pre(self, _module, _inputs) -> None:
        grad = torch.is_grad_enabled()
        # a step is any synchronised forward with autograd on, in train or eval mode (DDP's
        # rule: fine-tuning with the whole model in eval mode communicates as in train mode)
        step = grad and self._sync
        buffers = self._buffers_due and bool(self._sync_buffers)
        self._buffers_due = grad and self._sync
        if not (step or buffers):
            return
        src = 0                     # buffers: rank 0's; while joining, the highest active
        order = 0 if self._order_pending else -1
        if self._join is not None:
            ranks, _, order = join_round(self.group, True, buffers, step,
                                         order=self._order_pending)
            if len(ranks) < self.group.size and self._join["throw"]:
                raise early_termination(self.group)
            src = ranks[-1]
        self._start_step(src, buffers, step, order)

    def _start_step(self, src: int, buffers: bool = True, step: bool = True,
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
        if self._autotuner is not None:
            self._autotuner.on_step(self)     # may switch configuration, on every rank
        self.impl.forward_pre_hook(self.ctx)

    def _adopt_unfrozen(self) -> None:
        """Parameters frozen at ``with_bagua`` that now require a gradient join the buckets
        (collective: every rank unfreezes them before the same forward, as the same training
        code does).  They start from rank 0's values; the algorithm's state is carried."""
        newly = [p for p in self._frozen if p.requires_grad]
        self._frozen = [p for p in self._frozen if not p.requires_grad]
        _broadcast_tensors(newly, self.group)
        if self.group.rank == 0:
            names = {id(p): n for n, p in self.ctx.module.named_parameters()}
            logger.warning("bagua_algos: parameters frozen at with_bagua now require a gradient; "
                           f"they take rank 0's values and {type(self.algorithm).__name__} "
                           f"synchronises them from now on: {[names.get(id(p), '?') for p in newly]}")
        known = {id(t) for t in self._tensors}
        if self.algorithm.sparse_allreduce and self.impl.uses_grad_buckets:
            had = {id(p) for p in self._sparse}
            for p in sparse_parameters(self.module):
                if id(p) not in had:      # an Embedding(sparse=True) unfrozen: on its own
                    self._sparse.append(p)
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._sparse_ready))
        self._tensors = self._bucketed(self.impl.init_tensors(self.ctx))
        self._set_names()
        for p in self._tensors:
            if id(p) not in known:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_ready))
        self._relayout(self._bucket_size)

    def _hook_outputs(self, out) -> None:
        """End-of-backward detection: a hook on the outputs queues the callback in the
        backward pass that reaches them, the outermost one, so that the inner backward passes
        of reentrant activation checkpointing do not each end a step."""
        if isinstance(out, torch.Tensor):
            if out.requires_grad:
                out.register_hook(self._output_grad)
            return
        from torch.utils._pytree import tree_leaves

        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._output_grad)

    def _output_grad(self, _grad) -> None:
        if self._sync and not self._cb_queued:
            self._cb_queued = True
            Variable._execution_engine.queue_callback(self._backward_end)

    def _grad_ready(self, param) -> None:
        if param.grad is not None and param.grad.is_sparse and self.impl.uses_grad_buckets:
            names = {id(p): n for n, p in self.ctx.module.named_parameters()}
            how = ("make it dense (e.g. Embedding(sparse=False)), or compute it through an "
                   "nn.Embedding/EmbeddingBag(sparse=True) module, whose gradients "
                   f"{type(self.algorithm).__name__} averages sparsely"
                   if self.algorithm.sparse_allreduce else
                   "make it dense (e.g. Embedding(sparse=False))")
            raise ValueError(f"parameter {names.get(id(param), '?')!r} got a sparse gradient; "
                             f"{type(self.algorithm).__name__} reduces gradients in dense "
                             f"buckets: {how}")
        if not self._sync:
            self._used_nosync.add(id(param))
            return
        if not self._cb_queued:           # outputs not hooked (used without forward)
            self._cb_queued = True
            Variable._execution_engine.queue_callback(self._backward_end)
        key = id(param)
        i = self._bucket_of.get(key)
        if i is None:
            return
        # A weight used in several reentrant-checkpointed segments (a shared block) has its
        # gradient accumulated, and this hook run, once per segment: it is ready after the
        # most accumulations seen in a backward (learnt in the first one, which launches
        # nothing before its end, as DDP's static_graph), not after the first.
        n = self._fires[key] = self._fires.get(key, 0) + 1
        if n == 1:
            self._ready.add(key)
            if self._observing:
                self._observed.append(key)
        expected = self._expected_fires.get(key, 1)
        if n > expected:
            self._expected_fires[key] = n
            if i < self._next:
                raise self._late_accumulation(param, n, expected)
            return
        if n < expected:
            return
        self._pending[i] -= 1
        if self._pending[i] == 0 and not self._observing:
            self._launch(force=False)

    def _late_accumulation(self, param, n: int, expected: int) -> RuntimeError:
        names = {id(p): name for name, p in self.ctx.module.named_parameters()}
        return RuntimeError(
            f"parameter {names.get(id(param), '?')!r} received gradient accumulation {n} in "
            f"this backward after its bucket's communication had started (earlier backwards "
            f"accumulated it at most {expected} times, e.g. a block used in more reentrant-"
            f"checkpointed segments than before): its averaged gradient would be wrong. Use "
            f"torch.utils.checkpoint(..., use_reentrant=False), or use it as many times in "
            f"the first backward as in any later one; this rank's next backward waits for {n}")

    def _sparse_ready(self, _param) -> None:
        """A sparse-gradient weight's gradient arrived: it is averaged at the end of backward
        (under ``no_sync()`` it accumulates, as DDP's does)."""
        if self._sync and not self._cb_queued:
            self._cb_queued = True
            Variable._execution_engine.queue_callback(self._backward_end)

    def _reduce_sparse(self) -> None:
        """Average the sparse gradients, one weight after another in registration order (the
        same on every rank), after every bucket's communication (a hierarchical algorithm's
        thread is done with the group by then).  A weight no rank gave a gradient keeps
        ``.grad`` None."""
        if self.group.size == 1:
            return
        for p in self._sparse:
            p.grad = allreduce_sparse(p.grad, p, self.group, self._sparse_average)

    def _launch(self, force: bool) -> None:
        """Start buckets in index order (the same on every rank), as far as they are ready."""
        while self._next < len(self.buckets) and (force or self._pending[self._next] == 0):
            b = self.buckets[self._next]
            self._next += 1
            if not self.impl.uses_grad_buckets:
                continue
            try:
                b.gather_grads(self.impl.grad_divisor(b))
            except RuntimeError as err:
                changed = self._dtype_changed(b)
                if changed is None:
                    raise
                raise changed from err
            if b.flags is not None:     # the last bucket: every rank knows its flags now
                self._carried = self.impl.carries_unused_flags(self.ctx)
                if self._carried:
                    self._local_flags(b.flags)
            self._handles.append((b, self._start_bucket(b)))

    def _dtype_changed(self, bucket) -> RuntimeError | None:
        """The error to raise when a bucket's parameters changed dtype or device after the
        wrap (``model.double()``, ``model.to(...)``), else None."""
        names = {id(p): n for n, p in self.ctx.module.named_parameters()}
        for p in bucket.params:
            if p.dtype != bucket.dtype or p.device != bucket.device:
                return RuntimeError(
                    f"parameter {names.get(id(p), '?')!r} is {p.dtype} on {p.device} but was "
                    f"{bucket.dtype} on {bucket.device} at with_bagua: changing parameters' "
                    f"dtype or device after with_bagua (model.to(), .double(), .half()) is not "
                    f"supported; cast or move the model before wrapping it")
        return None

    def _start_bucket(self, bucket):
        """The algorithm's communication of a ready bucket: its handle (or None)."""
        if bucket.device.type == "cuda":
            return self._launch_on_stream(bucket)
        return self.impl.bucket_ready_hook(self.ctx, bucket)

    def _launch_on_stream(self, bucket):
        # No host synchronisation: the side stream waits for the gradients on the GPU.
        if self._comm_stream is None:
            self._comm_stream = torch.cuda.Stream(device=bucket.device)
        self._comm_stream.wait_stream(torch.cuda.current_stream(bucket.device))
        with torch.cuda.stream(self._comm_stream):
            return self.impl.bucket_ready_hook(self.ctx, bucket)

    def _missing_grads(self) -> list[torch.Tensor] | None:
        """Before the last buckets start: the bucketed tensors that got no gradient in this
        step (nor in the ``no_sync()`` steps before it) and whose ``.grad`` is None.  None
        when every one got a gradient."""
        if len(self._ready) == len(self._slotted):
            return None
        used = self._ready | self._used_nosync
        return [t for t in self._slotted if id(t) not in used and t.grad is None]

    def _local_flags(self, out: torch.Tensor) -> torch.Tensor:
        """Write this rank's flags into ``out`` (one per flag slot; 1: a gradient arrived in
        this step or in the ``no_sync()`` steps before it) and return it.  Every tensor has
        one when the last bucket starts during backward; only a step that misses some
        starts it at the end of backward, after :meth:`_missing_grads`."""
        if len(self._ready) == len(self._slotted):
            self._last_used = None
            return out.fill_(1)
        used = self._last_used = self._ready | self._used_nosync
        local = torch.tensor([id(t) in used for t in self._slotted], dtype=out.dtype)
        return out.copy_(local)

    # a joined rank reports, in the steps it shadows, which tensors its last synchronised
    # backward gave a gradient (None: all of them, also before any), as DDP's joined rank
    # reports its last local-used map: a tensor only it used gets a zero gradient elsewhere
    _last_used: set[int] | None = None

    def _shadow_flags(self, out: torch.Tensor) -> torch.Tensor:
        if self._last_used is None:
            return out.fill_(1)
        local = torch.tensor([id(t) in self._last_used for t in self._slotted], dtype=out.dtype)
        return out.copy_(local)

    def _start_unused_check(self, none_before):
        """For an algorithm whose communication cannot carry the flags, after every bucket's
        communication completed (the same order on every rank): reduce them with MAX in a
        collective of their own, so that each rank knows which tensors no rank gave a
        gradient."""
        flags = self._local_flags(torch.empty(len(self._slotted), dtype=torch.uint8))
        if self.group.size == 1:
            return flags, bc.Work.completed()   # one rank: nothing to reduce
        return flags, bc.allreduce_inplace(flags, bc.ReduceOp.MAX, group=self.group,
                                           async_op=True)

    def _drop_unused(self, flags: torch.Tensor, none_before) -> None:
        """A tensor no rank gave a gradient (its reduced flag is 0) keeps ``.grad`` None (DDP
        with ``find_unused_parameters=True``: the optimizer skips it); one used on some rank
        keeps the average, in which this rank's missing gradient counted as zero."""
        used = (flags.cpu() != 0).tolist()
        slot = {id(t): j for j, t in enumerate(self._slotted)}
        for t in none_before:
            if not used[slot[id(t)]]:
                t.grad = None

    def _backward_end(self) -> None:
        check = None
        try:
            grads = self.impl.uses_grad_buckets
            none_before = self._missing_grads() if grads else None
            self._launch(force=True)
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
                check = self._start_unused_check(none_before)
            for _, handle in self._handles:
                if handle is not None:
                    handle.wait()
            if own_check and check is None:
                check = self._start_unused_check(none_before)
            if self._comm_stream is not None:     # GPU: order, don't block the host
                torch.cuda.current_stream(self._comm_stream.device).wait_stream(
                    self._comm_stream)
            for b, _ in self._handles:
                b.scatter_grads()
            if check is not None:
                check[1].wait()
            if none_before:
                self._drop_unused(check[0] if check is not None else self.buckets[-1].flags,
                                  none_before)
            if self._sparse:
                self._reduce_sparse()
        finally:
            self._carried = False
            self._handles.clear()
            self._ready.clear()
            self._fires.clear()
            self._used_nosync.clear()
            self._pending = [len(b.params) for b in self.buckets]
            self._next = 0
            self._cb_queued = False
            if self._observing:
                self._observing = False
                self._order_pending = True
        self.impl.post_backward_hook(self.ctx)

    def _optimizer_stepped(self, optimizer, _args, _kwargs) -> None:
        self.impl.post_optimizer_step_hook(self.ctx, optimizer)

    # -- checkpoints ----------------------------------------------------------------------------
    def bagua_state_dict(self) -> dict:
        """The algorithm's state (also saved inside the first optimizer's ``state_dict()``),
        with the world size and rank that saved it."""
        return {"algorithm": self.algorithm.name, "step": self.step,
                "world_size": self.group.size, "rank": self.group.rank,
                "impl": self.impl.state_dict()}

    def load_bagua_state_dict(self, state: dict) -> None:
        """Restore :meth:`bagua_state_dict`'s output, from this rank's own checkpoint (exact)
        or from another rank's / another world size's (shared state such as the step and
        round counters is restored; per-rank state is re-derived or reset, said in one log
        line).  State saved by another algorithm restores the step counter only."""
        if not isinstance(state, dict) or "step" not in state:
            raise ValueError("state must be a dict from BaguaModule.bagua_state_dict()")
        self.step = int(state["step"])
        if state.get("algorithm") != self.algorithm.name:
            warnings.warn(f"checkpoint holds the state of algorithm {state.get('algorithm')!r}"
                          f" but this module runs {self.algorithm.name!r}: only the step "
                          "counter is restored", stacklevel=2)
            return
        world, rank = self.group.size, self.group.rank
        saved_world = int(state.get("world_size", world))
        saved_rank = int(state.get("rank", rank))
        try:
            if saved_world == world and saved_rank == rank:
                self.impl.load_state_dict(state["impl"])          # exact
                return
            note = self.impl.load_foreign_state_dict(state["impl"], world_size=saved_world,
                                                      rank=saved_rank)
        except (KeyError, TypeError, IndexError) as err:
            saved = state.get("impl")
            keys = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
            raise ValueError(
                f"the checkpoint's {self.algorithm.name} state is incomplete or not from "
                f"bagua_algos ({type(err).__name__}: {err}; it holds {keys}): load the "
                f"optimizer state_dict saved by this algorithm, or drop its "
                f"{_STATE_KEY!r} entry to start the algorithm's state afresh") from err
        if saved_world != world and not note:
            note = "nothing is per rank; the step counter and optimizer state are restored"
        # One line per job: the lowest rank that resets anything says it.
        speaker = 0 if (saved_world != world or saved_rank != 0) else 1
        if note and rank == speaker:
            where = (f"at world size {saved_world}, now {world}" if saved_world != world
                     else f"by rank {saved_rank} and loaded on other ranks too")
            logger.warning(f"bagua_algos: {self.algorithm.name} resumes from a checkpoint "
                           f"saved {where}: {note}")

    def _save_into_optimizer(self, _optimizer, state_dict):
        state_dict[_STATE_KEY] = self.bagua_state_dict()
        return state_dict

    def _load_from_optimizer(self, _optimizer, state_dict):
        state_dict = dict(state_dict)
        saved = state_dict.pop(_STATE_KEY, None)
        if saved is not None:
            self.load_bagua_state_dict(saved)
        return state_dict

    def state_dict(self, *args, **kwargs):
        """The wrapped model's ``state_dict`` (no ``module.`` prefix; for a
        ``torch.compile``-d model, the original model's: no ``_orig_mod.`` prefix either)."""
        return self.ctx.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load the wrapped model's ``state_dict``; keys saved from a ``torch.compile``-d
        model (``_orig_mod.`` prefix) load too."""
        if assign:
            raise ValueError("assign=True would replace parameters that bagua has flattened; "
                             "load with assign=False")
        if state_dict and all(k.startswith("_orig_mod.") for k in state_dict):
            state_dict = type(state_dict)(state_dict)    # keeps _metadata on an OrderedDict
            torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(state_dict,
                                                                           "_orig_mod.")
        return self.ctx.module.load_state_dict(state_dict, strict=strict)

    # -- user API -------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        out = self.module(*args, **kwargs)
        if self._sync and torch.is_grad_enabled():
            _eager(self._hook_outputs, out)
        return out

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally: no communication in forwards/backwards inside."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    @contextlib.contextmanager
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False):
        """Train on uneven inputs, as DDP's ``join()``: wrap the training loop in it, and a
        rank whose data ends first shadows the others' remaining steps (zero gradients) until
        every rank's loop has ended; then every rank takes the model of the highest rank among
        the last to finish.  GradientAllReduce only; one training forward per step inside.
        ``throw_on_early_termination=True`` raises on every rank as soon as one runs out."""
        check_joinable(self, divide_by_initial_world_size, enable, throw_on_early_termination)
        if not enable or self.group.size == 1:
            yield
            return
        self._join = {"throw": throw_on_early_termination}
        try:
            yield
        finally:
            self._join = None
        last = True                           # reached only when the loop ended normally
        while True:
            ranks, (buffers, step), order = join_round(self.group, False,
                                                       order=self._order_pending)
            if not ranks:
                break
            if throw_on_early_termination:
                raise early_termination(self.group)
            shadow_step(self, ranks[-1], buffers, step, order)
            last = False
        final_sync(self, last)

    def autotune_report(self) -> dict | None:
        """``None`` unless autotuning; else ``{"done", "steps", "best", "trials", ...}``:
        whether the tuner has settled, the training steps it took, the configuration it
        chose (``{"bucket_size": bytes, ...}``) and every trial's configuration and score
        (seconds per step, the slowest rank's)."""
        return None if self._autotuner is None else self._autotuner.report()

    def abort(self) -> None:
        """Stop background communication (AsyncModelAverage); returns once it has stopped."""
        fn = getattr(self.impl, "abort", None)
        if fn is None:
            raise RuntimeError(f"{self.algorithm.name} has no background communication to abort")
        fn(self.ctx)

    def resume(self) -> None:
        """Restart background communication stopped by :meth:`abort` (collective)."""
        fn = getattr(self.impl, "resume", None)
        if fn is None:
            raise RuntimeError(f"{self.algorithm.name} has no background communication to resume")
        fn(self.ctx)

    def detach_algorithm(self) -> None:
        """Remove hooks and stop the algorithm (``with_bagua`` calls this when switching)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.impl.shutdown()
