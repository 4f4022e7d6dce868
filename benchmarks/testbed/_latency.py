"""Latency for the testbed: the delay line (:mod:`.delay`) started, routed and reconfigured.

``latency_ms`` is the *one-way* delay between two hosts (a ping's round trip is twice it):
a number (every pair of hosts) or an ``n x n`` matrix (``[i][j]``: from host ``i`` to host
``j``; :func:`regions` builds one for hosts split into sites).  0 or None: no delay line,
traffic goes straight through the veth links and the bridge.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .delay import IFNAME

DELAY_SCRIPT = str(Path(__file__).with_name("delay.py"))
#: The TUN devices' MTU: jumbo frames, so the line handles 6x fewer packets than at 1500.
DELAY_MTU = 9000
#: Above this many Mbit/s through the line in total it falls behind (measured on a loaded
#: 2-core machine; see benchmarks/testbed/README.md): callers keep runs below it.
LINE_CAPACITY_MBIT = 1500


def latency_matrix(latency_ms, n: int) -> list[list[float]] | None:
    """The ``n x n`` one-way delay matrix (ms) for ``latency_ms``; None: no latency at all.

    Raises ``ValueError`` naming ``latency_ms`` for a negative, non-numeric or mis-shaped
    value.
    """
    def num(v) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 or v > 10_000:
            raise ValueError(f"latency_ms must be a number of milliseconds in [0, 10000] (or "
                             f"an n x n matrix of them), got {v!r}")
        return float(v)

    if latency_ms is None:
        return None
    if isinstance(latency_ms, (list, tuple)):
        if len(latency_ms) != n or any(not isinstance(row, (list, tuple)) or len(row) != n
                                       for row in latency_ms):
            raise ValueError(f"latency_ms as a matrix must be {n} x {n} (one row per host), "
                             f"got {latency_ms!r}")
        m = [[num(v) for v in row] for row in latency_ms]
        for i in range(n):
            m[i][i] = 0.0  # a host's own traffic never leaves it
        return m if any(any(row) for row in m) else None
    d = num(latency_ms)
    if d == 0:
        return None
    return [[0.0 if i == j else d for j in range(n)] for i in range(n)]


def regions(sizes, intra_ms: float, inter_ms: float) -> list[list[float]]:
    """A delay matrix for hosts split into sites: ``sizes`` hosts each, in order.

    ``regions([2, 2], 1, 40)``: hosts 0-1 and 2-3 are 1 ms apart inside a site, 40 ms across.
    """
    site = [k for k, size in enumerate(sizes) for _ in range(size)]
    return [[0.0 if i == j else (intra_ms if site[i] == site[j] else inter_ms)
             for j in range(len(site))] for i in range(len(site))]


class DelayLineProcess:
    """The running delay line of one testbed: its devices, routes and control pipe."""

    def __init__(self, sandbox, hosts, matrix, down_mbit, netns_dir: str = "/run/netns"):
        self.sandbox = sandbox
        cfg = {"netns": [f"{netns_dir}/{h.netns}" for h in hosts],
               "addrs": [h.addr for h in hosts], "delay_ms": matrix, "down_mbit": down_mbit}
        self.proc = subprocess.Popen([*sandbox.prefix(), sys.executable, DELAY_SCRIPT,
                                      json.dumps(cfg)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, start_new_session=True)
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            self.stop()
            raise RuntimeError(f"the delay line did not start (said {line!r}); it needs "
                               f"/dev/net/tun and CAP_NET_ADMIN")
        for i, h in enumerate(hosts):
            cmds = [f"link set {IFNAME} mtu {DELAY_MTU} up"]
            cmds += [f"route replace {p.addr}/32 dev {IFNAME} src {h.addr}"
                     for j, p in enumerate(hosts) if j != i]
            sandbox.run(["ip", "-n", h.netns, "-batch", "-"], input="\n".join(cmds) + "\n")

    def send(self, **msg) -> None:
        if not self.alive():
            raise RuntimeError(f"the delay line exited ({self.proc.returncode}): the testbed "
                               f"no longer adds latency")
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def stats(self) -> dict:
        """Packets and bytes forwarded, drops, CPU seconds used, how late packets left."""
        self.send(stats=True)
        return json.loads(self.proc.stdout.readline())

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # the line exits on EOF; its devices and routes go
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
