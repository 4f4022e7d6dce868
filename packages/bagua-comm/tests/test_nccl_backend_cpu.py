"""The NCCL backend's Python path on CPU, with CuPy, CUDA streams and the communicator faked.

No GPU runs here, so this checks what the GPU cannot show by itself: that repeated calls
reuse the group's streams, events and compressed-allreduce buffers instead of creating new
ones per call, that the watchdog tracks and recycles completion events, and that a failure
the watchdog recorded makes the next call raise before anything is launched.
"""

import contextlib
import ctypes
import sys
import time
import types

import pytest
import torch

from bagua_comm._backends import nccl as backend
from bagua_comm.ops import ReduceOp

CREATED = {"Event": 0, "ExternalStream": 0, "torch ExternalStream": 0, "stream entered": 0}


class FakeEvent:
    def __init__(self, disable_timing=True):
        CREATED["Event"] += 1
        self.records = 0

    def record(self, stream=None):
        self.records += 1

    @property
    def done(self):
        return True


class FakeStream:
    def __init__(self, ptr=777, **kw):
        self.ptr = ptr

    def wait_event(self, event):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class FakeExternalStream(FakeStream):
    def __init__(self, ptr, *a):
        CREATED["ExternalStream"] += 1
        super().__init__(ptr)


class FakeComm:
    """One rank: collectives copy send to recv; send/recv to itself pair up in order."""

    def __init__(self):
        self.watch = None
        self.alive = True
        self.sent = []

    def async_error(self, blocking=True):
        return 0

    def abort(self):
        self.alive = False

    def allreduce(self, s, r, count, dtype, op, stream):
        ctypes.memmove(r, s, count * 4)

    def allgather(self, s, r, count, dtype, stream):
        ctypes.memmove(r, s, count)       # uint8 payloads in the compressed allreduce

    def broadcast(self, s, r, count, dtype, root, stream):
        ctypes.memmove(r, s, count * 4)

    def send(self, buf, count, dtype, peer, stream):
        self.sent.append((buf, count))

    def recv(self, buf, count, dtype, peer, stream):
        src, n = self.sent.pop(0)
        assert n == count
        ctypes.memmove(buf, src, count)


class FakeGroup:
    size, rank = 1, 0

    def cuda_device(self):
        return None          # the watchdog then leaves the thread's device alone

    def __repr__(self):
        return "FakeGroup(ranks=[0])"


class FakeBackend(backend.NcclBackend):
    """The real NCCL backend object over a fake communicator and stream."""

    def __init__(self):
        super().__init__(FakeGroup())
        self.fake_comm = FakeComm()
        self.fake_stream = FakeStream()

    def comm(self):
        return self.fake_comm

    def stream(self):
        return self.fake_stream


@pytest.fixture
def fake_cuda(monkeypatch):
    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(Event=FakeEvent, ExternalStream=FakeExternalStream,
                                      Stream=FakeStream)
    monkeypatch.setitem(sys.modules, "cupy", cupy)

    def torch_external(ptr):
        CREATED["torch ExternalStream"] += 1
        return object()

    monkeypatch.setattr(torch.cuda, "ExternalStream", torch_external)
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: types.SimpleNamespace(cuda_stream=4242))
    def torch_stream(s):
        CREATED["stream entered"] += 1
        return contextlib.nullcontext()

    monkeypatch.setattr(torch.cuda, "stream", torch_stream)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None, raising=False)
    monkeypatch.setattr(backend.NcclBackend, "_grouped", lambda self, comm, fn: fn())
    for k in CREATED:
        CREATED[k] = 0
    yield


def _settle(watch):
    t0 = time.monotonic()
    while watch.pending and time.monotonic() - t0 < 10:
        time.sleep(0.02)
    assert not watch.pending


def test_repeated_calls_reuse_streams_and_events(fake_cuda):
    be = FakeBackend()
    x = torch.arange(16.0)
    for i in range(300):
        y = torch.zeros(16)
        be.allreduce(x, y, ReduceOp.SUM, async_op=False)
        assert torch.equal(y, x)
        if i % 50 == 49:
            _settle(be._state.watch)         # the watchdog returns finished events to the pool
    assert CREATED["torch ExternalStream"] == 1
    assert CREATED["ExternalStream"] == 1          # the caller's stream, once
    # one "ready" event for the caller stream plus the completion events in flight between
    # two watchdog polls (at most 50 here), never one or two per call
    assert CREATED["Event"] <= 52, CREATED
    # async handles keep their own event (they may be waited on much later)
    works = [be.allreduce(x, torch.zeros(16), ReduceOp.SUM, async_op=True)
             for _ in range(3)]
    assert len({id(w._event) for w in works}) == 3
    for w in works:
        w.wait()


def test_a_recorded_failure_raises_before_launching(fake_cuda):
    be = FakeBackend()
    x = torch.ones(4)
    be.allreduce(x, torch.empty(4), ReduceOp.SUM, async_op=False)
    work = be.allreduce(x, torch.empty(4), ReduceOp.SUM, async_op=True)
    watch = be._state.watch
    watch.error = RuntimeError("bagua_comm: the NCCL communicator of FakeGroup(ranks=[0]) "
                               "was aborted: test (timeout 3 s)")
    launched = []
    be.fake_comm.allreduce = lambda *a: launched.append(a)
    with pytest.raises(RuntimeError, match=r"FakeGroup\(ranks=\[0\]\) was aborted.*timeout 3"):
        be.allreduce(x, torch.empty(4), ReduceOp.SUM, async_op=False)
    with pytest.raises(RuntimeError, match="was aborted"):
        work.wait()
    assert launched == [] and watch.observed
    watch.close()


def test_a_plain_call_enters_no_stream_context_a_folding_one_does(fake_cuda):
    """Host time per call: an NCCL call names its stream itself, so only a call that also does
    local torch work (NCCL has no bitwise reductions: gather, then fold here) makes the
    communication stream current; the result is the same either way."""
    be = FakeBackend()
    x = torch.tensor([6, 3, 5], dtype=torch.int32)
    for op in (ReduceOp.SUM, ReduceOp.MAX):
        y = torch.zeros_like(x)
        be.allreduce(x, y, op, async_op=False)
        assert torch.equal(y, x)
    be.broadcast(x, 0, async_op=False)
    be.allgather(x, torch.zeros_like(x), async_op=False)
    assert CREATED["stream entered"] == 0
    b = x.to(torch.uint8)    # the fake allgather copies bytes
    y = torch.zeros_like(b)
    be.allreduce(b, y, ReduceOp.BAND, async_op=False)   # one rank: x & nothing else = x
    assert torch.equal(y, b)
    assert CREATED["stream entered"] == 1
    be._state.watch.close()
