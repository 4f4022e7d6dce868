"""LengthGroupedDistributedBatchSampler: resuming mid-epoch (same and other world sizes, every
rank simulated, nothing communicated), and a real 2-rank gloo job taking its world from
torch.distributed."""

import json
import os
from collections import Counter
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _reference import lognormal_lengths

from bagua_data import LengthGroupedDistributedBatchSampler as LG

N = 1003
LENGTHS = [min(n, 600) for n in lognormal_lengths(N, seed=21)]
KINDS = [dict(batch_size=8), dict(max_cost=1200.0), dict(batch_size=8, drop_last=True)]


def run_world(world, k, epoch, state=None, **kw):
    """Every rank: load ``state`` (if any), take ``k`` batches (None: the rest).  Returns the
    batches each rank took and the (common) state afterwards."""
    taken, states = [], []
    for r in range(world):
        s = LG(LENGTHS, LENGTHS, num_replicas=world, rank=r, seed=7, **kw)
        s.set_epoch(epoch)
        if state is not None:
            s.load_state_dict(json.loads(json.dumps(state)))
            s.set_epoch(epoch)                     # the usual loop: keeps the position
        it = iter(s)
        taken.append(list(it) if k is None else [next(it) for _ in range(k)])
        states.append(s.state_dict())
    assert all(st == states[0] for st in states), "state_dict() differs between ranks"
    assert len({len(t) for t in taken}) == 1, "ranks took different numbers of batches"
    return taken, states[0]


def samples(taken):
    return Counter(i for batches in taken for b in batches for i in b)


@pytest.mark.parametrize("kw", KINDS)
def test_same_world_resume_is_exact(kw):
    full, _ = run_world(2, None, 1, **kw)
    head, state = run_world(2, 5, 1, **kw)
    tail, end = run_world(2, None, 1, state, **kw)
    assert [h + t for h, t in zip(head, tail)] == full
    assert end["history"] == [[2, len(full[0])]]


@pytest.mark.parametrize("kw", KINDS)
@pytest.mark.parametrize("worlds", [(2, 3), (3, 2), (2, 3, 1)])
def test_other_world_resume_takes_each_remaining_sample_once(kw, worlds):
    drop = kw.get("drop_last", False)
    whole = samples(run_world(worlds[0], None, 2, **kw)[0])
    state, got, stages = None, Counter(), []
    for j, world in enumerate(worlds):
        k = None if j == len(worlds) - 1 else 4 + j
        taken, state = run_world(world, k, 2, state, **kw)
        got += samples(taken)
        stages.append(samples(taken))
    assert state["history"][:-1] == [[w, 4 + j] for j, w in enumerate(worlds[:-1])]
    if drop:
        # never a repeat; only the last plan's incomplete step is left out
        assert max(got.values()) == 1 and set(got) <= set(range(N))
        assert N - len(got) < worlds[-1] * 8
    else:
        assert set(got) == set(range(N))
        # repeats only to give every rank a batch in a plan's last step
        assert sum(got.values()) - N < sum(worlds)
        assert sum(stages[0].values()) <= sum(whole.values())
    # the resumed plans are still length-grouped and within the limits
    last = run_world(worlds[-1], None, 2, None, **kw)[0]
    assert all(len(b) <= kw.get("batch_size", N) for r in last for b in r)


def test_resume_checks_the_settings():
    _, state = run_world(2, 3, 0, batch_size=8)
    with pytest.raises(ValueError, match="batch_size=8 but this"):
        LG(LENGTHS, LENGTHS, batch_size=9, num_replicas=2, rank=0, seed=7).load_state_dict(state)
    with pytest.raises(ValueError, match="cost='padded' but this"):
        LG(LENGTHS, LENGTHS, batch_size=8, cost="sum", num_replicas=2, rank=0,
           seed=7).load_state_dict(state)
    other = [n + 1 for n in LENGTHS]
    with pytest.raises(ValueError, match="lengths_total"):
        LG(other, other, batch_size=8, num_replicas=2, rank=0, seed=7).load_state_dict(state)
    with pytest.raises(ValueError, match="past the end"):
        bad = dict(state, history=[[2, 10_000]], consumed=20_000)
        LG(LENGTHS, LENGTHS, batch_size=8, num_replicas=2, rank=0, seed=7).load_state_dict(bad)


def _rank_main(rank: int, world: int, tmp: str) -> None:
    store = dist.FileStore(os.path.join(tmp, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        s = LG(LENGTHS, LENGTHS, max_cost=1500.0, seed=3)
        s.set_epoch(1)
        steps = 0
        for _ in s:                                   # one collective per batch: no hang
            t = torch.ones(1)
            dist.all_reduce(t)
            steps += 1
        out = {"world": s.num_replicas, "rank": s.rank, "batches": list(s), "steps": steps}
        with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_two_gloo_ranks_take_world_and_rank_from_torch_distributed(tmp_path):
    mp.spawn(_rank_main, args=(2, str(tmp_path)), nprocs=2, join=True)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, g in enumerate(got):
        s = LG(LENGTHS, LENGTHS, max_cost=1500.0, seed=3, num_replicas=2, rank=r)
        s.set_epoch(1)
        assert (g["world"], g["rank"]) == (2, r)
        assert g["batches"] == list(s) and g["steps"] == len(s)
