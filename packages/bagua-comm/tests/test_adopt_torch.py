"""torch.distributed.init_process_group first, then bagua_comm: it adopts torch's group."""

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import bagua_comm as bc
from bagua_comm.testing import run_ranks


def _adopt(store_path):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world, timeout=timedelta(seconds=17))
    # torch's own group exists; bagua_comm is not initialised until asked
    assert not bc.is_initialized()
    bc.init_process_group()
    from bagua_comm import process_group

    out = {"rank": bc.get_rank(), "world": bc.get_world_size(), "backend": bc.get_backend(),
           "timeout": process_group._state.timeout.total_seconds()}
    x = torch.full((6,), float(rank + 1))
    bc.allreduce_inplace(x, op=bc.ReduceOp.AVG)
    out["avg"] = x.tolist()
    y = torch.arange(8, dtype=torch.float32) * (rank + 1)
    bc.compressed_allreduce(y, y, op=bc.ReduceOp.SUM)
    out["compressed"] = y.tolist()
    sub = bc.new_group([0, 1])
    z = torch.tensor([rank], dtype=torch.int64)
    bc.allreduce_inplace(z, op=bc.ReduceOp.MAX, group=sub)
    out["sub"] = z.item()
    bc.destroy_process_group()
    out["torch_still_initialised"] = dist.is_initialized()  # bagua_comm did not own it
    dist.destroy_process_group()
    return out


def test_init_after_torch_adopts_its_default_group(tmp_path):
    res = run_ranks(_adopt, 2, args=(str(tmp_path / "store"),), init=False, timeout=90)
    for rank, out in enumerate(res):
        assert (out["rank"], out["world"], out["backend"]) == (rank, 2, "gloo")
        assert out["timeout"] == 17.0   # torch's timeout reaches bagua_comm's groups
        assert out["avg"] == [1.5] * 6
        ref = (torch.arange(8, dtype=torch.float32) * 3).tolist()
        assert max(abs(a - b) for a, b in zip(out["compressed"], ref)) < 21 * 2 / 255 + 1e-5
        assert out["sub"] == 1
        assert out["torch_still_initialised"]


def _adopt_with_timeout(store_path):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    bc.init_process_group(timeout=timedelta(seconds=3))   # the user's T, on top of torch's
    x = torch.ones(4)
    bc.allreduce_inplace(x)                               # works while both answer
    bc.barrier()
    if rank == 1:                                         # stop answering until released
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not store.check(["released"]):
            time.sleep(0.05)
        return None
    start = time.monotonic()
    try:
        bc.allreduce_inplace(x)
        error = None
    except Exception as err:  # any error is the expected outcome
        error = f"{type(err).__name__}: {err}"
    elapsed = time.monotonic() - start
    store.set("released", "1")
    return elapsed, error, x.tolist()


def test_the_timeout_given_on_top_of_torchs_group_bounds_the_default_group(tmp_path):
    elapsed, error, _ = run_ranks(_adopt_with_timeout, 2, args=(str(tmp_path / "store"),),
                                  init=False, timeout=90)[0]
    assert error is not None, "the allreduce completed although the peer never joined"
    assert 1.5 < elapsed < 3 + 12, f"raised after {elapsed:.1f}s (asked: 3 s): {error}"
