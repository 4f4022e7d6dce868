"""A CPU model of CUDA stream ordering, for the GPU-correctness-by-construction tests (issue 46).

No GPU runs here, so the rules a GPU enforces are checked on their model:

- **Streams, events, waits** (``torch.cuda.Stream/Event/stream/current_stream/ExternalStream``
  and CuPy's, replaced process-wide): every stream carries a vector clock; an operation
  enqueued on a stream ticks it; ``Event.record`` snapshots the stream's clock; ``wait_event``
  and ``wait_stream`` merge it into the waiting stream's.  Each thread has its current stream
  (a new thread starts on the default stream, as with CUDA).
- **Races on watched memory**: a ``TorchDispatchMode`` on every thread that runs on a model
  stream records which stream read or wrote which bytes (aten and c10d operations, by their
  schema's write annotations).  Two accesses to the same bytes from two streams, one a write,
  that no chain of events orders, are a race: on a GPU the kernels may run in either order.
  Only the :meth:`StreamModel.watch` ed tensors are tracked (parameters, an algorithm's
  state), so the CPU allocator's reuse of freed memory cannot make false races.
- **Foreign enqueues**: an operation, event record or wait put on the training stream (the
  default stream) by a thread other than the training thread lands at an arbitrary point of
  the training thread's forward and backward: the kernels enqueued after it queue behind it.

The operations themselves run on the host at once, in program order (the values are the
CPU's); only their ordering on the modelled GPU is checked.  Used with
``bagua_comm.testing_nccl.use_fake_nccl`` the NCCL backend's events and waits go through the
model too (its CuPy stand-ins are replaced by :meth:`install`).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_LOCK = threading.RLock()


def _merge(into: dict, other: dict) -> None:
    for k, v in other.items():
        if into.get(k, 0) < v:
            into[k] = v


class Stream:
    """A model CUDA stream (torch's and CuPy's surface: ``cuda_stream``/``ptr``,
    ``wait_event``, ``wait_stream``, ``record_event``, ``synchronize``, a context manager)."""

    def __init__(self, model: StreamModel, name: str, ptr: int | None = None):
        self.model, self.name = model, name
        self.ptr = self.cuda_stream = ptr if ptr is not None else id(self)
        self.device = torch.device("cuda", 0)
        self.clock = {self.ptr: 0}

    def tick(self) -> tuple[int, int]:
        """Enqueue one operation here (from the calling thread): its timestamp."""
        self.model._enqueued(self)
        with _LOCK:
            _merge(self.clock, self.model._host_clock())
            self.clock[self.ptr] += 1
            return self.ptr, self.clock[self.ptr]

    def wait_event(self, event: Event) -> None:
        self.tick()
        if event.clock is not None:
            with _LOCK:
                _merge(self.clock, event.clock)

    def wait_stream(self, other: Stream) -> None:
        ev = Event(self.model)
        ev.record(other)
        self.wait_event(ev)

    def record_event(self, event=None):
        event = event or Event(self.model)
        event.record(self)
        return event

    def synchronize(self) -> None:
        self.model._host_join(self.clock)

    def query(self) -> bool:
        return True

    def __enter__(self):            # CuPy's `with stream:` (torch's goes through stream())
        return self

    def __exit__(self, *exc):
        return False

    def __eq__(self, other):
        return isinstance(other, Stream) and other.ptr == self.ptr

    def __hash__(self):
        return hash(self.ptr)

    def __repr__(self):
        return f"<model stream {self.name}>"


class Event:
    """A model CUDA event (torch's ``record/wait/query/synchronize`` and CuPy's ``done``)."""

    def __init__(self, model: StreamModel, *args, **kwargs):
        self.model = model
        self.clock: dict | None = None

    def record(self, stream: Stream | None = None) -> None:
        stream = stream if stream is not None else self.model.current()
        stream = self.model.of(stream)
        stream.tick()
        with _LOCK:
            self.clock = dict(stream.clock)

    def wait(self, stream: Stream | None = None) -> None:
        (stream if stream is not None else self.model.current()).wait_event(self)

    def query(self) -> bool:
        return True

    done = property(query)

    def synchronize(self) -> None:
        if self.clock is not None:
            self.model._host_join(self.clock)


class _Recorder(TorchDispatchMode):
    def __init__(self, model: StreamModel):
        super().__init__()
        self.model = model

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not getattr(func, "is_view", False):
            self.model._accessed(func, args, kwargs)
        return out


class StreamModel:
    """See the module docs.  ``install()`` in a rank's process, train, then read
    :attr:`races` and :attr:`foreign`."""

    def __init__(self):
        self.default = Stream(self, "default", ptr=0)
        self.training_thread = threading.current_thread()
        self._streams: dict[int, Stream] = {0: self.default}
        self._tls = threading.local()
        self._watched: list[tuple[int, int]] = []
        self._writes: dict[tuple[int, int], tuple] = {}       # interval -> (stream, tick, op)
        self._reads: dict[tuple[int, int], dict] = {}         # interval -> {stream: (tick, op)}
        self.races: list[str] = []
        self.foreign: list[str] = []
        self.enqueuers: set[tuple[str, str]] = set()    # (thread, stream) pairs seen

    # -- streams and threads ----------------------------------------------------------------
    def current(self) -> Stream:
        return getattr(self._tls, "stream", None) or self.default

    def of(self, s) -> Stream:
        """The model stream of ``s`` (a model stream, or anything with a ``ptr``)."""
        if isinstance(s, Stream):
            return s
        return self.by_ptr(getattr(s, "ptr", getattr(s, "cuda_stream", 0)))

    def by_ptr(self, ptr: int) -> Stream:
        with _LOCK:
            s = self._streams.get(ptr)
            if s is None:
                s = self._streams[ptr] = Stream(self, f"external-{ptr}", ptr)
            return s

    def new_stream(self, name: str = "stream") -> Stream:
        s = Stream(self, name)
        with _LOCK:
            self._streams[s.ptr] = s
        return s

    @contextlib.contextmanager
    def on(self, stream):
        """``torch.cuda.stream(stream)``: the thread's current stream, and this thread's
        operations recorded, for the block."""
        prev = getattr(self._tls, "stream", None)
        self._tls.stream = None if stream is None else self.of(stream)
        with self.recording():
            try:
                yield
            finally:
                self._tls.stream = prev

    @contextlib.contextmanager
    def recording(self):
        """Record this thread's operations (nested use is free)."""
        if getattr(self._tls, "recording", False):
            yield
            return
        self._tls.recording = True
        try:
            with _Recorder(self):
                yield
        finally:
            self._tls.recording = False

    def _enqueued(self, stream: Stream) -> None:
        me = threading.current_thread()
        self.enqueuers.add((me.name, stream.name))
        if stream is self.default and me is not self.training_thread:
            self.foreign.append(f"thread {me.name!r} enqueued on the training stream")

    def _host_clock(self) -> dict:
        return getattr(self._tls, "host", {})

    def _host_join(self, clock: dict) -> None:
        host = getattr(self._tls, "host", None)
        if host is None:
            host = self._tls.host = {}
        _merge(host, clock)

    def synchronize(self) -> None:
        with _LOCK:
            for s in list(self._streams.values()):
                self._host_join(s.clock)

    # -- memory -----------------------------------------------------------------------------
    def watch(self, tensors) -> None:
        """Track races on the bytes of ``tensors`` (their storages)."""
        for t in tensors:
            st = t.untyped_storage()
            if st.nbytes():
                self._watched.append((st.data_ptr(), st.data_ptr() + st.nbytes()))

    def _span(self, t: torch.Tensor):
        if t.device.type != "cpu" or not t.numel() or t.is_sparse:
            return None
        lo = t.data_ptr()
        hi = lo + t.element_size() * (1 + sum((n - 1) * s for n, s in zip(t.shape,
                                                                          t.stride())))
        for a, b in self._watched:
            if lo < b and a < hi:
                return max(lo, a), min(hi, b)
        return None

    def _accessed(self, func, args, kwargs) -> None:
        if not self._watched:
            return
        try:
            schema_args = func._schema.arguments
        except AttributeError:
            return
        values = list(args) + [kwargs.get(a.name) for a in schema_args[len(args):]]
        stream = self.current()
        stamp = None
        for a, v in zip(schema_args, values):
            tensors = [v] if isinstance(v, torch.Tensor) else \
                [x for x in v if isinstance(x, torch.Tensor)] if isinstance(v, (list, tuple)) \
                else []
            write = a.alias_info is not None and a.alias_info.is_write
            for t in tensors:
                span = self._span(t)
                if span is None:
                    continue
                if stamp is None:
                    stamp = stream.tick()
                self._check(span, stream, stamp[1], write, str(func))

    def _check(self, span, stream, tick, write, op) -> None:
        with _LOCK:
            clock = stream.clock
            for (lo, hi), (s, t, what) in list(self._writes.items()):
                if lo < span[1] and span[0] < hi and s is not stream and clock.get(s.ptr, 0) < t:
                    self.races.append(f"{op} on {stream.name} {'writes' if write else 'reads'}"
                                      f" bytes that {what} on {s.name} wrote, unordered")
            if write:
                for (lo, hi), readers in list(self._reads.items()):
                    if not (lo < span[1] and span[0] < hi):
                        continue
                    for s, (t, what) in readers.items():
                        if s is not stream and clock.get(s.ptr, 0) < t:
                            self.races.append(f"{op} on {stream.name} overwrites bytes that "
                                              f"{what} on {s.name} reads, unordered")
                self._writes[span] = (stream, tick, op)
                self._reads.pop(span, None)
            else:
                self._reads.setdefault(span, {})[stream] = (tick, op)

    # -- installation -----------------------------------------------------------------------
    def install(self) -> StreamModel:
        """Replace torch.cuda's stream API (and CuPy's, for the fake NCCL) by this model,
        process-wide, and record the calling (training) thread.  For test processes only."""
        model = self
        cuda = torch.cuda
        cuda.is_initialized = lambda: True
        cuda.set_device = lambda *a, **k: None
        cuda.current_device = lambda: 0
        cuda.current_stream = lambda device=None: model.current()
        cuda.default_stream = lambda device=None: model.default
        cuda.Stream = lambda device=None, priority=0, **k: model.new_stream("side")
        cuda.ExternalStream = lambda ptr, *a, **k: model.by_ptr(ptr)
        cuda.Event = lambda *a, **k: Event(model)
        cuda.stream = model.on
        cuda.synchronize = lambda device=None: model.synchronize()
        torch.Tensor.record_stream = lambda self, s: None
        cupy = types.ModuleType("cupy")
        cupy.cuda = types.SimpleNamespace(
            Event=lambda *a, **k: Event(model), ExternalStream=model.by_ptr,
            Stream=lambda *a, **k: model.new_stream("nccl"),
            Device=lambda d=None: contextlib.nullcontext())
        sys.modules["cupy"] = cupy
        try:
            from bagua_comm import testing_nccl
            testing_nccl._Stream = lambda *a, **k: model.new_stream("nccl")
        except ImportError:
            pass
        return self
