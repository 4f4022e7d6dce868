"""The primitives on CUDA tensors: our NCCL binding, streams and events through CuPy.

Arguments arrive validated (see primitives.py).  Each operation runs on its group's own CUDA
stream: that stream first waits for the caller's current torch stream (so the inputs are
ready), then NCCL (and any local post-processing) is enqueued on it, and an event marks the
end.  Synchronous calls make the caller's stream wait for that event (no host
synchronisation); ``async_op=True`` returns a work handle whose ``wait()`` does the same and
whose ``is_completed()`` queries the event.  Tensors are recorded on the communication
stream so torch's allocator keeps them alive until it is done.
"""

from __future__ import annotations

import collections

import torch

from ..ops import ReduceOp, reduce_rows
from ..work import finish

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


class _CudaEvent:
    """A backend handle over a CuPy event recorded on the communication stream."""

    __slots__ = ("_event", "_state")

    def __init__(self, event, state):
        self._event = event
        self._state = state

    def wait(self):
        self._state.watch.check()   # the watchdog aborted this group: raise, do not wait
        self._state.caller(torch.cuda.current_stream().cuda_stream)[0].wait_event(self._event)

    def is_completed(self):
        return self._event.done


class _GroupState:
    """What every call on one group reuses: its CuPy and torch views of the communication
    stream, one (CuPy stream, "inputs ready" event) pair per caller stream, a free list of
    completion events (refilled by the watchdog as operations finish), scratch buffers, and
    the watchdog's record of the communicator.  Stored on the group; built at its first call.
    """

    def __init__(self, g, comm):
        from .. import _nccl_watchdog

        self.comm = comm
        self.stream = g.nccl_stream()
        self.torch_stream = torch.cuda.ExternalStream(self.stream.ptr)
        self._callers: dict = {}
        self.free_events: collections.deque = collections.deque()
        self.scratch: dict = {}
        self.watch = _nccl_watchdog.watch(comm, repr(g), _timeout_seconds(), g.cuda_device())

    @classmethod
    def of(cls, g):
        comm = g.nccl_comm()
        st = g.__dict__.get("_nccl_state")
        if st is None or st.comm is not comm:
            st = g.__dict__["_nccl_state"] = cls(g, comm)
        return st

    def caller(self, ptr: int):
        """(CuPy view of the caller's stream ``ptr``, its reusable "inputs ready" event).

        Reusing the event is safe: ``cudaStreamWaitEvent`` waits for the record made before
        it, and a later record on the same stream only covers more work."""
        got = self._callers.get(ptr)
        if got is None:
            cp = _cupy()
            got = self._callers[ptr] = (cp.cuda.ExternalStream(ptr),
                                        cp.cuda.Event(disable_timing=True))
        return got

    def event(self):
        try:
            return self.free_events.pop()
        except IndexError:
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


def _timeout_seconds() -> float:
    from ..process_group import _state

    timeout = getattr(_state, "timeout", None)
    return timeout.total_seconds() if timeout is not None else 1800.0


class _Launch:
    """One operation on the group's stream: ``with _Launch(g) as L: L.comm.<call>(...)``."""

    def __init__(self, g, *tensors):
        self.g = g
        self.state = st = _GroupState.of(g)
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
        caller, ready = self.state.caller(torch.cuda.current_stream().cuda_stream)
        ready.record(caller)
        self.stream.wait_event(ready)
        # Local torch/CuPy work inside the block also goes to the communication stream.
        self._ctx = (torch.cuda.stream(self._torch_stream), self.stream)
        for c in self._ctx:
            c.__enter__()
        return self

    def __exit__(self, *exc):
        for c in reversed(self._ctx):
            c.__exit__(*exc)
        return False

    def keep(self, *tensors):
        self.tensors += [t for t in tensors if t is not None]

    def done(self, async_op):
        st = self.state
        for t in self.tensors:
            t.record_stream(self._torch_stream)
        event = st.event()
        event.record(self.stream)
        handle = _CudaEvent(event, st)
        # Synchronous calls are waited for now, so their event goes back to the free list once
        # the watchdog sees it complete; an async handle keeps its own.
        st.watch.track(handle, on_done=None if async_op else st.recycle)
        return finish([handle], async_op=async_op)


def _grouped(comm, fn):
    from .._nccl_loader import load

    nccl = load()
    nccl.group_start()
    try:
        fn()
    finally:
        nccl.group_end()


# -- point to point ------------------------------------------------------------------------
def send(tensor, dst, g, async_op):
    with _Launch(g, tensor) as L:
        L.comm.send(tensor.data_ptr(), tensor.numel(), nccl_dtype(tensor), dst, L.ptr)
    return L.done(async_op)


def recv(tensor, src, g, async_op):
    with _Launch(g, tensor) as L:
        L.comm.recv(tensor.data_ptr(), tensor.numel(), nccl_dtype(tensor), src, L.ptr)
    return L.done(async_op)


# -- collectives ---------------------------------------------------------------------------
def broadcast(tensor, src, g, async_op):
    with _Launch(g, tensor) as L:
        L.comm.broadcast(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(),
                         nccl_dtype(tensor), src, L.ptr)
    return L.done(async_op)


def reduce(send_, recv_, dst, op, g, async_op):
    with _Launch(g, send_, recv_) as L:
        if op in _BITWISE:
            gathered = _gather_all(L, send_, g)
            if g.rank == dst:
                recv_.copy_(_fold(gathered, op))
        else:
            L.comm.reduce(send_.data_ptr(), recv_.data_ptr(), send_.numel(), nccl_dtype(send_),
                          NCCL_OPS[op], dst, L.ptr)
    return L.done(async_op)


def allreduce(send_, recv_, op, g, async_op):
    with _Launch(g, send_, recv_) as L:
        if op in _BITWISE:
            recv_.copy_(_fold(_gather_all(L, send_, g), op))
        else:
            L.comm.allreduce(send_.data_ptr(), recv_.data_ptr(), send_.numel(),
                             nccl_dtype(send_), NCCL_OPS[op], L.ptr)
    return L.done(async_op)


def _gather_all(L, t, g):
    """NCCL has no bitwise reductions: gather every rank's tensor, fold locally."""
    out = torch.empty((g.size, t.numel()), dtype=t.dtype, device=t.device)
    L.comm.allgather(t.data_ptr(), out.data_ptr(), t.numel(), nccl_dtype(t), L.ptr)
    L.keep(out)
    return out


def _fold(rows, op):
    acc = rows[0].clone()
    for row in rows[1:]:
        acc = _BITWISE[op](acc, row)
    return acc


def allgather(send_, recv_, g, async_op):
    with _Launch(g, send_, recv_) as L:
        L.comm.allgather(send_.data_ptr(), recv_.data_ptr(), send_.numel(), nccl_dtype(send_),
                         L.ptr)
    return L.done(async_op)


def reduce_scatter(send_, recv_, op, g, async_op):
    with _Launch(g, send_, recv_) as L:
        if op in _BITWISE:
            rows = _gather_all(L, send_, g).view(g.size, g.size, -1)[:, g.rank]
            recv_.view(-1).copy_(_fold(rows, op))
        else:
            L.comm.reduce_scatter(send_.data_ptr(), recv_.data_ptr(), recv_.numel(),
                                  nccl_dtype(send_), NCCL_OPS[op], L.ptr)
    return L.done(async_op)


def _p2p(L, sends, recvs):
    """Grouped send/recv: ``sends``/``recvs`` are (peer, tensor) pairs."""
    def run():
        for peer, t in sends:
            if t.numel():
                L.comm.send(t.data_ptr(), t.numel(), nccl_dtype(t), peer, L.ptr)
        for peer, t in recvs:
            if t.numel():
                L.comm.recv(t.data_ptr(), t.numel(), nccl_dtype(t), peer, L.ptr)

    _grouped(L.comm, run)


def gather(send_, recv_, dst, g, async_op):
    with _Launch(g, send_, recv_) as L:
        if g.rank == dst:
            parts = recv_.view(-1).chunk(g.size)
            parts[dst].copy_(send_.view(-1))
            _p2p(L, [], [(r, parts[r]) for r in range(g.size) if r != dst])
        else:
            _p2p(L, [(dst, send_)], [])
    return L.done(async_op)


def scatter(send_, recv_, src, g, async_op):
    with _Launch(g, send_, recv_) as L:
        if g.rank == src:
            parts = send_.view(-1).chunk(g.size)
            recv_.view(-1).copy_(parts[src])
            _p2p(L, [(r, parts[r]) for r in range(g.size) if r != src], [])
        else:
            _p2p(L, [], [(src, recv_)])
    return L.done(async_op)


def alltoall(send_, recv_, g, async_op):
    with _Launch(g, send_, recv_) as L:
        s, r = send_.view(-1).chunk(g.size), recv_.view(-1).chunk(g.size)
        _p2p(L, [(p, s[p]) for p in range(g.size)], [(p, r[p]) for p in range(g.size)])
    return L.done(async_op)


def alltoall_v(send_, send_counts, send_displs, recv_, recv_counts, recv_displs, g, async_op):
    with _Launch(g, send_, recv_) as L:
        s, r = send_.view(-1), recv_.view(-1)
        _p2p(L, [(p, s[d:d + c]) for p, (c, d) in enumerate(zip(send_counts, send_displs))],
             [(p, r[d:d + c]) for p, (c, d) in enumerate(zip(recv_counts, recv_displs))])
    return L.done(async_op)


# -- compressed allreduce ------------------------------------------------------------------
def compressed_allreduce(send_, recv_, op, compressor, k, seg, key, g, async_op):
    """The same scatter-reduce-gather as on gloo, all on the group's stream (CuPy kernels)."""
    n = g.size
    chunks = n * k
    padded = seg * n
    numel = send_.numel()
    with _Launch(g, send_, recv_) as L:
        buf = L.state.buffer
        dev = send_.device
        x = send_.detach().view(-1)
        if padded != numel:
            xp = buf("input", padded, send_.dtype, dev)
            xp[:numel].copy_(x)
            xp[numel:].zero_()
            x = xp
        payload = compressor.compress(x, chunks=chunks, key=f"{key}/scatter",
                                      out=buf("payload", compressor.payload_numel(
                                          padded, chunks=chunks), torch.uint8, dev))
        received = buf("received", payload.numel(), torch.uint8, dev)
        p, q = payload.chunk(n), received.chunk(n)
        _p2p(L, [(j, p[j]) for j in range(n)], [(j, q[j]) for j in range(n)])
        parts = buf("parts", padded, torch.float32, dev)
        compressor.decompress(received, parts, chunks=chunks, dtype=send_.dtype)
        mine = reduce_rows(parts.view(n, seg), op)
        own = compressor.compress(mine.to(send_.dtype), chunks=k, key=f"{key}/gather",
                                  out=buf("own", compressor.payload_numel(seg, chunks=k),
                                          torch.uint8, dev))
        gathered = buf("gathered", n * own.numel(), torch.uint8, dev)
        L.comm.allgather(own.data_ptr(), gathered.data_ptr(), own.numel(), NCCL_DTYPES[torch.uint8],
                         L.ptr)
        out = recv_.detach().view(-1)
        if padded != numel:
            full = buf("output", padded, recv_.dtype, dev)
            compressor.decompress(gathered, full, chunks=chunks)
            out.copy_(full[:numel])
        else:
            compressor.decompress(gathered, out, chunks=chunks)
        L.keep(x, payload, received, parts, own, gathered)
    return L.done(async_op)
