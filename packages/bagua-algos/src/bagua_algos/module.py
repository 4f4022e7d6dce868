"""``with_bagua`` and :class:`BaguaModule`, the wrapper users hold: the per-step machinery
is the step engine (:mod:`bagua_algos._engine.engine`), checkpoints go through
:mod:`bagua_algos._engine.checkpoint`, uneven inputs through :mod:`bagua_algos._engine.join`."""

from __future__ import annotations

import contextlib
import copy
import logging

import torch

import bagua_comm as bc

from ._engine import checkpoint
from ._engine import consistency as _consistency
from ._engine.bucket import BaguaBucket
from ._engine.checks import check_bucket_size, check_model
from ._engine.comm import broadcast_tensors
from ._engine.compiled import eager as _eager
from ._engine.compiled import uncompiled as _uncompiled
from ._engine.engine import StepEngine
from ._engine.join import check_joinable, shadow_until_done
from .algorithm import Algorithm, AlgorithmImpl, BaguaContext
from .tuning import autotune as _autotune

DEFAULT_BUCKET_SIZE = 10 * 1024 * 1024
_STATE_KEY = checkpoint.STATE_KEY
logger = logging.getLogger("bagua_algos")


def with_bagua(model: torch.nn.Module, optimizers=(), algorithm: Algorithm | None = None, *,
               group: bc.ProcessGroup | None = None, do_flatten: bool = True,
               bucket_size: int | None = None, autotune: bool | dict = False,
               broadcast_buffers: bool = True) -> BaguaModule:
    """Wrap ``model`` for data-parallel training with ``algorithm``.

    Every rank ends up with rank 0's parameters, buffers and optimizer state (on gloo, ranks
    that already hold equal ones, as when seeded alike, are proven so by one allgather of
    digests and nothing is broadcast).  Gradients (or
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
    return _wrap(model, optimizers, algorithm, group=group, do_flatten=do_flatten,
                 bucket_size=bucket_size, autotune=autotune, broadcast_buffers=broadcast_buffers)


def _wrap(model: torch.nn.Module, optimizers=(), algorithm: Algorithm | None = None, *,
          group: bc.ProcessGroup | None = None, do_flatten: bool = True,
          bucket_size: int | None = None, autotune: bool | dict = False,
          broadcast_buffers: bool = True, in_sync: bool = False) -> BaguaModule:
    """:func:`with_bagua`; with ``in_sync=True`` (bagua_algos.ft's rebuild, which has proven
    it: every rank compared :func:`_wrap_configuration` and its parameters, buffers and
    optimizer state, see ``ft._source``) without the configuration check and without the
    broadcast of rank 0's parameters, buffers and optimizer state (collectives that would
    move equal values)."""
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
        from .tuning.timed_choice import resolve_algorithm
        rec = resolve_algorithm(algorithm, model, group, bucket_given=bucket_given,
                                optimizers=None if autotune else optimizers)
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
    if not in_sync:
        _consistency.check_same_on_every_rank(_consistency.configuration(
            model, optimizers, algorithm,
            {"do_flatten": do_flatten, "bucket_size": bucket_size, "autotune": autotune}), group)
    return BaguaModule(model, optimizers, algorithm, group, do_flatten, bucket_size,
                       autotune=autotune, broadcast_buffers=broadcast_buffers,
                       broadcast_state=not in_sync)


def _wrap_configuration(model: torch.nn.Module, optimizers, algorithm: Algorithm, *,
                        do_flatten: bool = True, bucket_size: int | None = None,
                        autotune: bool | dict = False) -> dict[str, str]:
    """What :func:`with_bagua` checks is the same on every rank (an ``Algorithm``, not
    ``"auto"``), with the same defaults resolved."""
    bucket_size = DEFAULT_BUCKET_SIZE if bucket_size is None else bucket_size
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    return _consistency.configuration(
        model, list(optimizers or []), algorithm,
        {"do_flatten": do_flatten, "bucket_size": bucket_size,
         "autotune": _autotune.resolve_options(autotune)})


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
    """A model wrapped by :func:`with_bagua`. ``forward`` passes through to ``.module``.

    The per-step machinery (buckets, hooks, overlap, unused parameters) is the
    :class:`~bagua_algos._engine.engine.StepEngine` in :attr:`engine`."""

    def __init__(self, module, optimizers, algorithm, group, do_flatten, bucket_size, *,
                 autotune: dict | None = None, broadcast_buffers: bool = True,
                 broadcast_state: bool = True):
        super().__init__()
        self.module = module
        self.algorithm = algorithm
        self.optimizers = optimizers
        self.group = group
        self.do_flatten = do_flatten
        self._broadcast_buffers = broadcast_buffers
        self.ctx = BaguaContext(_uncompiled(module), optimizers, group)
        self._attach(algorithm, bucket_size, autotune, broadcast_state)

    def _attach(self, algorithm, bucket_size, autotune, broadcast_state: bool) -> None:
        module, optimizers, group = self.module, self.optimizers, self.group
        # rank 0's parameters, buffers and optimizer state, unless every rank holds them
        synced = (group.size > 1 and broadcast_state
                  and not _consistency.already_equal(module, optimizers, group))
        if synced:
            broadcast_tensors(list(module.parameters()) + list(module.buffers()), group)
        for opt in optimizers if synced else ():
            state = bc.broadcast_object(opt.state_dict() if group.rank == 0 else None, 0,
                                        group=group)
            if group.rank != 0:
                opt.load_state_dict(state)
        self.impl: AlgorithmImpl = _flat_on_one_level(algorithm, group).reify(group)
        self._engine = StepEngine(self, self.ctx, self.impl, algorithm, bucket_size,
                                  do_flatten=self.do_flatten,
                                  broadcast_buffers=self._broadcast_buffers)
        if optimizers:
            self._engine.hooks.extend(checkpoint.register_optimizer_hooks(self, optimizers[0]))
        # autotuning (bagua_algos.tuning.autotune): collective, after the buckets exist
        self._autotuner = _autotune.Autotuner(self, autotune) if autotune else None
        self._engine.tuner = self._autotuner

    def _switch(self, algorithm, bucket_size: int | None) -> None:
        """Switch this module to ``algorithm`` in place (every rank at the same training
        forward: ``with_bagua(..., "auto")``'s timed choice), from rank 0's parameters,
        buffers and optimizer state."""
        bucket_size = self._engine.bucket_size if bucket_size is None else bucket_size
        self._engine.detach()
        step = self.ctx.step
        self.ctx = BaguaContext(_uncompiled(self.module), self.optimizers, self.group)
        self.ctx.step = step
        self.algorithm = algorithm
        self._attach(algorithm, bucket_size, None, broadcast_state=True)

    @property
    def engine(self) -> StepEngine:
        """The step engine (bagua_algos internals: join, autotuning, fault tolerance)."""
        return self._engine

    @property
    def buckets(self) -> list[BaguaBucket]:
        """The current buckets (they change on :meth:`rebucket`)."""
        return self._engine.buckets

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
        return self._engine.bucket_size

    def rebucket(self, bucket_size: int) -> None:
        """Re-group the gradients (and weights) into buckets of ``bucket_size`` bytes.

        Collective: every rank calls it with the same value, between steps (not inside
        forward/backward).  The algorithm's state (residuals, replicas, momenta, pending
        averages) is carried into the new buckets, so training continues as before;
        GradientAllReduce gives the same results as a run that never re-bucketed.
        """
        check_bucket_size(bucket_size)
        self._engine.rebucket(bucket_size)

    # -- checkpoints ----------------------------------------------------------------------------
    def bagua_state_dict(self) -> dict:
        """The algorithm's state (also saved inside the first optimizer's ``state_dict()``),
        with the world size and rank that saved it."""
        return checkpoint.bagua_state(self)

    def load_bagua_state_dict(self, state: dict) -> None:
        """Restore :meth:`bagua_state_dict`'s output, from this rank's own checkpoint (exact)
        or from another rank's / another world size's (shared state such as the step and
        round counters is restored; per-rank state is re-derived or reset, said in one log
        line).  State saved by another algorithm restores the step counter only."""
        checkpoint.load_bagua_state(self, state)

    def state_dict(self, *args, **kwargs):
        """The wrapped model's ``state_dict`` (no ``module.`` prefix; for a
        ``torch.compile``-d model, the original model's: no ``_orig_mod.`` prefix either)."""
        return self.ctx.module.state_dict(*args, **kwargs)

    def synced_state_dict(self) -> dict:
        """The model every rank agrees on, as a ``state_dict`` (no collective; each rank
        returns the same values).  For the synchronous algorithms, :meth:`state_dict`.  For
        DiLoCo and LocalSGD, the anchor: the parameters as of the last sync that landed (with
        ``overlap_steps`` the ranks' own models never are: each holds its inner steps since
        a sync started), with the floating-point buffers averaged at that sync; the run's
        result to keep or evaluate.  Raises ``RuntimeError`` for algorithms whose ranks
        agree on no model (Decentralized, LowPrecisionDecentralized, AsyncModelAverage)."""
        return self.impl.synced_state(self.ctx, self.state_dict())

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load the wrapped model's ``state_dict``; keys saved from a ``torch.compile``-d
        model (``_orig_mod.`` prefix) load too."""
        return checkpoint.load_model_state(self.ctx.module, state_dict, strict, assign)

    # -- user API -------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if self.impl.switch_to is not None and self._engine.sync and torch.is_grad_enabled():
            _eager(self._switch, *self.impl.switch_to)   # communicates: never traced
        out = self.module(*args, **kwargs)
        if self._engine.sync and torch.is_grad_enabled():
            _eager(self._engine.hook_outputs, out)
        return out

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally: no communication in forwards/backwards inside."""
        old, self._engine.sync = self._engine.sync, False
        try:
            yield
        finally:
            self._engine.sync = old

    @contextlib.contextmanager
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False):
        """Train on uneven inputs, as DDP's ``join()``: wrap the training loop in it, and a
        rank whose data ends first shadows the others' remaining steps (zero gradients) until
        every rank's loop has ended; then every rank takes the model of the highest rank among
        the last to finish.  GradientAllReduce only; one training forward per step inside.
        ``throw_on_early_termination=True`` raises on every rank as soon as one runs out."""
        check_joinable(self.algorithm, self._autotuner is not None,
                       divide_by_initial_world_size, enable, throw_on_early_termination)
        if not enable or self.group.size == 1:
            yield
            return
        self._engine.joining = {"throw": throw_on_early_termination}
        try:
            yield
        finally:
            self._engine.joining = None
        shadow_until_done(self._engine, throw_on_early_termination)

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
        self._engine.detach()
