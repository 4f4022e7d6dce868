"""A flood of strangers sheds those that waited longest; a failed receive is never written
after test() reported the failure (issue #49).

As in ``test_net_stranger.py``: the receiver is the plugin driven through its NCCL table in this
process, strangers and the peer that holds the handle are plain sockets (``_net_strangers``).
"""

import ctypes
import os
import select
import socket
import time

import _net_freeze
import pytest
from _net_strangers import chunk, dial, handle_info, hello, peer_name

from bagua_net.testing import Plugin, PluginError

MAX_UNGREETED = 128  # BN_MAX_UNGREETED: connections that may wait for their greeting at once


@pytest.fixture
def plugin():
    p = Plugin()
    p.init()
    return p


def _warned(log, *words):
    return any(line.startswith("WARN") and all(w in line for w in words) for line in log)


def _closed_by_listener(socks, expect, timeout=10.0):
    """Indices of ``socks`` the listener has closed, once at least ``expect`` are (or after
    ``timeout``), plus any that close within a short settling time after that."""
    closed: set[int] = set()
    deadline, settle = time.monotonic() + timeout, None
    while True:
        open_ = [s for i, s in enumerate(socks) if i not in closed]
        readable, _, _ = select.select(open_, [], [], 0.05) if open_ else ([], [], [])
        for s in readable:  # nobody sends to a stranger: readable means EOF or reset
            try:
                data = s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except ConnectionResetError:
                data = b""
            except BlockingIOError:
                continue
            if data == b"":
                closed.add(socks.index(s))
        now = time.monotonic()
        if settle is None and (len(closed) >= expect or now > deadline):
            settle = now + 0.3
        if settle is not None and now > settle:
            return sorted(closed)


def _accept_for(p, listen, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        comm = p.accept_once(listen)
        if comm:
            return comm
        time.sleep(0.01)
    return None


# -- 1. shed the oldest -----------------------------------------------------------------------
def test_a_flood_taken_in_one_accept_sheds_the_strangers_that_waited_longest(plugin):
    p = plugin
    handle, listen = p.listen(0)
    strangers = [dial(handle) for _ in range(MAX_UNGREETED + 8)]  # all in the backlog
    assert p.accept_once(listen) is None  # one call takes them all, at one clock reading
    assert _closed_by_listener(strangers, expect=8) == list(range(8))
    for s in strangers[:8]:
        assert _warned(p.log, peer_name(s), f"it is the oldest of {MAX_UNGREETED}")
    for s in strangers:
        s.close()
    p.close_listen(listen)


def test_a_flood_does_not_shed_the_peer_whose_hello_is_in_flight(plugin):
    """127 strangers, then the real peer (connected, hello not yet sent), then 2 strangers:
    the 2 oldest strangers make room, the peer is accepted once its hello arrives."""
    p = plugin
    handle, listen = p.listen(0)
    before = [dial(handle) for _ in range(MAX_UNGREETED - 1)]
    peer = dial(handle)
    after = [dial(handle) for _ in range(2)]
    assert p.accept_once(listen) is None
    everyone = [*before, peer, *after]
    assert _closed_by_listener(everyone, expect=2) == [0, 1], "the peer or a newer one was shed"
    peer.sendall(hello(handle, 0x49, 0, 1))
    recv = _accept_for(p, listen, 10)
    assert recv, "the real peer was not accepted"
    data, buf = os.urandom(4096), bytearray(4096)
    req = p.irecv(recv, buf, 4096)
    peer.sendall(chunk(handle_info(handle)[0], 0, 4096, 0, 1) + data)
    assert p.wait(req, timeout=10) == 4096 and buf == data
    for s in everyone:
        s.close()
    p.close_recv(recv)
    p.close_listen(listen)


# -- 2. nothing lands after the failure is reported -------------------------------------------
def _queue_more(sock, limit):
    """Send up to ``limit`` bytes of payload without blocking: what the kernel will queue."""
    sock.setblocking(False)
    sent, piece = 0, b"\xaa" * 65536
    try:
        while sent < limit:
            sent += sock.send(piece[: limit - sent])
    except BlockingIOError:
        pass
    finally:
        sock.setblocking(True)
    return sent


@pytest.mark.skipif(not _net_freeze.available(), reason="needs Linux tgkill and /proc/self/task")
def test_no_byte_lands_in_a_receive_after_test_reported_its_failure(plugin):
    """A stream thread is copying chunk 0 of a large message when chunk 0 arrives again on the
    other stream (the comm fails). Whatever the kernel had queued for the first copy must not
    reach the buffer once test() has reported the failure: the caller may free it then."""
    p = plugin
    handle, listen = p.listen(0)
    conn_id = int.from_bytes(os.urandom(8), "little")
    socks = [dial(handle, hello(handle, conn_id, s, 2)) for s in range(2)]
    recv = _accept_for(p, listen, 10)
    assert recv
    wire, size = handle_info(handle)[0], 16 << 20
    buf = bytearray(size)
    lo = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    req = p.irecv(recv, buf, size)
    socks[0].sendall(chunk(wire, 0, size, 0, 2) + b"\xaa" * 4096)  # chunk 0 of 2 begins
    reader = _net_freeze.thread_reading_into(lo, lo + size)  # it waits for the rest of chunk 0
    reported = None
    with _net_freeze.frozen(reader):
        assert _queue_more(socks[0], size // 2 - 4096) > 0
        time.sleep(0.1)  # on loopback it is in the receiver's queue by now
        socks[1].sendall(chunk(wire, 0, size, 0, 2))  # chunk 0 again: the comm fails
        deadline = time.monotonic() + 1.0
        while reported is None and time.monotonic() < deadline:
            try:
                assert not p.test(req)[0]
            except PluginError:
                reported = bytes(buf)
    if reported is None:  # (the fixed plugin waits for the reader before it says so)
        with pytest.raises(PluginError):
            p.wait(req, timeout=10)
        reported = bytes(buf)
    time.sleep(0.3)
    landed = buf.count(b"\xaa") - reported.count(b"\xaa")  # the buffer began all zeros
    assert landed == 0, f"{landed} bytes landed after test() reported the failure"
    assert _warned(p.log, "twice")
    for s in socks:
        s.close()
    p.close_recv(recv)
    p.close_listen(listen)
