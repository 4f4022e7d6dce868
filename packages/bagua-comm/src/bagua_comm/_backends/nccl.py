"""The nccl backend: CUDA tensors through our NCCL binding, streams and events through CuPy.

Arguments arrive validated (see primitives.py).  Each operation runs on its group's own CUDA
stream: that stream first waits for the caller's current torch stream (so the inputs are
ready), then NCCL (and any local post-processing) is enqueued on it, and an event marks the
end.  Synchronous calls make the caller's stream wait for that event (no host
synchronisation); ``async_op=True`` returns a work handle whose ``wait()`` does the same and
whose ``is_completed()`` queries the event.  Tensors are recorded on the communication
stream so torch's allocator keeps them alive until it is done.

The backend object owns the group's NCCL state: its communicator (created at first use,
collectively over the group: its rank 0 makes a unique id and shares it through the store)
and its stream.  Nothing here imports CuPy or loads libnccl before the first CUDA call.
"""

from __future__ import annotations

import collections
import threading

import torch
import torch.distributed as dist

from .. import _nccl_loader, _nccl_watchdog
from .._state import state as _process
from ..ops import ReduceOp
from ..work import Work
from . import Backend

NCCL_DTYPES = {torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4,
               torch.float16: 6, torch.float32: 7, torch.float64: 8, torch.bfloat16: 9}
NCCL_OPS = {ReduceOp.SUM: 0, ReduceOp.PRODUCT: 1, ReduceOp.MAX: 2, ReduceOp.MIN: 3,
            ReduceOp.AVG: 4}
_BITWISE = {ReduceOp.BAND: torch.bitwise_and, ReduceOp.BOR: torch.bitwise_or,
            ReduceOp.BXOR: torch.bitwise_xor}


def _cupy():
    import cupy

    return cupy


def nccl_dtype(t: torch.Tensor) -> int:
    try:
        return NCCL_DTYPES[t.dtype]
    except KeyError:
        raise ValueError(f"the nccl backend does not support {t.dtype}; use one of "
                         f"{sorted(str(d) for d in NCCL_DTYPES)}") from None


class _CudaWork(Work):
    """The CUDA form of :class:`~bagua_comm.work.Work`: the operation ends with a CuPy event
    recorded on the group's communication stream.  ``wait()`` makes the caller's current
    stream wait for it (no host synchronisation); ``is_completed()`` queries the event (the
    watchdog polls it too, so it only reads)."""

    __slots__ = ("_event", "_state")

    def __init__(self, event, state):
        super().__init__()
        self._event = event
        self._state = state

    def _wait_leaves(self):
        self._state.watch.check()   # the watchdog aborted this group: raise, do not wait
        st = self._state
        st.caller(torch.cuda.current_stream(st.device).cuda_stream)[0].wait_event(self._event)

    def _leaves_completed(self):
        return self._event.done

    def is_completed(self):
        return self._finished or self._event.done


class _GroupState:
    """What every call on one group reuses: its CuPy and torch views of the communication
    stream, one (CuPy stream, "inputs ready" event) pair per caller stream, a free list of
    completion events (refilled by the watchdog as operations finish), scratch buffers, and
    the watchdog's record of the communicator.  Stored on the group; built at its first call.
    """

    def __init__(self, be, comm):
        g = be.group
        self.comm = comm
        self.stream = be.stream()
        self.torch_stream = torch.cuda.ExternalStream(self.stream.ptr)
        self._callers: dict = {}
        self.free_events: collections.deque = collections.deque()
        self.scratch: dict = {}
        self.device = be.device
        self.watch = _nccl_watchdog.watch(comm, repr(g), _process.timeout_seconds(), be.device)

    @classmethod
    def of(cls, be):
        comm = be.comm()
        st = be._state
        if st is None or st.comm is not comm:
            st = be._state = cls(be, comm)
        return st

    def caller(self, ptr: int):
        """(CuPy view of the caller's stream ``ptr``, its reusable "inputs ready" event).

        Reusing the event is safe: ``cudaStreamWaitEvent`` waits for the record made before
        it, and a later record on the same stream only covers more work."""
        got = self._callers.get(ptr)
        if got is None:
            cp = _cupy()
            with _on_device(self.device):
                got = self._callers[ptr] = (cp.cuda.ExternalStream(ptr),
                                            cp.cuda.Event(disable_timing=True))
        return got

    def event(self):
        try:
            return self.free_events.pop()
        except IndexError:
            with _on_device(self.device):   # an event belongs to the device current at creation
                return _cupy().cuda.Event(disable_timing=True)

    def recycle(self, handle):
        self.free_events.append(handle._event)

    def buffer(self, name, numel, dtype, device):
        """A scratch tensor reused across calls: only this group's stream touches it, in
        order, so the next call's use waits for this one's on the GPU."""
        t = self.scratch.get(name)
        if t is None or t.numel() != numel or t.dtype != dtype or t.device != device:
            t = self.scratch[name] = torch.empty(numel, dtype=dtype, device=device)
        return t


def _on_device(device):
    """CuPy's current device set to ``device`` (None: leave it; the CPU test fakes)."""
    import contextlib

    return contextlib.nullcontext() if device is None else _cupy().cuda.Device(device)


class _Launch:
    """One operation on the group's stream: ``with _Launch(be) as L: L.comm.<call>(...)``."""

    def __init__(self, be, *tensors, local: bool = True):
        self.state = st = _GroupState.of(be)
        #: whether the block does local torch/CuPy work (copies, folds, allocations) that must
        #: go to the communication stream; a plain NCCL call names its stream itself and
        #: skips entering the two stream contexts (host time on every call)
        self._local = local
        st.watch.check()            # an earlier failure on this group: raise before launching
        self.comm = st.comm
        self.stream = st.stream
        self.tensors = [t for t in tensors if t is not None]
        self._torch_stream = st.torch_stream
        self._ctx = None

    @property
    def ptr(self) -> int:
        return self.stream.ptr

    def __enter__(self):
        # the device named: torch then skips resolving the current device (is_available(),
        # environment lookups), a third of this call's host time in a profile on an H200
        caller, ready = self.state.caller(torch.cuda.current_stream(self.state.device)
                                          .cuda_stream)
        ready.record(caller)
        self.stream.wait_event(ready)
        # Local torch/CuPy work inside the block also goes to the communication stream.
        if self._local:
            self._ctx = (torch.cuda.stream(self._torch_stream), self.stream)
            for c in self._ctx:
                c.__enter__()
        return self

    def __exit__(self, *exc):
        for c in reversed(self._ctx or ()):
            c.__exit__(*exc)
        if exc[0] is not None and issubclass(exc[0], RuntimeError):
            # NCCL failed because the watchdog aborted the communicator meanwhile: say so
            self.state.watch.check()
        return False

    def keep(self, *tensors):
        self.tensors += [t for t in tensors if t is not None]

    def done(self, async_op):
        st = self.state
        for t in self.tensors:
            t.record_stream(self._torch_stream)
        event = st.event()
        event.record(self.stream)
        work = _CudaWork(event, st)
        # Synchronous calls are waited for now, so their event goes back to the free list once
        # the watchdog sees it complete; an async handle keeps its own.
        st.watch.track(work, on_done=None if async_op else st.recycle)
        if async_op:
            return work
        work._wait_leaves()     # nobody else holds this handle: no completion bookkeeping
        return None


class NcclBackend(Backend):
    name = "nccl"

    def __init__(self, group, device: int | None = None):
        super().__init__(group)
        if device is None:
            device = _process.cuda_device
        #: The CUDA device of this rank's communicator, stream and events.
        self.device = device
        self._lock = threading.Lock()
        self._comm = None
        self._stream = None
        self._launch = None  # the _Launch of the run() in progress
        self._state = None   # _GroupState: streams, events, scratch, watchdog record

    # -- state ----------------------------------------------------------------------------------
    def comm(self):
        """This group's NCCL communicator, created at first use (collective over the group)."""
        with self._lock:
            if self._comm is None:
                g = self.group
                nccl = _nccl_loader.load()
                store = dist.distributed_c10d._get_default_store()
                key = f"bagua_comm/nccl_uid/{g._generation}/{g._id}"
                if g.rank == 0:
                    store.set(key, nccl.get_unique_id())
                uid = store.get(key)
                # Non-blocking creation, bounded by the group's timeout: a peer that never
                # joins makes this rank raise instead of hanging in ncclCommInitRank.
                with torch.cuda.device(self.device):
                    self._comm = nccl.NcclCommunicator(g.size, bytes(uid), g.rank,
                                                       timeout=_process.timeout_seconds())
            return self._comm

    def stream(self):
        """The CuPy stream this group's NCCL work runs on (created at first use)."""
        with self._lock:
            if self._stream is None:
                import cupy

                with cupy.cuda.Device(self.device):
                    self._stream = cupy.cuda.Stream(non_blocking=True)
            return self._stream

    def close(self, abort: bool = False) -> None:
        state, self._state = self._state, None
        if state is not None:
            state.watch.close()    # stop watching before the communicator goes away
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.abort() if abort else comm.destroy()
        super().close(abort)

    # -- point to point ------------------------------------------------------------------------
    def send(self, tensor, dst, async_op):
        with _Launch(self, tensor, local=False) as L:
            L.comm.send(tensor.data_ptr(), tensor.numel(), nccl_dtype(tensor), dst, L.ptr)
        return L.done(async_op)

    def recv(self, tensor, src, async_op):
        with _Launch(self, tensor, local=False) as L:
            L.comm.recv(tensor.data_ptr(), tensor.numel(), nccl_dtype(tensor), src, L.ptr)
        return L.done(async_op)

    # -- collectives ---------------------------------------------------------------------------
    def broadcast(self, tensor, src, async_op):
        with _Launch(self, tensor, local=False) as L:
            L.comm.broadcast(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(),
                             nccl_dtype(tensor), src, L.ptr)
        return L.done(async_op)

    def reduce(self, tensor, dst, op, async_op):
        with _Launch(self, tensor, local=op in _BITWISE) as L:
            if op in _BITWISE:
                gathered = self._gather_all(L, tensor)
                if self.group.rank == dst:
                    tensor.copy_(self._fold(gathered, op))
            else:
                L.comm.reduce(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(),
                              nccl_dtype(tensor), NCCL_OPS[op], dst, L.ptr)
        return L.done(async_op)

    def allreduce(self, send_, recv_, op, async_op):
        with _Launch(self, send_, recv_, local=op in _BITWISE) as L:
            if op in _BITWISE:
                recv_.copy_(self._fold(self._gather_all(L, send_), op))
            else:
                L.comm.allreduce(send_.data_ptr(), recv_.data_ptr(), send_.numel(),
                                 nccl_dtype(send_), NCCL_OPS[op], L.ptr)
        return L.done(async_op)

    def _gather_all(self, L, t):
        """NCCL has no bitwise reductions: gather every rank's tensor, fold locally."""
        out = torch.empty((self.group.size, t.numel()), dtype=t.dtype, device=t.device)
        L.comm.allgather(t.data_ptr(), out.data_ptr(), t.numel(), nccl_dtype(t), L.ptr)
        L.keep(out)
        return out

    @staticmethod
    def _fold(rows, op):
        acc = rows[0].clone()
        for row in rows[1:]:
            acc = _BITWISE[op](acc, row)
        return acc

    def allgather(self, send_, recv_, async_op):
        with _Launch(self, send_, recv_, local=False) as L:
            L.comm.allgather(send_.data_ptr(), recv_.data_ptr(), send_.numel(),
                             nccl_dtype(send_), L.ptr)
        return L.done(async_op)

    def reduce_scatter(self, send_, recv_, op, async_op):
        with _Launch(self, send_, recv_, local=op in _BITWISE) as L:
            if op in _BITWISE:
                n = self.group.size
                rows = self._gather_all(L, send_).view(n, n, -1)[:, self.group.rank]
                recv_.view(-1).copy_(self._fold(rows, op))
            else:
                L.comm.reduce_scatter(send_.data_ptr(), recv_.data_ptr(), recv_.numel(),
                                      nccl_dtype(send_), NCCL_OPS[op], L.ptr)
        return L.done(async_op)

    def _grouped(self, comm, fn):
        """Run ``fn``'s NCCL calls between ncclGroupStart and ncclGroupEnd: one operation.
        NCCL's send and recv block the GPU until their peer's match runs, so a rank's sends
        and receives of one exchange must be grouped, or two ranks that each posted a recv
        first wait for each other forever."""
        nccl = _nccl_loader.load()
        nccl.group_start()
        try:
            fn()
        finally:
            nccl.group_end(comm)

    def _p2p(self, L, sends, recvs):
        """Grouped send/recv: ``sends``/``recvs`` are (peer, tensor) pairs."""
        def run():
            for peer, t in sends:
                if t.numel():
                    L.comm.send(t.data_ptr(), t.numel(), nccl_dtype(t), peer, L.ptr)
            for peer, t in recvs:
                if t.numel():
                    L.comm.recv(t.data_ptr(), t.numel(), nccl_dtype(t), peer, L.ptr)

        self._grouped(L.comm, run)

    def send_recv(self, sends, recvs, async_op):
        with _Launch(self, *(t for _, t in sends), *(t for _, t in recvs), local=False) as L:
            self._p2p(L, sends, recvs)
        return L.done(async_op)

    def gather(self, send_, recv_, dst, async_op):
        with _Launch(self, send_, recv_) as L:
            if self.group.rank == dst:
                parts = recv_.view(-1).chunk(self.group.size)
                parts[dst].copy_(send_.view(-1))
                self._p2p(L, [], [(r, parts[r]) for r in range(self.group.size) if r != dst])
            else:
                self._p2p(L, [(dst, send_)], [])
        return L.done(async_op)

    def scatter(self, send_, recv_, src, async_op):
        with _Launch(self, send_, recv_) as L:
            if self.group.rank == src:
                parts = send_.view(-1).chunk(self.group.size)
                recv_.view(-1).copy_(parts[src])
                self._p2p(L, [(r, parts[r]) for r in range(self.group.size) if r != src], [])
            else:
                self._p2p(L, [], [(src, recv_)])
        return L.done(async_op)

    def alltoall(self, send_, recv_, async_op):
        with _Launch(self, send_, recv_, local=False) as L:
            n = self.group.size
            s, r = send_.view(-1).chunk(n), recv_.view(-1).chunk(n)
            self._p2p(L, [(p, s[p]) for p in range(n)], [(p, r[p]) for p in range(n)])
        return L.done(async_op)

    def alltoall_v(self, send_, send_counts, send_displs, recv_, recv_counts, recv_displs,
                   async_op):
        with _Launch(self, send_, recv_, local=False) as L:
            s, r = send_.view(-1), recv_.view(-1)
            self._p2p(L, [(p, s[d:d + c]) for p, (c, d) in enumerate(zip(send_counts, send_displs))],
                      [(p, r[d:d + c]) for p, (c, d) in enumerate(zip(recv_counts, recv_displs))])
        return L.done(async_op)

    def barrier(self, async_op):
        """A one-element NCCL allreduce on this group's stream; the synchronous form also
        waits on the host for it (a barrier is a host rendezvous)."""
        with _Launch(self) as L:
            t = L.state.buffer("barrier", 1, torch.int32, torch.device("cuda", self.device))
            L.comm.allreduce(t.data_ptr(), t.data_ptr(), 1, nccl_dtype(t), NCCL_OPS[ReduceOp.SUM],
                             L.ptr)
        work = L.done(True)
        if async_op:
            return work
        work._event.synchronize()
        work.wait()
        return None

    # -- multi-phase collectives ----------------------------------------------------------------
    def run(self, fn, tensors, async_op):
        """Run ``fn`` with the group's stream current (torch and CuPy): its kernels and NCCL
        calls are enqueued in order after the caller's pending work."""
        with _Launch(self, *tensors) as L:
            self._launch = L
            try:
                fn()
            finally:
                self._launch = None
        return L.done(async_op)

    def exchange(self, recv_rows, send_rows):
        n = self.group.size
        self._p2p(self._launch, [(j, send_rows[j]) for j in range(n)],
                  [(j, recv_rows[j]) for j in range(n)])
