"""DistributedSampler's contract, case by case, against torch's own DistributedSampler."""

from collections import Counter

import pytest
import torch
from _reference import flat, lognormal_lengths, our_orders, torch_orders
from torch.utils.data import DataLoader, DistributedSampler

from bagua_data import LoadBalancingDistributedSampler

# (dataset size, ranks): divisible, padded by less than the dataset, padded by more than it
# (n < world), a single rank, an empty dataset.
CASES = [(24, 4), (103, 4), (10, 3), (3, 8), (1, 5), (17, 1), (0, 2), (1000, 7)]


@pytest.mark.parametrize("n,world", CASES)
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [True, False])
def test_lengths_match_distributed_sampler(n, world, drop_last, shuffle):
    lengths = lognormal_lengths(n)
    for r in range(world):
        ours = LoadBalancingDistributedSampler(lengths, lengths, world, r, shuffle=shuffle,
                                               drop_last=drop_last)
        ref = DistributedSampler(range(n), world, r, shuffle=shuffle, drop_last=drop_last)
        assert len(ours) == len(ref)
        assert (ours.num_samples, ours.total_size) == (ref.num_samples, ref.total_size)
        assert len(list(ours)) == len(ours)


@pytest.mark.parametrize("n,world", CASES)
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("epoch", [0, 3])
def test_epoch_takes_the_same_samples_as_distributed_sampler(n, world, drop_last, shuffle,
                                                             epoch):
    # Same seed and epoch: the same multiset of indices over all ranks (which samples pad,
    # which are dropped), only dealt out differently.
    lengths = lognormal_lengths(n, seed=epoch)
    ours = our_orders(lengths, world, epoch, shuffle=shuffle, drop_last=drop_last, seed=11)
    ref = torch_orders(n, world, epoch, shuffle=shuffle, drop_last=drop_last, seed=11)
    assert Counter(i for o in ours for i in o) == Counter(i for o in ref for i in o)


@pytest.mark.parametrize("n,world", [(103, 4), (10, 3), (3, 8), (1, 5)])
def test_padding_covers_every_sample_and_repeats_only_the_shortfall(n, world):
    counts = Counter(i for o in our_orders(lognormal_lengths(n), world) for i in o)
    assert set(counts) == set(range(n))
    total = -(-n // world) * world
    assert sum(counts.values()) == total
    assert max(counts.values()) == -(-total // n)


@pytest.mark.parametrize("n,world", [(103, 4), (10, 3), (24, 4), (3, 8)])
def test_drop_last_gives_disjoint_ranks_without_repeats(n, world):
    orders = our_orders(lognormal_lengths(n), world, drop_last=True)
    flat = [i for o in orders for i in o]
    assert len(flat) == len(set(flat)) == n // world * world
    assert all(len(o) == n // world for o in orders)


def test_ranks_are_disjoint_when_divisible():
    orders = our_orders(lognormal_lengths(96), 4)
    assert sorted(i for o in orders for i in o) == list(range(96))


def test_set_epoch_changes_the_order_and_each_epoch_is_reproducible():
    lengths = lognormal_lengths(200)
    e0, e1 = our_orders(lengths, 2, epoch=0), our_orders(lengths, 2, epoch=1)
    assert e0 != e1
    assert flat(e0) == flat(e1)
    assert our_orders(lengths, 2, epoch=1) == e1
    s = LoadBalancingDistributedSampler(lengths, lengths, 2, 0)
    assert list(s) == list(s) == e0[0]  # no set_epoch: the same order again, like torch


def test_seed_changes_the_order():
    lengths = lognormal_lengths(200)
    assert our_orders(lengths, 2, seed=0) != our_orders(lengths, 2, seed=1)


def test_no_shuffle_is_ascending_complexity_and_ignores_epoch():
    lengths = lognormal_lengths(101)
    orders = our_orders(lengths, 3, shuffle=False)
    assert orders == our_orders(lengths, 3, epoch=5, shuffle=False)
    rows = list(zip(*orders))
    keys = [lengths[i] for row in rows for i in row]  # padding (sample 0) is sorted in too
    assert keys == sorted(keys)
    assert max(rows[-1], key=lambda i: lengths[i]) == max(range(101), key=lambda i: lengths[i])


def test_works_as_a_dataloader_sampler():
    data = torch.arange(50)
    lengths = lognormal_lengths(50)
    seen = []
    for r in range(2):
        s = LoadBalancingDistributedSampler(data, lengths, 2, r)
        loader = DataLoader(data, batch_size=8, sampler=s)
        assert len(loader) == 4
        seen += torch.cat(list(loader)).tolist()
    assert sorted(seen) == list(range(50))


@pytest.mark.parametrize("kw,match", [
    ({"num_replicas": 0}, "num_replicas"),
    ({"num_replicas": 2, "rank": 2}, "rank"),
    ({"num_replicas": 2, "rank": -1}, "rank"),
    ({"num_replicas": 2.0}, "num_replicas"),
    ({"random_level": 1.5}, "random_level"),
    ({"random_level": -0.1}, "random_level"),
    ({"seed": 1.5}, "seed"),
])
def test_bad_arguments_raise_value_error(kw, match):
    with pytest.raises(ValueError, match=match):
        LoadBalancingDistributedSampler([1, 2, 3], [1, 2, 3], **kw)
