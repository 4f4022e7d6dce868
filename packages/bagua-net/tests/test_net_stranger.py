"""A stranger on the network cannot inject, exhaust or corrupt (issue #31).

The real receiver is the plugin driven through its NCCL table; strangers and misbehaving peers
are plain sockets (``_net_strangers``). Each rule broken must be dropped or fail its request
with a warning naming the peer and the rule, and must never reach a posted buffer.
"""

import os
import time

import pytest
from _net_strangers import (
    chunk,
    closed_by_listener,
    dial,
    handle_info,
    hello,
    listen_and_receive,
    listen_with_few_fds,
    peer_name,
    stranger_first_then_connect,
    strangers_then_connect,
)

from bagua_net.testing import Plugin, PluginError, run_pair

REMOTE_ERROR = 6


def _warned(log, *words):
    return any(line.startswith("WARN") and all(w in line for w in words) for line in log)


def _accept_for(p, listen, seconds):
    """Call accept() as NCCL does for ``seconds``; the comm if one came up."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        comm = p.accept_once(listen)
        if comm:
            return comm
        time.sleep(0.01)
    return None


def _peer_with_handle(p, nstreams):
    """A misbehaving peer that holds the handle: it greets correctly on ``nstreams`` plain
    sockets and is accepted. Returns (listen, recv comm, sockets, wire version)."""
    handle, listen = p.listen(0)
    conn_id = int.from_bytes(os.urandom(8), "little")
    socks = [dial(handle, hello(handle, conn_id, s, nstreams)) for s in range(nstreams)]
    recv = _accept_for(p, listen, 10)
    assert recv, "a peer with the handle's secret must be accepted"
    return listen, recv, socks, handle_info(handle)[0]


@pytest.fixture
def plugin():
    p = Plugin()
    p.init()
    return p


# -- 1. authentication ----------------------------------------------------------------------
def test_a_stranger_that_greets_first_is_not_taken_for_the_peer():
    got, sent = run_pair(listen_and_receive, stranger_first_then_connect, (4096,), timeout=60)
    assert got["data"] == sent["real"], "the receiver got the stranger's bytes as the peer's"
    assert _warned(got["log"], sent["stranger"], "secret")


def test_a_hello_with_a_wrong_secret_is_dropped_and_the_peer_still_connects(plugin):
    p = plugin
    handle, listen = p.listen(0)
    bad = bytes(b ^ 1 for b in handle_info(handle)[2]) or bytes(16)
    stranger = dial(handle, hello(handle, 1, 0, 1, secret=bad))
    assert _accept_for(p, listen, 0.3) is None
    assert closed_by_listener(stranger)
    assert _warned(p.log, peer_name(stranger), "secret")
    from _net_scenarios import connect_in_process

    p.close_listen(listen)
    listen, send, recv = connect_in_process(p)
    data, out = bytearray(b"peer"), bytearray(4)
    req = p.irecv(recv, out, 4)
    assert p.send(send, data) == 4 and p.wait(req) == 4 and out == data
    for close, comm in ((p.close_send, send), (p.close_recv, recv), (p.close_listen, listen)):
        close(comm)


def test_an_old_wire_version_is_refused_with_a_clear_warning(plugin):
    p = plugin
    handle, listen = p.listen(0)
    old = dial(handle, hello(handle, 9, 0, 1, version=1))  # a wire-version-1 peer's hello
    assert _accept_for(p, listen, 0.3) is None
    assert closed_by_listener(old)
    assert _warned(p.log, peer_name(old), "wire version 1, expected 2")
    # and the other way round: a handle from a version-1 listener (version field zero)
    old_handle = handle[:4] + bytes(4) + handle[8:]
    with pytest.raises(PluginError):
        p.connect(old_handle, timeout=5)
    assert _warned(p.log, "handle of bagua-net wire version 1, expected 2")
    p.close_listen(listen)


# -- 2. duplicate streams ---------------------------------------------------------------------
def test_a_stream_claimed_twice_refuses_the_connection(plugin):
    p = plugin
    handle, listen = p.listen(0)
    first = dial(handle, hello(handle, 0xD0D0, 0, 2))
    again = dial(handle, hello(handle, 0xD0D0, 0, 2))
    assert _accept_for(p, listen, 0.3) is None
    rest = dial(handle, hello(handle, 0xD0D0, 1, 2))
    assert _accept_for(p, listen, 0.3) is None, "a connection with stream 0 twice was accepted"
    assert all(closed_by_listener(s) for s in (first, again, rest))
    assert _warned(p.log, "claimed twice")
    assert _warned(p.log, peer_name(rest), "already accepted or refused")
    p.close_listen(listen)


# -- 3. descriptor exhaustion -----------------------------------------------------------------
def test_greetings_that_do_not_complete_in_time_are_dropped(monkeypatch):
    monkeypatch.setenv("BAGUA_NET_GREETING_TIMEOUT_MS", "300")
    p = Plugin()
    p.init()
    handle, listen = p.listen(0)
    idle = [dial(handle) for _ in range(5)]
    partial = dial(handle, hello(handle, 5, 0, 1)[:10])
    assert _accept_for(p, listen, 1.0) is None
    assert all(closed_by_listener(s, timeout=2) for s in [*idle, partial])
    for s in [*idle, partial]:
        assert _warned(p.log, peer_name(s), "no complete hello within 300 ms")
    p.close_listen(listen)


@pytest.mark.parametrize(("limit", "nstrangers", "rule"), [
    (100, 150, "out of file descriptors"),               # EMFILE sheds the oldest stranger
    (256, 300, "too many connections are waiting"),      # the cap keeps under the limit
])
def test_idle_strangers_cannot_exhaust_the_listeners_descriptors(limit, nstrangers, rule):
    size = 1 << 20
    got, sent = run_pair(listen_with_few_fds, strangers_then_connect, (limit, size, nstrangers),
                         timeout=60)
    assert got["digest"] == sent  # the real peer got through, byte-exact
    before, after = got["fds"]
    assert after == before, "descriptors leaked"
    assert _warned(got["log"], "oldest of", rule)


# -- 4. each range once -----------------------------------------------------------------------
@pytest.mark.parametrize("second_stream", [0, 1])
def test_a_chunk_delivered_twice_fails_the_receive(plugin, second_stream):
    p = plugin
    listen, recv, socks, wire = _peer_with_handle(p, 2)
    buf = bytearray(8192)
    req = p.irecv(recv, buf, len(buf))
    for s in (0, second_stream):  # chunk 0 of 2, twice; chunk 1 never sent
        socks[s].sendall(chunk(wire, 0, 8192, 0, 2) + b"\xaa" * 4096)
    with pytest.raises(PluginError) as err:
        p.wait(req, timeout=5)
    assert err.value.code == REMOTE_ERROR
    assert _warned(p.log, peer_name(socks[0]), "twice")
    assert buf[4096:] == bytes(4096)
    p.close_recv(recv)
    p.close_listen(listen)


def test_a_chunk_whose_range_overlaps_another_fails_the_receive(plugin):
    p = plugin
    listen, recv, socks, wire = _peer_with_handle(p, 1)
    buf = bytearray(8192)
    req = p.irecv(recv, buf, len(buf))
    socks[0].sendall(chunk(wire, 0, 8192, 0, 2) + b"\xaa" * 4096
                     + chunk(wire, 0, 8192, 1, 2, offset=2048) + b"\xbb" * 4096)
    with pytest.raises(PluginError) as err:
        p.wait(req, timeout=5)
    assert err.value.code == REMOTE_ERROR
    assert _warned(p.log, peer_name(socks[0]), "offset")
    assert buf[6144:] == bytes(2048)
    p.close_recv(recv)
    p.close_listen(listen)


# -- 5. nothing after completion --------------------------------------------------------------
def test_a_late_chunk_never_writes_into_a_completed_receive(plugin):
    p = plugin
    listen, recv, socks, wire = _peer_with_handle(p, 2)
    a, first = bytearray(4096), b"\x11" * 4096
    req_a = p.irecv(recv, a, 4096)
    socks[0].sendall(chunk(wire, 0, 4096, 0, 1) + first)  # message 0, complete
    time.sleep(0.3)
    socks[1].sendall(chunk(wire, 0, 4096, 0, 1))  # message 0's range again: header only
    time.sleep(0.3)
    assert p.wait(req_a, timeout=5) == 4096 and a == first
    b, req_b = bytearray(4096), None
    try:
        req_b = p.irecv(recv, b, 4096)
        socks[0].sendall(chunk(wire, 1, 4096, 0, 1))  # message 1 announced, payload held back
        socks[1].sendall(b"\x22" * 4096)  # the late payload
    except (PluginError, OSError):
        pass  # the comm already failed (and shut its sockets): fine
    time.sleep(0.3)
    assert a == first, "a late chunk overwrote a receive already reported complete"
    if req_b is not None:
        with pytest.raises(PluginError):
            assert not p.test(req_b)[0], "message 1 completed without its bytes"
            p.wait(req_b, timeout=1)
    assert _warned(p.log, peer_name(socks[0]), "twice")
    p.close_recv(recv)
    p.close_listen(listen)


def test_a_chunk_for_a_message_already_handed_back_is_a_remote_error(plugin):
    p = plugin
    listen, recv, socks, wire = _peer_with_handle(p, 2)
    a, b = bytearray(4096), bytearray(4096)
    req = p.irecv(recv, a, 4096)
    socks[0].sendall(chunk(wire, 0, 4096, 0, 1) + b"\x11" * 4096)
    assert p.wait(req, timeout=5) == 4096  # handed back to the caller
    req = p.irecv(recv, b, 4096)
    socks[1].sendall(chunk(wire, 0, 4096, 0, 1) + b"\x33" * 4096)  # message 0 again
    time.sleep(0.3)
    try:
        socks[0].sendall(chunk(wire, 1, 4096, 0, 1) + b"\x22" * 4096)
    except OSError:
        pass
    with pytest.raises(PluginError) as err:
        p.wait(req, timeout=2)
    assert err.value.code == REMOTE_ERROR
    assert _warned(p.log, peer_name(socks[0]), "after the message was complete")
    assert a == b"\x11" * 4096
    p.close_recv(recv)
    p.close_listen(listen)
