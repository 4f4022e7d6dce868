"""LengthGroupedDistributedBatchSampler: coverage, limits, padding and cross-rank balance
against independent numpy references (a Hugging Face-style length grouping, torch's
DistributedSampler), every rank built separately as in a real job."""

from collections import Counter

import numpy as np
import pytest
import torch
from _reference import lognormal_lengths, torch_orders
from torch.utils.data import DataLoader

from bagua_data import LengthGroupedDistributedBatchSampler as LG

# The data: 20,000 lognormal lengths (mean ~70, tail clipped at 2,048).
G = torch.Generator().manual_seed(1)
BIG = (torch.exp(torch.randn(20_000, generator=G, dtype=torch.float64) * 0.85) * 48).round() \
    .clamp(1, 2048).long().tolist()


def rank_batches(lengths, world, epoch=0, **kw):
    """Every rank's batches, each rank's sampler built on its own."""
    out = []
    for r in range(world):
        s = LG(lengths, lengths, num_replicas=world, rank=r, **kw)
        s.set_epoch(epoch)
        out.append(list(s))
        assert len(s) == len(out[-1])
    return out


def costs(per_rank, lengths, model="padded"):
    """(ranks, steps) numpy cost of each rank's batch at each step."""
    la = np.asarray(lengths, dtype=np.float64)
    f = {"padded": lambda x: len(x) * x.max(), "sum": lambda x: x.sum(),
         "attention": lambda x: len(x) * x.max() ** 2}[model]
    return np.array([[f(la[b]) for b in batches] for batches in per_rank])


def hf_grouped(lengths, world, batch_size, seed=0, mult=50):
    """Reference: shuffle, sort mega-batches of ``mult`` batches per rank by length
    (descending), cut batches, deal consecutive batches to the ranks in order."""
    la = np.asarray(lengths)
    perm = np.random.default_rng(seed).permutation(len(la))
    mega = mult * world * batch_size
    per_rank = [[] for _ in range(world)]
    for s in range(0, len(la), mega):
        chunk = perm[s:s + mega][np.argsort(-la[perm[s:s + mega]], kind="stable")]
        batches = [chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size)]
        for j in range(0, len(batches) - world + 1, world):
            for r in range(world):
                per_rank[r].append(batches[j + r].tolist())
    return per_rank


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("kw", [dict(batch_size=8), dict(max_cost=900.0),
                                dict(batch_size=16, max_cost=1500.0, cost="sum"),
                                dict(max_cost=300_000.0, cost="attention", bucket_size=3)])
def test_every_sample_once_equal_counts_and_limits(world, kw):
    lengths = [min(n, 500) for n in lognormal_lengths(1001, seed=world)]
    for epoch in (0, 1):
        per_rank = rank_batches(lengths, world, epoch, **kw)
        assert len({len(b) for b in per_rank}) == 1           # no rank hangs at a collective
        seen = Counter(i for batches in per_rank for b in batches for i in b)
        assert set(seen) == set(range(1001))
        extra = sum(seen.values()) - 1001                     # repeats only to give every
        assert 0 <= extra < world                             # rank a last batch
        assert all(b for batches in per_rank for b in batches)
        if "batch_size" in kw:
            assert max(len(b) for batches in per_rank for b in batches) <= kw["batch_size"]
        if "max_cost" in kw:
            c = costs(per_rank, lengths, kw.get("cost", "padded"))
            assert c.max() <= kw["max_cost"]


def test_epoch_steps_are_the_ranks_batches_and_epochs_differ():
    lengths = lognormal_lengths(500)
    s = LG(lengths, lengths, batch_size=8, num_replicas=3, rank=1, seed=4)
    steps = s.epoch_steps()
    assert list(s) == [step[1] for step in steps]
    assert all(len(step) == 3 for step in steps)
    s.set_epoch(1)
    assert s.epoch_steps() != steps
    again = LG(lengths, lengths, batch_size=8, num_replicas=3, rank=1, seed=4)
    assert again.epoch_steps() == steps                        # deterministic in seed + epoch
    fixed = LG(lengths, lengths, batch_size=8, num_replicas=3, rank=1, shuffle=False)
    first = fixed.epoch_steps()
    fixed.set_epoch(5)
    assert fixed.epoch_steps() == first


def test_drop_last_keeps_full_batches_only():
    lengths = lognormal_lengths(1001, seed=3)
    per_rank = rank_batches(lengths, 4, batch_size=16, drop_last=True)
    sizes = {len(b) for batches in per_rank for b in batches}
    seen = Counter(i for batches in per_rank for b in batches for i in b)
    assert sizes == {16} and max(seen.values()) == 1
    assert 1001 - 4 * 16 < len(seen) <= 1001 and len(seen) % (4 * 16) == 0


def test_few_samples_repeat_only_to_give_every_rank_a_batch():
    per_rank = rank_batches([5, 1, 3], 4, batch_size=2)
    assert [len(b) for b in per_rank] == [1, 1, 1, 1]
    seen = Counter(i for batches in per_rank for b in batches for i in b)
    assert set(seen) == {0, 1, 2} and sum(seen.values()) == 4
    assert rank_batches([5, 1, 3], 4, batch_size=2, drop_last=True) == [[]] * 4
    assert rank_batches([], 2, batch_size=2) == [[], []]


def test_low_padding_and_balanced_against_the_references():
    world, bs = 4, 32
    per_rank = rank_batches(BIG, world, batch_size=bs)
    ours = costs(per_rank, BIG)
    ref = costs(hf_grouped(BIG, world, bs), BIG)
    ds = costs([[o[i:i + bs] for i in range(0, len(o) - bs + 1, bs)]
                for o in torch_orders(len(BIG), world)], BIG)
    # padded cost of a step: its slowest rank; within 1.1x of the length-grouped reference
    assert ours.max(0).sum() <= 1.1 * ref.max(0).sum()
    assert ours.max(0).sum() < 0.25 * ds.max(0).sum()
    imb = (ours.max(0) / ours.mean(0)).mean()
    assert imb <= 1.05 < (ref.max(0) / ref.mean(0)).mean()
    # with a padded-token budget: even less padding, still balanced
    budget = costs(rank_batches(BIG, world, max_cost=4096.0, batch_size=128), BIG)
    assert budget.max() <= 4096
    assert budget.max(0).sum() <= ref.max(0).sum()
    assert (budget.max(0) / budget.mean(0)).mean() <= 1.05


@pytest.mark.parametrize("model,limit", [("sum", 3000.0), ("attention", 2_000_000.0)])
def test_other_cost_models_are_balanced_in_their_own_cost(model, limit):
    per_rank = rank_batches(BIG[:8000], 4, max_cost=limit, cost=model)
    c = costs(per_rank, BIG[:8000], model)
    assert c.max() <= limit
    assert np.median(c.max(0) / c.mean(0)) <= 1.05


def test_a_callable_cost_plans_like_the_builtin_it_computes():
    lengths = lognormal_lengths(3000, seed=5)
    ours = rank_batches(lengths, 2, max_cost=2000.0, cost=lambda ls: len(ls) * max(ls))
    assert ours == rank_batches(lengths, 2, max_cost=2000.0, cost="padded")


def test_with_dataloader():
    lengths = lognormal_lengths(300)
    data = torch.arange(300)
    b = LG(data, lengths, batch_size=10, num_replicas=2, rank=1)
    got = [t.tolist() for t in DataLoader(data, batch_sampler=b)]
    assert got == list(b) and len(got) == len(b)
    assert b.batch_cost(got[0]) == len(got[0]) * max(lengths[i] for i in got[0])


def test_lengths_from_a_callable():
    data = [torch.ones(n) for n in lognormal_lengths(200)]
    s = LG(data, len, batch_size=4)
    assert s.lengths.tolist() == [float(len(x)) for x in data]


@pytest.mark.parametrize("kw,match", [
    (dict(batch_size=8, bucket_size=0), "bucket_size must be an int >= 1"),
    (dict(batch_size=0), "batch_size must be an int >= 1"),
    (dict(), "batch_size or max_cost is required"),
    (dict(max_cost=0), "max_cost must be a finite number > 0"),
    (dict(max_cost=-5.0), "max_cost must be a finite number > 0"),
    (dict(max_cost=float("nan")), "max_cost must be a finite number > 0"),
    (dict(batch_size=8, cost="quadratic"), "cost must be one of 'sum', 'padded', 'attention'"),
    (dict(batch_size=8, cost=3), "cost must be one of"),
    (dict(batch_size=8, cost=lambda ls: float("nan")), "cost .*lambda.* cannot be used"),
    (dict(batch_size=8, cost=lambda ls: ls.max()), "cost .*lambda.* cannot be used"),
    (dict(max_cost=100.0, cost="attention"), "max_cost=100 cannot be honoured under cost "
                                            "'attention': sample 2"),
    (dict(batch_size=8, seed=1.5), "seed must be an int"),
])
def test_bad_arguments_name_the_argument(kw, match):
    with pytest.raises(ValueError, match=match):
        LG([1, 5, 20], [1, 5, 20], num_replicas=2, rank=0, **kw)


@pytest.mark.parametrize("lengths,match", [
    ([1.0, float("nan"), 3.0], "lengths must give finite numbers; sample 1"),
    ([1.0, float("inf"), 3.0], "lengths must give finite numbers"),
    ([1.0, -2.0, 3.0], "lengths must be >= 0; sample 1"),
    ([1.0, 2.0], "lengths must be 1-D with one number per sample"),
])
def test_bad_lengths_name_the_argument(lengths, match):
    with pytest.raises(ValueError, match=match):
        LG([0, 1, 2], lengths, batch_size=2)
