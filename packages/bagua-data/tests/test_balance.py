"""Balancing: ranks' i-th samples cost alike; complexities from a callable or a column."""

import numpy as np
import pytest
import torch
from _reference import flat, lognormal_lengths, our_orders, step_imbalance, torch_orders

from bagua_data import LoadBalancingDistributedSampler


@pytest.mark.parametrize("world,batch", [(2, 32), (8, 32), (4, 8)])
def test_per_step_imbalance_beats_distributed_sampler(world, batch):
    lengths = lognormal_lengths(20_000, seed=world)
    ours = step_imbalance(our_orders(lengths, world, epoch=1), lengths, batch)
    ref = step_imbalance(torch_orders(len(lengths), world, epoch=1), lengths, batch)
    assert ours <= 1.02
    assert ref >= 1.08  # DistributedSampler's random split is visibly unbalanced
    assert ours < ref


def test_each_step_is_a_window_of_the_sorted_order():
    # Rank r takes element r of each chunk of num_replicas neighbours in sorted order: the
    # steps, put back in order, rebuild the sorted complexities exactly.
    lengths = lognormal_lengths(4000, seed=3)
    orders = our_orders(lengths, 4, epoch=2)
    steps = [tuple(lengths[i] for i in step) for step in zip(*orders)]
    assert all(list(step) == sorted(step) for step in steps)
    assert [v for step in sorted(steps) for v in step] == sorted(lengths)


def test_chunk_order_is_shuffled_not_sorted():
    lengths = lognormal_lengths(1000)
    order = our_orders(lengths, 2, epoch=0)[0]
    keys = [lengths[i] for i in order]
    assert keys != sorted(keys)
    # Early and late steps draw from the whole range, like a shuffled epoch.
    assert np.mean(keys[:250]) == pytest.approx(np.mean(keys[-250:]), rel=0.35)


def test_random_level_trades_balance_for_randomness():
    lengths = lognormal_lengths(20_000, seed=5)
    levels = [step_imbalance(our_orders(lengths, 4, random_level=lv), lengths, 16)
              for lv in (0.0, 0.01, 1.0)]
    ref = step_imbalance(torch_orders(len(lengths), 4), lengths, 16)
    assert levels[0] < levels[1] < levels[2]
    assert levels[2] < ref * 1.05  # full noise is no worse than a random split
    # Noise does not change which samples are taken.
    assert flat(our_orders(lengths, 4, random_level=1.0)) == flat(our_orders(lengths, 4))


def test_complexity_fn_called_once_per_sample():
    calls = []
    data = [torch.zeros(n) for n in lognormal_lengths(64)]

    def complexity(sample):
        calls.append(1)
        return sample.numel()

    s = LoadBalancingDistributedSampler(data, complexity, 2, 1)
    for epoch in range(3):
        s.set_epoch(epoch)
        list(s)
    assert len(calls) == 64


@pytest.mark.parametrize("as_column", [list, np.array, torch.tensor, tuple])
def test_precomputed_column_equals_callable(as_column):
    lengths = lognormal_lengths(77)
    data = [torch.zeros(n) for n in lengths]
    for r in range(3):
        a = LoadBalancingDistributedSampler(data, lambda x: x.numel(), 3, r, seed=2)
        b = LoadBalancingDistributedSampler(data, as_column(lengths), 3, r, seed=2)
        a.set_epoch(4)
        b.set_epoch(4)
        assert list(a) == list(b)
        assert torch.equal(b.complexities, torch.tensor(lengths, dtype=torch.float64))


def test_float_complexities_and_tensor_return_values():
    g = torch.Generator().manual_seed(0)
    data = list(torch.rand(50, generator=g))
    s = LoadBalancingDistributedSampler(data, lambda x: x * 10, 2, 0)  # 0-d tensors
    assert torch.allclose(s.complexities, torch.stack(data).double() * 10)


def test_column_is_copied():
    lengths = np.array(lognormal_lengths(40))
    s = LoadBalancingDistributedSampler(range(40), lengths, 2, 0)
    before = list(s)
    lengths[:] = 0
    assert list(s) == before


@pytest.mark.parametrize("column,match", [
    ([1, 2], "one number per sample"),
    ([[1, 2, 3]], "1-D"),
    ([1, float("nan"), 3], "finite"),
    (["a", "b", "c"], "sequence of numbers"),
    ("abc", "string"),
])
def test_bad_complexity_column_raises(column, match):
    with pytest.raises(ValueError, match=match):
        LoadBalancingDistributedSampler([0, 1, 2], column, 1, 0)


def test_bad_complexity_fn_result_names_the_sample():
    with pytest.raises(ValueError, match=r"complexity_fn\(dataset\[1\]\)"):
        LoadBalancingDistributedSampler([1, "x", 3], lambda s: s if s != "x" else None, 1, 0)


def test_dataset_without_len_raises():
    with pytest.raises(ValueError, match="dataset must have a length"):
        LoadBalancingDistributedSampler(iter([1, 2]), [1, 2], 1, 0)
