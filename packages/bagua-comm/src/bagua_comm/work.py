"""The completion handle of every asynchronous operation: :class:`Work`.

One type serves the primitives (``async_op=True``), the multi-phase collectives, the
algorithms' chains of collectives and their background jobs.  torch's ``Work`` is the model,
with its ``get_future()`` folded into the handle itself: ``wait()``, ``is_completed()``, and a
future's ``then()``, ``value()``, ``done()``, ``set_result()``, ``set_exception()``.  The NCCL
backend's handles are a subclass (``_backends.nccl``) whose completion is a CUDA event.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

_PENDING, _CLAIMED, _DONE = 0, 1, 2
# One lock for every handle's state changes: each holds it for a few field updates, and
# handles are rarely touched by two threads at once (a lock per handle costs every call).
_LOCK = threading.Lock()


class Work:
    """Completion handle of an asynchronous operation, chainable like a torch future.

    It completes once its leaves complete (the backend's own handles: torch ``Work`` objects,
    ``concurrent.futures.Future``, or anything with ``wait()`` and ``is_completed()``) and its
    finisher has run, exactly once (e.g. the division of an AVG reduction on gloo); or, made
    with :meth:`pending`, when :meth:`set_result` or :meth:`set_exception` is called.

    ``then(fn)`` returns a new handle that completes once this one has and ``fn(self)`` has
    run; ``fn``'s return value is the new handle's :meth:`value`.  ``fn`` runs **when this
    handle completes**, whether or not anyone waits: on the thread that completes it (the
    thread that calls :meth:`set_result`, or a shared waiter thread for a primitive's work),
    or at once in the caller's thread if it has already completed; on the CUDA stream that was
    current when ``then`` was called.  An exception (in the work or in a callback) completes
    every handle further down the chain with it; :meth:`wait` raises it.
    """

    __slots__ = ("_callbacks", "_error", "_finisher", "_leaves", "_ready", "_status", "_value",
                 "_watched")

    def __init__(self, handles=(), finisher: Callable[[], None] | None = None):
        self._leaves = [h for h in handles if h is not None]
        self._finisher = finisher
        self._status = _PENDING
        self._value = None
        self._error: BaseException | None = None
        self._callbacks: list | None = None
        self._ready: threading.Event | None = None   # made when a thread must block on it
        self._watched = False

    @classmethod
    def completed(cls, value: Any = None) -> Work:
        """A handle that has already completed with ``value``."""
        w = cls()
        w._status, w._value = _DONE, value
        return w

    @classmethod
    def pending(cls) -> Work:
        """A handle completed by :meth:`set_result` / :meth:`set_exception` (a job's)."""
        w = cls()
        w._status = _CLAIMED
        return w

    @property
    def _finished(self) -> bool:
        return self._status == _DONE

    def get_future(self) -> Work:
        """torch's name for the chainable view of a work: here the handle itself."""
        return self

    # -- leaves: how a subclass's completion is observed -----------------------------------
    def _wait_leaves(self) -> None:
        for h in self._leaves:
            h.result() if isinstance(h, Future) else h.wait()

    def _leaves_completed(self) -> bool:
        return all(h.done() if isinstance(h, Future) else h.is_completed()
                   for h in self._leaves)

    # -- completion -------------------------------------------------------------------------
    def _claim(self) -> bool:
        """True for the one caller that is to wait on the leaves and complete this handle."""
        with _LOCK:
            if self._status != _PENDING:
                return False
            self._status = _CLAIMED
            return True

    def _settle(self) -> None:
        """Wait for the leaves (this thread), run the finisher, complete with the outcome."""
        try:
            self._wait_leaves()
            if self._finisher is not None:
                self._finisher()
        except BaseException as err:  # handed to whoever waits
            self._complete(None, err)
        else:
            self._complete(None, None)

    def _complete(self, value: Any, error: BaseException | None) -> None:
        with _LOCK:
            self._value, self._error = value, error
            self._status = _DONE
            callbacks, self._callbacks = self._callbacks, None
            ready = self._ready
        if ready is not None:
            ready.set()
        for cb in callbacks or ():
            cb(self)

    def set_result(self, value: Any = None) -> None:
        """Complete a :meth:`pending` handle with ``value``."""
        self._complete(value, None)

    def set_exception(self, error: BaseException) -> None:
        """Complete a :meth:`pending` handle with ``error`` (raised by :meth:`wait`)."""
        self._complete(None, error)

    def _watch(self) -> None:
        """Have the leaves' completion complete this handle without a waiter in the caller."""
        with _LOCK:
            if self._watched or self._status != _PENDING:
                return
            self._watched = True
        if self._claim():
            _waiter().submit(self._settle)

    def _on_done(self, cb: Callable[[Work], None]) -> None:
        with _LOCK:
            if self._status != _DONE:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(cb)
                cb = None
        if cb is not None:
            cb(self)
        else:
            self._watch()

    # -- the Work / Future surface ----------------------------------------------------------
    def wait(self) -> Any:
        """Block until complete (the caller's thread waits on the leaves if nobody else
        does); return :meth:`value`'s result, raise the work's exception."""
        if self._status != _DONE:
            if self._claim():
                self._settle()
            else:
                with _LOCK:
                    if self._status != _DONE and self._ready is None:
                        self._ready = threading.Event()
                    ready = self._ready
                if ready is not None:
                    ready.wait()
        if self._error is not None:
            raise self._error
        return self._value

    def value(self) -> Any:
        """The result: ``None`` for a collective, the object of ``broadcast_object``, the
        return value of the function a :meth:`then` handle ran (waits for completion)."""
        return self.wait()

    def is_completed(self) -> bool:
        """Whether the work has completed (completes it here, finisher included, once its
        leaves have)."""
        if self._status == _DONE:
            return True
        if self._status == _PENDING and self._leaves_completed() and self._claim():
            self._settle()
        return self._status == _DONE

    def done(self) -> bool:
        """torch future's name for :meth:`is_completed`."""
        return self.is_completed()

    def then(self, fn: Callable[[Work], Any]) -> Work:
        child = Work.pending()          # completed by this handle's callback
        stream = _current_cuda_stream()

        def run(parent: Work) -> None:
            if parent._error is not None:
                child.set_exception(parent._error)
                return
            try:
                if stream is None:
                    value = fn(parent)
                else:
                    with torch.cuda.stream(stream):
                        value = fn(parent)
            except BaseException as err:  # handed to whoever waits
                child.set_exception(err)
            else:
                child.set_result(value)

        self._on_done(run)
        return child


_waiter_pool: ThreadPoolExecutor | None = None


def _waiter() -> ThreadPoolExecutor:
    """The thread that waits on primitives' asynchronous work for chained handles (one per
    process, started on first use; works complete in the order collectives were issued, so
    one thread waiting on them in turn loses nothing)."""
    global _waiter_pool
    with _LOCK:
        if _waiter_pool is None:
            _waiter_pool = ThreadPoolExecutor(max_workers=1,
                                              thread_name_prefix="bagua-handle-waiter")
        return _waiter_pool


def _current_cuda_stream():
    """The caller's current CUDA stream, or None when CUDA was never initialised (the CPU
    path never touches CUDA)."""
    if not torch.cuda.is_initialized():
        return None
    return torch.cuda.current_stream()


def finish(handles, finisher=None, async_op=False) -> Work | None:
    """Return a handle when ``async_op``; otherwise complete the work now and return None."""
    if async_op:
        return Work(handles, finisher)
    for h in handles:
        h.result() if isinstance(h, Future) else h.wait()
    if finisher is not None:
        finisher()
    return None
