"""Communication helpers shared by the algorithms: an ordered background runner, completed
handles, and the hierarchical (intra-node / inter-node) pattern."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

import bagua_comm as bc


class FutureWork:
    """A ``wait()``-able handle for a function running on a :class:`Runner`."""

    def __init__(self, future: Future):
        self._future = future

    def wait(self) -> None:
        self._future.result()

    def is_completed(self) -> bool:
        return self._future.done()


class Runner:
    """Runs communication functions one after another on a background thread.

    Collectives issued from it keep their submission order, which is the same on every rank,
    so chains of blocking collectives (hierarchical modes) overlap the caller's computation.
    """

    def __init__(self, name: str):
        self._name = name
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, fn: Callable[[], None]) -> FutureWork:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self._name)
        return FutureWork(self._pool.submit(fn))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def hierarchical(group: bc.ProcessGroup, tensor: torch.Tensor,
                 inter_op: Callable[[torch.Tensor, bc.ProcessGroup], None],
                 average: bool = True) -> None:
    """Intra-node reduce to the node leader, ``inter_op`` among leaders, intra-node broadcast.

    ``tensor`` holds this rank's contribution and receives the result.  With ``average`` the
    intra-node reduction is a mean (``inter_op`` decides what happens among leaders).
    """
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
