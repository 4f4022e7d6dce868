#!/usr/bin/env python3
"""What a DiLoCo sync costs after the link sat idle: TCP's restart after idle, measured.

    python benchmarks/studies/sync_after_idle.py                       # 100 Mbit/s, 50 ms
    python benchmarks/studies/sync_after_idle.py --switch 0            # restart switched off
    python benchmarks/studies/sync_after_idle.py --cc cubic            # every socket on CUBIC
    python benchmarks/studies/sync_after_idle.py --quick               # 5 ms, 2 syncs of each

4 emulated hosts (the testbed, root or user namespaces), one rank each.  Each rank times
``compressed_allreduce`` of the main job's small model (1.44M floats) with
``MinMaxUInt4(4, error_feedback=True)``, recommend's DiLoCo sync, ``--reps`` times, each after
``--idle`` seconds of silence on the sync's connections, then the same back to back; rank 0
prints one JSON line (the slowest rank's seconds).  ``--switch`` sets
``net.ipv4.tcp_slow_start_after_idle`` in every host.  The hosts inherit the machine's
congestion control (``Testbed.tcp_settings()``); ``--cc NAME`` sets NAME on every TCP socket
the ranks open instead, through a small ``LD_PRELOAD`` library compiled here with ``cc``
(a namespace may not change its default on every machine).  Linux skips the restart for
BBR, so under BBR the switch changes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # benchmarks/
import _paths  # noqa: F401  (testbed on sys.path)

SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
int socket(int domain, int type, int protocol) {
  static int (*next)(int, int, int);
  if (!next) next = (int (*)(int, int, int))dlsym(RTLD_NEXT, "socket");
  int fd = next(domain, type, protocol);
  const char *cc = getenv("SYNC_STUDY_CC");
  if (fd >= 0 && cc && (domain == AF_INET || domain == AF_INET6) && (type & 0xf) == SOCK_STREAM)
    setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, cc, strlen(cc));
  return fd;
}
"""


def rank_main(idle: float, reps: int) -> None:
    import torch
    import torch.distributed as dist

    import bagua_comm as bc
    from bagua_comm.compression import MinMaxUInt4

    bc.init_process_group()
    x = torch.randn(1439680)
    codec = MinMaxUInt4(chunks=4, error_feedback=True)

    def sync() -> float:
        t = time.perf_counter()
        bc.compressed_allreduce(x, x.clone(), bc.ReduceOp.AVG, codec)
        return time.perf_counter() - t

    after_idle, back_to_back = [], []
    for _ in range(reps):
        dist.barrier()          # on the default group: the sync's own connections stay idle
        time.sleep(idle)
        after_idle.append(sync())
    for _ in range(reps):
        back_to_back.append(sync())
    worst = torch.tensor(after_idle + back_to_back, dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        w = [round(v, 3) for v in worst.tolist()]
        print("RESULT " + json.dumps({"after_idle_s": w[:reps], "back_to_back_s": w[reps:]}),
              flush=True)
    bc.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bandwidth", type=float, default=100.0, help="Mbit/s (default 100)")
    ap.add_argument("--latency-ms", type=float, default=50.0, help="one way (default 50)")
    ap.add_argument("--idle", type=float, default=1.2, help="seconds of silence (default 1.2)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--switch", type=int, choices=(0, 1), default=None,
                    help="net.ipv4.tcp_slow_start_after_idle in every host (default: as is)")
    ap.add_argument("--cc", default=None, help="congestion control for every socket")
    ap.add_argument("--quick", action="store_true", help="5 ms one way, 2 syncs of each")
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank:
        rank_main(args.idle, args.reps)
        return 0
    if args.quick:
        args.latency_ms, args.reps, args.idle = 5.0, 2, 0.5
    from testbed import Testbed, testbed_available

    ok, why = testbed_available()
    if not ok:
        print(f"no testbed here ({why}): this study needs emulated hosts", file=sys.stderr)
        return 0

    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        if args.cc:
            src, lib = os.path.join(tmp, "shim.c"), os.path.join(tmp, "shim.so")
            with open(src, "w") as f:
                f.write(SHIM)
            subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", lib, src, "-ldl"], check=True)
            env.update(LD_PRELOAD=lib, SYNC_STUDY_CC=args.cc)
        switch = None if args.switch is None else bool(args.switch)
        with Testbed(n_hosts=4, bandwidth_mbit=args.bandwidth, latency_ms=args.latency_ms,
                     name="sai", tcp_slow_start_after_idle=switch) as tb:
            argv = [os.path.abspath(__file__), "--rank", "--idle", str(args.idle),
                    "--reps", str(args.reps)]
            procs = [tb.popen(i, tb.torchrun_argv(i, argv), env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(4)]
            outs = [p.communicate(timeout=600)[0] for p in procs]
            tcp = tb.tcp_settings()
    lines = [line for out in outs for line in out.splitlines() if line.startswith("RESULT ")]
    if not lines:
        print("\n".join(outs), file=sys.stderr)
        return 1
    result = {"bandwidth_mbit": args.bandwidth, "latency_ms": args.latency_ms,
              "idle_s": args.idle, "hosts_tcp": tcp, "socket_cc": args.cc,
              **json.loads(lines[0][len("RESULT "):])}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
