"""The gloo backend: CPU tensors through torch.distributed's gloo process groups.

Collectives call the torch process group object directly (``pg.allreduce([t], opts)``, as
torch's own wrappers do after their argument checks, which our primitives have already made),
so a call costs little more than gloo itself.  Group ranks are the torch group's ranks: a
group's ranks are kept sorted, as torch keeps them.

Each group has a second gloo group of the same ranks (``aux``) and one worker thread
(``_worker.Worker``, its loop compiled): multi-phase collectives
(:func:`bagua_comm.compressed_allreduce` and its launchers) run there, FIFO, over ``aux``, so
they never interleave with the primitives the caller issues meanwhile.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from ..ops import ReduceOp, reduce_rows, to_torch
from ..work import finish
from . import Backend

_HALF = (torch.float16, torch.bfloat16)


def _opts(cls, **fields):
    o = cls()
    for k, v in fields.items():
        setattr(o, k, v)
    return o


class GlooBackend(Backend):
    name = "gloo"

    def __init__(self, group, torch_group, aux_torch_group):
        super().__init__(group)
        self.pg = torch_group
        self.aux = aux_torch_group
        self.size = group.size
        self._lock = threading.Lock()
        self._worker = None
        self._reduce_opts = {op: _opts(dist.AllreduceOptions, reduceOp=to_torch(op))
                             for op in ReduceOp}
        self._rs_opts = {op: _opts(dist.ReduceScatterOptions, reduceOp=to_torch(op))
                         for op in ReduceOp}
        self._bcast_opts = [_opts(dist.BroadcastOptions, rootRank=r, rootTensor=0)
                            for r in range(group.size)]
        self._a2a_opts = dist.AllToAllOptions()
        self._barrier_opts = dist.BarrierOptions()

    # -- point to point -------------------------------------------------------------------------
    def send(self, tensor, dst, async_op):
        return finish([self.pg.send([tensor], dst, 0)], async_op=async_op)

    def recv(self, tensor, src, async_op):
        return finish([self.pg.recv([tensor], src, 0)], async_op=async_op)

    # -- collectives ----------------------------------------------------------------------------
    def broadcast(self, tensor, src, async_op):
        return finish([self.pg.broadcast([tensor], self._bcast_opts[src])], async_op=async_op)

    def _reduction(self, tensor, op, start):
        """Start a reduction of ``tensor`` with ``start(buf) -> handle``; AVG is SUM and a
        division at completion.  Should this torch's gloo lack a 16-bit float reduction, it
        runs on a float32 copy (every rank takes the same path: the error comes from the
        dtype, before anything is sent)."""
        try:
            h, buf = start(tensor), tensor
        except RuntimeError as err:
            if tensor.dtype not in _HALF or "type" not in str(err).lower():
                raise
            buf = tensor.float()
            h = start(buf)
        if op is not ReduceOp.AVG and buf is tensor:
            return h, None
        size = self.size

        def then():
            if op is ReduceOp.AVG:
                buf.div_(size)
            if buf is not tensor:
                tensor.copy_(buf)

        return h, then

    def allreduce(self, send, recv, op, async_op):
        if recv.data_ptr() != send.data_ptr():
            recv.copy_(send)
        opts = self._reduce_opts[op]
        h, then = self._reduction(recv, op, lambda t: self.pg.allreduce([t], opts))
        return finish([h], then, async_op)

    def allreduce_launcher(self, tensor, op, nbytes):
        """A :class:`bagua_comm._launch.Launcher` of ``pg.allreduce`` on ``tensor``, or None
        where the reduction needs Python around it (AVG's division, a 16-bit float copy)."""
        if op is ReduceOp.AVG or tensor.dtype in _HALF:
            return None
        from .._launch import Launcher

        return Launcher(self.pg.allreduce, [tensor], self._reduce_opts[op], "allreduce",
                        nbytes)

    def reduce(self, tensor, dst, op, async_op):
        opts = _opts(dist.ReduceOptions, reduceOp=to_torch(op), rootRank=dst, rootTensor=0)
        h, then = self._reduction(tensor, op, lambda t: self.pg.reduce([t], opts))
        # Other ranks hold partial results: only dst averages (and copies back).
        return finish([h], then if self.group.rank == dst else None, async_op)

    # Buffers may have any shape (a ``[world, n]`` allgather output, a ``[2, n]``
    # reduce_scatter input): gloo compares shapes, so every collective below moves flat
    # views of them, as the NCCL backend does (the primitives checked they are contiguous).
    def allgather(self, send, recv, async_op):
        return finish([self.pg._allgather_base(recv.view(-1), send.view(-1))],
                      async_op=async_op)

    def gather(self, send, recv, dst, async_op):
        me = self.group.rank
        outs = [list(recv.view(-1).chunk(self.size))] if me == dst else []
        h = self.pg.gather(outs, [send.view(-1)], _opts(dist.GatherOptions, rootRank=dst))
        return finish([h], async_op=async_op)

    def scatter(self, send, recv, src, async_op):
        me = self.group.rank
        ins = [list(send.view(-1).chunk(self.size))] if me == src else []
        h = self.pg.scatter([recv.view(-1)], ins, _opts(dist.ScatterOptions, rootRank=src))
        return finish([h], async_op=async_op)

    def reduce_scatter(self, send, recv, op, async_op):
        send, recv = send.view(-1), recv.view(-1)
        if op not in (ReduceOp.SUM, ReduceOp.AVG):
            return self._reduce_scatter_rows(send, recv, op, async_op)
        opts = self._rs_opts[op]
        try:
            h, buf = self.pg._reduce_scatter_base(recv, send, opts), recv
        except RuntimeError as err:
            if send.dtype not in _HALF or "type" not in str(err).lower():
                raise
            buf = torch.empty(recv.numel(), dtype=torch.float32)
            h = self.pg._reduce_scatter_base(buf, send.float(), opts)
        if op is not ReduceOp.AVG and buf is recv:
            return finish([h], None, async_op)
        size = self.size

        def then():
            if op is ReduceOp.AVG:
                buf.div_(size)
            if buf is not recv:
                recv.copy_(buf)

        return finish([h], then, async_op)

    def _reduce_scatter_rows(self, send, recv, op, async_op):
        """PRODUCT/MIN/MAX/bitwise reduce_scatter: every rank's part ``r`` to rank ``r`` (an
        alltoall, the same bytes as a ring reduce_scatter), reduced here in rank order.
        gloo's own reduce_scatter sums whatever op it is given in torch 2.4."""
        rows = torch.empty((self.size, recv.numel()), dtype=send.dtype)
        h = self.pg.alltoall_base(rows, send.reshape(-1), [], [], self._a2a_opts)

        def then():
            reduce_rows(rows, op, out=recv.view(-1))

        return finish([h], then, async_op)

    def alltoall(self, send, recv, async_op):
        return finish([self.pg.alltoall_base(recv.view(-1), send.view(-1), [], [],
                                             self._a2a_opts)],
                      async_op=async_op)

    def alltoall_v(self, send, send_counts, send_displs, recv, recv_counts, recv_displs,
                   async_op):
        packed_send = torch.cat([send[d:d + c] for c, d in zip(send_counts, send_displs)])
        packed_recv = torch.empty(sum(recv_counts), dtype=recv.dtype)
        h = self.pg.alltoall_base(packed_recv, packed_send, list(recv_counts),
                                  list(send_counts), self._a2a_opts)

        def then():
            off = 0
            for c, d in zip(recv_counts, recv_displs):
                recv[d:d + c].copy_(packed_recv[off:off + c])
                off += c

        return finish([h], then, async_op)

    def barrier(self, async_op):
        return finish([self.pg.barrier(self._barrier_opts)], async_op=async_op)

    def send_recv(self, sends, recvs, async_op):
        # receives first, as in exchange(); gloo's send/recv never block the caller
        works = [self.pg.recv([t], p, 0) for p, t in recvs if t.numel()]
        works += [self.pg.send([t], p, 0) for p, t in sends if t.numel()]
        return finish(works, async_op=async_op)

    # -- multi-phase collectives ----------------------------------------------------------------
    def worker(self):
        """The group's worker thread (``_worker.Worker``): made at its first use."""
        with self._lock:
            if self._worker is None:
                from .._worker import Worker

                self._worker = Worker(f"bagua-comm-{self.group.ranks[:4]}")
            return self._worker

    def run(self, fn, tensors, async_op):
        """Run ``fn`` on the group's single worker thread (FIFO: the same order on every
        rank, which keeps multi-phase collectives matched across ranks)."""
        return finish([self.worker().submit(fn)], async_op=async_op)

    def compressed_launcher(self, build, nbytes, primitive="compressed_allreduce"):
        """A :class:`bagua_comm._worker.CompressedLauncher` of the job ``build()`` makes (on
        the worker thread, where the scratch pool is used): each call records ``nbytes``
        sent by ``primitive`` and hands the job to the worker, in order with every
        :meth:`run`."""
        from .._worker import CompressedLauncher

        worker = self.worker()
        done = worker.submit(build)
        done.wait()
        return CompressedLauncher(worker, done.value, nbytes, primitive)

    def exchange(self, recv_rows, send_rows):
        """Every receive is posted before the first send, so each rank's "ready to receive"
        notice leaves ahead of its bulk data and both directions of every link carry data
        at once.  (A gloo sender waits for its peer's notice, which travels on the same TCP
        connection as that peer's own outgoing data: with gloo's ``all_to_all`` a notice
        could wait behind a whole message, and the two directions of a link took turns.)"""
        me = self.group.rank
        peers = [j for j in range(self.size) if j != me]
        works = [self.aux.recv([recv_rows[j]], j, 0) for j in peers]
        works += [self.aux.send([send_rows[j]], j, 0) for j in peers]
        recv_rows[me].copy_(send_rows[me])
        for w in works:
            w.wait()

    def close(self, abort: bool = False) -> None:
        with self._lock:
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.close(wait=not abort)
        # Let go of torch's process groups now: held on (the group and its backends form a
        # reference cycle) they would be destroyed at interpreter exit, where gloo's
        # destructor aborts the process ("terminate called without an active exception").
        self.pg = self.aux = None
        super().close(abort)
