"""num_replicas/rank come from torch.distributed when initialised, else 1 and 0."""

import json
import os
from datetime import timedelta

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from _reference import lognormal_lengths, our_orders

from bagua_data import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler

LENGTHS = lognormal_lengths(301, seed=2)


def test_without_process_group_one_rank_takes_everything():
    assert not dist.is_initialized()
    s = LoadBalancingDistributedSampler(LENGTHS, LENGTHS)
    assert (s.num_replicas, s.rank) == (1, 0)
    assert sorted(s) == list(range(301))
    with pytest.raises(ValueError, match="rank"):
        LoadBalancingDistributedSampler(LENGTHS, LENGTHS, rank=1)  # world is 1 here


def _uneven_batches(indices):
    """Batches of 1 to 7 samples, so that the ranks' own counts differ."""
    out, i = [], 0
    while i < len(indices):
        k = 1 + indices[i] % 7
        out.append(indices[i:i + k])
        i += k
    return out


def _rank_main(rank: int, world: int, tmp: str) -> None:
    store = dist.FileStore(os.path.join(tmp, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        s = LoadBalancingDistributedSampler(LENGTHS, LENGTHS, seed=3)
        s.set_epoch(1)
        b = LoadBalancingDistributedBatchSampler(s, _uneven_batches)
        counts = [None] * world
        dist.all_gather_object(counts, len(b))
        out = {"world": s.num_replicas, "rank": s.rank, "order": list(s), "counts": counts,
               "batches": len(list(b))}
        with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_two_ranks_take_world_and_rank_from_torch_distributed(tmp_path):
    mp.spawn(_rank_main, args=(2, str(tmp_path)), nprocs=2, join=True)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    expected = our_orders(LENGTHS, 2, epoch=1, seed=3)
    for r, g in enumerate(got):
        assert (g["world"], g["rank"]) == (2, r)
        # what explicit num_replicas/rank give here: also determinism across processes
        assert g["order"] == expected[r]
        assert g["counts"][0] == g["counts"][1] == g["batches"]
    own = [len(_uneven_batches(o)) for o in expected]
    assert got[0]["batches"] == max(own)
