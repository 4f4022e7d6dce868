"""Every group bagua_comm creates honours init_process_group's ``timeout``.

Rank 1 stops answering (it waits on the store, outside any collective) while rank 0 uses a
group; rank 0 must raise after about the timeout, not torch's 30-minute default.
"""

import time

import pytest
import torch
import torch.distributed as dist

import bagua_comm as bc
from bagua_comm.testing import run_ranks

TIMEOUT = 3.0   # seconds, given to init_process_group
MARGIN = 12.0   # scheduling slack on a loaded 2-core machine


def _idle_until_released(store):
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not store.check(["released"]):
        time.sleep(0.05)


def _stalled_peer(case):
    r = bc.get_rank()
    store = dist.distributed_c10d._get_default_store()
    g = bc.get_default_group()
    x = torch.ones(64)
    if case == "intra_node":
        group = g.intra_node_group()
    elif case == "inter_node":
        group = g.inter_node_group()
    else:
        group = g
    bc.allreduce_inplace(x, group=group)  # the group works while both ranks answer
    bc.barrier()
    if r == 1:
        _idle_until_released(store)
        return None
    start = time.monotonic()
    try:
        if case == "new_group":
            bc.new_group()
        elif case == "compressed_allreduce":
            bc.compressed_allreduce(x, x)
        else:
            bc.allreduce_inplace(x, group=group)
        error = None
    except Exception as err:  # any error is the expected outcome
        error = f"{type(err).__name__}: {err}"
    elapsed = time.monotonic() - start
    store.set("released", "1")
    return elapsed, error


@pytest.mark.parametrize("case, local_world_size", [
    ("new_group", 2),
    ("intra_node", 2),             # 2 ranks on one node: the intra-node group is both
    ("inter_node", 1),             # 2 nodes of one rank: the inter-node group is both
    ("compressed_allreduce", 2),   # its auxiliary group
])
def test_a_stalled_peer_fails_the_group_after_the_timeout(case, local_world_size):
    elapsed, error = run_ranks(_stalled_peer, 2, args=(case,), timeout=90,
                               local_world_size=local_world_size, pg_timeout=TIMEOUT)[0]
    assert error is not None, f"{case} completed although the peer never joined"
    assert elapsed < TIMEOUT + MARGIN, f"{case} raised only after {elapsed:.1f}s: {error}"
    assert elapsed > TIMEOUT * 0.5, f"{case} failed at once ({elapsed:.1f}s): {error}"
