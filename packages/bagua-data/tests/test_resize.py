"""Resuming an epoch at another world size (an elastic restart): every rank's sampler is
simulated here (they communicate nothing), and the job's consumed and remaining samples are
checked against the epoch's own sample set: no sample lost, none repeated, still balanced."""

import itertools
import json
from collections import Counter

import pytest
import torch
from _reference import lognormal_lengths, step_imbalance, torch_orders

from bagua_data import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler

N = 503            # not a multiple of 2 or 3: both worlds pad (or drop)
LENGTHS = lognormal_lengths(N, seed=11)


def make(world, rank, **kw):
    return LoadBalancingDistributedSampler(LENGTHS, LENGTHS, world, rank, **kw)


def budget_fn(indices, budget=900):
    batches, batch, total = [], [], 0
    for i in indices:
        if batch and total + LENGTHS[i] > budget:
            batches.append(batch)
            batch, total = [], 0
        batch.append(i)
        total += LENGTHS[i]
    return batches + [batch] if batch else batches


def epoch_set(world, epoch, **kw):
    """The samples the uninterrupted epoch would use (all of them unless drop_last)."""
    out = set()
    for r in range(world):
        s = make(world, r, **kw)
        s.set_epoch(epoch)
        out.update(s)
    return out


def run_ranks(world, k, epoch, state=None, **kw):
    """Every rank of a world: load ``state`` (if any), take ``k`` samples (None: the rest).
    Returns what each rank took, and every rank's state_dict afterwards."""
    taken, states = [], []
    for r in range(world):
        s = make(world, r, **kw)
        s.set_epoch(epoch)
        if state is not None:
            s.load_state_dict(json.loads(json.dumps(state)))
            s.set_epoch(epoch)          # the usual loop: keeps the position
        it = iter(s)
        taken.append(list(it) if k is None else [next(it) for _ in range(k)])
        states.append(s.state_dict())
    assert all(st == states[0] for st in states), "state_dict() differs between ranks"
    return taken, states[0]


KWS = [dict(), dict(random_level=0.3), dict(shuffle=False), dict(drop_last=True)]


@pytest.mark.parametrize("kw", KWS, ids=["default", "random_level", "no-shuffle", "drop_last"])
@pytest.mark.parametrize(("old", "new", "k"), [(2, 3, 100), (3, 2, 70), (2, 3, 0),
                                               (3, 2, 167)])
def test_sampler_resumes_at_another_world_size(old, new, k, kw):
    epoch = 3
    head, state = run_ranks(old, k, epoch, **kw)
    assert state["consumed"] == old * k and state["num_replicas"] == old
    rest, end = run_ranks(new, None, epoch, state, **kw)
    assert end["consumed"] == old * k + new * len(rest[0])
    consumed = {i for h in head for i in h}
    remaining = Counter(i for r in rest for i in r)
    assert len({len(r) for r in rest}) == 1, "ranks got different lengths"
    assert not consumed & remaining.keys(), "a consumed sample came again"
    unseen = epoch_set(old, epoch, **kw) - consumed
    repeats = sum(remaining.values()) - len(remaining)
    if kw.get("drop_last"):
        assert repeats == 0 and remaining.keys() <= unseen
        assert len(unseen - remaining.keys()) < new, "drop_last dropped more than the tail"
    else:
        assert remaining.keys() == unseen, "a sample of the epoch was lost"
        assert repeats < new, "more padding than the new world needs"


def test_rebalanced_rows_are_windows_of_the_sorted_order():
    _, state = run_ranks(2, 90, 0)
    rest, _ = run_ranks(3, None, 0, state)
    lt = torch.tensor(LENGTHS)
    rows = sorted((lt[list(row)].min().item(), lt[list(row)].max().item())
                  for row in zip(*rest))
    for (_, hi), (lo, _) in itertools.pairwise(rows):
        assert hi <= lo, "a step's samples are not neighbours in complexity"
    # and the per-step imbalance stays far below DistributedSampler's on the same world
    ours = step_imbalance(rest, LENGTHS, 8)
    theirs = step_imbalance(torch_orders(N, 3), LENGTHS, 8)
    assert ours < 1.05 < 1.2 < theirs, (ours, theirs)


def test_same_world_resume_after_a_resize_is_exact():
    # 2 ranks, then 3 (resized), checkpoint at 3, restart at 3: identical to not restarting
    _, s2 = run_ranks(2, 60, 1)
    head3, s3 = run_ranks(3, 25, 1, s2)
    tail3, _ = run_ranks(3, None, 1, s3)
    whole3, _ = run_ranks(3, None, 1, s2)
    assert [h + t for h, t in zip(head3, tail3)] == whole3


def test_chained_resizes_keep_every_sample_once():
    consumed = []
    state = None
    for world, k in ((2, 40), (3, 30), (2, 20), (3, None)):
        taken, state = run_ranks(world, k, 5, state)
        consumed += [i for t in taken for i in t]
    counts = Counter(consumed)
    assert counts.keys() == set(range(N))
    # padding: at most one pad per world change (each < world), plus the first world's own
    assert sum(counts.values()) - N <= 1 + 2 + 1 + 2


def test_later_epochs_are_whole_at_the_new_world():
    _, state = run_ranks(2, 50, 0)
    s = make(3, 1)
    s.load_state_dict(state)
    s.set_epoch(1)
    fresh = make(3, 1)
    fresh.set_epoch(1)
    assert list(s) == list(fresh) and len(s) == len(fresh)


def test_world_mismatch_of_other_settings_raises():
    _, state = run_ranks(2, 10, 0)
    with pytest.raises(ValueError, match="seed"):
        make(3, 0, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="dataset_len"):
        LoadBalancingDistributedSampler(LENGTHS[:-1], LENGTHS[:-1], 3, 0).load_state_dict(state)
    with pytest.raises(ValueError, match="history"):
        make(3, 0).load_state_dict({**state, "history": [[2, 10], [0, 1]]})
    with pytest.raises(ValueError, match="consumed"):
        make(3, 0).load_state_dict({**state, "consumed": 3})


def run_batches(world, k, epoch, state=None, drop_last=False):
    taken, states = [], []
    for r in range(world):
        b = LoadBalancingDistributedBatchSampler(make(world, r), budget_fn, drop_last=drop_last)
        b.set_epoch(epoch)
        if state is not None:
            b.load_state_dict(json.loads(json.dumps(state)))
        it = iter(b)
        taken.append(list(it) if k is None else [next(it) for _ in range(k)])
        states.append(b.state_dict())
    assert all(st == states[0] for st in states), "state_dict() differs between ranks"
    return taken, states[0]


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(("old", "new", "k"), [(2, 3, 12), (3, 2, 9)])
def test_batch_sampler_resumes_at_another_world_size(old, new, k, drop_last):
    head, state = run_batches(old, k, 2, drop_last=drop_last)
    assert state["consumed"] == old * k
    rest, _ = run_batches(new, None, 2, state, drop_last=drop_last)
    assert len({len(r) for r in rest}) == 1, "ranks got different batch counts"
    consumed = {i for h in head for b in h for i in b}
    flat_rest = [i for r in rest for b in r for i in b]
    assert not consumed & set(flat_rest), "a consumed sample came again"
    # repeats in the remaining plan come only from padding: batches a rank repeats to reach
    # the common count, and fewer than `new` padded samples
    repeated = sum(len(b) for r in rest for j, b in enumerate(r) if b in r[:j])
    assert len(flat_rest) - len(set(flat_rest)) <= repeated + new - 1
    if not drop_last:
        assert consumed | set(flat_rest) == set(range(N)), "a sample of the epoch was lost"
    # same-size resume of the resized epoch is exact
    mid, s2 = run_batches(new, 3, 2, state, drop_last=drop_last)
    tail, _ = run_batches(new, None, 2, s2, drop_last=drop_last)
    assert [m + t for m, t in zip(mid, tail)] == rest


@pytest.mark.parametrize("n, extra", [(1, 0), (7, 3), (100, 40), (4096, 1500)])
def test_unseen_of_is_the_python_reference(n, extra):
    """The tensor re-deal's pool (one scatter over the index space, no sort) is
    ``_resume.unseen``'s: the unconsumed indices, each once, in first-seen order."""
    from bagua_data._resume import unseen, unseen_of

    g = torch.Generator().manual_seed(n)
    for _ in range(3):
        rest = torch.randint(0, n, (n + extra,), generator=g)
        consumed = torch.rand(n, generator=g) < 0.3
        expected = unseen(set(torch.nonzero(consumed).view(-1).tolist()), rest.tolist())
        assert unseen_of(consumed, rest).tolist() == expected
    assert unseen_of(torch.zeros(n, dtype=torch.bool), rest[:0]).tolist() == []


@pytest.mark.parametrize("shuffle, drop_last, level", [(True, False, 0.0), (True, True, 0.3),
                                                       (False, False, 0.0)])
def test_a_resized_sampler_plans_only_the_last_change(shuffle, drop_last, level):
    """``resized`` hands the current plan to the sampler of the new world: its
    ``load_state_dict`` plans only the last change, and every table of a chain of world
    sizes 3 -> 2 -> 5 -> 1 -> 4 is the one a fresh sampler replaying the epoch computes."""
    n = 203
    data = list(range(n))
    complexity = [float((i * 37) % 11) for i in range(n)]
    kw = {"shuffle": shuffle, "drop_last": drop_last, "random_level": level, "seed": 9}
    s = LoadBalancingDistributedSampler(data, complexity, num_replicas=3, rank=0, **kw)
    s.set_epoch(2)
    s.epoch_chunks()                          # the plan the job ran (iterating computes it)
    real = LoadBalancingDistributedSampler._base_chunks
    replays = []

    def counted(*a):
        replays.append(a)
        return real(*a)
    for new_world, used in ((2, 7), (5, 11), (1, 9), (4, 13)):
        state = s.state_dict(consumed=used)
        s = s.resized(new_world, new_world - 1)
        try:
            LoadBalancingDistributedSampler._base_chunks = counted
            s.load_state_dict(state)
        finally:
            LoadBalancingDistributedSampler._base_chunks = real
        assert replays == []                  # nothing replayed from the epoch's start
        fresh = LoadBalancingDistributedSampler(data, complexity, num_replicas=new_world,
                                                rank=new_world - 1, **kw)
        fresh.load_state_dict(state)
        assert torch.equal(s.epoch_chunks(), fresh.epoch_chunks())
        assert list(s) == list(fresh)
