"""Hierarchical modes on 4 ranks emulating 2 nodes of 2 (one spawn for all of them)."""

import pytest
import torch
from _common import batch, loss_fn, make_model, params
from test_decentralized import _run, reference_dpsgd
from test_gradient_allreduce import check_equals_full_batch, train_allreduce

import bagua_comm as bc
from bagua_algos import (
    ByteGrad,
    Decentralized,
    GradientAllReduce,
    LowPrecisionDecentralized,
    QAdam,
    QAdamOptimizer,
    with_bagua,
)
from bagua_comm.testing import run_ranks


def _qadam_hierarchical():
    model = make_model(seed=1)
    opt = QAdamOptimizer(model.parameters(), lr=1e-2, warmup_steps=3)
    model = with_bagua(model, [opt], QAdam(opt, hierarchical=True), bucket_size=300)
    rank = bc.get_rank()
    for step in range(8):                     # 3 warmup steps, then compressed momentum
        opt.zero_grad()
        loss_fn(model, *batch(step, rank)).backward()
        opt.step()
    return params(model)


def _four_ranks():
    out = {"gradient_allreduce": train_allreduce(GradientAllReduce(hierarchical=True))}
    for name, algo, mode in (
            ("decentralized_all", Decentralized(hierarchical=True), "all"),
            ("shift_one_flat", Decentralized(hierarchical=False, peer_selection_mode="shift_one"),
             "shift_one")):
        out[name] = (_run(algo), reference_dpsgd(mode, 1))
    out["bytegrad"] = train_allreduce(ByteGrad(hierarchical=True))
    out["low_precision"] = _run(LowPrecisionDecentralized(hierarchical=True))
    out["qadam"] = _qadam_hierarchical()
    # hierarchical shift_one pairs node leaders: 2 nodes -> always the other node
    out["node"] = bc.get_node_rank()
    return out


@pytest.fixture(scope="module")
def four_ranks():
    return run_ranks(_four_ranks, 4, local_world_size=2, timeout=240)


def test_hierarchical_allreduce_equals_full_batch(four_ranks):
    check_equals_full_batch([r["gradient_allreduce"] for r in four_ranks], 4)


@pytest.mark.parametrize("case", ["decentralized_all", "shift_one_flat"])
def test_decentralized_matches_reference_on_four_ranks(four_ranks, case):
    for r in four_ranks:
        (got, before, after, _), ref = r[case]
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
        assert after < 0.8 * before


def test_hierarchical_bytegrad_keeps_ranks_identical_and_trains(four_ranks):
    first = four_ranks[0]["bytegrad"]
    for r in four_ranks:
        assert all(torch.equal(a, b) for a, b in zip(r["bytegrad"][0], first[0]))
    assert first[2] < 0.7 * first[1]


def test_hierarchical_low_precision_keeps_nodes_identical_and_trains(four_ranks):
    for a, b in ((0, 1), (2, 3)):            # ranks of a node share the broadcast weights
        torch.testing.assert_close(four_ranks[a]["low_precision"][0],
                                   four_ranks[b]["low_precision"][0], atol=0, rtol=0)
    for r in four_ranks:
        _, before, after, _ = r["low_precision"]
        assert after < 0.8 * before


def test_hierarchical_qadam_keeps_ranks_identical(four_ranks):
    first = four_ranks[0]["qadam"]
    for r in four_ranks:
        assert all(torch.equal(a, b) for a, b in zip(r["qadam"], first))
