"""The padding of a compressed allreduce is computed by one formula (bagua_comm's
``padded_numel``) for the collective and for the error-feedback state export: with a compressor
whose ``alignment(chunks)`` is not proportional to ``chunks`` the residuals used to be exported
at wrong offsets and sizes, so re-bucketing (and checkpoints) lost or misplaced them."""

import math

import torch
from _common import batch, loss_fn, make_model

import bagua_comm as bc
from bagua_algos import ByteGrad, with_bagua
from bagua_comm.compression import MinMaxUInt8
from bagua_comm.testing import run_ranks


class EightAligned(MinMaxUInt8):
    """MinMaxUInt8 whose inputs must be multiples of 8 elements whatever the chunks."""

    def alignment(self, chunks):
        return math.lcm(self._chunks(chunks), 8)


def _residuals(model):
    return {k: v.clone() for k, v in model.impl.state.allreduce.compressor._residuals.items()}


def _job():
    rank = bc.get_rank()
    model = make_model(seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    algo = ByteGrad(hierarchical=False, compressor=EightAligned(bc.get_world_size(),
                                                               error_feedback=True))
    model = with_bagua(model, [opt], algo, bucket_size=300)
    for step in range(2):
        opt.zero_grad()
        loss_fn(model, *batch(step, rank)).backward()
        opt.step()
    before = _residuals(model)
    model.rebucket(10_000)            # one bucket, then the old layout again: the residuals
    model.rebucket(300)               # go out by parameter name and come back
    after = _residuals(model)
    opt.zero_grad()
    loss_fn(model, *batch(2, rank)).backward()   # and the next compression accepts them
    opt.step()
    return before, after


def test_residuals_round_trip_with_an_alignment_not_proportional_to_chunks():
    for before, after in run_ranks(_job, 2, timeout=180):
        assert before.keys() == after.keys() and before
        for key, value in before.items():
            assert torch.equal(after[key], value), key
