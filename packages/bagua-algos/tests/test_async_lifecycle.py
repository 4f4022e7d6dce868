"""AsyncModelAverage's thread: ``abort()`` on one rank then ``resume()`` on every rank restarts
averaging everywhere, and the thread never keeps a process alive."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from _common import batch, loss_fn, make_model

import bagua_comm as bc
from bagua_algos import AsyncModelAverage, with_bagua
from bagua_comm.testing import run_ranks

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_fault_worker.py")


def _wait_for(pred, what, limit=30.0):
    end = time.monotonic() + limit
    while not pred():
        if time.monotonic() > end:
            raise TimeoutError(f"waited {limit:.0f}s for {what}")
        time.sleep(0.005)


def _train(model, opt, steps):
    rank = bc.get_rank()
    for step in steps:
        opt.zero_grad()
        loss_fn(model, *batch(step, rank)).backward()
        opt.step()


def _abort_on_one_rank_then_resume_everywhere():
    rank = bc.get_rank()
    model = make_model(seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model = with_bagua(model, [opt], AsyncModelAverage(sync_interval_ms=5))
    impl = model.impl
    _train(model, opt, range(3))
    _wait_for(lambda: impl.rounds >= 2, "averaging rounds")
    out = {"daemon": impl.thread.daemon}
    bc.barrier()
    if rank == 0:
        model.abort()
    else:                              # rank 1 never calls abort(): the peer's stopped it
        _wait_for(lambda: impl.stopped, "the peer's abort to stop this rank's thread")
    bc.barrier()
    before = impl.rounds
    model.resume()                     # every rank
    _train(model, opt, range(3, 6))
    _wait_for(lambda: impl.rounds >= before + 3, "averaging rounds after resume()")
    out["restarted"] = impl.thread is not None and impl.thread.is_alive()
    # resume() on every rank while averaging runs (no abort) restarts it too
    bc.barrier()
    model.resume()
    mid = impl.rounds
    _wait_for(lambda: impl.rounds >= mid + 2, "averaging rounds after a second resume()")
    # each rank read its own ``mid``: one whose count was a round behind must see its rounds
    # before the peer's abort stops both threads
    bc.barrier()
    model.abort()
    out["stopped"] = impl.thread is None and impl.stopped
    return out


@pytest.mark.timeout(120)
def test_abort_on_one_rank_then_resume_on_every_rank_restarts_everywhere():
    for res in run_ranks(_abort_on_one_rank_then_resume_everywhere, 2, timeout=90):
        assert res == {"daemon": True, "restarted": True, "stopped": True}


@pytest.mark.timeout(90)
def test_forgotten_abort_does_not_keep_processes_alive(tmp_path):
    """Both ranks train with averaging running and return without abort(): they exit 0."""
    procs = []
    for rank in range(2):
        spec = {"rank": rank, "world": 2, "local": 2, "algo": "async", "dir": str(tmp_path),
                "timeout_s": 30.0, "deadline_s": 80.0, "steps": 40}
        procs.append(subprocess.Popen([sys.executable, WORKER, json.dumps(spec)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      env={**os.environ, "OMP_NUM_THREADS": "1"}))
    try:
        for p in procs:
            _, err = p.communicate(timeout=75)
            assert p.returncode == 0, err.decode()[-2000:]   # 3 would be the deadline
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _closure_raises_inside_step():
    """A closure that raises inside optimizer.step() (as Lightning's training_step does when it
    raises under automatic optimization) must not leave the step lock held."""
    rank = bc.get_rank()
    model = make_model(seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model = with_bagua(model, [opt], AsyncModelAverage(sync_interval_ms=5))
    impl = model.impl
    _train(model, opt, range(2))
    _wait_for(lambda: impl.rounds >= 1, "averaging rounds")

    def closure():
        opt.zero_grad()
        loss = loss_fn(model, *batch(7, rank))
        loss.backward()
        raise ValueError("user code failed inside the closure")

    try:
        opt.step(closure)
    except ValueError:
        pass
    # Training goes on after the user caught it, and the thread keeps averaging.
    before = impl.rounds
    _train(model, opt, range(2, 4))
    _wait_for(lambda: impl.rounds >= before + 2, "averaging rounds after the failed step",
              limit=20)
    bc.barrier()          # every rank saw its rounds before a peer's abort stops the threads
    try:                                  # and again, then abort() straight away
        opt.step(closure)
    except ValueError:
        pass
    start = time.monotonic()
    model.abort()
    return time.monotonic() - start


def test_a_step_whose_closure_raised_neither_stops_averaging_nor_blocks_abort():
    for took in run_ranks(_closure_raises_inside_step, 2, timeout=150):
        assert took < 10.0, f"abort() took {took:.1f}s"
