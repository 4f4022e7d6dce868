"""GradientAllReduce: equal to full-batch training, bit-identical ranks, overlap, no_sync."""

import pytest
import torch
from _common import (
    batch,
    eval_loss,
    global_batch,
    loss_fn,
    make_model,
    params,
    reference_full_batch,
    train,
)

import bagua_comm as bc
from bagua_algos import GradientAllReduce, with_bagua
from bagua_comm.testing import run_ranks

STEPS, LR = 12, 0.05
CONFIGS = {"flat_one_bucket": (True, None), "flat_small_buckets": (True, 64),
           "unflattened": (False, 64)}


def train_allreduce(algorithm, do_flatten=True, bucket_size=200):
    model = make_model(seed=bc.get_rank() + 1)          # ranks start apart: rank 0's wins
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    model = with_bagua(model, [opt], algorithm, do_flatten=do_flatten, bucket_size=bucket_size)
    before = eval_loss(model, bc.get_world_size())
    train(model, opt, STEPS)
    flat = all(b.check_flat() for b in model.buckets)
    return params(model), before, eval_loss(model, bc.get_world_size()), len(model.buckets), flat


def check_equals_full_batch(results, world):
    ref = reference_full_batch(STEPS, world, LR, seed=1)
    first = results[0][0]
    for res in results:
        assert all(torch.equal(a, b) for a, b in zip(res[0], first))     # bit-identical ranks
    for got, want in zip(first, ref):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert results[0][2] < 0.7 * results[0][1]


def _no_sync_accumulation():
    rank, world = bc.get_rank(), bc.get_world_size()
    model = make_model(seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model = with_bagua(model, [opt], GradientAllReduce(), bucket_size=300)
    for step in range(3):
        opt.zero_grad()
        with model.no_sync():
            loss_fn(model, *batch(step, rank, micro=0)).backward()
            loss_fn(model, *batch(step, rank, micro=1)).backward()
        loss_fn(model, *batch(step, rank, micro=2)).backward()
        opt.step()
    ref = make_model(seed=1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for step in range(3):
        ref_opt.zero_grad()
        for micro in range(3):
            loss_fn(ref, *global_batch(step, world, micro)).backward()
        ref_opt.step()
    return [torch.allclose(a, b, atol=1e-5, rtol=0) for a, b in zip(params(model), params(ref))]


def _sum_instead_of_average():
    rank, world = bc.get_rank(), bc.get_world_size()
    model = with_bagua(make_model(seed=1), [], GradientAllReduce(average=False))
    loss_fn(model, *batch(0, rank)).backward()
    ref = make_model(seed=1)
    loss_fn(ref, *global_batch(0, world)).backward()
    return [torch.allclose(p.grad, world * r.grad, atol=1e-6, rtol=0)
            for p, r in zip(model.parameters(), ref.parameters())]


def _exact_average():
    """Each gradient is, bit for bit, (g0 + g1) / 2 of the two ranks' own gradients, on each
    path the gather takes: a fresh gradient (divided as it is copied into the bucket), one
    already in the bucket (divided in place), unflattened buckets."""
    rank, world = bc.get_rank(), bc.get_world_size()
    out = []
    for do_flatten, set_to_none in ((True, True), (True, False), (False, True)):
        model = with_bagua(make_model(seed=1), [], GradientAllReduce(hierarchical=False),
                           do_flatten=do_flatten, bucket_size=300)
        ref = make_model(seed=1)
        for step in range(2):
            model.zero_grad(set_to_none=set_to_none)
            ref.zero_grad()
            loss_fn(model, *batch(step, rank)).backward()
            loss_fn(ref, *batch(step, rank)).backward()
            local = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
            every = torch.empty(world * local.numel())
            bc.allgather(local, every)
            want = every.view(world, -1).sum(0).div_(world)
            got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            out.append(torch.equal(got, want))
    return out


def _two_ranks():
    out = {name: train_allreduce(GradientAllReduce(hierarchical=False), *cfg)
           for name, cfg in CONFIGS.items()}
    out["sum"] = _sum_instead_of_average()
    out["no_sync"] = _no_sync_accumulation()
    out["exact"] = _exact_average()
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_two_ranks, 2, timeout=180)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_flat_allreduce_equals_full_batch_training(two_ranks, config):
    results = [r[config] for r in two_ranks]
    check_equals_full_batch(results, 2)
    do_flatten, bucket_size = CONFIGS[config]
    if bucket_size:
        assert results[0][3] > 2                         # several buckets were overlapped
    assert results[0][4] is do_flatten                   # grads are views of the buckets


def test_no_sync_accumulation_equals_full_batch(two_ranks):
    for r in two_ranks:
        assert all(r["no_sync"])


def test_average_is_bit_exact_on_every_gather_path(two_ranks):
    for r in two_ranks:
        assert r["exact"] == [True] * 6


def test_average_false_sums_gradients(two_ranks):
    for r in two_ranks:
        assert all(r["sum"])
