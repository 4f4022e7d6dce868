"""Error-feedback state under ``torch.amp.GradScaler`` (docs/design.md §5, "DDP parity": a step
skipped on one rank included).  An overflow on one rank makes the scaler skip that step on
every rank; TopK's residuals and DGC velocities and LowRank's residuals and Q must keep
nothing of it, as DDP keeps nothing.  The reference is the same run in which that step never
happened (its scale halved by hand): every later parameter must equal it bit for bit, and the
scale must follow DDP's.  Before, the overflow stayed in the state and every later step was
skipped too (the scale halved at every step while the model stood still)."""

from __future__ import annotations

import pytest
import torch
from _common import batch, make_model, params
from torch.nn.parallel import DistributedDataParallel as DDP

import bagua_comm as bc
from bagua_algos import LowRank, TopK, with_bagua
from bagua_comm.compression import MinMaxUInt8
from bagua_comm.testing import run_ranks

STEPS, OVERFLOW, SCALE = 7, 2, 1024.0

VARIANTS = {
    "topk": lambda: TopK(density=0.3),
    "topk_u8": lambda: TopK(density=0.3, compressor=MinMaxUInt8(2)),
    "topk_dgc": lambda: TopK(density=0.3, momentum=0.9),
    # the whole run in the warm-up: DGC's velocity averaged exactly, and the flags carried
    "topk_dgc_warmup": lambda: TopK(density=0.3, momentum=0.9, start_step=100),
    "low_rank": lambda: LowRank(rank=1),
    "low_rank_u8": lambda: LowRank(rank=1, compressor=MinMaxUInt8(2)),
}


def _train(make, overflow: bool):
    """``overflow``: rank 1's loss is infinite at step OVERFLOW; otherwise that step is left
    out altogether and the scale halved as the scaler would have."""
    rank = bc.get_rank()
    model = make_model(seed=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    net = DDP(model) if make is None else with_bagua(model, [opt], make())
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    trajectory, scales = [], []
    for step in range(STEPS):
        if step == OVERFLOW and not overflow:
            scaler.update(scaler.get_scale() / 2)
        else:
            opt.zero_grad()
            x, y = batch(step, rank)
            loss = torch.nn.functional.mse_loss(net(x), y)
            if step == OVERFLOW and rank == 1:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        trajectory.append(params(model))
        scales.append(scaler.get_scale())
    if make is not None:
        net.detach_algorithm()
    return trajectory, scales


def _all():
    out = {"ddp": _train(None, True)}
    for name, make in VARIANTS.items():
        out[name] = (_train(make, True), _train(make, False))
    return out


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_all, 2, timeout=300)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_skipped_step_leaves_no_state_behind(runs, name):
    ddp_scales = runs[0]["ddp"][1]
    assert ddp_scales[OVERFLOW] == SCALE / 2 and ddp_scales[-1] == SCALE / 2   # skipped once
    for r in runs:
        (with_overflow, scales), (without, _) = r[name]
        assert scales == ddp_scales                  # the scaler skipped that step only
        assert all(torch.equal(a, b) for a, b in zip(with_overflow[OVERFLOW - 1],
                                                     with_overflow[OVERFLOW]))  # it stood
        for step in range(OVERFLOW + 1, STEPS):      # and then trained as if it never was
            for a, b in zip(with_overflow[step], without[step]):
                assert torch.equal(a, b), (name, step)
        assert not all(torch.equal(a, b) for a, b in zip(with_overflow[OVERFLOW],
                                                         with_overflow[-1]))   # it moved
    last = [r[name][0][0][-1] for r in runs]         # ranks identical
    assert all(torch.equal(a, b) for a, b in zip(*last))
