"""Test support: the NCCL backend's code path on CPU tensors, with NCCL's blocking semantics.

:func:`use_fake_nccl` (call it in each rank of a :func:`bagua_comm.testing.run_ranks` job,
after ``init_process_group(backend="gloo")``) routes every tensor of every group through the
real :class:`~bagua_comm._backends.nccl.NcclBackend` — its launches, events, grouping and
watchdog — over :class:`FakeCommunicator`, which moves CPU memory with the group's auxiliary
gloo group.  CuPy and torch's CUDA stream functions are replaced by host stand-ins in this
process only (a test process), so nothing here needs CUDA.

The model of NCCL that matters for correctness: a stream runs its operations in order, and an
ungrouped ``ncclRecv`` blocks its stream until the peer's matching ``ncclSend`` has run (so does
an ungrouped ``ncclSend`` until the peer's receive is posted).  Here the stream is the calling
thread: an ungrouped recv waits for the peer's data, and if none comes within ``timeout``
seconds it raises :class:`FakeNcclDeadlock` (two ranks that both receive first deadlock, as
they would on GPUs).  Calls between ``ncclGroupStart`` and ``ncclGroupEnd`` are posted
together at the group's end, receives and sends at once, as NCCL launches a group.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import types
from datetime import timedelta

import torch
import torch.distributed as dist

_DTYPES = {0: torch.int8, 1: torch.uint8, 2: torch.int32, 4: torch.int64, 6: torch.float16,
           7: torch.float32, 8: torch.float64, 9: torch.bfloat16}
_OPS = {0: dist.ReduceOp.SUM, 1: dist.ReduceOp.PRODUCT, 2: dist.ReduceOp.MAX,
        3: dist.ReduceOp.MIN, 4: dist.ReduceOp.SUM}   # 4: AVG, divided afterwards


class FakeNcclDeadlock(RuntimeError):
    """An ungrouped point-to-point call waited for its peer past the fake's timeout."""


def _view(ptr: int, count: int, dtype: int) -> torch.Tensor:
    """The ``count`` elements at address ``ptr`` as a CPU tensor (no copy)."""
    dt = _DTYPES[dtype]
    nbytes = count * torch.empty(0, dtype=dt).element_size()
    buf = (ctypes.c_char * nbytes).from_address(ptr)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dt)


class FakeCommunicator:
    """One rank's stand-in for :class:`bagua_comm._nccl.NcclCommunicator` (see module docs)."""

    def __init__(self, group, timeout: float):
        self.pg = group.aux_torch_group
        self.nranks, self.rank = group.size, group.rank
        self.timeout = timeout
        self.alive = True
        self.watch = None
        self._grouped: list | None = None    # the calls since ncclGroupStart, if in a group
        self.ungrouped_p2p = 0                # point-to-point calls made outside any group

    # -- lifetime / watchdog ------------------------------------------------------------------
    def async_error(self, blocking=True):
        return 0 if self.alive else None

    def abort(self):
        self.alive = False

    destroy = abort

    # -- grouping -----------------------------------------------------------------------------
    def group_start(self):
        self._grouped = []

    def group_end(self):
        calls, self._grouped = self._grouped, None
        works = [self.pg.recv([t], peer, 0) for kind, t, peer in calls if kind == "recv"]
        works += [self.pg.send([t], peer, 0) for kind, t, peer in calls if kind == "send"]
        for w in works:
            self._wait(w, "a grouped send/recv")

    def _wait(self, work, what):
        try:
            ok = work.wait(timedelta(seconds=self.timeout))
        except RuntimeError as err:
            raise FakeNcclDeadlock(f"fake NCCL: {what} did not complete within "
                                   f"{self.timeout:g} s ({err})") from err
        if ok is False:
            raise FakeNcclDeadlock(f"fake NCCL: {what} did not complete within "
                                   f"{self.timeout:g} s")

    # -- point to point -----------------------------------------------------------------------
    def _p2p(self, kind, buf, count, dtype, peer):
        t = _view(buf, count, dtype)
        if self._grouped is not None:
            self._grouped.append((kind, t, peer))
            return
        self.ungrouped_p2p += 1
        work = (self.pg.send if kind == "send" else self.pg.recv)([t], peer, 0)
        self._wait(work, f"an ungrouped ncclRecv from rank {peer} (it blocks the stream until "
                         "the peer's send runs; group send and recv)" if kind == "recv"
                   else f"an ungrouped ncclSend to rank {peer}")

    def send(self, buf, count, dtype, peer, stream):
        self._p2p("send", buf, count, dtype, peer)

    def recv(self, buf, count, dtype, peer, stream):
        self._p2p("recv", buf, count, dtype, peer)

    # -- collectives --------------------------------------------------------------------------
    def allreduce(self, s, r, count, dtype, op, stream):
        out = _view(r, count, dtype)
        if s != r:
            out.copy_(_view(s, count, dtype))
        self._wait(self.pg.allreduce([out], _opts(dist.AllreduceOptions, reduceOp=_OPS[op])),
                   "allreduce")
        if op == 4:
            out.div_(self.nranks)

    def broadcast(self, s, r, count, dtype, root, stream):
        out = _view(r, count, dtype)
        if s != r:
            out.copy_(_view(s, count, dtype))
        self._wait(self.pg.broadcast([out], _opts(dist.BroadcastOptions, rootRank=root,
                                                    rootTensor=0)), "broadcast")

    def reduce(self, s, r, count, dtype, op, root, stream):
        self.allreduce(s, r, count, dtype, op, stream)   # the root's result is the same

    def allgather(self, s, r, count, dtype, stream):
        out = _view(r, count * self.nranks, dtype)
        self._wait(self.pg._allgather_base(out, _view(s, count, dtype).clone()), "allgather")

    def reduce_scatter(self, s, r, count, dtype, op, stream):
        full = _view(s, count * self.nranks, dtype).clone()
        self._wait(self.pg.allreduce([full], _opts(dist.AllreduceOptions, reduceOp=_OPS[op])),
                   "reduce_scatter")
        if op == 4:
            full.div_(self.nranks)
        _view(r, count, dtype).copy_(full.view(self.nranks, count)[self.rank])


def _opts(cls, **fields):
    o = cls()
    for k, v in fields.items():
        setattr(o, k, v)
    return o


# -- CUDA stand-ins -------------------------------------------------------------------------------
class _Event:
    """Operations run when launched (the stream is the calling thread): always complete."""

    def __init__(self, disable_timing=True):
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass

    done = True


class _Stream:
    def __init__(self, ptr=0, *args, **kwargs):
        self.ptr = ptr or id(self)

    def wait_event(self, event):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _fake_backend_class():
    from ._backends.nccl import NcclBackend

    class FakeNcclBackend(NcclBackend):
        """The real NCCL backend object over a :class:`FakeCommunicator` and a host stream."""

        def __init__(self, group, timeout):
            super().__init__(group, device=-1)
            self.device = None          # no CUDA device: the watchdog leaves the thread's alone
            self.fake_comm = FakeCommunicator(group, timeout)
            self.fake_stream = _Stream()

        def comm(self):
            return self.fake_comm

        def stream(self):
            return self.fake_stream

        def _grouped(self, comm, fn):
            comm.group_start()
            try:
                fn()
            finally:
                comm.group_end()

    return FakeNcclBackend


def use_fake_nccl(timeout: float = 5.0) -> None:
    """From now on, in this process, every bagua_comm group sends every tensor through the
    NCCL backend over a :class:`FakeCommunicator` (see the module docs).  For test processes
    only: it replaces CuPy and torch's CUDA stream functions process-wide."""
    from . import process_group

    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(Event=_Event, ExternalStream=_Stream, Stream=_Stream,
                                      Device=lambda d: contextlib.nullcontext())
    sys.modules["cupy"] = cupy
    torch.cuda.ExternalStream = lambda ptr, *a, **k: _Stream(ptr)
    torch.cuda.current_stream = lambda *a, **k: types.SimpleNamespace(cuda_stream=4242)
    torch.cuda.stream = lambda s: contextlib.nullcontext()
    torch.Tensor.record_stream = lambda self, s: None
    cls = _fake_backend_class()

    def backend_for(group, tensor):
        be = group.__dict__.get("_fake_nccl")
        if be is None:
            be = group._fake_nccl = cls(group, timeout)
        return be

    process_group.ProcessGroup.backend_for = backend_for


def fake_communicators() -> list[FakeCommunicator]:
    """The fake communicators made so far in this process (to inspect in a test)."""
    from . import process_group

    return [g._fake_nccl.fake_comm for g in process_group._state.groups
            if "_fake_nccl" in g.__dict__]
