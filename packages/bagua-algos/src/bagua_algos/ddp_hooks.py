"""bagua's compressors as a ``torch.nn.parallel.DistributedDataParallel`` communication hook.

For DDP, Lightning's ``DDPStrategy`` and Accelerate users who keep torch's DDP::

    from bagua_algos.ddp_hooks import CompressionHookState, compressed_allreduce_hook

    ddp_model = DistributedDataParallel(model)
    state = CompressionHookState(process_group=None, compressor=None, error_feedback=True)
    ddp_model.register_comm_hook(state, compressed_allreduce_hook)

Each DDP bucket is averaged with :func:`bagua_comm.compressed_allreduce` (ByteGrad's flat
scatter-reduce-gather over 8-bit records) on bagua_comm's group; every rank decodes the same
bytes, so ranks stay bit-identical.  ``compressor=None`` is ``MinMaxUInt8`` with one chunk per
rank (ByteGrad's default); any :class:`bagua_comm.compression.Compressor` whose ``chunks`` is
a multiple of the group size works (``MinMaxUInt4`` too).  On CPU (gloo) with ``MinMaxUInt8``
and no error feedback, each bucket buffer gets bagua_comm's compiled launcher at its first
sight: a hook call then runs no other Python, and bagua_comm's worker thread completes the
returned future itself (no waiter thread).

Error-feedback residuals live in the compressor, one key per bucket named by its parameters
(their order of first appearance in the hook, the same in every run of the same model), so
they follow a parameter set, not DDP's bucket index, which changes when DDP rebuilds its
buckets after the first iteration.  A bucket whose parameter set is new starts from a zero
residual; residuals of buckets DDP no longer uses are dropped after two backward passes
without them.  :meth:`CompressionHookState.state_dict` holds plain tensors and dicts
(``torch.load(..., weights_only=True)`` reads it).

Resuming from it is exact when the fresh DDP model's first buckets are the ones saved: with
``find_unused_parameters=True`` (DDP never rebuilds its buckets then), or a model whose rebuilt
buckets hold the same parameters in the same order as its first ones.  Otherwise the first
iteration after the resume runs in DDP's first buckets, without residuals (their layout
differs, and a rank's gather residual covers another segment); the saved residuals apply from
the second iteration on, so the run differs slightly from the uninterrupted one.

Sparse gradients (``Embedding(sparse=True)``) are not supported: the hook raises a ValueError
saying so at the first backward.
"""

# No ``from __future__ import annotations``: DDP's register_comm_hook compares the hook's
# annotations with dist.GradBucket and torch.futures.Future[torch.Tensor] themselves.
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

import bagua_comm as bc

from ._engine.checks import check_bool
from .algorithms._shared import check_chunks, check_compressor, make_compressor

__all__ = ["CompressionHookState", "compressed_allreduce_hook"]


def _bagua_group(process_group) -> bc.ProcessGroup:
    """The bagua_comm group that carries the hook's traffic for ``process_group``."""
    if isinstance(process_group, bc.ProcessGroup):
        return process_group
    if not bc.is_initialized():
        if not dist.is_initialized():
            raise RuntimeError("CompressionHookState needs a process group: call "
                               "torch.distributed.init_process_group() (or "
                               "bagua_comm.init_process_group()) first")
        bc.init_process_group()     # adopt torch's default group, as with_bagua does
    default = bc.get_default_group()
    if process_group is None or process_group is dist.group.WORLD:
        return default
    if isinstance(process_group, dist.ProcessGroup):
        from bagua_comm import process_group as pg_mod

        for g in pg_mod._state.groups:
            if not g._destroyed and process_group in (g.torch_group, g.aux_torch_group):
                return g
    raise ValueError(
        f"process_group: {process_group!r} is not a group bagua_comm can communicate over; "
        "pass None (the default group, DDP's default too), a bagua_comm.ProcessGroup, or the "
        "torch group of one (g = bagua_comm.new_group(ranks); "
        "DistributedDataParallel(model, process_group=g.torch_group))")


class CompressionHookState:
    """State of :func:`compressed_allreduce_hook`: the group, the compressor and its residuals.

    Args:
        process_group: ``None`` (bagua_comm's default group, adopting torch's default group
            when only ``torch.distributed`` is initialised), a ``bagua_comm.ProcessGroup``,
            or the torch group of one (``g.torch_group``); pass the group DDP reduces over.
        compressor: a ``bagua_comm.compression.Compressor`` whose ``chunks`` is a multiple of
            the group size; ``None``: ``MinMaxUInt8`` with one chunk per rank.
        error_feedback: keep each bucket's quantisation error and add it to its next
            gradient (EF-SGD), for the default compressor; a compressor passed in brings its
            own (``MinMaxUInt8(chunks, error_feedback=True)``).

    The group and the compressor are resolved when the state is made if a process group
    exists, else at the hook's first call (Lightning's ``DDPStrategy(ddp_comm_state=...)``
    makes the state before the processes join); either way on every rank, in the same order
    (adopting torch's default group is collective), before anything is sent.  Until then the
    state pickles (spawn launchers).  Use one state per DDP model.
    """

    def __init__(self, process_group=None, compressor=None, error_feedback: bool = False):
        check_compressor(compressor)            # argument errors first: before any group
        check_bool("error_feedback", error_feedback)
        if error_feedback and compressor is not None:
            raise ValueError("error_feedback=True configures the default compressor; a "
                             "compressor passed in keeps its own error feedback (e.g. "
                             "MinMaxUInt8(chunks, error_feedback=True)): drop one of the two")
        self.process_group = process_group
        self.error_feedback = error_feedback
        self._compressor_arg = compressor
        self._group: bc.ProcessGroup | None = None
        self._compressor = None
        self._ordinal: dict[int, int] = {}      # id(parameter) -> order of first appearance
        self._keys: dict[tuple, str] = {}       # parameter ids of a bucket -> its key
        self._last_used: dict[str, int] = {}    # key -> backward pass that last used it
        self._backward = 0
        self._stale: set[str] = set()
        self._lock = threading.Lock()
        self._waiter: ThreadPoolExecutor | None = None
        self._fast: dict = {}       # (address, numel, dtype) -> compiled launcher or None
        if bc.is_initialized() or dist.is_initialized():
            self._setup()

    def _setup(self) -> None:
        group = _bagua_group(self.process_group)
        check_chunks(self._compressor_arg, group.size, "compressor")
        self._compressor = make_compressor(self._compressor_arg, group.size,
                                           self.error_feedback)
        self._group = group

    @property
    def group(self) -> bc.ProcessGroup:
        """The bagua_comm group the hook communicates over."""
        if self._group is None:
            self._setup()
        return self._group

    @property
    def compressor(self):
        """The compressor (``MinMaxUInt8(group size)`` when ``compressor=None``)."""
        if self._group is None:
            self._setup()
        return self._compressor

    def __repr__(self) -> str:
        if self._group is None:
            return (f"CompressionHookState(process_group={self.process_group!r}, "
                    f"compressor={self._compressor_arg!r}, "
                    f"error_feedback={self.error_feedback}) (not set up yet)")
        return f"CompressionHookState(group={self._group!r}, compressor={self._compressor!r})"

    def __getstate__(self):
        if self._group is not None:
            raise TypeError("CompressionHookState holds a process group and threads once set "
                            "up; checkpoint state_dict() instead of pickling it")
        state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # -- keys ---------------------------------------------------------------------------------
    def _key(self, params) -> str:
        ids = tuple(id(p) for p in params)
        key = self._keys.get(ids)
        if key is None:
            for i in ids:
                self._ordinal.setdefault(i, len(self._ordinal))
            key = "params:" + ",".join(str(self._ordinal[i]) for i in ids)
            self._keys[ids] = key
        self._last_used[key] = self._backward
        return key

    def _end_of_backward(self) -> None:
        """Mark residuals of buckets unused in this backward and the one before as stale.
        They are dropped by :meth:`_drop_stale` at the next hook call, when DDP has waited
        for every collective of this backward (none reads the compressor meanwhile)."""
        stale = {k for k, b in self._last_used.items() if b < self._backward - 1}
        for k in stale:
            del self._last_used[k]
        self._stale |= stale
        self._backward += 1

    def _drop_stale(self) -> None:
        stale, self._stale = self._stale, set()
        state = self.compressor.state_dict()
        res = state.get("residuals") if isinstance(state, dict) else None
        if not isinstance(res, dict):
            return
        kept = {k: v for k, v in res.items() if k.rsplit("/", 1)[0] not in stale}
        if len(kept) != len(res):
            if hasattr(self.compressor, "reset_residuals"):
                self.compressor.reset_residuals()     # frees per-key scratch buffers too
            self.compressor.load_state_dict({**state, "residuals": kept})

    # -- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The compressor's state (residuals by bucket key): plain tensors and dicts."""
        if self._stale:
            self._drop_stale()
        return {"compressor": self.compressor.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s residuals.  They apply to buckets with the same
        parameters in the same order: after DDP's bucket rebuild (the first iteration of a
        fresh DDP model compresses its initial buckets without residuals)."""
        if not isinstance(state, dict) or not isinstance(state.get("compressor"), dict):
            raise ValueError("state must be a dict from CompressionHookState.state_dict() "
                             f"(with a 'compressor' dict), got {type(state).__name__}"
                             + (f" with keys {sorted(state)}" if isinstance(state, dict) else ""))
        self.compressor.load_state_dict(state["compressor"])
        for k in state["compressor"].get("residuals", {}):
            self._last_used[k.rsplit("/", 1)[0]] = self._backward

    # -- compiled launchers ---------------------------------------------------------------------
    def _launcher(self, buf: torch.Tensor):
        """The compiled launcher of ``buf``'s average (bagua_comm's, for MinMaxUInt8 without
        error feedback on gloo; residuals need no key then), or None for the general path;
        kept by the buffer's address, size and dtype (DDP keeps its bucket buffers: it
        rebuilds them once, after the first iteration)."""
        from bagua_comm._compressed import _inplace_launcher

        if len(self._fast) >= 256:          # buffers of layouts DDP no longer uses
            self._fast.clear()
        fast = _inplace_launcher(buf, bc.ReduceOp.AVG, self.compressor, self.group,
                                 buf.numel())
        self._fast[(buf.data_ptr(), buf.numel(), buf.dtype)] = fast
        return fast

    # -- completion ---------------------------------------------------------------------------
    def _complete(self, work, fut: torch.futures.Future, buf: torch.Tensor) -> None:
        """Resolve ``fut`` to ``buf`` once ``work`` is done (the general path): on a waiter
        thread for CPU tensors (the gloo collective runs on bagua_comm's worker thread, overlapping the rest
        of backward), at once for CUDA tensors (``wait`` orders the caller's stream after the
        collective's)."""
        if buf.is_cuda:
            _resolve(work, fut, buf)
            return
        with self._lock:
            if self._waiter is None:
                self._waiter = ThreadPoolExecutor(max_workers=1,
                                                  thread_name_prefix="bagua-ddp-hook")
        self._waiter.submit(_resolve, work, fut, buf)


_MISS = object()
_Future = torch._C.Future      # a future the worker completes in C (DDP takes its base type)


def _resolve(work, fut, buf) -> None:
    try:
        work.wait()
    except BaseException as err:  # surfaced to DDP (and the caller of backward)
        fut.set_exception(err)
        return
    fut.set_result(buf)


def compressed_allreduce_hook(state: CompressionHookState, bucket: dist.GradBucket
                              ) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's gradients averaged through ``state``'s
    compressor (``bagua_comm.compressed_allreduce``, op AVG).  Returns a future resolving to
    the averaged bucket buffer, as ``register_comm_hook`` requires."""
    if not isinstance(state, CompressionHookState):
        raise ValueError(f"state must be a CompressionHookState, got {type(state).__name__}: "
                         "ddp_model.register_comm_hook(CompressionHookState(), "
                         "compressed_allreduce_hook)")
    if state._stale:
        state._drop_stale()
    buf = bucket.buffer()
    if buf.layout is torch.strided and not buf.is_cuda:
        # CPU: the bucket's compiled launcher (made at its first sight), completing a torch
        # future from bagua_comm's worker thread: no Python in between, no waiter thread
        fast = state._fast.get((buf.data_ptr(), buf.numel(), buf.dtype), _MISS)
        if fast is _MISS:
            fast = state._launcher(buf)
        if fast is not None:
            fut = _Future([])
            fast.into_future(fut, buf)
            if bucket.is_last():
                state._end_of_backward()
            return fut
    if buf.layout is not torch.strided:
        shapes = [tuple(p.shape) for p in bucket.parameters()]
        raise ValueError(f"compressed_allreduce_hook does not support sparse gradients (the "
                         f"parameter of shape {shapes[0] if len(shapes) == 1 else shapes} has "
                         "one: Embedding/EmbeddingBag(sparse=True)); build it with sparse=False, "
                         "or keep DDP's default allreduce for this model (with_bagua's "
                         "GradientAllReduce averages sparse gradients)")
    key = state._key(bucket.parameters())
    # a CUDA result needs a future that knows its device (torch refuses it otherwise)
    fut: torch.futures.Future = torch.futures.Future(devices=[buf.device] if buf.is_cuda
                                                     else None)
    work = bc.compressed_allreduce(buf, buf, bc.ReduceOp.AVG, state.compressor, key=key,
                                   group=state.group, async_op=True)
    state._complete(work, fut, buf)
    if bucket.is_last():
        state._end_of_backward()
    return fut
