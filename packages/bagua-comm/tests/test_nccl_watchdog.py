"""The NCCL watchdog on CPU: fake communicators and a fake clock drive its logic; the real
binding over a stand-in libnccl (tests/fake_nccl.c) drives abort and async-error polling; a
subprocess shows a blocked rank exits non-zero and that the thread never keeps a process alive.
The real-NCCL version is in test_gpu_watchdog.py (``gpu`` marker).
"""

import os
import subprocess
import sys
import textwrap

import pytest
from _fake_nccl import COMPILER, build

from bagua_comm._nccl_watchdog import Watchdog

needs_cc = pytest.mark.skipif(COMPILER is None, reason="no C compiler to build the fake libnccl")


class FakeComm:
    def __init__(self):
        self.status = 0
        self.aborts = 0
        self.alive = True
        self.watch = None

    def async_error(self, blocking=True):
        return self.status if self.alive else None

    def abort(self):
        self.aborts += 1
        self.alive = False


class Handle:
    def __init__(self, done=False):
        self.done = done

    def is_completed(self):
        return self.done


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _dog(**kw):
    clock, exits = Clock(), []
    dog = Watchdog(interval=0.01, exit_grace=5, clock=clock, exit=exits.append, **kw)
    return dog, clock, exits


def test_an_async_error_aborts_the_communicator_and_the_rank_raises_naming_group_and_timeout():
    dog, clock, exits = _dog()
    comm = FakeComm()
    w = dog.watch(comm, "ProcessGroup(ranks=[0, 1], backend='nccl')", 42, start=False)
    assert dog.watch(comm, "other", 1, start=False) is w          # one record per communicator
    dog.poll_once()
    w.check()                                                      # healthy: nothing raised
    assert comm.aborts == 0
    comm.status = 6
    dog.poll_once()
    assert comm.aborts == 1
    with pytest.raises(RuntimeError) as info:
        w.check()
    msg = str(info.value)
    assert "ProcessGroup(ranks=[0, 1], backend='nccl')" in msg and "timeout 42 s" in msg
    assert "asynchronous error" in msg and "status 6" in msg
    clock.t += 60
    dog.poll_once()
    assert exits == [] and comm.aborts == 1                        # seen: no exit, one abort


def test_an_operation_older_than_the_timeout_aborts_and_finished_ones_are_recycled():
    dog, clock, _ = _dog()
    comm = FakeComm()
    w = dog.watch(comm, "G", 10, start=False)
    recycled = []
    done, slow = Handle(done=True), Handle(done=False)
    w.track(done, on_done=recycled.append, now=clock.t)
    w.track(slow, on_done=recycled.append, now=clock.t + 1)
    clock.t += 10.5                      # 'slow' is 9.5 s old: within the timeout
    dog.poll_once()
    assert recycled == [done] and comm.aborts == 0 and w.error is None
    clock.t += 1                         # 10.5 s: over
    dog.poll_once()
    assert comm.aborts == 1 and recycled == [done]
    with pytest.raises(RuntimeError, match=r"has not completed after 10\.5 s.*timeout 10 s"):
        w.check()


def test_finished_operations_never_time_out():
    dog, clock, _ = _dog()
    comm = FakeComm()
    w = dog.watch(comm, "G", 1, start=False)
    h = Handle()
    w.track(h, now=clock.t)
    h.done = True
    clock.t += 1000
    dog.poll_once()
    assert comm.aborts == 0 and not w.pending


def test_an_unseen_error_ends_the_process_with_status_1_after_the_grace_period(capfd):
    dog, clock, exits = _dog()
    comm = FakeComm()
    dog.watch(comm, "G", 3, start=False)
    comm.status = 3
    dog.poll_once()
    clock.t += 4.9
    dog.poll_once()
    assert exits == []
    clock.t += 0.2
    dog.poll_once()
    assert exits == [1]
    assert "exiting with status 1" in capfd.readouterr().err
    dog.poll_once()
    assert exits == [1]                                            # once


def test_exit_can_be_turned_off():
    dog, clock, exits = _dog(exit_on_unseen=False)
    comm = FakeComm()
    dog.watch(comm, "G", 3, start=False)
    comm.status = 3
    dog.poll_once()
    clock.t += 100
    dog.poll_once()
    assert exits == [] and comm.aborts == 1


def test_the_watchdog_thread_queries_events_on_the_communicators_device():
    devices = []
    dog = Watchdog(interval=0.01, exit_grace=5, clock=Clock(), exit=print,
                   set_device=devices.append)
    w = dog.watch(FakeComm(), "G", 3, device=3, start=False)
    dog.poll_once()
    assert devices == []                 # nothing to query
    w.track(Handle(done=True))
    dog.poll_once()
    assert devices == [3] and not w.pending


def test_a_destroyed_communicator_is_dropped():
    dog, clock, _ = _dog()
    comm = FakeComm()
    w = dog.watch(comm, "G", 3, start=False)
    w.track(Handle(), now=clock.t)
    comm.alive = False                   # destroy() by the owner
    clock.t += 100
    dog.poll_once()
    assert w.closed and comm.aborts == 0
    dog.poll_once()
    assert not dog._watched


_REAL = r"""
import ctypes, os, sys, time
import bagua_comm._nccl_loader as L
from bagua_comm._nccl_watchdog import Watchdog
n = L.load()
fake = ctypes.CDLL(os.environ["BAGUA_NCCL_LIBRARY"])
dog = Watchdog(interval=0.02, exit_grace=float(sys.argv[1]))
comm = n.NcclCommunicator(1, n.get_unique_id(), 0)
w = dog.watch(comm, "ProcessGroup(ranks=[0])", 7)
assert comm.watch is w
time.sleep(0.2)
assert w.error is None and comm.alive
if sys.argv[2] == "abort-blocks":    # ncclCommAbort never returns
    fake.fakeSetAbortBlocks(1)
fake.fakeSetAsyncError(6)
t0 = time.monotonic()
while w.error is None and time.monotonic() - t0 < 10:
    time.sleep(0.01)
print("error recorded", w.error is not None, flush=True)
while (fake.fakeAborts() == 0 or comm.alive) and time.monotonic() - t0 < 2:
    time.sleep(0.01)                 # the abort runs on a thread of its own
print("aborts", fake.fakeAborts(), "alive", comm.alive, flush=True)
if sys.argv[2] == "raise":
    try:
        comm.allreduce(0, 0, 0, 7, 0, 0)
    except RuntimeError as e:
        print("call:", e, flush=True)
    w.check()
while True:                          # a main thread stuck, as in a CUDA synchronisation
    time.sleep(0.1)
"""


def _real(lib, grace, mode, timeout=60):
    return subprocess.run([sys.executable, "-c", _REAL, str(grace), mode], capture_output=True,
                          text=True, timeout=timeout,
                          env={**os.environ, "BAGUA_NCCL_LIBRARY": lib})


@needs_cc
def test_binding_async_error_aborts_and_the_rank_raises(tmp_path):
    out = _real(build(tmp_path), 30, "raise")
    assert out.returncode == 1, out.stderr[-2000:]            # uncaught: the usual non-zero exit
    assert "aborts 1 alive False" in out.stdout
    assert "call: this NCCL communicator was destroyed or aborted" in out.stdout
    assert "RuntimeError: bagua_comm: the NCCL communicator of ProcessGroup(ranks=[0]) was " \
           "aborted: NCCL reported an asynchronous error (status 6: fake remote error) " \
           "(timeout 7 s)" in out.stderr


@needs_cc
def test_an_abort_that_blocks_still_records_the_error_and_ends_the_rank(tmp_path):
    out = _real(build(tmp_path), 0.3, "abort-blocks")
    assert out.returncode == 1, (out.stdout, out.stderr[-2000:])
    assert "error recorded True" in out.stdout
    assert "aborts 1" in out.stdout          # called (and never returned)
    assert "exiting with status 1" in out.stderr


_ABORT_RACE = r"""
import ctypes, os, threading, time
import bagua_comm._nccl_loader as L
n = L.load()
fake = ctypes.CDLL(os.environ["BAGUA_NCCL_LIBRARY"])
comm = n.NcclCommunicator(1, n.get_unique_id(), 0, timeout=3)
fake.fakeSetInProgress(1)            # the collective waits for a peer that is gone
out = {}

def call():
    try:
        comm.allreduce(0, 0, 0, 7, 0, 0)
    except n.NcclError as e:
        out["error"] = str(e)

t = threading.Thread(target=call)
t.start()
time.sleep(0.3)                      # the call is polling ncclInProgress
t0 = time.monotonic()
comm.abort()                         # as the watchdog does, from another thread
t.join(20)
print("returned after %.1f s" % (time.monotonic() - t0), "alive", comm.alive, flush=True)
print("uses after free", fake.fakeUsesAfterFree(), "aborts", fake.fakeAborts(), flush=True)
print("error:", out.get("error"), flush=True)
"""


@needs_cc
def test_abort_during_a_call_frees_the_communicator_only_once_the_call_left(tmp_path):
    """The watchdog's abort() while a collective polls ncclInProgress on another thread: the
    call stops at its next poll and raises; the handle is freed after that, never used."""
    out = subprocess.run([sys.executable, "-c", _ABORT_RACE], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "BAGUA_NCCL_LIBRARY": build(tmp_path)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "uses after free 0 aborts 1" in out.stdout, out.stdout
    line = next(x for x in out.stdout.splitlines() if x.startswith("returned after"))
    assert float(line.split()[2]) < 2.5 and line.endswith("alive False"), line
    assert "was aborted or destroyed by another thread" in out.stdout, out.stdout


_INIT = r"""
import ctypes, os, time
import bagua_comm._nccl_loader as L
n = L.load()
fake = ctypes.CDLL(os.environ["BAGUA_NCCL_LIBRARY"])
fake.fakeSetInitHangs(1)             # the peers never join: ncclInProgress for ever
t0 = time.monotonic()
try:
    n.NcclCommunicator(2, n.get_unique_id(), 0, timeout=0.5)
except n.NcclError as e:
    print("raised after %.1f s: %s" % (time.monotonic() - t0, e), flush=True)
print("aborts", fake.fakeAborts(), flush=True)
fake.fakeSetInitHangs(0)
comm = n.NcclCommunicator(1, n.get_unique_id(), 0, timeout=5)
comm.allreduce(0, 0, 0, 7, 0, 0)
print("nonblocking", comm.nonblocking, "alive", comm.alive, flush=True)
"""


@needs_cc
def test_communicator_creation_is_bounded_by_the_timeout(tmp_path):
    out = subprocess.run([sys.executable, "-c", _INIT], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "BAGUA_NCCL_LIBRARY": build(tmp_path)})
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("raised after"))
    assert 0.4 < float(line.split()[2]) < 5, line
    assert "creating the communicator did not complete within 0.5 s" in line
    assert "aborts 1" in out.stdout and "nonblocking True alive True" in out.stdout


@needs_cc
def test_a_blocked_rank_is_ended_with_status_1(tmp_path):
    out = _real(build(tmp_path), 0.3, "block")
    assert out.returncode == 1, (out.stdout, out.stderr[-2000:])
    assert "aborts 1 alive False" in out.stdout
    assert "exiting with status 1" in out.stderr and "ProcessGroup(ranks=[0])" in out.stderr


_OLD = r"""
import threading, time, bagua_comm._nccl_loader as L
import bagua_comm._nccl_watchdog as wd
from bagua_comm._nccl_watchdog import Watchdog
# The abort runs on a daemon thread of its own, after the error is recorded: wait for it
# to log, or the process may exit first (seen in CI under load)
aborted, _abort = threading.Event(), wd._abort
def _logged_abort(w):
    try:
        _abort(w)
    finally:
        aborted.set()
wd._abort = _logged_abort
n = L.load()
dog = Watchdog(interval=0.02, exit_grace=60)
comm = n.NcclCommunicator(1, n.get_unique_id(), 0)
w = dog.watch(comm, "G", 0.2)
class Never:
    def is_completed(self):
        return False
w.track(Never())
t0 = time.monotonic()
while w.error is None and time.monotonic() - t0 < 10:
    time.sleep(0.01)
aborted.wait(10)
print(w.can_poll, "|", w.error)
"""


@needs_cc
def test_without_async_error_polling_old_nccl_still_times_out(tmp_path):
    env = {**os.environ, "BAGUA_NCCL_LIBRARY": build(tmp_path, old=True)}
    out = subprocess.run([sys.executable, "-c", _OLD], capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("False |") and "has not completed" in out.stdout
    assert "ncclCommAbort is missing from libnccl 2.3.7" in out.stderr   # logged by the abort


def test_the_watchdog_thread_never_keeps_a_process_alive():
    code = textwrap.dedent("""
        import bagua_comm._nccl_watchdog as wd
        class C:
            watch = None
            def async_error(self, blocking=True):
                return 0
        wd.watch(C(), "G", 1)
        assert wd.get()._thread.daemon and wd.get()._thread.is_alive()
        print("main done", flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout == "main done\n", out.stderr
