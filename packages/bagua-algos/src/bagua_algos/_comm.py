"""Communication plumbing shared by the algorithms.

:class:`Handle` is a completion handle that chains like a torch future (``then``, ``wait``,
``is_completed``).  :class:`Runner` runs blocking communication chains one after another on a
background thread, on the CUDA stream that was current when they were submitted.
:class:`Reducer` is "reduce this bucket, flat or hierarchical": every algorithm goes through
it instead of re-typing the flat-async / hierarchical-on-a-thread split.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

import bagua_comm as bc


class Handle:
    """Completion handle of a bucket's communication, chainable like ``torch.futures.Future``.

    ``then(fn)`` returns a new handle that completes once this one has and ``fn(self)`` has
    run; ``fn``'s return value is the new handle's :meth:`value`.  Callbacks run in the thread
    that observes completion (:meth:`wait` or a :meth:`is_completed` that returns True), never
    on a communication thread, so they may touch tensors the training thread owns.
    """

    __slots__ = ("_done", "_fn", "_parent", "_value", "_work")

    def __init__(self, work: Any = None, *, parent: Handle | None = None,
                 fn: Callable[[Handle], Any] | None = None):
        self._work = work            # anything with wait() (and is_completed()), or None
        self._parent = parent
        self._fn = fn
        self._done = False
        self._value = None

    @classmethod
    def completed(cls, value: Any = None) -> Handle:
        h = cls()
        h._done, h._value = True, value
        return h

    def then(self, fn: Callable[[Handle], Any]) -> Handle:
        return Handle(parent=self, fn=fn)

    def wait(self) -> Any:
        if not self._done:
            if self._parent is not None:
                self._parent.wait()
            if self._work is not None:
                self._work.wait()
            if self._fn is not None:
                self._value = self._fn(self._parent if self._parent is not None else self)
            self._done = True
        return self._value

    def value(self) -> Any:
        """The chained function's result (waits for completion)."""
        return self.wait()

    def is_completed(self) -> bool:
        if self._done:
            return True
        if self._parent is not None and not self._parent.is_completed():
            return False
        if self._work is not None and not self._work.is_completed():
            return False
        self.wait()
        return True


class _FutureWork:
    __slots__ = ("_future",)

    def __init__(self, future: Future):
        self._future = future

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
