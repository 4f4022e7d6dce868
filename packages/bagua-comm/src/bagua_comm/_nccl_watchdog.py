"""The NCCL watchdog: a dead or silent peer becomes an error within the group's timeout.

NCCL itself never times out: a collective whose peer died spins on the GPU forever, and the
host only notices when it synchronises (and then hangs).  One daemon thread per process
(started at the first watched communicator; it never keeps the process alive) polls every
watched communicator: ``ncclCommGetAsyncError`` and the age of its oldest unfinished
operation.  On an asynchronous error, or an operation older than the group's ``timeout``, it
records a ``RuntimeError`` naming the group and the timeout, then aborts the communicator
(``ncclCommAbort``, which also ends its in-flight kernels) on a thread of its own, so that an
abort that blocks delays neither the error nor the exit below.  The rank's next call on that group, and
``wait()`` on its handles, raise that error.  If the error is still unseen ``exit_grace``
seconds later (the main thread is blocked, say in a CUDA synchronisation), the watchdog prints
it and ends the process with exit code 1, so that torchrun restarts the job.
``BAGUA_NCCL_WATCHDOG_EXIT=0`` turns that last step off.

Operations of one communicator run in order on its stream, so only the oldest unfinished one
is timed: :meth:`Watched.track` appends ``(start time, handle, on_done)``, and each poll
drops the finished ones from the front.  A handle is anything with ``is_completed()``.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import sys
import threading
import time

log = logging.getLogger("bagua_comm.nccl")

DEFAULT_INTERVAL = float(os.environ.get("BAGUA_NCCL_WATCHDOG_INTERVAL", "0.1"))
DEFAULT_EXIT_GRACE = float(os.environ.get("BAGUA_NCCL_WATCHDOG_GRACE", "10"))
IN_PROGRESS = 7   # ncclInProgress: a non-blocking communicator still enqueuing, not an error


class Watched:
    """The watchdog's record of one communicator."""

    def __init__(self, comm, name: str, timeout: float, device: int | None = None):
        self.comm = comm
        self.device = device
        self.name = name
        self.timeout = float(timeout)
        self.pending: collections.deque = collections.deque()
        self.error: RuntimeError | None = None
        self.failed_at: float | None = None
        self.observed = False
        self.closed = False
        self.can_poll = True   # False on a libnccl without ncclCommGetAsyncError

    def track(self, handle, on_done=None, now: float | None = None) -> None:
        """Time ``handle`` (its ``is_completed()``) against the timeout from now on;
        ``on_done(handle)`` runs on the watchdog thread once it is seen complete."""
        self.pending.append((time.monotonic() if now is None else now, handle, on_done))

    def check(self) -> None:
        """Raise the recorded failure, if any (on the calling rank's thread)."""
        if self.error is not None:
            self.observed = True
            raise self.error

    def close(self) -> None:
        """Stop watching (before the communicator is destroyed)."""
        self.closed = True
        self.pending.clear()


class Watchdog:
    """Polls watched communicators; see the module docstring.

    ``interval``, ``exit_grace``, ``clock`` and ``exit`` are injectable so that the logic runs
    in tests with fake communicators and a fake clock (``poll_once``).
    """

    def __init__(self, interval: float = DEFAULT_INTERVAL, exit_grace: float = DEFAULT_EXIT_GRACE,
                 clock=time.monotonic, exit=os._exit, exit_on_unseen: bool | None = None,
                 set_device=None):
        self.interval = interval
        # The watchdog thread queries CUDA events: it makes the communicator's device current
        # first, so that it never creates a context on device 0 of a rank that uses another.
        self._set_device = set_device or _cuda_set_device
        self.exit_grace = exit_grace
        self.clock = clock
        self._exit = exit
        if exit_on_unseen is None:
            exit_on_unseen = os.environ.get("BAGUA_NCCL_WATCHDOG_EXIT", "1") != "0"
        self.exit_on_unseen = exit_on_unseen
        self._watched: list[Watched] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- registration -----------------------------------------------------------------------
    def watch(self, comm, name: str, timeout: float, device: int | None = None,
              start: bool = True) -> Watched:
        """Watch ``comm`` (idempotent: a communicator's record is kept on ``comm.watch``);
        ``device`` is its CUDA device."""
        w = getattr(comm, "watch", None)
        if isinstance(w, Watched):
            return w
        w = Watched(comm, name, timeout, device)
        try:
            comm.watch = w
        except AttributeError:
            pass
        with self._lock:
            self._watched.append(w)
        if start:
            self.start()
        return w

    def start(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._stop.clear()
                self._thread = threading.Thread(target=self._run, name="bagua-nccl-watchdog",
                                                daemon=True)
                self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.poll_once()
            except Exception:  # never let the watchdog die silently
                log.exception("bagua_comm NCCL watchdog: poll failed")

    # -- one pass -----------------------------------------------------------------------------
    def poll_once(self) -> None:
        with self._lock:
            self._watched = [w for w in self._watched if not w.closed]
            watched = list(self._watched)
        now = self.clock()
        for w in watched:
            if w.error is None:
                reason = self._diagnose(w, now)
                if reason is not None:
                    self._fail(w, reason, now)
            elif (not w.observed and self.exit_on_unseen
                  and now - w.failed_at >= self.exit_grace):
                print(f"{w.error}\nbagua_comm: the error was not handled within "
                      f"{self.exit_grace:g} s; exiting with status 1 so that the launcher "
                      "restarts the job.", file=sys.stderr, flush=True)
                w.observed = True
                self._exit(1)

    def _diagnose(self, w: Watched, now: float) -> str | None:
        if w.can_poll:
            try:
                status = w.comm.async_error(blocking=False)
            except RuntimeError as err:
                if getattr(err, "symbol", None) == "ncclCommGetAsyncError":
                    w.can_poll = False  # an NCCL before 2.4: timeouts still apply
                    status = 0
                else:
                    return f"polling it failed ({err})"
            if status is None:  # destroyed, or being destroyed/aborted by another thread
                if not getattr(w.comm, "alive", True):
                    w.close()
                return None
            if status and status != IN_PROGRESS:
                return f"NCCL reported an asynchronous error ({_describe(status)})"
        if w.pending and w.device is not None:
            self._set_device(w.device)
        while w.pending and _completed(w.pending[0][1]):
            _start, handle, on_done = w.pending.popleft()
            if on_done is not None:
                on_done(handle)
        if w.pending and now - w.pending[0][0] > w.timeout:
            return (f"an operation has not completed after {now - w.pending[0][0]:.1f} s, "
                    f"more than the group's timeout")
        return None

    def _fail(self, w: Watched, reason: str, now: float) -> None:
        """Record the error and arm the exit first, then abort the communicator on a thread
        of its own: ncclCommAbort can block (a hung kernel, a dead network), and the rank
        must still raise, or exit after ``exit_grace``, whatever it does."""
        w.error = RuntimeError(
            f"bagua_comm: the NCCL communicator of {w.name} was aborted: {reason} "
            f"(timeout {w.timeout:g} s). A peer rank probably died or stopped "
            "answering; this group can no longer be used. Restart the job (torchrun restarts "
            "it when this process exits non-zero) and resume from the last checkpoint.")
        w.failed_at = now
        w.pending.clear()
        log.error("%s", w.error)
        threading.Thread(target=_abort, args=(w,), name="bagua-nccl-abort", daemon=True).start()


def _abort(w: Watched) -> None:
    try:
        w.comm.abort()
    except Exception as err:  # the recorded error is what matters; say why abort failed
        log.error("bagua_comm: aborting the NCCL communicator of %s failed too: %s", w.name, err)


def _cuda_set_device(device: int) -> None:
    import cupy

    cupy.cuda.runtime.setDevice(device)


def _completed(handle) -> bool:
    try:
        return bool(handle.is_completed())
    except Exception:  # an event of an aborted communicator: count it done
        return True


def _describe(status: int) -> str:
    try:
        from . import _nccl

        return f"status {status}: {_nccl.error_string(status)}"
    except ImportError:
        return f"status {status}"


_watchdog: Watchdog | None = None
_singleton_lock = threading.Lock()


def get() -> Watchdog:
    """The process's watchdog (created on first use; its thread starts at the first watch)."""
    global _watchdog
    with _singleton_lock:
        if _watchdog is None:
            _watchdog = Watchdog()
            atexit.register(_watchdog.stop)  # no NCCL call during interpreter teardown
        return _watchdog


def watch(comm, name: str, timeout: float, device: int | None = None) -> Watched:
    """Watch ``comm`` (on CUDA ``device``) with the process's watchdog; returns its record."""
    return get().watch(comm, name, timeout, device)
