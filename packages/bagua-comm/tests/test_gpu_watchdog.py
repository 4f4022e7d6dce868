"""GPU: the NCCL watchdog on a real one-rank communicator.

A dead peer cannot be staged with one GPU (NCCL refuses two ranks on one device), so an
operation is held back instead: the group's stream spins (``torch.cuda._sleep``) in front of
an allreduce for longer than the group's timeout.  The watchdog must abort the communicator,
the rank's next call must raise naming the group and the timeout, and a rank blocked in a CUDA
synchronisation must be ended with exit status 1.  Marked ``gpu``.
"""

import os
import subprocess
import sys
import time

import pytest

from bagua_comm.testing import run_ranks

pytestmark = pytest.mark.gpu

# Runs in the rank: init with a 3 s timeout, one allreduce, then one held back by a spin.
_HELD_BACK = """
import time
from datetime import timedelta
import torch, torch.distributed as dist
import bagua_comm as bc
from bagua_comm.process_group import get_default_group

def spin_cycles(seconds):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(); torch.cuda._sleep(100_000_000); end.record(); torch.cuda.synchronize()
    return int(seconds * 100_000_000 / (start.elapsed_time(end) / 1000))

def held_back_allreduce(store, seconds):
    bc.init_process_group("nccl", store=dist.FileStore(store, 1), rank=0, world_size=1,
                          timeout=timedelta(seconds=3))
    g = get_default_group()
    x = torch.ones(1 << 20, device="cuda")
    bc.allreduce_inplace(x)                        # makes the communicator and its record
    torch.cuda.synchronize()
    comm = g._nccl.comm()
    assert comm.async_error() == 0 and comm.watch is not None and comm.watch.error is None
    cycles = spin_cycles(seconds)
    with torch.cuda.stream(torch.cuda.ExternalStream(g._nccl.stream().ptr)):
        torch.cuda._sleep(cycles)                  # holds back what follows on that stream
    return comm, x, bc.allreduce_inplace(x, async_op=True)
"""


def _times_out(store):
    ns = {}
    exec(_HELD_BACK, ns)
    comm, x, work = ns["held_back_allreduce"](store, 30)
    t0 = time.monotonic()
    while comm.watch.error is None and time.monotonic() - t0 < 25:
        time.sleep(0.05)
    detected = time.monotonic() - t0
    errors = []
    for call in (work.wait, lambda: ns["bc"].allreduce_inplace(x)):
        try:
            call()
            errors.append(None)
        except RuntimeError as err:
            errors.append(str(err))
    return detected, comm.alive, errors


def test_a_held_back_operation_aborts_the_communicator_and_the_rank_raises(tmp_path):
    detected, alive, errors = run_ranks(_times_out, 1, backend="nccl", init=False, timeout=300,
                                        args=(str(tmp_path / "store"),))[0]
    assert detected < 10, detected                 # 3 s timeout, 0.1 s polls, the abort
    assert alive is False
    for err in errors:
        assert err is not None and "was aborted" in err and "timeout 3 s" in err, errors
        assert "ProcessGroup(ranks=[0]" in err


def test_a_rank_blocked_in_cuda_synchronize_exits_with_status_1(tmp_path):
    code = _HELD_BACK + (
        f"comm, x, work = held_back_allreduce({str(tmp_path / 'store')!r}, 60)\n"
        "print('blocking', flush=True)\n"
        "torch.cuda.synchronize()                  # stuck behind the spin for a minute\n"
        "print('not reached before the watchdog', flush=True)\n")
    env = {**os.environ, "BAGUA_NCCL_WATCHDOG_GRACE": "2"}
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=240, env=env)
    took = time.monotonic() - t0
    assert out.returncode == 1, (out.returncode, out.stdout, out.stderr[-3000:])
    assert "blocking" in out.stdout and "not reached" not in out.stdout
    assert "exiting with status 1" in out.stderr and "timeout 3 s" in out.stderr
    assert took < 55, took                         # well before the 60 s spin ends


def _healthy():
    import torch

    import bagua_comm as bc
    from bagua_comm.process_group import get_default_group

    x = torch.arange(8.0, device="cuda")
    for _ in range(50):
        bc.allreduce_inplace(x)
    torch.cuda.synchronize()
    comm = get_default_group()._nccl.comm()
    time.sleep(0.5)                                # a few polls
    w = comm.watch
    return comm.async_error(), w.error is None, len(w.pending), x.tolist()


def test_a_healthy_communicator_is_watched_and_left_alone():
    status, ok, pending, values = run_ranks(_healthy, 1, backend="nccl", timeout=300)[0]
    assert status == 0 and ok and pending == 0
    assert values == [float(i) for i in range(8)]
