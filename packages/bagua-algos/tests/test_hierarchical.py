"""Hierarchical modes on 4 ranks emulating 2 nodes of 2 (one spawn for all of them)."""

import pytest
import torch
from _common import batch, loss_fn, make_model, params
from _diloco_ref import flat, inner_optimizer, simulate
from test_decentralized import _run, reference_dpsgd
from test_gradient_allreduce import check_equals_full_batch, train_allreduce
from test_one_collective import check_hierarchical, hierarchical_run

import bagua_comm as bc
from bagua_algos import (
    ByteGrad,
    Decentralized,
    DiLoCo,
    GradientAllReduce,
    LowPrecisionDecentralized,
    QAdam,
    QAdamOptimizer,
    with_bagua,
)
from bagua_comm import traffic
from bagua_comm.compression import MinMaxUInt4
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
    out = {"gradient_allreduce": train_allreduce(GradientAllReduce(hierarchical=True)),
           "gradient_allreduce_calls": hierarchical_run()}
    for name, algo, mode in (
            ("decentralized_all", Decentralized(hierarchical=True), "all"),
            ("shift_one_flat", Decentralized(hierarchical=False, peer_selection_mode="shift_one"),
             "shift_one")):
        out[name] = (_run(algo), reference_dpsgd(mode, 1))
    out["bytegrad"] = train_allreduce(ByteGrad(hierarchical=True))
    out["low_precision"] = _run(LowPrecisionDecentralized(hierarchical=True))
    out["qadam"] = _qadam_hierarchical()
    for name, (kw, inner) in DILOCO_CASES.items():
        out[name] = _diloco(kw, inner)
    # hierarchical shift_one pairs node leaders: 2 nodes -> always the other node
    out["node"] = bc.get_node_rank()
    return out


DILOCO_STEPS = 8
DILOCO_CASES = {   # name: (DiLoCo keyword arguments besides hierarchical=True, inner optimizer)
    "diloco adam": (dict(sync_every=3), "adam"),
    "diloco fragments 2 overlap 1": (dict(sync_every=4, fragments=2, overlap_steps=1),
                                     "momentum"),
    # 4-bit outer gradient among the 2 node leaders (its chunks divide the 2 leaders)
    "diloco 4-bit": (dict(sync_every=3, compressor=MinMaxUInt4(2, error_feedback=True)), "adam"),
}


def _diloco(kwargs, inner):
    """Per step: the flat parameters and the bytes sent by primitive (syncs included)."""
    rank = bc.get_rank()
    model = make_model(1)
    opt = inner_optimizer(model, inner)
    model = with_bagua(model, [opt], DiLoCo(hierarchical=True, **kwargs))
    traj, sent = [], []
    for t in range(DILOCO_STEPS):
        traffic.reset()
        opt.zero_grad()
        loss_fn(model, *batch(t, rank)).backward()
        opt.step()
        model.impl.finish()            # a sync's bytes (sent from the runner) count in its step
        traj.append(flat(model.module))
        sent.append(traffic.by_primitive())
    model.detach_algorithm()
    return traj, sent


@pytest.fixture(scope="module")
def four_ranks():
    return run_ranks(_four_ranks, 4, local_world_size=2, timeout=240)


def test_hierarchical_allreduce_equals_full_batch(four_ranks):
    check_equals_full_batch([r["gradient_allreduce"] for r in four_ranks], 4)


def test_hierarchical_allreduce_one_collective_chain_per_bucket_and_none_for_flags(four_ranks):
    check_hierarchical([r["gradient_allreduce_calls"] for r in four_ranks])


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


def _leader(rank: int) -> bool:
    return rank % 2 == 0                 # local_world_size=2: ranks 0 and 2 lead their node


@pytest.mark.parametrize("case", ["diloco adam", "diloco fragments 2 overlap 1"])
def test_hierarchical_diloco_matches_the_single_process_simulation(four_ranks, case):
    kw, inner = DILOCO_CASES[case]
    ref = simulate(4, DILOCO_STEPS, inner=inner,
                   **{k.replace("_steps", ""): v for k, v in kw.items()})
    for r in range(4):
        traj, _ = four_ranks[r][case]
        for t in range(DILOCO_STEPS):
            assert torch.allclose(traj[t], ref[t][r], rtol=0, atol=2e-6), (case, r, t + 1)


def test_hierarchical_diloco_goes_through_node_leaders(four_ranks):
    n = flat(make_model(1)).numel()
    for r in range(4):
        _, sent = four_ranks[r]["diloco adam"]                  # sync_every=3
        for t, by in enumerate(sent):
            if (t + 1) % 3:
                assert by == {}, (r, t + 1)                      # nothing between syncs
                continue
            # every rank reduces into its leader (2 ranks: half the float32 buffer) ...
            assert by["reduce"] == 4 * n // 2, (r, t + 1)
            if _leader(r):   # ... leaders allreduce among 2 leaders, broadcast to their node
                assert by["allreduce"] == 2 * 4 * n // 2 and by["broadcast"] == 4 * n
            else:
                assert "allreduce" not in by and "broadcast" not in by


def test_hierarchical_diloco_4bit_keeps_every_rank_identical_after_syncs(four_ranks):
    first, _ = four_ranks[0]["diloco 4-bit"]
    exact = simulate(4, DILOCO_STEPS, sync_every=3, inner="adam")
    for r in range(4):
        traj, sent = four_ranks[r]["diloco 4-bit"]
        for t in range(2, DILOCO_STEPS, 3):
            assert torch.equal(traj[t], first[t]), (r, t + 1)
            # 4 bits lose a little against the full-precision average, but not everything
            err = (traj[t] - exact[t][r]).abs().max().item()
            assert 0 < err < 0.05, (r, t + 1, err)
            assert ("compressed_allreduce" in sent[t]) == _leader(r), (r, t + 1)
