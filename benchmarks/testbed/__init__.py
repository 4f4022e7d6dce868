"""An emulated multi-host network on one machine, for benchmarks and tests.

    import sys; sys.path.insert(0, "benchmarks")
    from testbed import Testbed, testbed_available
    ok, why = testbed_available()
    with Testbed(n_hosts=2, bandwidth_mbit=100, per_flow_mbit=None, name="bt") as tb:
        tb.hosts                     # [Host(name, netns, addr, ifname), ...]
        tb.popen(0, ["python3", "-c", "..."])
        tb.run(1, ["ip", "addr"], capture_output=True)
        tb.reshape(bandwidth_mbit=1000, per_flow_mbit=None)
        tb.set_latency(5)                        # 5 ms one way between any two hosts
        measure_tcp(tb, src=0, dst=1, flows=2)   # {"total_mbit": ..., "per_flow_mbit": [...]}
        measure_rtt(tb, src=0, dst=1)            # {"median_ms": ~10, "rtt_ms": [...]}

Each host is a network namespace with its own 198.18.0.0/15 address on a veth link to a
private bridge; links are shaped with ``tc`` (tbf for the link rate, htb + u32 for per-flow
caps).  Latency (``latency_ms=``, :meth:`Testbed.set_latency`) comes from a user-space
delay line (``delay.py``) between per-host TUN devices.  Root uses ``ip netns`` directly; an unprivileged user gets the same inside a user
namespace (``unshare``).  Teardown always happens (context manager, atexit, SIGINT/SIGTERM),
and a new testbed first sweeps what a killed run with the same name left behind.
Command line: ``python benchmarks/testbed up|down|status [--name bt] [--hosts 2] [--mbit 100]``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from ._core import Host, Testbed, leftovers, sweep, testbed_available
from ._latency import LINE_CAPACITY_MBIT, latency_matrix, regions
from ._shaping import FLOW_CLASSES, flow_class

FLOW_SCRIPT = str(Path(__file__).with_name("flow.py"))

__all__ = ["FLOW_CLASSES", "FLOW_SCRIPT", "LINE_CAPACITY_MBIT", "Host", "Testbed",
           "flow_class", "latency_matrix", "leftovers", "measure_rtt", "measure_tcp", "regions",
           "sweep", "testbed_available"]


def measure_tcp(tb: Testbed, src: int = 0, dst: int = 1, *, flows: int = 1,
                seconds: float = 2.0, port: int = 5201, src_ports=None) -> dict:
    """TCP throughput from host ``src`` to host ``dst`` over ``flows`` parallel connections.

    Returns the receiver's report: ``total_mbit``, ``per_flow_mbit`` (list), ``window_s``.
    ``src_ports`` pins the senders' source ports (see :func:`flow_class`).
    """
    recv = tb.popen(dst, [sys.executable, FLOW_SCRIPT, "recv", "--port", port,
                          "--flows", flows], stdout=subprocess.PIPE, text=True)
    try:
        if recv.stdout.readline().strip() != "listening":
            raise RuntimeError("the TCP receiver did not start")
        argv = [sys.executable, FLOW_SCRIPT, "send", "--host", tb.hosts[dst].addr,
                "--port", port, "--flows", flows, "--seconds", seconds]
        if src_ports:
            argv += ["--src-ports", ",".join(map(str, src_ports))]
        tb.run(src, argv, check=True, timeout=seconds + 60)
        out, _ = recv.communicate(timeout=60)
    finally:
        if recv.poll() is None:
            recv.kill()
            time.sleep(0)
    return json.loads(out.strip().splitlines()[-1])


def measure_rtt(tb: Testbed, src: int = 0, dst: int = 1, *, count: int = 20,
                port: int = 5202) -> dict:
    """UDP round trips from host ``src`` to host ``dst``: ``median_ms``, ``min_ms``, ``rtt_ms``."""
    echo = tb.popen(dst, [sys.executable, FLOW_SCRIPT, "echo", "--port", port,
                          "--count", count], stdout=subprocess.PIPE, text=True)
    try:
        if echo.stdout.readline().strip() != "listening":
            raise RuntimeError("the UDP echo did not start")
        out = tb.run(src, [sys.executable, FLOW_SCRIPT, "ping", "--host", tb.hosts[dst].addr,
                           "--port", port, "--count", count], check=True, timeout=60,
                     capture_output=True, text=True).stdout
    finally:
        if echo.poll() is None:
            echo.kill()
        echo.wait()
    return json.loads(out.strip().splitlines()[-1])
