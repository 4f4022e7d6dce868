"""On a GPU machine: NCCL itself loads BaguaNet when NCCL_NET_PLUGIN names it."""

import os
import subprocess
import sys

import pytest

import bagua_net

SCRIPT = """
import sys, torch, torch.distributed as dist
dist.init_process_group("nccl", init_method="file://" + sys.argv[1], rank=0, world_size=1)
t = torch.arange(4.0, device="cuda")
dist.all_reduce(t)
torch.cuda.synchronize()
print("sum", t.sum().item())
dist.destroy_process_group()
"""


@pytest.mark.gpu
def test_nccl_loads_baguanet_in_a_one_rank_communicator(tmp_path):
    env = dict(os.environ, NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET",
               NCCL_SOCKET_IFNAME="lo", NCCL_IB_DISABLE="1")
    env.pop("NCCL_NET", None)
    env["NCCL_NET_PLUGIN"] = bagua_net.library_path()
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "store")], env=env,
                         capture_output=True, text=True, timeout=300)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert "sum 6.0" in out.stdout
    assert "Loaded net plugin BaguaNet" in log, log[-4000:]
    assert "Using network BaguaNet" in log or "Initialized NET plugin BaguaNet" in log, log[-4000:]
