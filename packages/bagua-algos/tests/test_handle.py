"""bagua_comm.Work.then (the algorithms' handles): callbacks run when the handle completes, with nobody calling wait(), so chains
of dependent collectives (P, then Q computed from P) progress by themselves; exceptions reach
wait() of every handle down the chain."""

import threading

import pytest
import torch

import bagua_comm as bc
from bagua_algos._engine.comm import Runner
from bagua_comm.testing import run_ranks

TIMEOUT = 30


class _GatedWork:
    """A work handle (wait/is_completed only, like a primitive's) released by an event."""

    def __init__(self, fail=None):
        self.gate = threading.Event()
        self.fail = fail

    def wait(self):
        if not self.gate.wait(TIMEOUT):
            raise TimeoutError("gate never opened")
        if self.fail is not None:
            raise self.fail

    def is_completed(self):
        return self.gate.is_set()


def _runner_job(gate, fail=None):
    def job():
        assert gate.wait(TIMEOUT)
        if fail is not None:
            raise fail
        return "job"
    return job


@pytest.fixture
def runner():
    r = Runner("test-handle")
    yield r
    r.close()


def test_chained_callbacks_run_on_completion_without_wait(runner):
    gate, seen, ran = threading.Event(), [], threading.Event()
    h = runner.submit(_runner_job(gate))
    tail = h.then(lambda _: seen.append("a") or 1).then(
        lambda p: seen.append(("b", p.value())) or ran.set() or 2)
    assert not ran.is_set() and seen == []          # not before the work completes
    gate.set()
    assert ran.wait(TIMEOUT), "the chained callbacks never ran without a wait()"
    assert seen == ["a", ("b", 1)] and tail.is_completed()
    assert tail.wait() == 2 and seen == ["a", ("b", 1)]   # wait() does not run them again


def test_primitive_like_work_is_watched_for_its_callbacks():
    work, ran = _GatedWork(), threading.Event()
    h = bc.Work([work]).then(lambda _: ran.set() or "done")
    work.gate.set()
    assert ran.wait(TIMEOUT), "no callback on completion of a wait()-only work"
    assert h.wait() == "done"


def test_then_on_a_completed_handle_runs_at_once_in_the_caller():
    where = []
    h = bc.Work.completed(5).then(lambda p: where.append(threading.current_thread()) or p.value())
    assert where == [threading.current_thread()] and h.is_completed() and h.wait() == 5


def test_a_handle_nobody_chains_on_is_completed_by_wait_as_before():
    work = _GatedWork()
    h = bc.Work([work])
    assert not h.is_completed()
    work.gate.set()
    assert h.is_completed() and h.wait() is None


@pytest.mark.parametrize("where", ["work", "callback"])
def test_exceptions_propagate_to_wait_down_the_chain(runner, where):
    gate, calls = threading.Event(), []
    boom = RuntimeError(f"boom in the {where}")

    def first(_):
        calls.append("first")
        if where == "callback":
            raise boom

    h = runner.submit(_runner_job(gate, boom if where == "work" else None))
    mid = h.then(first)
    tail = mid.then(lambda _: calls.append("second"))
    gate.set()
    with pytest.raises(RuntimeError, match=f"boom in the {where}"):
        tail.wait()
    with pytest.raises(RuntimeError, match=f"boom in the {where}"):
        mid.wait()
    assert calls == ([] if where == "work" else ["first"])   # nothing after the failure ran
    work = _GatedWork(fail=ValueError("work failed"))
    chained = bc.Work([work]).then(lambda _: calls.append("never"))
    work.gate.set()
    with pytest.raises(ValueError, match="work failed"):
        chained.wait()
    assert "never" not in calls


def _p_then_q():
    """P allreduced asynchronously; its callback computes Q from the reduced P and allreduces
    it.  The training thread only polls (with a timeout) until Q is there: no wait()."""
    rank = bc.get_rank()
    p = torch.full((4,), float(rank + 1))
    q = torch.empty(4)
    done = threading.Event()

    def compute_q(_):
        torch.mul(p, rank + 1, out=q)           # Q depends on the reduced P
        bc.allreduce_inplace(q)
        done.set()
        return q.clone()

    chained = bc.allreduce_inplace(p, async_op=True).then(compute_q)
    progressed = done.wait(TIMEOUT)
    before_wait = q.clone()
    return progressed, before_wait, chained.wait()


def test_dependent_collectives_progress_without_wait_on_two_ranks():
    for progressed, before_wait, value in run_ranks(_p_then_q, 2, timeout=120):
        assert progressed, "Q's allreduce never ran before wait()"
        # P = 1 + 2 = 3 on both ranks; Q = 3 * 1 + 3 * 2 = 9
        assert torch.equal(before_wait, torch.full((4,), 9.0))
        assert torch.equal(value, before_wait)
