"""The rank-spawning helper: results in rank order, child tracebacks, kill on failure/timeout."""

import os
import time

import pytest
import torch

import bagua_comm as bc
from bagua_comm.testing import RankFailure, run_ranks


def _identity():
    return bc.get_rank(), bc.get_world_size(), bc.get_local_rank(), bc.get_node_rank(), os.getpid()


def _fail_on_rank_one():
    if bc.get_rank() == 1:
        raise ValueError("boom from rank one")
    time.sleep(60)  # rank 0 would wait forever; the helper must kill it


def _hang():
    time.sleep(600)


def _crash():
    if bc.get_rank() == 0:
        os._exit(3)
    time.sleep(60)


def _sum_ranks():
    t = torch.tensor([float(bc.get_rank() + 1)])
    bc.allreduce_inplace(t)
    return t.item()


def test_results_come_back_in_rank_order_from_distinct_processes():
    out = run_ranks(_identity, 4, local_world_size=2)
    assert [o[:4] for o in out] == [(0, 4, 0, 0), (1, 4, 1, 0), (2, 4, 0, 1), (3, 4, 1, 1)]
    assert len({o[4] for o in out} | {os.getpid()}) == 5


def test_ranks_really_communicate():
    assert run_ranks(_sum_ranks, 3) == [6.0, 6.0, 6.0]


def test_child_traceback_reaches_the_parent_and_all_ranks_die():
    start = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1 failed") as info:
        run_ranks(_fail_on_rank_one, 2, timeout=50)
    assert "boom from rank one" in str(info.value)
    assert "_fail_on_rank_one" in str(info.value)  # the child's own frame
    assert time.monotonic() - start < 40


def test_timeout_kills_every_rank():
    start = time.monotonic()
    with pytest.raises(RankFailure, match="timed out"):
        run_ranks(_hang, 2, timeout=5, init=False)
    assert time.monotonic() - start < 30


def _hang_on_rank_one():
    if bc.get_rank() == 1:
        time.sleep(600)
    return "done"


def test_a_timeout_reports_where_the_missing_rank_hangs():
    with pytest.raises(RankFailure, match=r"waiting for ranks \[1\]") as info:
        run_ranks(_hang_on_rank_one, 2, timeout=5)
    text = str(info.value)
    stacks = text.split("--- rank 1 ---", 1)[1]
    assert "in _hang_on_rank_one" in stacks  # the function and line it sleeps in
    assert "--- rank 0 ---" not in text      # rank 0 had reported


def test_a_crashed_rank_is_reported():
    with pytest.raises(RankFailure, match="rank 0 died"):
        run_ranks(_crash, 2, timeout=50)


def test_bad_arguments():
    with pytest.raises(ValueError, match="local_world_size"):
        run_ranks(_identity, 3, local_world_size=2)
