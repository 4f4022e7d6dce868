"""Communication plumbing shared by the algorithms.

:class:`Handle` is bagua_comm's completion handle (:class:`bagua_comm.Work`), which chains like
a torch future (``then``, ``wait``, ``is_completed``).  :class:`Runner` runs blocking communication chains one after another on a
background thread, on the CUDA stream that was current when they were submitted.
:class:`Reducer` is "reduce this bucket, flat or hierarchical": every algorithm goes through
it instead of re-typing the flat-async / hierarchical-on-a-thread split.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

import bagua_comm as bc

#: The completion handle of a bucket's communication: bagua_comm's one handle type, which
#: chains like ``torch.futures.Future`` (``then``, ``wait``, ``value``, ``is_completed``).
Handle = bc.Work


def on_gpu(device) -> bool:
    """Whether work on ``device`` is ordered by CUDA streams and events.  Every stream
    decision of the algorithms goes through here, so that tests/_stream_model.py can run the
    GPU ordering code on CPU tensors."""
    return device is not None and device.type == "cuda"


class StreamHandle(Handle):
    """A :class:`Handle` whose job ran on a stream of its own: ``wait()`` (and ``then``)
    make the consumer's current stream wait, on the GPU, for the job's end (an event),
    without blocking the host beyond the job's submission."""

    __slots__ = ("_done",)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._done = None

    def _order(self) -> None:
        if self._done is not None:
            torch.cuda.current_stream().wait_event(self._done)

    def wait(self) -> Any:
        value = super().wait()
        self._order()
        return value

    def then(self, fn):
        def ordered(h):
            self._order()
            return fn(h)

        return super().then(ordered)


class Runner:
    """Runs communication functions one after another on one background thread.

    Collectives issued from it keep their submission order, which is the same on every rank,
    so chains of blocking collectives (hierarchical modes, peer exchanges) overlap the
    caller's computation.  CUDA work a function issues goes by default to the stream that was
    current in the submitting thread (the engine's communication stream, in a bucket hook).

    With ``own_stream`` (for jobs submitted from the training stream: Decentralized's
    exchange, DiLoCo's syncs) the jobs run on a stream of the runner's own instead, which
    first waits for the submitter's stream at submission; the training stream waits for a
    job only where its result is consumed (:class:`StreamHandle`), and no thread but the
    training thread ever enqueues anything on it (issue 46: the exchange's blocking
    collectives made the training stream wait for them, from the runner's thread, in the
    middle of the next forward and backward).
    """

    def __init__(self, name: str, own_stream: bool = False):
        self._name = name
        self._pool: ThreadPoolExecutor | None = None
        self._own = own_stream
        self._streams: dict = {}     # device -> the runner's stream there

    def _side(self, caller):
        s = self._streams.get(caller.device)
        if s is None:
            s = self._streams[caller.device] = torch.cuda.Stream(device=caller.device)
        return s

    def submit(self, fn: Callable[[], Any]) -> Handle:
        """Run ``fn`` after the jobs submitted before; the handle completes (with None) when
        it has, and its ``then`` callbacks run on this runner's thread."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self._name)
        stream = torch.cuda.current_stream() if torch.cuda.is_initialized() else None
        ready = done = None
        if stream is not None and self._own:
            ready, done = torch.cuda.Event(), torch.cuda.Event()
            ready.record(stream)          # the inputs, as the submitter's stream has them
            stream = self._side(stream)
            handle = StreamHandle.pending()
            handle._done = done
        else:
            handle = Handle.pending()

        def job():
            try:
                if stream is None:
                    fn()
                else:
                    with torch.cuda.stream(stream):
                        if ready is not None:
                            stream.wait_event(ready)
                        fn()
                        if done is not None:
                            done.record(stream)
            except BaseException as err:  # handed to whoever waits
                handle.set_exception(err)
            else:
                handle.set_result(None)

        self._pool.submit(job)
        return handle

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

    def __init__(self, group: bc.ProcessGroup, hierarchical: bool, name: str,
                 own_stream: bool = False):
        self.group = group
        self.runner = Runner(name, own_stream)
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
            return bc.allreduce_inplace(tensor, op, group=self.group, async_op=True)
        return self.runner.submit(lambda: hierarchical(
            self.group, tensor, lambda t, g: bc.allreduce_inplace(t, op, group=g),
            op is bc.ReduceOp.AVG))

    def compressed_allreduce(self, tensor: torch.Tensor, compressor, key: str,
                             op: bc.ReduceOp = bc.ReduceOp.AVG) -> Handle:
        """Allreduce ``tensor`` in place through ``compressor`` (among node leaders only when
        hierarchical; the intra-node steps stay full precision)."""
        if not self.hierarchical:
            return bc.compressed_allreduce(tensor, tensor, op, compressor, key=key,
                                           group=self.group, async_op=True)

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
