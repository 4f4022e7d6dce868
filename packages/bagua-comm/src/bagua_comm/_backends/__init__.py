"""Backends: how a process group moves tensors.

A :class:`~bagua_comm.ProcessGroup` holds one :class:`Backend` object per kind of tensor it
carries, chosen when the group is made: :class:`~._backends.gloo.GlooBackend` for CPU
tensors (always), :class:`~._backends.nccl.NcclBackend` for CUDA tensors on the ``nccl``
backend.  The primitives (``primitives.py``) validate their arguments, count traffic and
call the backend of the tensor's device; the backend only moves data.

The contract every backend implements (``tests/test_backends.py`` runs it against each):

* Arguments arrive validated: contiguous tensors of a carried dtype on the backend's device,
  ranks are group ranks in ``[0, size)``, ``op`` a :class:`~bagua_comm.ReduceOp` valid for
  the dtype (AVG on floating point only; bitwise ops on integers only).
* Each collective method returns :func:`~bagua_comm.work.finish`'s result: a
  :class:`~bagua_comm.work.Work` when ``async_op`` else None, after the result is in place
  (for NCCL: ordered before later work on the caller's current stream).
* ``run(fn, tensors, async_op)`` runs ``fn()`` in the backend's execution context for
  multi-phase collectives (gloo: the group's worker thread, FIFO, so phases never interleave
  with another call's; NCCL: the group's stream).  Inside ``fn``, ``exchange(recv_rows,
  send_rows)`` sends row ``j`` to group rank ``j`` and receives row ``j`` from it (an
  alltoall; an allgather when every send row is the same tensor), and ``scratch(tag, numel,
  dtype)`` returns a buffer of the group's pool, reused by the next call of the same shape.
* ``allreduce_launcher(tensor, op, nbytes)``: optional (None by default), see there.
* ``close(abort=False)`` releases what the backend holds (threads, communicators).
"""

from __future__ import annotations

import collections

import torch

#: At most this many buffers stay in a group's scratch pool; past it the least recently used
#: one is dropped (never the whole pool: a model whose buckets need more distinct shapes than
#: the pool holds would otherwise reallocate every buffer on every step).
SCRATCH_BUFFERS = 256


class Backend:
    """Base class of the backends: the methods each one implements (see module docs)."""

    name = "?"
    #: CUDA device index of a GPU backend (None for gloo).
    device: int | None = None

    def __init__(self, group):
        self.group = group
        self._scratch: collections.OrderedDict = collections.OrderedDict()

    # -- primitives (group ranks, validated tensors) ------------------------------------------
    def send(self, tensor, dst, async_op):
        raise NotImplementedError

    def recv(self, tensor, src, async_op):
        raise NotImplementedError

    def broadcast(self, tensor, src, async_op):
        raise NotImplementedError

    def reduce(self, tensor, dst, op, async_op):
        """In place: rank ``dst``'s ``tensor`` becomes the reduction (others: unspecified)."""
        raise NotImplementedError

    def allreduce(self, send, recv, op, async_op):
        """``recv`` = reduction of every rank's ``send`` (``recv`` may be ``send``)."""
        raise NotImplementedError

    def allreduce_launcher(self, tensor, op, nbytes):
        """A no-argument callable that starts ``allreduce(tensor, tensor, op, True)`` and
        records ``nbytes`` of traffic without entering Python, or None (the default: the
        primitive's own path is used)."""
        return None

    def allgather(self, send, recv, async_op):
        raise NotImplementedError

    def gather(self, send, recv, dst, async_op):
        raise NotImplementedError

    def scatter(self, send, recv, src, async_op):
        raise NotImplementedError

    def reduce_scatter(self, send, recv, op, async_op):
        raise NotImplementedError

    def alltoall(self, send, recv, async_op):
        raise NotImplementedError

    def alltoall_v(self, send, send_counts, send_displs, recv, recv_counts, recv_displs,
                   async_op):
        raise NotImplementedError

    def barrier(self, async_op):
        raise NotImplementedError

    def send_recv(self, sends, recvs, async_op):
        """Every ``(peer, tensor)`` of ``sends`` sent and of ``recvs`` received as one
        operation: no rank's receive can wait for a send this rank has not posted yet."""
        raise NotImplementedError

    # -- multi-phase collectives --------------------------------------------------------------
    def run(self, fn, tensors, async_op):
        raise NotImplementedError

    def exchange(self, recv_rows, send_rows):
        raise NotImplementedError

    def scratch(self, tag, numel: int, dtype: torch.dtype, device=None) -> torch.Tensor:
        """A reusable buffer of this group (fresh large allocations cost a page fault per
        4 KiB on every call; the next call of the same shape reuses this one).  Only for use
        inside :meth:`run`, whose calls are serialised."""
        key = (tag, numel, dtype, device)
        buf = self._scratch.get(key)
        if buf is None:
            while len(self._scratch) >= SCRATCH_BUFFERS:
                self._scratch.popitem(last=False)
            buf = self._scratch[key] = torch.empty(numel, dtype=dtype, device=device)
        else:
            self._scratch.move_to_end(key)
        return buf

    def scratch_rows(self, tag, numel: int, dtype: torch.dtype, device, n: int):
        """:meth:`scratch` and its ``n`` equal rows as views, made once per buffer (an
        exchange of the rows then dispatches no view or select per call)."""
        buf = self.scratch(tag, numel, dtype, device)
        key = ("rows", tag, numel, dtype, device, n)
        got = self._scratch.get(key)
        if got is None or got[0] is not buf:
            got = self._scratch[key] = (buf, buf.view(n, -1).unbind(0))
        else:
            self._scratch.move_to_end(key)
        return got

    def close(self, abort: bool = False) -> None:
        self._scratch.clear()
