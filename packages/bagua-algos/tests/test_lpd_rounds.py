"""LowPrecisionDecentralized runs one gossip round per training step, whatever the optimizers
do: two optimizers, or a GradScaler that skips the step on one rank only (issue #29, A6)."""

import torch
from _common import batch, loss_fn, make_model, params

import bagua_comm as bc
from bagua_algos import LowPrecisionDecentralized, with_bagua
from bagua_comm.testing import run_ranks

STEPS = 4


def _train(split: bool):
    rank = bc.get_rank()
    model = make_model(seed=3)
    ps = list(model.parameters())
    opts = ([torch.optim.SGD(ps[:2], lr=0.05), torch.optim.SGD(ps[2:], lr=0.05)] if split
            else [torch.optim.SGD(ps, lr=0.05)])
    model = with_bagua(model, opts, LowPrecisionDecentralized(hierarchical=False))
    for step in range(STEPS):
        for opt in opts:
            opt.zero_grad()
        loss_fn(model, *batch(step, rank)).backward()
        for opt in opts:
            opt.step()
    rounds = model.impl.rounds
    model.detach_algorithm()
    return rounds, params(model)


def _one_and_two_optimizers():
    return _train(False), _train(True)


def test_two_optimizers_one_round_per_step_and_same_result():
    for (r1, p1), (r2, p2) in run_ranks(_one_and_two_optimizers, 2, timeout=120):
        assert r1 == r2 == STEPS
        for a, b in zip(p1, p2):
            assert torch.equal(a, b)


def _scaler_skips_on_rank1(skip_step):
    rank = bc.get_rank()
    model = make_model(seed=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model = with_bagua(model, [opt], LowPrecisionDecentralized(hierarchical=False))
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    skipped = []
    for step in range(STEPS):
        opt.zero_grad()
        before = params(model)
        loss = loss_fn(model, *batch(step, rank))
        if rank == 1 and step == skip_step:
            loss = loss * float("inf")           # this rank's gradients overflow
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        # a skipped step leaves this rank's update out, not its round: the weights moved
        # by the gossip only, and the round counter kept pace with the peer's
        skipped.append(model.impl.rounds == step + 1 and not all(
            torch.equal(a, b) for a, b in zip(before, params(model))))
    st = model.impl.state
    out = ([t.clone() for t in st.mine], [t.clone() for t in st.left], model.impl.rounds,
           skipped)
    model.detach_algorithm()
    return out


def test_grad_scaler_skip_on_one_rank_keeps_the_ranks_in_lockstep():
    # the skip at the last step too: there is no later forward to catch the round up
    for skip_step in (1, STEPS - 1):
        (mine0, left0, r0, ok0), (mine1, left1, r1, ok1) = run_ranks(
            _scaler_skips_on_rank1, 2, args=(skip_step,), timeout=150, pg_timeout=60)
        assert r0 == r1 == STEPS
        assert all(ok0) and all(ok1)
        # each rank's replica of its neighbour is the neighbour's own x, bit for bit
        for a, b in zip(left0, mine1):
            assert torch.equal(a, b)
        for a, b in zip(left1, mine0):
            assert torch.equal(a, b)
