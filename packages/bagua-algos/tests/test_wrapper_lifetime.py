"""A wrapper the user drops is freed, with everything it holds (buckets, the algorithm, its
process groups' sockets and threads), as any Python object: the parameters' gradient hooks
hold the step engine's compiled loop weakly (``_engine._hot.LoopHook``), since torch keeps a
tensor's hooks where Python's collector does not look."""

import gc
import weakref

import pytest
import torch
from _common import batch, loss_fn, make_model

from bagua_algos import Algorithm, with_bagua
from bagua_comm.testing import run_ranks

ALGORITHMS = ["gradient_allreduce", "bytegrad", "decentralized", "low_precision_decentralized",
              "diloco"]


def _drop(name):
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    wrapped = with_bagua(model, [opt], Algorithm.init(name))
    for step in range(2):
        opt.zero_grad()
        loss_fn(wrapped, *batch(step, 0)).backward()
        opt.step()
    gone = [weakref.ref(o) for o in (wrapped, wrapped.engine, wrapped.impl, wrapped.engine._loop)]
    del wrapped, model, opt
    gc.collect()
    return [r() is None for r in gone]


@pytest.mark.parametrize("name", ALGORITHMS)
def test_a_dropped_wrapper_is_freed(name):
    for freed in run_ranks(_drop, 2, args=(name,), timeout=120):
        assert freed == [True, True, True, True], name


def _keep_training_after_a_collection():
    """While the wrapper lives its hooks still reach the loop: a collection in between does
    not stop the gradients from being averaged."""
    import bagua_comm as bc

    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    wrapped = with_bagua(model, [opt], Algorithm.init("gradient_allreduce"))
    gc.collect()
    opt.zero_grad()
    loss_fn(wrapped, *batch(0, bc.get_rank())).backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    every = torch.empty(2 * grads.numel())
    bc.allgather(grads, every)
    return every.view(2, -1)


def test_hooks_reach_the_loop_while_the_wrapper_lives():
    for rows in run_ranks(_keep_training_after_a_collection, 2, timeout=120):
        torch.testing.assert_close(rows[0], rows[1], rtol=0, atol=0)   # averaged: equal
