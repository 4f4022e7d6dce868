"""Decentralized's compiled round (one ``bagua_comm`` average job per round on the gloo worker,
issue #46) trains bit for bit as its Python path: at 2 and 3 ranks ("all"), 2 and 4 ranks
("shift_one", whose pairing rotates at 4), every step and every other step, through a resume
from ``state_dict`` into a fresh wrap; and takes its round off the runner thread."""

import pytest
import torch
from _common import batch, loss_fn, make_model, params

import bagua_comm as bc
from bagua_algos import Decentralized, with_bagua
from bagua_comm.testing import run_ranks

STEPS, RESUME = 9, 5


def _wrap(model, mode, interval, compiled):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
    wrapped = with_bagua(model, [opt], Decentralized(hierarchical=False,
                                                     peer_selection_mode=mode,
                                                     communication_interval=interval),
                         bucket_size=300)               # several buckets
    wrapped.impl.compiled = compiled
    return wrapped, opt


def _steps(model, opt, steps):
    rank = bc.get_rank()
    for step in steps:
        opt.zero_grad()
        loss_fn(model, *batch(step, rank)).backward()
        opt.step()


def _train(mode: str, interval: int, compiled: bool):
    """RESUME steps, the weights and the algorithm's state saved, a fresh model wrapped and
    loaded with them (each rank its own), the remaining steps."""
    model, opt = _wrap(make_model(seed=5), mode, interval, compiled)
    impl = model.impl
    _steps(model, opt, range(RESUME))
    took = impl._compiled() is not None
    runner_used = impl.reducer.runner._pool is not None
    saved, state = params(model), impl.state_dict()
    model.detach_algorithm()
    model, opt = _wrap(make_model(seed=9), mode, interval, compiled)
    with torch.no_grad():
        for p, v in zip(model.parameters(), saved):
            p.copy_(v)
    model.impl.load_state_dict(state)
    _steps(model, opt, range(RESUME, STEPS))
    out = took, runner_used, params(model), model.impl.rounds, len(model.buckets)
    model.detach_algorithm()
    return out


def _both_paths(cases):
    return {(mode, interval, compiled): _train(mode, interval, compiled)
            for mode, interval in cases for compiled in (True, False)}


@pytest.mark.parametrize("world,modes", [(2, ("all", "shift_one")), (3, ("all",)),
                                         (4, ("shift_one",))])
def test_compiled_round_trains_bit_for_bit_as_the_python_path(world, modes):
    cases = [(mode, interval) for mode in modes for interval in (1, 2)]
    start = make_model(seed=5)
    for r in run_ranks(_both_paths, world, args=(cases,), timeout=300):
        for mode, interval in cases:
            took, runner, p_fast, rounds, buckets = r[(mode, interval, True)]
            took_slow, runner_slow, p_slow, rounds_slow, _ = r[(mode, interval, False)]
            assert took and not took_slow
            assert runner_slow and not runner     # the compiled round is the worker's job
            assert rounds == rounds_slow == -(-STEPS // interval)
            assert buckets > 1
            assert all(torch.equal(a, b) for a, b in zip(p_fast, p_slow)), (mode, interval)
            # the weights moved: a test of something
            assert not any(torch.equal(a, b) for a, b in zip(p_fast, params(start)))
