#!/usr/bin/env python3
"""Does NCCL on this machine load bagua-net?  One-rank NCCL allreduce with the plugin enabled.

Runs ``torch.distributed`` NCCL (rank 0 of 1) in a child process with ``bagua_net.enable()``
and ``NCCL_DEBUG=INFO``, then prints NCCL's lines about net plugins and networks, the
allreduce result, and a verdict: the plugin is loaded when NCCL logs "Loaded net plugin
BaguaNet", and used when it logs "Using network BaguaNet" (NCCL may pick its own IB/socket
transport on one rank, so "used" is reported, not required).

    python benchmarks/gpu/net_plugin.py
Without CUDA it prints why it is skipped and exits 0.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import torch

CHILD = """
import sys, torch, torch.distributed as dist
dist.init_process_group("nccl", init_method="file://" + sys.argv[1], rank=0, world_size=1)
t = torch.arange(4.0, device="cuda")
dist.all_reduce(t)
torch.cuda.synchronize()
print("allreduce sum", t.sum().item())
dist.destroy_process_group()
"""


def main() -> None:
    if not torch.cuda.is_available():
        print("skipped: needs CUDA (no GPU here)")
        return
    import bagua_net

    path = bagua_net.enable()            # sets NCCL_NET_PLUGIN (and LD_LIBRARY_PATH)
    env = dict(os.environ)
    env.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET", NCCL_SOCKET_IFNAME="lo",
               NCCL_IB_DISABLE="1")
    env.pop("NCCL_NET", None)
    print(f"plugin: {path}\nNCCL_NET_PLUGIN={env.get('NCCL_NET_PLUGIN')}")
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run([sys.executable, "-c", CHILD, os.path.join(tmp, "store")],
                             env=env, capture_output=True, text=True, timeout=300)
    log = out.stdout + out.stderr
    for line in log.splitlines():
        if re.search(r"net plugin|NET/|Using network|BaguaNet|allreduce sum|NCCL version",
                     line, re.I):
            print("  " + line.strip()[:200])
    loaded = "Loaded net plugin BaguaNet" in log
    used = "Using network BaguaNet" in log
    print(f"exit {out.returncode}; plugin loaded: {loaded}; network used: {used}")
    if out.returncode or not loaded:
        print(log[-4000:])
        raise SystemExit(1)


if __name__ == "__main__":
    main()
