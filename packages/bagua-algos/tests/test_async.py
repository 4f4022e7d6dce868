"""AsyncModelAverage: warmup allreduce, background averaging, agreed abort, resume."""

import threading
import time

import pytest
import torch
from _common import batch, eval_loss, loss_fn, make_model, params

import bagua_comm as bc
from bagua_algos import AsyncModelAverage, with_bagua
from bagua_comm.testing import run_ranks

WARMUP = 3


def _wait_for(pred, what):
    while not pred():              # bounded by run_ranks' timeout, which kills the ranks
        time.sleep(0.005)


def _async_average():
    rank, world = bc.get_rank(), bc.get_world_size()
    model = make_model(seed=rank + 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model = with_bagua(model, [opt], AsyncModelAverage(sync_interval_ms=5, warmup_steps=WARMUP))
    impl = model.impl
    out = {"before": eval_loss(model, world)}
    step = 0
    from bagua_comm._backends import gloo

    real_finish, main_thread_calls = gloo.finish, []

    def counted(works, *args, **kwargs):     # collectives issued by the training thread
        if threading.current_thread() is threading.main_thread():
            main_thread_calls.append(step)
        return real_finish(works, *args, **kwargs)

    gloo.finish = counted
    for step in range(40):
        opt.zero_grad()
        loss_fn(model, *batch(step, rank)).backward()
        opt.step()
        if step == WARMUP - 1:
            out["after_warmup"] = params(model)      # synchronous so far: thread not started
            out["thread_before_warmup_end"] = impl.thread is not None
        time.sleep(0.002)
    gloo.finish = real_finish
    out["training_thread_collective_steps"] = sorted(set(main_thread_calls))
    out["after"] = eval_loss(model, world)
    # Both ranks idle: two further rounds make model + pending the exact average.
    bc.barrier()
    start = impl.rounds
    _wait_for(lambda: impl.rounds >= start + 2, "two averaging rounds")
    # Each rank read its own start: one that read it a round later must see its two rounds
    # before a peer's abort stops the threads (else it waits forever).
    bc.barrier()
    # Only rank 0 aborts; rank 1's thread must stop too, through the agreed flag.
    if rank == 0:
        model.abort()
    else:
        _wait_for(lambda: impl.stopped, "rank 1's thread to stop")
        model.abort()                                 # returns at once, applies the average
    out["averaged"] = params(model)
    out["rounds"] = impl.rounds
    # resume() restarts averaging on every rank.
    model.resume()
    for s in range(step + 1, step + 6):
        opt.zero_grad()
        loss_fn(model, *batch(s, rank)).backward()
        opt.step()
    more = impl.rounds
    _wait_for(lambda: impl.rounds > more, "a round after resume")
    bc.barrier()                          # as above: every rank saw its round before abort
    model.abort()
    out["stopped"] = impl.thread is None and impl.stopped
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_async_average, 2, timeout=180)


def test_warmup_allreduces_gradients_synchronously(results):
    a, b = results
    assert not a["thread_before_warmup_end"]
    assert all(torch.equal(x, y) for x, y in zip(a["after_warmup"], b["after_warmup"]))


def test_no_gradient_collective_after_warmup(results):
    # after its warm-up the training thread communicates nothing: its gradients stay local
    # (the background thread averages the weights); the warm-up steps allreduce them
    for r in results:
        assert r["training_thread_collective_steps"] == list(range(WARMUP))


def test_background_averaging_converges(results):
    for r in results:
        assert r["rounds"] >= 2
        assert r["after"] < 0.7 * r["before"]
    for x, y in zip(results[0]["averaged"], results[1]["averaged"]):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=0)


def test_abort_on_one_rank_stops_every_rank_and_resume_restarts(results):
    for r in results:
        assert r["stopped"]


def test_bad_arguments():
    with pytest.raises(ValueError, match="sync_interval_ms"):
        AsyncModelAverage(sync_interval_ms=-1)
    with pytest.raises(ValueError, match="warmup_steps"):
        AsyncModelAverage(warmup_steps=1.5)
    with pytest.raises(ValueError, match="peer_selection_mode"):
        AsyncModelAverage(peer_selection_mode="shift_one")
