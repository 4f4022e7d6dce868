"""The algorithm framework: a declaration (:class:`Algorithm`) reified per model into an
implementation holding state (:class:`AlgorithmImpl`), with Bagua's phases.

Phases, in the order :func:`~bagua_algos.with_bagua` drives them.  Every hook receives a
:class:`BaguaContext` ``ctx`` (the wrapped model, its optimizers, the step counter, the
current buckets, the group), not the whole :class:`~bagua_algos.BaguaModule`:

1. ``init_tensors(ctx)``: the parameters the algorithm communicates about.
2. ``tensors_to_buckets(tensors, bucket_size)``: group them into buckets.
3. ``init_operations(ctx, buckets)``: allocate per-bucket state (buffers, compressors).
4. ``forward_pre_hook(ctx)``: before every training forward.
5. ``bucket_ready_hook(ctx, bucket)``: in backward, once the bucket's last gradient has been
   accumulated; returns a handle with ``wait()`` (or ``None``) so communication overlaps the
   rest of backward.
6. ``post_backward_hook(ctx)``: at the end of backward, after every bucket's handle was
   waited.
7. ``post_optimizer_step_hook(ctx, optimizer)``: after each ``optimizer.step()``.

``state_dict()``/``load_state_dict()`` carry the algorithm's own state (residuals, peer
replicas, counters) inside the optimizer checkpoint, keyed by parameter name (not by bucket),
so a resumed run continues exactly, whatever its bucket size.  When the buckets change
(:meth:`~bagua_algos.BaguaModule.rebucket`, or the first step's gradient order),
``before_rebucket(ctx)`` returns the state to carry and ``after_rebucket(ctx, buckets, state)``
rebuilds the per-bucket state from it; the defaults go through ``state_dict`` and
``init_operations`` + ``load_state_dict``.
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Any, ClassVar

import torch

import bagua_comm as bc

if TYPE_CHECKING:
    from ._engine.bucket import BaguaBucket

_REGISTRY: dict[str, type[Algorithm]] = {}
FIRST_BUCKET_SIZE = 1024 * 1024


class BaguaContext:
    """What an algorithm's hooks see of the wrapped model.

    Attributes:
        module: the user's ``torch.nn.Module`` (what :func:`with_bagua` wrapped).
        optimizers: the optimizers given to :func:`with_bagua`.
        group: the process group the algorithm communicates over.
        step: synchronised training forwards so far (this step included, inside hooks).
        buckets: the current buckets (they change on re-bucketing).
    """

    __slots__ = ("buckets", "group", "module", "optimizers", "step")

    def __init__(self, module: torch.nn.Module, optimizers: list, group: bc.ProcessGroup):
        self.module = module
        self.optimizers = optimizers
        self.group = group
        self.step = 0
        self.buckets: list[BaguaBucket] = []

    def __repr__(self) -> str:
        return (f"BaguaContext(step={self.step}, {len(self.buckets)} buckets, "
                f"{len(self.optimizers)} optimizers)")


class Algorithm:
    """A communication algorithm's declaration: validated constructor arguments only.

    Subclasses register under a name with ``class MyAlgo(Algorithm, name="my_algo")`` and
    implement :meth:`reify`, returning a fresh :class:`AlgorithmImpl` for one model.
    """

    name: ClassVar[str | None] = None
    #: True: gradients travel in dense buckets, so a parameter with sparse gradients
    #: (``torch.nn.Embedding(sparse=True)``) is refused at :func:`with_bagua`.
    dense_gradients: ClassVar[bool] = False
    #: True: the gradients of ``Embedding``/``EmbeddingBag(sparse=True)`` weights stay out of
    #: the dense buckets and are averaged by a sparse exchange of their own at the end of
    #: backward (as DDP averages sparse gradients); the algorithm's buckets hold the rest.
    sparse_allreduce: ClassVar[bool] = False
    #: True: :meth:`BaguaModule.join` can shadow a step's collectives on a rank without data
    #: (zero gradients through ``bucket_ready_hook``): no per-rank state the zeros would skew.
    joinable: ClassVar[bool] = False

    def compresses(self) -> bool:
        """True when this algorithm quantises the tensors it sends, so that every trainable
        parameter must be float32, float16 or bfloat16 (checked at :func:`with_bagua`)."""
        return False

    def __init_subclass__(cls, name: str | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if name is not None:
            if name in _REGISTRY and _REGISTRY[name] is not cls:
                raise ValueError(f"an algorithm named {name!r} is already registered "
                                 f"({_REGISTRY[name].__qualname__})")
            cls.name = name
            _REGISTRY[name] = cls

    @classmethod
    def init(cls, name: str, **kwargs) -> Algorithm:
        """Build a registered algorithm by name, e.g. ``Algorithm.init("bytegrad")``."""
        if name not in _REGISTRY:
            raise ValueError(f"unknown algorithm {name!r}; registered: {sorted(_REGISTRY)}")
        algo_cls = _REGISTRY[name]
        try:
            inspect.signature(algo_cls).bind(**kwargs)
        except TypeError as err:
            raise ValueError(f"bad arguments for algorithm {name!r}: {err}; its signature is "
                             f"{name}{inspect.signature(algo_cls)}") from err
        return algo_cls(**kwargs)

    @staticmethod
    def registered() -> list[str]:
        """Names accepted by :meth:`init`."""
        return sorted(_REGISTRY)

    def check_wrap(self, module: torch.nn.Module, optimizers: list) -> None:
        """Called by :func:`with_bagua` on every rank before any communication: raise
        ``ValueError`` (naming the argument) for a model or optimizers this algorithm cannot
        run with.  The default accepts everything."""

    def reify(self, group: bc.ProcessGroup) -> AlgorithmImpl:
        """Create the per-model implementation communicating over ``group``."""
        raise NotImplementedError(f"{type(self).__name__} must implement reify(group)")

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({args})"


class AlgorithmImpl:
    """Per-model state and hooks of an algorithm (override the phases you need).

    Class attributes tune the framework: ``bucket_alignment(group)`` pads every bucket to a
    multiple (compressors split buckets into per-rank chunks); ``synchronous = True`` (identical
    models on every rank after each step) lets ``broadcast_buffers`` broadcast rank 0's buffers
    before the training steps (DDP's timing); ``flatten_weights = True``
    makes parameters views of one flat weight buffer per bucket (for algorithms that
    communicate weights); ``uses_grad_buckets = False`` skips gradient buckets altogether;
    ``unused_check_beside = True`` declares that the buckets' communication never issues a
    collective on the group's own channel (it runs on the group's second, "aux" channel or on
    its node groups), so that the check of which parameters no rank gave a gradient (one tiny
    allreduce per step where the buckets cannot carry its flags) runs beside it rather than
    after it: one exchange less of waiting per step, ~0.4 s on 4 hosts 50 ms apart.
    """

    flatten_weights: ClassVar[bool] = False
    uses_grad_buckets: ClassVar[bool] = True
    unused_check_beside: ClassVar[bool] = False
    # True: every rank holds the same model after each step, so that with_bagua's
    # broadcast_buffers=True starts every training step from rank 0's buffers (as DDP)
    synchronous: ClassVar[bool] = False
    # True: the first step's gradient buckets are DDP's first iteration's (one per dtype, in
    # registration order, no size limit) until the gradient-ready order is known
    ddp_first_layout: ClassVar[bool] = False
    #: (algorithm, bucket size or None) the wrapped module switches to at its next
    #: synchronised training forward (``with_bagua(..., "auto")``'s timed choice sets it)
    switch_to: tuple | None = None

    def __init__(self, group: bc.ProcessGroup):
        self.group = group

    # -- phases -----------------------------------------------------------------------------
    def bucket_alignment(self) -> int:
        return 1

    def init_tensors(self, ctx: BaguaContext) -> list[torch.nn.Parameter]:
        """Parameters that need communication, in reverse registration order (the order
        their gradients usually become ready in backward)."""
        seen, params = set(), []
        for p in ctx.module.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
        return params[::-1]

    def tensors_to_buckets(self, tensors: list[torch.Tensor],
                           bucket_size: int) -> list[list[torch.Tensor]]:
        """Split per dtype (and device) by DDP's rule (``_compute_bucket_assignment_by_size``):
        tensors join their dtype's open bucket in the given order, and the tensor that brings
        it to its limit or past it closes it (the bucket holds that tensor).  The limit of a
        dtype's first bucket is ``min(FIRST_BUCKET_SIZE, bucket_size)`` (DDP's
        ``_DEFAULT_FIRST_BUCKET_BYTES``, 1 MiB, so that communication starts early in
        backward), ``bucket_size`` after it.  Buckets come in the order of their first
        tensor."""
        open_: dict[Any, list] = {}
        sizes: dict[Any, int] = {}
        closed: set = set()      # keys whose first bucket has closed
        buckets = []
        for t in tensors:
            key = (t.dtype, t.device)
            open_.setdefault(key, []).append(t)
            sizes[key] = sizes.get(key, 0) + t.numel() * t.element_size()
            limit = bucket_size if key in closed else min(FIRST_BUCKET_SIZE, bucket_size)
            if sizes[key] >= limit:
                buckets.append(open_[key])
                open_[key], sizes[key] = [], 0
                closed.add(key)
        buckets.extend(b for b in open_.values() if b)
        order = {id(t): i for i, t in enumerate(tensors)}
        return sorted(buckets, key=lambda b: order[id(b[0])])   # launch in readiness order

    def init_operations(self, ctx: BaguaContext, buckets: list[BaguaBucket]) -> None:
        """Allocate per-bucket state once buckets exist."""

    def forward_pre_hook(self, ctx: BaguaContext) -> None:
        """Before each training forward (``module.step`` already counts this step)."""

    def grad_divisor(self, bucket: BaguaBucket) -> int | None:
        """A number to divide ``bucket``'s gradients by while they are gathered into
        ``bucket.grad``, just before :meth:`bucket_ready_hook` (None: leave them as they are).
        The division rides on the copy the gather makes anyway."""
        return None

    def carries_unused_flags(self, ctx: BaguaContext) -> bool:
        """True when this step's :meth:`bucket_ready_hook` reduces ``bucket.grad_and_flags``
        (``bucket.grad``, followed on the last bucket by one "got a gradient" flag per
        tensor) with an elementwise SUM or AVG allreduce over the whole group, in any float
        dtype: the flags then ride in the step's own communication, and a flag still 0
        afterwards means no rank gave that tensor a gradient.  Asked as the last bucket
        starts; the answer must be the same on every rank.  The default, False, makes the
        module reduce the flags in a collective of its own after every bucket's
        communication (a second collective per step)."""
        return False

    def bucket_ready_hook(self, ctx: BaguaContext, bucket: BaguaBucket):
        """In backward: every gradient of ``bucket`` is in ``bucket.grad``. Start its
        communication and return a handle with ``wait()`` (or None if done already)."""
        return None

    def bucket_launchers(self, ctx: BaguaContext, buckets: list[BaguaBucket]) -> list:
        """Per bucket of ``buckets`` (the current layout), ``(divisor, start)`` for this step:
        :meth:`grad_divisor`'s answer and a no-argument callable that does what
        :meth:`bucket_ready_hook` does (start the communication, return a handle with
        ``wait()`` or None).  Asked once per step, as the first bucket starts; an algorithm
        whose answers do not change from step to step may return the same list object again
        (the engine then reuses what it derived from it).  The default asks
        :meth:`grad_divisor` and calls :meth:`bucket_ready_hook`."""
        return [(self.grad_divisor(b), functools.partial(self.bucket_ready_hook, ctx, b))
                for b in buckets]

    def post_backward_hook(self, ctx: BaguaContext) -> None:
        """End of backward: every bucket's communication has completed."""

    def post_optimizer_step_hook(self, ctx: BaguaContext, optimizer) -> None:
        """After each ``optimizer.step()``."""

    # -- state and lifetime -------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Algorithm state to checkpoint (tensors are cloned by the caller's ``torch.save``)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} has no state to load, got keys "
                             f"{sorted(state)}")

    def before_rebucket(self, ctx: BaguaContext) -> dict:
        """Between steps, before the buckets change: finish background work and return the
        state to carry into the new layout (layout-independent, like :meth:`state_dict`).
        Collective: every rank calls it at the same point."""
        return self.state_dict()

    def after_rebucket(self, ctx: BaguaContext, buckets: list[BaguaBucket],
                       state: dict) -> None:
        """Rebuild per-bucket state for ``buckets`` from :meth:`before_rebucket`'s state."""
        self.init_operations(ctx, buckets)
        self.load_state_dict(state)

    def synced_state(self, ctx: BaguaContext, state: dict) -> dict:
        """``BaguaModule.synced_state_dict()``: ``state`` (the wrapped model's ``state_dict``)
        as the model every rank agrees on, read without a collective.  A synchronous
        algorithm's ranks hold it after each step: ``state`` itself.  Others override this
        (DiLoCo: its anchor) or have none to give."""
        if self.synchronous:
            return state
        raise RuntimeError(
            f"{type(self).__name__.removesuffix('Impl')}'s ranks hold different models and "
            f"none that all of them agree on: read each rank's state_dict(), or average them "
            f"(bagua_comm.allreduce_inplace with ReduceOp.AVG) at a step every rank reaches")

    def foreign_view(self, state: dict):
        """What :meth:`load_foreign_state_dict` reads of ``state``: its effect (and its note)
        must depend on nothing else but the saving world size and rank.  A rebuild under
        ``bagua_algos.ft`` whose replicas hold equal views (and equal everything else) loads
        each replica's own state instead of broadcasting the source's.  The default: the
        whole state; None: a state only its saving rank can use (never compared)."""
        return state

    def load_foreign_state_dict(self, state: dict, *, world_size: int, rank: int) -> str | None:
        """Load ``state`` saved by ``rank`` of a job of ``world_size`` ranks, where that is
        not this rank or not this world size (elastic resume from rank 0's checkpoint).

        Restore what every rank shares; re-derive or reset what belongs to one rank or one
        world size, and return a short phrase saying what was reset (None: nothing was).
        Never raise for a state this algorithm saved.  The default loads the state as is and,
        if it does not fit, starts this algorithm's state afresh.
        """
        try:
            self.load_state_dict(state)
        except (ValueError, KeyError, RuntimeError) as err:
            return f"its saved state does not fit this job and starts afresh ({err})"
        return None

    def shutdown(self) -> None:
        """Release threads and buffers (before re-wrapping or at exit)."""
