"""LoadBalancingDistributedBatchSampler: variable-size batches, equal counts on all ranks."""

from collections import Counter

import pytest
import torch
from _reference import lognormal_lengths
from torch.utils.data import DataLoader

from bagua_data import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler


def token_budget(lengths, budget):
    def batch_fn(indices):
        batches, batch, total = [], [], 0
        for i in indices:
            if batch and total + lengths[i] > budget:
                batches.append(batch)
                batch, total = [], 0
            batch.append(i)
            total += lengths[i]
        return batches + [batch] if batch else batches
    return batch_fn


def rank_batches(lengths, world, batch_fn, epoch=0, drop_last=False, **kw):
    out = []
    for r in range(world):
        s = LoadBalancingDistributedSampler(lengths, lengths, world, r, **kw)
        b = LoadBalancingDistributedBatchSampler(s, batch_fn, drop_last=drop_last)
        b.set_epoch(epoch)
        out.append(list(b))
        assert len(b) == len(out[-1])
    return out


def unpadded_counts(lengths, world, batch_fn, epoch=0):
    """Each rank's own batch count: batch_fn on that rank's sampler order."""
    counts = []
    for r in range(world):
        s = LoadBalancingDistributedSampler(lengths, lengths, world, r)
        s.set_epoch(epoch)
        counts.append(len(batch_fn(list(s))))
    return counts


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("epoch", [0, 1])
def test_every_rank_gets_the_same_number_of_batches(world, epoch):
    lengths = lognormal_lengths(3001, seed=world)
    fn = token_budget(lengths, 2000)
    counts = unpadded_counts(lengths, world, fn, epoch)
    padded = rank_batches(lengths, world, fn, epoch)
    dropped = rank_batches(lengths, world, fn, epoch, drop_last=True)
    assert {len(b) for b in padded} == {max(counts)}
    assert {len(b) for b in dropped} == {min(counts)}


def test_batches_follow_the_sampler_order_and_cover_it():
    lengths = lognormal_lengths(2000)
    fn = token_budget(lengths, 1500)
    for r, batches in enumerate(rank_batches(lengths, 2, fn, epoch=3)):
        s = LoadBalancingDistributedSampler(lengths, lengths, 2, r)
        s.set_epoch(3)
        order = list(s)
        own = fn(order)
        assert batches[:len(own)] == own
        assert batches[len(own):] == own[:len(batches) - len(own)]  # padding repeats own
        assert all(sum(lengths[i] for i in b) <= 1500 or len(b) == 1 for b in batches)


def test_padding_repeats_batches_cyclically_and_drop_truncates():
    # batch_fn giving rank 0 one batch and rank 1 three: rank 0 repeats its only batch.
    lengths = list(range(1, 9))  # shuffle=False: rank 0 gets 1,3,5,7; rank 1 gets 2,4,6,8

    def fn(indices):
        return [indices] if 0 in indices else [[i] for i in indices[:3]]

    padded = rank_batches(lengths, 2, fn, shuffle=False)
    assert padded[0] == [[0, 2, 4, 6]] * 3
    assert padded[1] == [[1], [3], [5]]
    dropped = rank_batches(lengths, 2, fn, shuffle=False, drop_last=True)
    assert dropped == [[[0, 2, 4, 6]], [[1]]]


def test_token_budget_steps_are_balanced():
    lengths = lognormal_lengths(20_000, seed=9)
    lt = torch.tensor(lengths, dtype=torch.float64)
    per_rank = rank_batches(lengths, 4, token_budget(lengths, 4096), epoch=1)
    cost = torch.tensor([[float(lt[b].sum()) for b in batches] for batches in per_rank])
    # every rank's i-th batch carries near the same number of tokens
    assert float((cost.max(0).values / cost.mean(0)).median()) <= 1.05


def test_with_dataloader_and_set_epoch_on_either_sampler():
    lengths = lognormal_lengths(300)
    data = torch.arange(300)
    s = LoadBalancingDistributedSampler(data, lengths, 2, 1)
    b = LoadBalancingDistributedBatchSampler(s, token_budget(lengths, 900))
    loader = DataLoader(data, batch_sampler=b)
    first = [t.tolist() for t in loader]
    assert first == list(b) and len(loader) == len(b)
    s.set_epoch(1)  # the wrapped sampler's epoch drives the batches
    second = [t.tolist() for t in loader]
    b.set_epoch(1)
    assert second == list(b) != first
    assert b.epoch == s.epoch == 1


def test_sampler_padding_and_drop_last_are_honoured():
    lengths = lognormal_lengths(101)
    batches = rank_batches(lengths, 2, lambda ix: [ix[i:i + 10] for i in range(0, len(ix), 10)])
    flat = Counter(i for r in batches for b in r for i in b)
    assert set(flat) == set(range(101)) and sum(flat.values()) == 102  # padded by one
    s = LoadBalancingDistributedSampler(lengths, lengths, 2, 0, drop_last=True)
    b = LoadBalancingDistributedBatchSampler(s, lambda ix: [ix])
    assert sum(len(x) for x in b) == 50


def test_bad_arguments():
    s = LoadBalancingDistributedSampler([1, 2], [1, 2], 1, 0)
    with pytest.raises(ValueError, match="sampler must be a LoadBalancingDistributedSampler"):
        LoadBalancingDistributedBatchSampler(range(3), lambda ix: [ix])
    with pytest.raises(ValueError, match="batch_fn must be callable"):
        LoadBalancingDistributedBatchSampler(s, [[0, 1]])
    with pytest.raises(ValueError, match="empty batch"):
        list(LoadBalancingDistributedBatchSampler(s, lambda ix: [ix, []]))
    # a batch_fn returning something else than batches (was: TypeError 'int' object is not
    # iterable), or indices it was not given (another rank's samples: overlapping data)
    with pytest.raises(ValueError, match=r"must return a list of batches.*returned int 5"):
        list(LoadBalancingDistributedBatchSampler(s, lambda ix: 5))
    with pytest.raises(ValueError, match=r"index 10\d\d in batch 0 .* not one of the indices"):
        list(LoadBalancingDistributedBatchSampler(s, lambda ix: [[i + 1000] for i in ix]))


def test_rank_without_batches_raises_on_every_rank():
    lengths = [1, 2, 3]

    def fn(indices):  # sorted, padded: rank 0 gets [0, 1], rank 1 [0, 2] and no batch
        return [indices] if 1 in indices else []

    for r in range(2):
        s = LoadBalancingDistributedSampler(lengths, lengths, 2, r, shuffle=False)
        with pytest.raises(RuntimeError, match="no batch for rank 1"):
            len(LoadBalancingDistributedBatchSampler(s, fn))
        assert len(LoadBalancingDistributedBatchSampler(s, fn, drop_last=True)) == 0
