"""DDP users' reflex: torch.distributed.init_process_group, then with_bagua (no bagua init)."""

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from _common import batch, loss_fn, make_model

import bagua_comm as bc
from bagua_algos import GradientAllReduce, with_bagua
from bagua_comm.testing import run_ranks


def _train(store_path):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    model = make_model(seed=rank)          # different on each rank: with_bagua broadcasts 0's
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model = with_bagua(model, [opt], GradientAllReduce())
    assert bc.is_initialized() and bc.get_rank() == rank and bc.get_world_size() == world
    for step in range(3):
        opt.zero_grad()
        loss_fn(model, *batch(step, rank)).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _reference(world):
    """One process: rank 0's model, SGD on the average of every rank's gradient."""
    model = make_model(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        grads = []
        for r in range(world):
            model.zero_grad()
            loss_fn(model, *batch(step, r)).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *gs in zip(model.parameters(), *grads):
            p.grad = sum(gs) / world
        opt.step()
    return [p.detach() for p in model.parameters()]


def test_with_bagua_after_torch_init_process_group(tmp_path):
    res = run_ranks(_train, 2, args=(str(tmp_path / "store"),), init=False, timeout=90)
    for a, b, ref in zip(*res, _reference(2)):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, ref, rtol=1e-5, atol=1e-6)
