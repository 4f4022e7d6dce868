"""torchrun's shared rendezvous store and restarts.

torchrun (c10d rendezvous) hands its workers a TCPStore that its rank-0 agent created at the
first rendezvous and keeps for the whole job. Every launch's default group writes the same keys
in it, so after a restart a worker can read the *previous* launch's gloo addresses: the first
test shows that with real processes (and is the reason for the warning; if torch ever scopes
the keys per launch it fails, and the warning can go). The others check that
``init_process_group`` warns, once per job, exactly when torchrun may restart workers on such
a store, naming the setting that avoids it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import bagua_comm as bc
from bagua_comm.process_group import _shared_store_hazard
from bagua_comm.testing import run_ranks

# One worker of a launch: joins through the long-lived store (as torchrun's workers do with
# TORCHELASTIC_USE_AGENT_STORE=True), all-reduces once, then holds (launch 1, killed) or exits.
WORKER = textwrap.dedent("""
    import sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    import bagua_comm as bc
    port, rank, world, hold = map(int, sys.argv[1:5])
    store = dist.TCPStore("127.0.0.1", port, None, is_master=False,
                          timeout=timedelta(seconds=20))
    try:
        bc.init_process_group("gloo", store=dist.PrefixStore("default_pg", store), rank=rank,
                              world_size=world, timeout=timedelta(seconds=4))
        x = torch.ones(1)
        bc.allreduce_inplace(x)
        print("ok", x.item(), flush=True)
    except Exception as err:
        print("error", type(err).__name__, err, flush=True)
        sys.exit(1)
    if hold:
        print("holding", flush=True)
        time.sleep(120)
""")


def _worker(port, rank, world, hold):
    return subprocess.Popen([sys.executable, "-c", WORKER, str(port), str(rank), str(world),
                             str(int(hold))], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_a_store_kept_across_launches_hands_out_the_dead_launchs_addresses():
    server = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=30))   # the agent's: outlives launches
    first = [_worker(server.port, r, 2, hold=True) for r in range(2)]
    try:
        for p in first:   # both joined and all-reduced: their addresses are in the store
            line = p.stdout.readline()
            assert line.startswith("ok 2.0"), line + p.stdout.read()
    finally:
        for p in first:   # the failure: launch 1 is gone
            p.kill()
            p.wait(timeout=30)
    # Launch 2's rank 1 starts before its rank 0. On a fresh store it waits for rank 0's key
    # and times out; on the kept one it finds launch 1's rank 0 at once and tries to connect
    # to a process that is gone (refused, or no answer).
    late = _worker(server.port, 1, 2, hold=False)
    out, _ = late.communicate(timeout=90)
    assert late.returncode == 1, out
    assert "connectFullMesh" in out and "wait timeout" not in out, out

    fresh = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    alone = _worker(fresh.port, 1, 2, hold=False)
    out, _ = alone.communicate(timeout=90)
    assert alone.returncode == 1, out
    assert "wait timeout" in out and "connectFullMesh" not in out, out


@pytest.mark.parametrize(("env", "warns"), [
    ({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "3"}, True),
    ({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "0"}, False),
    ({"TORCHELASTIC_USE_AGENT_STORE": "False", "TORCHELASTIC_MAX_RESTARTS": "3"}, False),
    ({"TORCHELASTIC_MAX_RESTARTS": "3"}, False),
    ({"TORCHELASTIC_USE_AGENT_STORE": "True"}, False),
    ({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "x"}, False),
])
def test_hazard_only_when_torchrun_may_restart_on_its_shared_store(env, warns):
    msg = _shared_store_hazard(env)
    assert (msg is not None) == warns
    if warns:
        assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in msg
        assert f"--max-restarts={env['TORCHELASTIC_MAX_RESTARTS']}" in msg


def _init_and_count_warnings():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bc.init_process_group("gloo", timeout=timedelta(seconds=20))
    x = torch.ones(1)
    bc.allreduce_inplace(x)            # the job works either way
    bc.destroy_process_group()
    ours = [w for w in caught if "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" in str(w.message)]
    return len(ours), x.item()


@pytest.mark.parametrize(("restarts", "expected"), [("3", [1, 0]), ("0", [0, 0])])
def test_init_process_group_warns_once_per_job_when_workers_may_restart(restarts, expected):
    """Two ranks initialised from torchrun's environment with the agent's store: rank 0 warns
    (once), rank 1 does not; without restarts nobody does."""
    server = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=30))
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(server.port),
           "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": restarts}
    out = run_ranks(_init_and_count_warnings, 2, init=False, env=env, timeout=120)
    assert [n for n, _ in out] == expected
    assert [v for _, v in out] == [2.0, 2.0]
