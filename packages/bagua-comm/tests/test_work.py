"""bagua_comm.Work, the one completion handle: a primitive's async handle, a completed one
(broadcast_object), a pending one completed by a job, and chains of them (torch's Work with its
future: wait, is_completed, get_future, then, value)."""

import threading

import pytest
import torch

import bagua_comm as bc
from bagua_comm.testing import run_ranks

TIMEOUT = 30


class _Gated:
    """A backend handle (wait/is_completed) released by an event."""

    def __init__(self):
        self.gate = threading.Event()

    def wait(self):
        assert self.gate.wait(TIMEOUT)

    def is_completed(self):
        return self.gate.is_set()


def test_the_finisher_runs_once_after_the_leaves_whichever_call_completes_it():
    leaf, runs = _Gated(), []
    w = bc.Work([leaf], lambda: runs.append(1))
    assert not w.is_completed() and runs == []
    leaf.gate.set()
    assert w.is_completed() and runs == [1]
    assert w.wait() is None and w.done() and runs == [1]


def test_a_chain_runs_when_the_leaves_complete_and_carries_values_and_errors():
    leaf, ran = _Gated(), threading.Event()
    w = bc.Work([leaf])
    assert w.get_future() is w
    tail = w.then(lambda _: 2).then(lambda p: ran.set() or p.value() * 3)
    assert not ran.is_set()
    leaf.gate.set()
    assert ran.wait(TIMEOUT) and tail.wait() == 6
    failing = bc.Work.completed(1).then(lambda _: 1 / 0).then(lambda _: "never")
    with pytest.raises(ZeroDivisionError):
        failing.wait()


def test_a_pending_handle_is_completed_by_another_thread_and_wakes_its_waiter():
    w = bc.Work.pending()
    assert not w.is_completed()
    threading.Timer(0.05, w.set_result, args=("late",)).start()
    assert w.wait() == "late" and w.is_completed()
    e = bc.Work.pending()
    e.set_exception(RuntimeError("job failed"))
    with pytest.raises(RuntimeError, match="job failed"):
        e.wait()


def _async_handles():
    rank = bc.get_rank()
    t = torch.full((3,), float(rank + 1))
    reduced = bc.allreduce_inplace(t, bc.ReduceOp.AVG, async_op=True)
    doubled = reduced.then(lambda _: t * 2)
    obj = bc.broadcast_object({"from": rank}, src=1, async_op=True)
    return (isinstance(reduced, bc.Work), doubled.wait(), t, obj.wait(), obj.value(),
            obj.is_completed())


def test_primitives_return_work_that_chains_on_two_ranks():
    for is_work, doubled, t, got, value, done in run_ranks(_async_handles, 2, timeout=120):
        assert is_work and done
        assert torch.equal(t, torch.full((3,), 1.5))        # (1 + 2) / 2, the finisher's division
        assert torch.equal(doubled, torch.full((3,), 3.0))
        assert got == value == {"from": 1}
