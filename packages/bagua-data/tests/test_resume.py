"""Mid-epoch resumption: a restarted job continues from the next unseen sample or batch."""

import json

import pytest
import torch
from _reference import lognormal_lengths
from torch.utils.data import DataLoader

from bagua_data import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler

LENGTHS = lognormal_lengths(500, seed=7)


def sampler(rank=0, world=2, **kw):
    return LoadBalancingDistributedSampler(LENGTHS, LENGTHS, world, rank, **kw)


def budget_fn(indices, budget=1200):
    batches, batch, total = [], [], 0
    for i in indices:
        if batch and total + LENGTHS[i] > budget:
            batches.append(batch)
            batch, total = [], 0
        batch.append(i)
        total += LENGTHS[i]
    return batches + [batch] if batch else batches


def full_epoch(epoch, rank=0, **kw):
    s = sampler(rank, **kw)
    s.set_epoch(epoch)
    return list(s)


@pytest.mark.parametrize("k", [0, 1, 137, 249, 250])
@pytest.mark.parametrize("call_set_epoch", [True, False])
def test_sampler_resumes_at_the_next_sample(k, call_set_epoch):
    s = sampler(random_level=0.3)
    s.set_epoch(4)
    it = iter(s)
    seen = [next(it) for _ in range(k)]
    state = json.loads(json.dumps(s.state_dict()))  # plain data: goes into any checkpoint
    assert state["epoch"] == 4 and state["consumed"] == 2 * k  # the job: both ranks

    restarted = sampler(random_level=0.3)
    restarted.load_state_dict(state)
    if call_set_epoch:  # the usual loop calls set_epoch(epoch) again: the position stays
        restarted.set_epoch(4)
    rest = list(restarted)
    assert seen + rest == full_epoch(4, random_level=0.3)
    restarted.set_epoch(5)  # later epochs start from their beginning
    assert list(restarted) == full_epoch(5, random_level=0.3)
    restarted.set_epoch(4)  # and so does a repeat of the resumed epoch
    assert list(restarted) == full_epoch(4, random_level=0.3)


def test_every_rank_resumes_its_own_stream():
    for rank in range(2):
        s = sampler(rank)
        it = iter(s)
        head = [next(it) for _ in range(100)]
        r = sampler(rank)
        r.load_state_dict(s.state_dict())
        assert head + list(r) == full_epoch(0, rank)


def test_position_follows_the_epoch():
    s = sampler()
    list(s)
    assert s.state_dict()["consumed"] == 2 * len(s)
    s.set_epoch(1)
    assert s.state_dict() == {**s.state_dict(), "epoch": 1, "consumed": 0}
    r = sampler()
    s.set_epoch(0)
    list(s)
    r.load_state_dict(s.state_dict())
    assert list(r) == []  # a finished epoch resumes to nothing; the next one is whole
    r.set_epoch(1)
    assert list(r) == full_epoch(1)


def test_dataloader_with_workers_resumes_from_the_consumed_count():
    # Worker processes prefetch ahead of the loop, so the loop says how far it got.
    data = torch.arange(500)
    s = LoadBalancingDistributedSampler(data, LENGTHS, 2, 1)
    loader = DataLoader(data, batch_size=10, sampler=s, num_workers=2, prefetch_factor=2,
                        multiprocessing_context="fork")
    it = iter(loader)
    head = [next(it).tolist() for _ in range(3)]
    assert s.state_dict()["consumed"] > 30  # the sampler has handed out more than was used
    state = s.state_dict(consumed=30)
    del it
    r = LoadBalancingDistributedSampler(data, LENGTHS, 2, 1)
    r.load_state_dict(state)
    tail = [b.tolist() for b in DataLoader(data, batch_size=10, sampler=r)]
    assert head + tail == [b.tolist() for b in DataLoader(data, batch_size=10,
                                                          sampler=sampler(1))]


@pytest.mark.parametrize("k", [0, 5, None])
def test_batch_sampler_resumes_at_the_next_batch(k):
    data = torch.arange(500)
    b = LoadBalancingDistributedBatchSampler(sampler(1), budget_fn)
    b.set_epoch(2)
    expected = list(b)
    k = len(expected) if k is None else k
    it = iter(DataLoader(data, batch_sampler=b))
    head = [next(it).tolist() for _ in range(k)]
    state = b.state_dict()
    assert state["consumed"] == 2 * k and state["num_batches"] == len(expected)

    r = LoadBalancingDistributedBatchSampler(sampler(1), budget_fn)
    r.load_state_dict(json.loads(json.dumps(state)))
    r.set_epoch(2)
    tail = [t.tolist() for t in DataLoader(data, batch_sampler=r)]
    assert head + tail == expected
    assert r.state_dict()["consumed"] == 2 * len(expected)
    r.set_epoch(3)
    assert r.state_dict()["consumed"] == 0


def test_batch_sampler_consumed_override():
    b = LoadBalancingDistributedBatchSampler(sampler(), budget_fn)
    state = b.state_dict(consumed=4)
    r = LoadBalancingDistributedBatchSampler(sampler(), budget_fn)
    r.load_state_dict(state)
    assert list(r) == list(b)[4:]


@pytest.mark.parametrize("change,match", [
    ({"seed": 1}, "seed"),
    ({"shuffle": False}, "shuffle"),
    ({"drop_last": True}, "drop_last"),
    ({"random_level": 0.5}, "random_level"),
])
def test_resume_into_different_settings_raises(change, match):
    state = sampler().state_dict()
    with pytest.raises(ValueError, match=match):
        sampler(**change).load_state_dict(state)
    bstate = LoadBalancingDistributedBatchSampler(sampler(), budget_fn).state_dict()
    with pytest.raises(ValueError, match=match):
        LoadBalancingDistributedBatchSampler(sampler(**change), budget_fn).load_state_dict(bstate)


def test_bad_state_raises():
    s = sampler()
    good = s.state_dict()
    with pytest.raises(ValueError, match="missing"):
        s.load_state_dict({"epoch": 0})
    with pytest.raises(ValueError, match="consumed"):
        s.load_state_dict({**good, "consumed": len(s) + 1})
    with pytest.raises(ValueError, match="version"):
        s.load_state_dict({**good, "version": 99})
    with pytest.raises(ValueError, match="consumed"):
        s.state_dict(consumed=-1)
    b = LoadBalancingDistributedBatchSampler(sampler(), budget_fn)
    with pytest.raises(ValueError, match="num_batches"):
        b.load_state_dict(good)  # a sampler's state, not a batch sampler's
    with pytest.raises(ValueError, match="batches"):
        LoadBalancingDistributedBatchSampler(sampler(), lambda ix: [ix]).load_state_dict(
            b.state_dict())
