"""Hierarchical modes on 4 ranks emulating 2 nodes of 2 (one spawn for all of them)."""

import numpy as np
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
    out["sharded"] = _sharded_reductions()
    out["sharded_ef"] = _sharded_error_feedback_across_rebucket()
    return out


SHARD_NUMEL = 4 * 1000 + 4          # a multiple of 2 local ranks x 2 chunks


def _sharded_reductions():
    """The reducer's sharded path on raw tensors: this rank's inputs and what it got."""
    from bagua_algos._comm import Reducer
    from bagua_comm.compression import MinMaxUInt8

    rank = bc.get_rank()
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(SHARD_NUMEL, generator=gen) * (rank + 1)
    reducer = Reducer(bc.get_default_group(), True, "test-sharded", shard=True)
    try:
        compressed, plain = x.clone(), x.clone()
        reducer.compressed_allreduce(compressed, MinMaxUInt8(2), "k").wait()
        reducer.allreduce(plain, bc.ReduceOp.AVG).wait()
        odd = torch.arange(7, dtype=torch.float32) * (rank + 1)   # not a multiple of 2
        reducer.allreduce(odd, bc.ReduceOp.AVG).wait()
        return {"sharded": reducer.sharded, "peers": reducer.peers.ranks, "x": x,
                "compressed": compressed, "plain": plain, "odd": odd}
    finally:
        reducer.close()


def _sharded_error_feedback_across_rebucket():
    """Hierarchical ByteGrad with error feedback (sharded: every rank compresses a shard)
    through a change of bucket layout mid-run."""
    from torch.optim import SGD

    model = make_model(seed=1)
    opt = SGD(model.parameters(), lr=1e-2)
    model = with_bagua(model, [opt], ByteGrad(hierarchical=True, error_feedback=True),
                       bucket_size=300)
    rank, seen = bc.get_rank(), []
    for step in range(6):
        if step == 4:
            before = model.impl.state_dict()["compressor"]
            model.rebucket(10 * 2**20)
            seen.append((before, model.impl.state_dict()["compressor"]))
        opt.zero_grad()
        loss_fn(model, *batch(step, rank)).backward()
        opt.step()
    sharded = model.impl.state.allreduce.reducer.sharded
    return params(model), seen, sharded, len(model.buckets)


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


def _reference_sharded_compressed(xs):
    """Single-process replica of the sharded hierarchical compressed allreduce on 2 nodes of
    2: node means in float32 (local ranks in order), then for each node-local shard the
    rail's scatter-reduce-gather through MinMaxUInt8 (2 chunks out, 1 back)."""
    from bagua_comm.compression import MinMaxUInt8

    c = MinMaxUInt8(2)
    means = [torch.stack([xs[2 * n], xs[2 * n + 1]]).sum(0).div_(2) for n in range(2)]
    shard = SHARD_NUMEL // 2
    seg = shard // 2
    out = []
    for lo in (0, shard):                               # shard 0: local rank 0's rail
        decoded = []
        for m in means:                                 # every node's input to the rail
            full = torch.empty(shard)
            c.decompress(c.compress(m[lo:lo + shard], chunks=2, key="ref"), full, chunks=2)
            decoded.append(full)
        for j in range(2):                              # rail rank j reduces segment j
            avg = torch.stack([d[j * seg:(j + 1) * seg] for d in decoded]).sum(0).div_(2)
            back = torch.empty(seg)
            c.decompress(c.compress(avg, chunks=1, key="ref"), back, chunks=1)
            out.append(back)
    return torch.cat(out)


def test_sharded_compressed_allreduce_matches_a_single_process_reference(four_ranks):
    res = [r["sharded"] for r in four_ranks]
    assert all(r["sharded"] for r in res)
    assert [r["peers"] for r in res] == [[0, 2], [1, 3], [0, 2], [1, 3]]   # rails
    want = _reference_sharded_compressed([r["x"] for r in res])
    for r in res:
        assert torch.equal(r["compressed"], want)       # bit-identical, and as the replica
    mean = torch.stack([r["x"] for r in res]).double().mean(0).float()
    err = (want - mean).abs().max().item()
    assert 0 < err < 0.05 * mean.abs().max().item()     # 8-bit: lossy, but close


def test_sharded_allreduce_is_the_mean_on_every_rank(four_ranks):
    res = [r["sharded"] for r in four_ranks]
    mean = torch.from_numpy(np.mean(np.stack([r["x"].numpy() for r in res]), 0,
                                    dtype=np.float64)).float()
    for r in res:
        assert torch.equal(r["plain"], res[0]["plain"])
        torch.testing.assert_close(r["plain"], mean, atol=1e-6, rtol=1e-6)
        # a size the node cannot split evenly takes the leader path
        torch.testing.assert_close(r["odd"], torch.arange(7, dtype=torch.float32) * 2.5)


def test_sharded_error_feedback_residuals_survive_a_rebucket(four_ranks):
    def total(states, key):
        out = {}
        for st in states:
            for name, t in st[key].items():
                out[name] = out.get(name, 0) + t
        return out

    res = [r["sharded_ef"] for r in four_ranks]
    assert all(r[2] for r in res) and res[0][3] == 1
    for r in res:                                       # ranks stay bit-identical
        assert all(torch.equal(a, b) for a, b in zip(r[0], res[0][0]))
    befores = [r[1][0][0] for r in res]
    afters = [r[1][0][1] for r in res]
    assert all(b["scatter"] for b in befores)           # every rank compresses a shard
    # gather residuals: each element's on one rank of the job, before and after
    tb, ta = total(befores, "gather"), total(afters, "gather")
    assert tb.keys() == ta.keys() and tb
    for k in tb:
        torch.testing.assert_close(tb[k], ta[k], atol=0, rtol=0)
    # scatter residuals: each element's on one rank of its node, before and after
    for node in ((0, 1), (2, 3)):
        sb = total([befores[i] for i in node], "scatter")
        sa = total([afters[i] for i in node], "scatter")
        assert sb.keys() == sa.keys() and sb
        for k in sb:
            torch.testing.assert_close(sb[k], sa[k], atol=0, rtol=0)
