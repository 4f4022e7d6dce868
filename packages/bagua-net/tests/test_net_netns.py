"""Two processes in two network namespaces joined by a veth link (skipped where namespaces
cannot be made, e.g. without root): the plugin picks the veth by NCCL_SOCKET_IFNAME and moves
bytes over it intact."""

import os
import shutil
import subprocess
import time

import pytest
from _net_scenarios import netns_receive, netns_send

from bagua_net.testing import run_pair


def _ip(*args):
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def veth_pair():
    if shutil.which("ip") is None:
        pytest.skip("network namespaces: the ip command (iproute2) is not installed")
    tag = f"bn{os.getpid() % 100000}"
    ns = (f"{tag}a", f"{tag}b")
    made = []
    try:
        for name in ns:
            res = _ip("netns", "add", name)
            if res.returncode != 0:
                pytest.skip(f"network namespaces cannot be created here: {res.stderr.strip()}")
            made.append(name)
        steps = [
            ("link", "add", f"{tag}x", "netns", ns[0], "type", "veth", "peer", "name", f"{tag}y",
             "netns", ns[1]),
            ("-n", ns[0], "addr", "add", "10.231.0.1/24", "dev", f"{tag}x"),
            ("-n", ns[1], "addr", "add", "10.231.0.2/24", "dev", f"{tag}y"),
            ("-n", ns[0], "link", "set", f"{tag}x", "up"),
            ("-n", ns[1], "link", "set", f"{tag}y", "up"),
            ("-n", ns[0], "link", "set", "lo", "up"),
            ("-n", ns[1], "link", "set", "lo", "up"),
        ]
        for step in steps:
            res = _ip(*step)
            if res.returncode != 0:
                pytest.skip(f"a veth link cannot be set up here: ip {' '.join(step)}: "
                            f"{res.stderr.strip()}")
        for name, dev in zip(ns, (f"{tag}x", f"{tag}y")):  # the carrier comes up a bit later
            for _ in range(100):
                if "LOWER_UP" in _ip("-n", name, "link", "show", "dev", dev).stdout:
                    break
                time.sleep(0.05)
        yield ns, (f"{tag}x", f"{tag}y")
    finally:
        for name in made:  # deleting a namespace removes its end of the veth pair
            _ip("netns", "del", name)


def test_transfer_between_namespaces_over_veth(veth_pair):
    namespaces, ifnames = veth_pair
    sizes = [0, 1, 65_536, (1 << 20) + 3, 9 << 20]
    (name_a, ok), name_b = run_pair(netns_receive, netns_send,
                                    (namespaces, ifnames, sizes, 3), timeout=120)
    assert (name_a, name_b) == ifnames  # each side found its veth end by NCCL_SOCKET_IFNAME
    assert ok == [True] * len(sizes)
