"""The emulated-network testbed (benchmarks/testbed): hosts, teardown, shaping, torchrun."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT / "benchmarks"))  # appended: benchmarks/e2e (see _paths) stays first

from testbed import (  # noqa: E402
    Testbed,
    flow_class,
    latency_matrix,
    leftovers,
    measure_rtt,
    measure_tcp,
    regions,
    sweep,
)
from testbed import testbed_available as _available  # noqa: E402
from testbed._shaping import FLOW_CLASSES, shape_commands  # noqa: E402

OK, WHY = _available()
ROOT_MODE = OK and WHY.startswith("root")


def _name(prefix: str) -> str:
    """A testbed name unique to this test run (two runs at once must not share one)."""
    return f"{prefix}{os.getpid() % 100000}"


TBU, TBK, TBS, TBW, TBR, TBL = (_name(p) for p in ("tbu", "tbk", "tbs", "tbw", "tbr", "tbl"))
needs_root = pytest.mark.skipif(not ROOT_MODE, reason=f"needs root network namespaces: {WHY}")


# -- command generation and validation (no privileges needed) -------------------------------
def test_unshaped_link_has_no_qdisc():
    assert shape_commands("eth0", None, None) == ["qdisc del dev eth0 root"]


def test_link_rate_uses_tbf():
    cmds = shape_commands("v0", 100, None)
    assert any(c.startswith("qdisc add dev v0 root handle 1: tbf rate 100000kbit") for c in cmds)


def test_per_flow_caps_use_htb_classes_and_a_u32_port_hash():
    cmds = shape_commands("v0", 300, 20)
    leaves = [c for c in cmds if "class add" in c and "ceil 20000kbit" in c]
    assert len(leaves) == FLOW_CLASSES
    assert sum("u32 ht 2:" in c for c in cmds) == FLOW_CLASSES
    assert any("hashkey mask 0x01fe0000 at 20 link 2:" in c for c in cmds)
    assert any("classid 1:1 htb rate 300000kbit ceil 300000kbit" in c for c in cmds)


def test_flow_class_skips_the_parity_bit():
    assert flow_class(40000) != flow_class(40002)
    assert flow_class(40000) == flow_class(40001)
    assert len({flow_class(40000 + 2 * k) for k in range(FLOW_CLASSES)}) == FLOW_CLASSES


@pytest.mark.parametrize("kw, match", [
    ({"bandwidth_mbit": 0}, "bandwidth_mbit"),
    ({"bandwidth_mbit": -5}, "bandwidth_mbit"),
    ({"per_flow_mbit": "fast"}, "per_flow_mbit"),
    ({"n_hosts": 0}, "n_hosts"),
    ({"name": "Bad-Name"}, "name"),
    ({"name": "muchtoolongname"}, "name"),
    ({"mode": "magic"}, "mode"),
    ({"latency_ms": -1}, "latency_ms"),
    ({"latency_ms": "5ms"}, "latency_ms"),
    ({"latency_ms": [[0, 5]]}, "latency_ms"),
    ({"tcp_slow_start_after_idle": 0}, "tcp_slow_start_after_idle"),
    ({"tcp_slow_start_after_idle": "off"}, "tcp_slow_start_after_idle"),
])
def test_bad_arguments_are_rejected_before_anything_is_made(kw, match):
    with pytest.raises(ValueError, match=match):
        Testbed(**kw)


def test_ip_and_tc_are_found_in_sbin_when_path_lacks_it(monkeypatch):
    """A PATH without the sbin directories (``env -i``, cron) must not turn the testbed off
    when iproute2 is installed there."""
    import shutil

    from testbed import _system

    sbin = next((d for d in _system._SBIN if shutil.which("tc", path=d)), None)
    if sbin is None:
        pytest.skip("iproute2's tc is not installed in an sbin directory")
    monkeypatch.setenv("PATH", "/nonexistent-bin")
    assert shutil.which("tc") is None
    assert _system._tools_missing() == []
    assert sbin in os.environ["PATH"].split(os.pathsep)
    assert os.environ["PATH"].startswith("/nonexistent-bin")   # appended, not replacing


# -- real namespaces ------------------------------------------------------------------------
@pytest.mark.testbed
@pytest.mark.skipif(not OK, reason=WHY)
@pytest.mark.parametrize("mode", ["auto", "unshare"])
def test_hosts_come_up_talk_and_go_down(mode):
    if mode == "unshare" and subprocess.run(["unshare", "--user", "--map-root-user", "true"],
                                            capture_output=True).returncode != 0:
        pytest.skip("user namespaces unavailable")
    with Testbed(n_hosts=3, bandwidth_mbit=None, name=TBU, mode=mode) as tb:
        addrs = [h.addr for h in tb.hosts]
        assert len(set(addrs)) == 3 and all(a.startswith("198.18.") for a in addrs)
        for i, h in enumerate(tb.hosts):
            out = tb.run(i, ["ip", "-4", "-o", "addr", "show", h.ifname],
                         capture_output=True, text=True, check=True).stdout
            assert f"{h.addr}/24" in out
        # Every host reaches every other one (TCP, through the bridge).
        code = ("import socket,sys; s=socket.create_connection((sys.argv[1], int(sys.argv[2])),"
                " timeout=10); s.sendall(b'hi'); s.close()")
        for src, dst in [(0, 1), (2, 0)]:
            srv = tb.popen(dst, [sys.executable, "-c",
                                 "import socket; s=socket.create_server(('0.0.0.0', 7000)); "
                                 "print('up', flush=True); c,_=s.accept(); print(c.recv(2))"],
                           stdout=subprocess.PIPE, text=True)
            assert srv.stdout.readline().strip() == "up"
            tb.run(src, [sys.executable, "-c", code, tb.hosts[dst].addr, "7000"], check=True,
                   timeout=30)
            assert srv.communicate(timeout=30)[0].strip() == "b'hi'"
        if mode != "unshare":
            assert len(leftovers(TBU)["netns"]) == 3
    assert leftovers(TBU) == {"netns": [], "links": []}


TBT = _name("tbt")


@pytest.mark.testbed
@pytest.mark.skipif(not OK, reason=WHY)
@pytest.mark.parametrize("mode", ["auto", "unshare"])
def test_tcp_slow_start_after_idle_is_set_in_every_host_only(mode):
    if mode == "unshare" and subprocess.run(["unshare", "--user", "--map-root-user", "true"],
                                            capture_output=True).returncode != 0:
        pytest.skip("user namespaces unavailable")
    knob = Path("/proc/sys/net/ipv4/tcp_slow_start_after_idle")
    before = knob.read_text()
    want = 1 - int(before)       # the opposite of the machine's, so the change is visible
    with Testbed(n_hosts=2, bandwidth_mbit=None, name=TBT, mode=mode,
                 tcp_slow_start_after_idle=bool(want)) as tb:
        for i in range(2):
            out = tb.run(i, ["cat", str(knob)], capture_output=True, text=True, check=True)
            assert int(out.stdout) == want
        cc = Path("/proc/sys/net/ipv4/tcp_congestion_control")
        assert tb.tcp_settings(1) == {"tcp_slow_start_after_idle": str(want),
                                      "tcp_congestion_control": cc.read_text().strip()}
        assert knob.read_text() == before          # the machine's own namespace untouched


_HOLD = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, sys.argv[1])
    from testbed import Testbed
    # A background parent may have left SIGINT ignored; this run wants Ctrl-C's behaviour.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    tb = Testbed(n_hosts=2, bandwidth_mbit=50, name=sys.argv[2])
    tb.__enter__()
    tb.popen(0, ["sleep", "600"])
    print("ready", flush=True)
    if sys.argv[3] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)
""")


def _hold(name: str, how: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", _HOLD, str(ROOT / "benchmarks"), name, how],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


@pytest.mark.testbed
@needs_root
def test_a_killed_run_is_swept_by_the_next_one():
    p = _hold(TBK, "kill")
    assert p.wait(timeout=30) == -signal.SIGKILL
    left = leftovers(TBK)
    assert len(left["netns"]) == 2 and f"{TBK}-br" in left["links"]
    with Testbed(n_hosts=1, bandwidth_mbit=None, name=TBK) as tb:
        assert leftovers(TBK)["netns"] == [tb.hosts[0].netns]
    assert leftovers(TBK) == {"netns": [], "links": []}
    assert sweep(TBK) == {"netns": [], "links": []}


@pytest.mark.testbed
@needs_root
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_tears_the_testbed_down(sig):
    p = _hold(TBS, "hold")
    assert len(leftovers(TBS)["netns"]) == 2
    with pytest.raises(RuntimeError, match="in use by pid"):
        Testbed(n_hosts=1, name=TBS)  # a live owner's testbed is never swept
    p.send_signal(sig)
    p.wait(timeout=30)
    assert leftovers(TBS) == {"netns": [], "links": []}


@pytest.mark.testbed
@needs_root
def test_shaping_really_limits_bandwidth():
    with Testbed(n_hosts=2, bandwidth_mbit=None, name=TBW) as tb:
        free = measure_tcp(tb, 0, 1, seconds=1.0)["total_mbit"]
        tb.reshape(bandwidth_mbit=40)
        slow = measure_tcp(tb, 0, 1, seconds=2.0)["total_mbit"]
        back = measure_tcp(tb, 1, 0, seconds=2.0)["total_mbit"]
        tb.reshape(bandwidth_mbit=80)
        fast = measure_tcp(tb, 0, 1, seconds=2.0)["total_mbit"]
        assert free > 4 * 80  # unshaped veth is far faster than the shaped rates
        assert 0.6 * 40 < slow < 1.2 * 40
        assert 0.6 * 40 < back < 1.2 * 40  # both directions of the link are shaped
        assert 1.5 < fast / slow < 2.5
        # Per-flow caps: each connection gets its cap; together they stay under the link.
        tb.reshape(bandwidth_mbit=None, per_flow_mbit=20)
        one = measure_tcp(tb, 0, 1, flows=1, seconds=2.0, src_ports=[40000])
        two = measure_tcp(tb, 0, 1, flows=2, seconds=2.0, src_ports=[40100, 40102])
        assert 0.6 * 20 < one["total_mbit"] < 1.2 * 20
        assert 1.5 < two["total_mbit"] / one["total_mbit"] < 2.5
        tb.reshape(bandwidth_mbit=30, per_flow_mbit=20)
        capped = measure_tcp(tb, 0, 1, flows=2, seconds=2.0, src_ports=[40200, 40202])
        assert capped["total_mbit"] < 1.2 * 30
        assert min(capped["per_flow_mbit"]) > 0.25 * 30


_ALLREDUCE = textwrap.dedent("""
    import json, os, socket, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.arange(4, dtype=torch.float32) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    # The address this process's namespace owns (its host's), as seen by a UDP "connect".
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.connect((os.environ["MASTER_ADDR"], 9))
    print("RESULT " + json.dumps({"rank": dist.get_rank(), "world": dist.get_world_size(),
                                  "node": int(os.environ["GROUP_RANK"]),
                                  "local_rank": int(os.environ["LOCAL_RANK"]),
                                  "local_world": int(os.environ["LOCAL_WORLD_SIZE"]),
                                  "addr": s.getsockname()[0],
                                  "master": os.environ["MASTER_ADDR"], "sum": t.tolist()}),
          flush=True)
    dist.destroy_process_group()
""")


def _torchrun_job(tb, script, nproc_per_node: int) -> list[dict]:
    procs = [tb.popen(i, tb.torchrun_argv(i, [script], nproc_per_node=nproc_per_node,
                                          rdzv_id="test"),
                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(tb.n_hosts)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    results = []
    for host, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, out[-3000:]
        # Two processes of a host share torchrun's stdout: lines may run together, so take
        # every "RESULT {...}" record wherever it is (the records hold no nested braces).
        results += [{**json.loads(rec), "host": host}
                    for rec in re.findall(r"RESULT (\{[^{}]*\})", out)]
    return results


@pytest.mark.testbed
@pytest.mark.skipif(not OK, reason=WHY)
@pytest.mark.timeout(300)
def test_two_host_torchrun_rendezvouses_across_namespaces(tmp_path):
    script = tmp_path / "allreduce.py"
    script.write_text(_ALLREDUCE)
    with Testbed(n_hosts=2, bandwidth_mbit=1000, name=TBR) as tb:
        results = _torchrun_job(tb, script, 1)
        expected = [float(k * (1 + 2)) for k in range(4)]  # ranks 0 and 1: t*(1) + t*(2)
        assert sorted(r["rank"] for r in results) == [0, 1]
        assert sorted(r["node"] for r in results) == [0, 1]
        for r in results:
            assert r["world"] == 2 and r["sum"] == expected
            assert r["master"] in {h.addr for h in tb.hosts}


@pytest.mark.testbed
@needs_root
def test_command_line_up_status_down():
    name = _name("tbc")
    cli = [sys.executable, str(ROOT / "benchmarks" / "testbed")]
    up = subprocess.run([*cli, "up", "--name", name, "--hosts", "2", "--mbit", "50"],
                        capture_output=True, text=True, timeout=60)
    try:
        assert up.returncode == 0, up.stderr
        assert leftovers(name)["netns"] == [f"{name}-h0", f"{name}-h1"]  # outlives the command
        status = subprocess.run([*cli, "status", "--name", name], capture_output=True,
                                text=True, timeout=60).stdout
        assert f"{name}-h1" in status and "tbf" in status and "rate 50Mbit" in status
        with pytest.raises(RuntimeError, match="brought up to stay"):
            Testbed(n_hosts=1, name=name)  # never swept from under its user
    finally:
        down = subprocess.run([*cli, "down", "--name", name], capture_output=True, text=True,
                              timeout=60)
    assert down.returncode == 0 and "removed 2 namespaces" in down.stdout
    assert leftovers(name) == {"netns": [], "links": []}


@pytest.mark.testbed
@pytest.mark.skipif(not OK, reason=WHY)
@pytest.mark.timeout(300)
def test_two_by_two_torchrun_has_the_right_local_ranks_on_each_host(tmp_path):
    """torchrun --nnodes 2 --nproc-per-node 2 across two namespaces: ranks 2h and 2h+1 live on
    host h with local ranks 0 and 1, and every process is in its host's namespace."""
    script = tmp_path / "allreduce.py"
    script.write_text(_ALLREDUCE)
    with Testbed(n_hosts=2, bandwidth_mbit=1000, name=TBR) as tb:
        results = _torchrun_job(tb, script, 2)
        assert sorted(r["rank"] for r in results) == [0, 1, 2, 3]
        expected = [float(k * (1 + 2 + 3 + 4)) for k in range(4)]
        for r in results:
            assert r["world"] == 4 and r["local_world"] == 2 and r["sum"] == expected
            assert r["node"] == r["host"] == r["rank"] // 2      # contiguous ranks per host
            assert r["local_rank"] == r["rank"] % 2
            assert r["addr"] == tb.hosts[r["host"]].addr
        for h in range(2):
            assert sorted(r["local_rank"] for r in results if r["host"] == h) == [0, 1]


@pytest.mark.testbed
@needs_root
def test_four_hosts_come_up_and_go_down_cleanly():
    name = _name("tb4")
    with Testbed(n_hosts=4, bandwidth_mbit=100, name=name) as tb:
        left = leftovers(name)
        assert left["netns"] == [f"{name}-h{i}" for i in range(4)]
        assert sorted(left["links"]) == sorted([f"{name}-br"] + [f"{name}-v{i}" for i in range(4)])
        assert len({h.addr for h in tb.hosts}) == 4
        for i, h in enumerate(tb.hosts):   # each host has its address and a shaped link
            q = tb.run(i, ["tc", "qdisc", "show", "dev", h.ifname], capture_output=True,
                       text=True, check=True).stdout
            assert "tbf" in q and "rate 100Mbit" in q
            a = tb.run(i, ["ip", "-4", "-o", "addr", "show", h.ifname], capture_output=True,
                       text=True, check=True).stdout
            assert f"{h.addr}/24" in a
    assert leftovers(name) == {"netns": [], "links": []}
    assert not (Path("/etc/netns") / f"{name}-h0").exists()


def test_latency_matrix_and_regions():
    assert latency_matrix(None, 3) is None and latency_matrix(0, 3) is None
    assert latency_matrix(5, 2) == [[0.0, 5.0], [5.0, 0.0]]
    assert latency_matrix([[9, 1], [2, 9]], 2) == [[0.0, 1.0], [2.0, 0.0]]  # no self-delay
    assert regions([2, 1], 1, 40) == [[0, 1, 40], [1, 0, 40], [40, 40, 0]]


def _run_line(line, socks, until: float) -> None:
    import select
    import time

    fds = [s.fileno() for s in socks]
    while time.monotonic() < until:
        nxt = line.next_event()
        timeout = 0.05 if nxt is None else max(0.0, min(0.05, nxt - time.monotonic()))
        readable, _, _ = select.select(fds, [], [], timeout)
        now = time.monotonic()
        for fd in readable:
            line.receive(fd, now)
        now = time.monotonic()
        line.release(now)
        line.drain_due(now)


@pytest.mark.timeout(60)
def test_delay_line_holds_packets_for_the_pair_delay_and_paces_each_downlink():
    """The line's logic on datagram socket pairs standing in for TUN devices (no root): a
    packet leaves after its pair's delay, and two senders into one host share its downlink's
    token bucket (burst, then the rate)."""
    import socket
    import threading
    import time

    from testbed.delay import DelayLine, burst_bytes

    addrs = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM) for _ in addrs]
    line_ends, host_ends = [p[0] for p in pairs], [p[1] for p in pairs]
    for s in line_ends:
        s.setblocking(False)

    def packet(dst: int, size: int) -> bytes:
        return bytes([0x45]) + bytes(15) + socket.inet_aton(addrs[dst]) + bytes(size - 20)

    line = DelayLine([s.fileno() for s in line_ends], addrs, regions([2, 1], 20, 60), None)
    t0 = time.monotonic()
    host_ends[0].send(packet(1, 100))
    host_ends[0].send(packet(2, 100))
    arrivals = {}
    for _ in range(40):
        _run_line(line, line_ends, time.monotonic() + 0.005)
        for j in (1, 2):
            host_ends[j].setblocking(False)
            try:
                host_ends[j].recv(65536)
                arrivals[j] = time.monotonic() - t0
            except BlockingIOError:
                pass
        if len(arrivals) == 2:
            break
    # Never early; late only by this test process's scheduling (the testbed's line runs
    # real-time, checked with real round trips below), generous on a loaded machine.
    assert 0.020 <= arrivals[1] < 0.070 and 0.060 <= arrivals[2] < 0.110, arrivals
    # Downlink pacing: 8 Mbit/s = 1 MB/s.  Hosts 0 and 2 each send 11 packets of 5000 B to
    # host 1 at once: the burst (13 packets) goes through, the other 45 kB at the rate.
    line.set_delay(latency_matrix(1, 3))
    line.set_rate(8)

    def blast(k: int, seconds: float) -> tuple[int, float]:
        def send():  # a datagram socket pair queues only a few packets: send beside the line
            for _ in range(k):
                host_ends[0].send(packet(1, 5000))
                host_ends[2].send(packet(1, 5000))

        host_ends[0].setblocking(True)
        host_ends[2].setblocking(True)
        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        start = time.monotonic()
        got, last = 0, start
        while time.monotonic() - start < seconds or (
                time.monotonic() - start < 10 and (sender.is_alive() or line.next_event())):
            _run_line(line, line_ends, time.monotonic() + 0.002)
            host_ends[1].setblocking(False)
            try:
                while True:
                    got += len(host_ends[1].recv(65536))
                    last = time.monotonic()
            except BlockingIOError:
                pass
        sender.join(timeout=5)
        return got, last - start

    paced = (110_000 - burst_bytes(8) // 5000 * 5000) / 1e6  # seconds at the rate
    tooks = []
    for _ in range(3):
        got, took = blast(11, 0.3)
        assert got == 110_000 and line.stats["dropped_queue"] == 0
        assert 0.75 * paced < took, (took, paced)  # never faster than the rate: every try
        tooks.append(took)
        if took < 1.5 * paced + 0.05:
            break
        time.sleep(0.1)  # the bucket refills
    # Not much slower than the rate either; the line is run by this process, so a loaded machine
    # can delay a whole blast: the best of 3 tries counts.
    assert min(tooks) < 1.5 * paced + 0.05, (tooks, paced)
    # Too much at once: the downlink holds 50 ms of traffic beyond its burst, drops the rest.
    time.sleep(0.1)  # the bucket refills
    got, took = blast(60, 0.5)
    dropped = line.stats["dropped_queue"]
    assert dropped > 0 and got == 600_000 - 5000 * dropped
    assert got <= burst_bytes(8) + 1e6 * took + 5000  # never faster than the bucket allows
    for s in line_ends + host_ends:
        s.close()


@pytest.mark.testbed
@needs_root
@pytest.mark.timeout(120)
def test_latency_adds_the_asked_delay_and_bandwidth_shaping_still_holds():
    """The delay line: a UDP round trip takes twice the one-way delay (within 20%) at 5 and
    50 ms, per pair with a matrix, and tbf still caps a bulk TCP flow under the delay (both
    directions); without latency, traffic is back on the veth links."""
    with Testbed(n_hosts=3, bandwidth_mbit=None, name=TBL, latency_ms=5) as tb:
        # The fastest round trip: the delay asked, without the probes' own scheduling delays
        # (their processes run at normal priority on a loaded machine).
        base = measure_rtt(tb, 0, 1, count=10)["min_ms"]
        assert tb.data_ifname == "dl0"
        assert 0.8 * 10 < base < 1.2 * 10
        tb.set_latency(50)
        assert 0.8 * 100 < measure_rtt(tb, 1, 0, count=6)["min_ms"] < 1.2 * 100
        tb.set_latency(regions([2, 1], 2, 20))   # hosts 0, 1 in one site, host 2 in another
        assert 0.8 * 4 < measure_rtt(tb, 0, 1, count=10)["min_ms"] < 1.2 * 4
        assert 0.8 * 40 < measure_rtt(tb, 0, 2, count=6)["min_ms"] < 1.2 * 40
        tb.set_latency(5)
        tb.reshape(bandwidth_mbit=40)
        up = measure_tcp(tb, 0, 1, seconds=2.0)["total_mbit"]
        down = measure_tcp(tb, 2, 0, seconds=2.0)["total_mbit"]
        assert 0.6 * 40 < up < 1.2 * 40 and 0.6 * 40 < down < 1.2 * 40
        stats = tb.delay_stats()
        # kept up, by the main job's rule (under 1% of packets over 1 ms late), and almost
        # none over 5 ms: a forwarder descheduled once on a loaded machine holds a handful
        # (CI saw 3 of 3912), which is not a line that fell behind
        n = stats["packets"]
        assert n > 1000 and stats["late_over_1ms"] < 0.01 * n, stats
        assert stats["late_over_5ms"] < 0.005 * n, stats
        tb.set_latency(0)
        assert tb.data_ifname == "eth0" and tb.delay_stats() is None
        assert measure_rtt(tb, 0, 1, count=10)["min_ms"] < 2.0     # the fastest, as above
    assert leftovers(TBL) == {"netns": [], "links": []}
