"""Environment variables: stream count, chunk size, NCCL_SOCKET_IFNAME; idle threads sleep."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _net_scenarios import connect_in_process

import bagua_net
from bagua_net.testing import Plugin, PluginError

INVALID_ARGUMENT = 4
SYSTEM_ERROR = 2


def _threads(prefix):
    """(name, state) of this process's threads whose name starts with ``prefix``."""
    out = []
    for task in Path("/proc/self/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            stat = (task / "stat").read_text()
        except OSError:
            continue
        if name.startswith(prefix):
            out.append((name, stat[stat.rindex(")") + 2]))
    return out


@pytest.mark.parametrize("nstreams", ["1", "3", "8"])
def test_nstreams_sets_the_tcp_streams_per_connection(monkeypatch, nstreams):
    monkeypatch.setenv("BAGUA_NET_NSTREAMS", nstreams)
    monkeypatch.setenv("BAGUA_NET_MIN_CHUNKSIZE", "64K")
    p = Plugin()
    p.init()
    listen, send, recv = connect_in_process(p)
    try:
        assert [n for n, _ in _threads("bagua-net-tx")] == ["bagua-net-tx"] * int(nstreams)
        assert [n for n, _ in _threads("bagua-net-rx")] == ["bagua-net-rx"] * int(nstreams)
        data = bytearray(os.urandom(1 << 20))
        out = bytearray(1 << 20)
        req = p.irecv(recv, out, len(out))
        assert p.send(send, data) == len(data) and p.wait(req) == len(data) and out == data
    finally:
        p.close_send(send)
        p.close_recv(recv)
        p.close_listen(listen)
    assert _threads("bagua-net") == []  # closing joins every stream thread


def test_stream_threads_sleep_when_idle(monkeypatch):
    monkeypatch.setenv("BAGUA_NET_NSTREAMS", "4")
    p = Plugin()
    p.init()
    listen, send, recv = connect_in_process(p)
    try:
        data, out = bytearray(4 << 20), bytearray(4 << 20)
        req = p.irecv(recv, out, len(out))
        p.send(send, data)
        p.wait(req)
        states = []
        for _ in range(5):  # a spinning thread would show up running in these samples
            time.sleep(0.02)
            states += [s for _, s in _threads("bagua-net")]
        assert len(states) == 5 * 8 and set(states) == {"S"}
    finally:
        p.close_send(send)
        p.close_recv(recv)
        p.close_listen(listen)


@pytest.mark.parametrize(("name", "value"), [
    ("BAGUA_NET_NSTREAMS", "0"), ("BAGUA_NET_NSTREAMS", "65"), ("BAGUA_NET_NSTREAMS", "four"),
    ("BAGUA_NET_MIN_CHUNKSIZE", "100"), ("BAGUA_NET_MIN_CHUNKSIZE", "1X"),
    ("BAGUA_NET_MIN_CHUNKSIZE", "-1M"),
])
def test_invalid_values_fail_init_with_a_warning_naming_the_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    p = Plugin()
    with pytest.raises(PluginError) as err:
        p.init()
    assert err.value.code == INVALID_ARGUMENT
    assert any(line.startswith("WARN") and f"{name}={value}" in line for line in p.log)


@pytest.mark.parametrize("value", ["4096", "64K", "2M", "1G"])
def test_chunk_size_accepts_bytes_and_binary_suffixes(monkeypatch, value):
    monkeypatch.setenv("BAGUA_NET_MIN_CHUNKSIZE", value)
    p = Plugin()
    p.init()
    size = int(value[:-1]) << {"K": 10, "M": 20, "G": 30}[value[-1]] if value[-1] in "KMG" \
        else int(value)
    assert any(f"chunks >= {size} bytes" in line for line in p.log)


@pytest.mark.parametrize(("spec", "expect_lo"), [("lo", True), ("=lo", True), ("nosuch,lo", True),
                                                 ("lo:5000", True), ("=l", False), ("^lo", False),
                                                 ("^nosuch,lo", False), ("nosuchif", False)])
def test_socket_ifname_follows_nccls_syntax(monkeypatch, spec, expect_lo):
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", spec)
    names = [name for name, _, _ in bagua_net.interfaces()]
    assert ("lo" in names) == expect_lo
    if spec.startswith("^"):
        assert all(not n.startswith("lo") for n in names)


def test_loopback_is_used_as_ipv4():
    assert bagua_net.interfaces()[0][:2] == ("lo", "127.0.0.1")


def test_no_matching_interface_fails_init():
    code = ("from bagua_net.testing import Plugin, PluginError\n"
            "p = Plugin()\n"
            "try:\n    p.init()\nexcept PluginError as e:\n    print(e.code, p.log[-1])\n")
    env = dict(os.environ, NCCL_SOCKET_IFNAME="=nosuchif0")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.stdout.startswith(f"{SYSTEM_ERROR} WARN"), out.stdout + out.stderr
    assert "NCCL_SOCKET_IFNAME==nosuchif0" in out.stdout


def _plugin_sockets():
    """This process's connected TCP sockets, as (local_port, socket) on duplicated fds."""
    import socket

    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        try:
            sock.getpeername()
        except OSError:
            sock.close()  # listening or unconnected
            continue
        if sock.type == socket.SOCK_STREAM:
            out.append((sock.getsockname()[1], sock))
        else:
            sock.close()
    return out


@pytest.mark.parametrize(("min_chunk", "streams_used"), [("64K", 4), ("8M", 1)])
def test_a_message_is_spread_over_the_streams_in_chunks(monkeypatch, min_chunk, streams_used):
    import ctypes
    import socket
    import struct

    monkeypatch.setenv("BAGUA_NET_NSTREAMS", "4")
    monkeypatch.setenv("BAGUA_NET_MIN_CHUNKSIZE", min_chunk)
    p = Plugin()
    p.init()
    handle, listen = p.listen(0)
    port = int.from_bytes(handle[10:12], "big")  # the handle carries the listen sockaddr_in
    buf = ctypes.create_string_buffer(handle, len(handle))
    send = recv = None
    while not (send and recv):
        send = send or p.connect_once(buf)
        recv = recv or p.accept_once(listen)
    socks = _plugin_sockets()
    try:
        # Small kernel buffers, so one stream cannot swallow the whole message while the
        # receive is not posted yet: the other streams' threads must take chunks too.
        for _, sock in socks:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 32 << 10)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 << 10)
        size = 4 << 20
        data, out = bytearray(os.urandom(size)), bytearray(size)
        sreq = p.isend(send, data, size)
        time.sleep(0.3)
        rreq = p.irecv(recv, out, size)
        assert p.wait(rreq) == size and p.wait(sreq) == size and out == data
        hello = 40  # wire version 2: magic, version, id, stream, count, 16-byte secret
        per_stream = sorted(
            struct.unpack_from("Q", s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256),
                               128)[0] - hello  # tcpi_bytes_received
            for lport, s in socks if lport == port)
        assert len(per_stream) == 4
        assert sum(per_stream) == size + 32 * (64 if min_chunk == "64K" else 1)  # + headers
        assert sum(1 for n in per_stream if n > 0) == streams_used
    finally:
        for _, sock in socks:
            sock.close()
        p.close_send(send)
        p.close_recv(recv)
        p.close_listen(listen)
