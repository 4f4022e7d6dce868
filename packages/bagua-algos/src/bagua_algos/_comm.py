"""Communication plumbing shared by the algorithms.

:class:`Handle` is a completion handle that chains like a torch future (``then``, ``wait``,
``is_completed``).  :class:`Runner` runs blocking communication chains one after another on a
background thread, on the CUDA stream that was current when they were submitted.
:class:`Reducer` is "reduce this bucket, flat or hierarchical": every algorithm goes through
it instead of re-typing the flat-async / hierarchical-on-a-thread split.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

import bagua_comm as bc


class Handle:
    """Completion handle of a bucket's communication, chainable like ``torch.futures.Future``.

    ``then(fn)`` returns a new handle that completes once this one has and ``fn(self)`` has
    run; ``fn``'s return value is the new handle's :meth:`value`.  ``fn`` runs **when this
    handle completes**, whether or not anyone waits: on the thread that completes it (the
    reducer's runner thread, or a shared waiter thread for a primitive's asynchronous work),
    or at once in the caller's thread if it has already completed.  A chain of dependent
    collectives (P then Q) therefore progresses during backward.  ``fn`` runs on the CUDA
    stream that was current when ``then`` was called.  An exception (in the work or in a
    callback) completes every handle further down the chain with it; :meth:`wait` raises it.
    """

    __slots__ = ("_callbacks", "_claimed", "_error", "_event", "_lock", "_value", "_watched",
                 "_work")

    def __init__(self, work: Any = None):
        self._work = work            # anything with wait() (and is_completed()), or None
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._callbacks: list[Callable[[Handle], None]] = []
        self._claimed = work is None  # someone is (or no one need be) waiting on the work
        self._watched = False
        self._value = None
        self._error: BaseException | None = None
        if work is None:
            self._event.set()

    @classmethod
    def completed(cls, value: Any = None) -> Handle:
        h = cls()
        h._value = value
        return h

    # -- completion -------------------------------------------------------------------------
    def _complete(self, value: Any = None, error: BaseException | None = None) -> None:
        with self._lock:
            self._value, self._error = value, error
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb(self)

    def _claim(self) -> bool:
        """True for the one caller that is to wait on the work and complete this handle."""
        with self._lock:
            if self._claimed:
                return False
            self._claimed = True
            return True

    def _settle(self) -> None:
        """Wait for the work (this thread) and complete the handle with its outcome."""
        try:
            self._work.wait()
        except BaseException as err:  # handed to whoever waits
            self._complete(error=err)
        else:
            self._complete()

    def _watch(self) -> None:
        """Have the work's completion complete this handle without a waiter in the caller."""
        with self._lock:
            if self._watched or self._event.is_set():
                return
            self._watched = True
        if not self._claim():
            return
        work = self._work
        if isinstance(work, _FutureWork):
            work.add_done_callback(lambda _f: self._settle())   # wait() returns at once
        else:
            _waiter().submit(self._settle)

    def _on_done(self, cb: Callable[[Handle], None]) -> None:
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(cb)
                cb = None
        if cb is not None:
            cb(self)
        else:
            self._watch()

    # -- the torch.futures.Future-like surface -----------------------------------------------
    def then(self, fn: Callable[[Handle], Any]) -> Handle:
        child = Handle.__new__(Handle)
        Handle.__init__(child, _PENDING)
        child._claimed = True           # completed by this handle's callback, never waited on
        stream = _current_cuda_stream()

        def run(parent: Handle) -> None:
            if parent._error is not None:
                child._complete(error=parent._error)
                return
            try:
                if stream is None:
                    value = fn(parent)
                else:
                    with torch.cuda.stream(stream):
                        value = fn(parent)
            except BaseException as err:  # handed to whoever waits
                child._complete(error=err)
            else:
                child._complete(value)

        self._on_done(run)
        return child

    def wait(self) -> Any:
        if not self._event.is_set() and self._claim():
            self._settle()
        self._event.wait()
        if self._error is not None:
            raise self._error
        return self._value

    def value(self) -> Any:
        """The chained function's result (waits for completion)."""
        return self.wait()

    def is_completed(self) -> bool:
        if self._event.is_set():
            return True
        work = self._work
        if work is not _PENDING and work.is_completed() and self._claim():
            self._settle()
        return self._event.is_set()


class _Pending:
    """The work of a chained handle: completed by its parent's callback."""

    def wait(self) -> None:  # pragma: no cover - a chained handle is never claimed
        raise AssertionError("a chained handle completes through its parent")

    def is_completed(self) -> bool:
        return False


_PENDING = _Pending()
_waiter_pool: ThreadPoolExecutor | None = None
_waiter_lock = threading.Lock()


def _waiter() -> ThreadPoolExecutor:
    """The thread that waits on primitives' asynchronous work for chained handles (one per
    process, started on first use; works complete in the order collectives were issued, so
    one thread waiting on them in turn loses nothing)."""
    global _waiter_pool
    with _waiter_lock:
        if _waiter_pool is None:
            _waiter_pool = ThreadPoolExecutor(max_workers=1,
                                              thread_name_prefix="bagua-handle-waiter")
        return _waiter_pool


class _FutureWork:
    __slots__ = ("_future",)

    def __init__(self, future: Future):
        self._future = future

    def add_done_callback(self, fn: Callable[[Future], None]) -> None:
        """``fn(future)`` on the runner thread once the job has finished (at once if it has)."""
        self._future.add_done_callback(fn)

    def wait(self) -> None:
        self._future.result()

    def is_completed(self) -> bool:
        return self._future.done()


def _current_cuda_stream():
    """The caller's current CUDA stream, or None when CUDA was never initialised (the CPU
    path never touches CUDA)."""
    if not torch.cuda.is_initialized():
        return None
    return torch.cuda.current_stream()


class Runner:
    """Runs communication functions one after another on one background thread.

    Collectives issued from it keep their submission order, which is the same on every rank,
    so chains of blocking collectives (hierarchical modes, peer exchanges) overlap the
    caller's computation.  CUDA work a function issues goes to the stream that was current
    in the submitting thread (the communication stream the module waits on), not to the
    background thread's default stream.
    """

    def __init__(self, name: str):
        self._name = name
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, fn: Callable[[], Any]) -> Handle:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self._name)
        stream = _current_cuda_stream()
        if stream is not None:
            inner = fn

            def fn():
                with torch.cuda.stream(stream):
                    return inner()

        return Handle(_FutureWork(self._pool.submit(fn)))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def hierarchical(group: bc.ProcessGroup, tensor: torch.Tensor,
                 inter_op: Callable[[torch.Tensor, bc.ProcessGroup], None],
                 average: bool = True) -> None:
    """Intra-node reduce to the node leader, ``inter_op`` among leaders, intra-node broadcast
    (blocking).  With ``average`` the intra-node reduction is a mean."""
    intra, inter = group.intra_node_group(), group.inter_node_group()
    op = bc.ReduceOp.AVG if average else bc.ReduceOp.SUM
    if intra.size > 1:
        bc.reduce_inplace(tensor, 0, op, group=intra)
    if group.is_node_leader() and inter.size > 1:
        inter_op(tensor, inter)
    if intra.size > 1:
        bc.broadcast(tensor, 0, group=intra)


def prepare_hierarchy(group: bc.ProcessGroup) -> None:
    """Create the intra/inter-node groups now (collective; every rank, same order)."""
    group.intra_node_group()
    group.inter_node_group()


class Reducer:
    """Reduce a bucket over ``group``, flat or hierarchical, returning a :class:`Handle`.

    Flat: the primitive's own asynchronous handle (no thread).  Hierarchical: intra-node
    reduce, the operation among node leaders, intra-node broadcast, chained on this reducer's
    single :class:`Runner`.  :attr:`peers` is the group the "among" step runs in (the
    inter-node group when hierarchical), e.g. the group a compressor's chunks must divide.
    """

    def __init__(self, group: bc.ProcessGroup, hierarchical: bool, name: str):
        self.group = group
        self.runner = Runner(name)
        self.hierarchical = hierarchical

    @property
    def hierarchical(self) -> bool:
        return self._hierarchical

    @hierarchical.setter
    def hierarchical(self, value: bool) -> None:
        """Switch modes between steps (collective the first time it turns True)."""
        if value:
            prepare_hierarchy(self.group)
        self._hierarchical = bool(value)
        self.peers = self.group.inter_node_group() if value else self.group

    def allreduce(self, tensor: torch.Tensor, op: bc.ReduceOp = bc.ReduceOp.AVG) -> Handle:
        """Allreduce ``tensor`` in place."""
        if not self.hierarchical:
            return Handle(bc.allreduce_inplace(tensor, op, group=self.group, async_op=True))
        return self.runner.submit(lambda: hierarchical(
            self.group, tensor, lambda t, g: bc.allreduce_inplace(t, op, group=g),
            op is bc.ReduceOp.AVG))

    def compressed_allreduce(self, tensor: torch.Tensor, compressor, key: str,
                             op: bc.ReduceOp = bc.ReduceOp.AVG) -> Handle:
        """Allreduce ``tensor`` in place through ``compressor`` (among node leaders only when
        hierarchical; the intra-node steps stay full precision)."""
        if not self.hierarchical:
            return Handle(bc.compressed_allreduce(tensor, tensor, op, compressor, key=key,
                                                  group=self.group, async_op=True))

        def among(t, g):
            bc.compressed_allreduce(t, t, op, compressor, key=key, group=g)

        return self.runner.submit(lambda: hierarchical(self.group, tensor, among,
                                                       op is bc.ReduceOp.AVG))

    def exchange(self, fn: Callable[[], None]) -> Handle:
        """Run a blocking chain of collectives ``fn`` on the runner (peer exchanges)."""
        return self.runner.submit(fn)

    def reduce_with(self, tensor: torch.Tensor,
                    among: Callable[[torch.Tensor, bc.ProcessGroup], None],
                    average: bool = True) -> None:
        """Blocking: ``among(tensor, group)`` flat, or wrapped in the hierarchical pattern."""
        if self.hierarchical:
            hierarchical(self.group, tensor, among, average)
        elif self.group.size > 1:
            among(tensor, self.group)

    def close(self) -> None:
        self.runner.close()


def broadcast_tensors(tensors, group: bc.ProcessGroup, src: int = 0) -> None:
    """``src``'s values into ``tensors`` on every rank (collective; one broadcast per dtype and
    device).  ``src`` writes nothing and the others write through ``.data``, which autograd's
    version counter does not see, as DDP's broadcasts: a second forward before one backward
    must not invalidate what the first saved for it (BatchNorm's running statistics)."""
    by_key: dict = {}
    for t in tensors:
        by_key.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for ts in by_key.values():
            flat = torch.cat([t.detach().reshape(-1) for t in ts])
            bc.broadcast(flat, src, group=group)
            if group.rank == src:
                continue
            off = 0
            for t in ts:
                t.data.copy_(flat[off:off + t.numel()].view_as(t))
                off += t.numel()
