"""Hold one of the plugin's stream threads still, from inside the test process.

A signal sent to one thread (``tgkill``) runs its handler in that thread. With libc's
``pause()`` as the handler of SIGUSR2, the thread stays in the handler, wherever it was
interrupted (here: a ``recv()`` into a posted buffer), until a second signal with a handler
(SIGUSR1) reaches it; then the interrupted call carries on. Linux only: threads are found by
name and by the arguments of the system call they block in (``/proc/self/task``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time

_libc = ctypes.CDLL(None, use_errno=True)


def available() -> bool:
    return hasattr(_libc, "tgkill") and os.path.exists(f"/proc/self/task/{os.getpid()}/syscall")


def _blocked_call(tid: int) -> list[int] | None:
    """[number, arg1, arg2, ...] of the system call thread ``tid`` is blocked in, else None."""
    try:
        with open(f"/proc/self/task/{tid}/syscall") as f:
            fields = f.read().split()
    except OSError:
        return None
    if len(fields) < 3 or not fields[0].lstrip("-").isdigit():
        return None  # "running"
    return [int(fields[0])] + [int(x, 16) for x in fields[1:]]


def _threads(name: str) -> list[int]:
    out = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == name:
                    out.append(int(tid))
        except OSError:
            pass
    return out


def thread_reading_into(lo: int, hi: int, name: str = "bagua-net-rx",
                        timeout: float = 10.0) -> int:
    """The thread named ``name`` blocked in a read whose buffer lies in [lo, hi)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for tid in _threads(name):
            call = _blocked_call(tid)
            if call is not None and lo <= call[2] < hi:
                return tid
        time.sleep(0.01)
    raise TimeoutError(f"no {name} thread is reading into [{lo:#x}, {hi:#x})")


@contextlib.contextmanager
def frozen(tid: int, timeout: float = 10.0):
    """Keep thread ``tid`` of this process in a signal handler for the ``with`` block.

    Call from the main thread (Python runs signal handlers there)."""
    before = _blocked_call(tid)
    released: list[int] = []  # Python runs this in the main thread once the C handler ran
    old_usr1 = signal.signal(signal.SIGUSR1, lambda *_: released.append(1))
    handler = ctypes.cast(_libc.pause, ctypes.c_void_p)
    _libc.signal.restype = ctypes.c_void_p
    _libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    _libc.signal(signal.SIGUSR2, handler)
    paused = None
    try:
        if _libc.tgkill(os.getpid(), tid, signal.SIGUSR2) != 0:
            raise OSError(ctypes.get_errno(), "tgkill")
        deadline = time.monotonic() + timeout
        while True:  # in the handler once it blocks in another call than before
            paused = _blocked_call(tid)
            if paused is not None and (before is None or paused[0] != before[0]):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"thread {tid} did not stop")
            time.sleep(0.01)
        yield
    finally:
        _libc.tgkill(os.getpid(), tid, signal.SIGUSR1)
        deadline = time.monotonic() + timeout
        while not released and time.monotonic() < deadline:
            time.sleep(0.01)
        if released:  # else keep the handler: SIGUSR1's default would end the process
            signal.signal(signal.SIGUSR1, old_usr1)
        signal.signal(signal.SIGUSR2, signal.SIG_DFL)
