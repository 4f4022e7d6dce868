"""Functions run in the two spawned processes of ``bagua_net.testing.run_pair``.

Each takes the pipe end first. Payloads are derived from a seed on both sides, so only
digests cross the pipe; the receiver checks what it got against bytes it builds itself.
"""

from __future__ import annotations

import hashlib
import os
import random
import time

from bagua_net.testing import Plugin, PluginError


def payload(seed: int, size: int) -> bytearray:
    """``size`` pseudo-random bytes (no period, so a misplaced chunk cannot go unnoticed)."""
    rng, out = random.Random(seed), bytearray()
    while len(out) < size:
        out += rng.randbytes(min(size - len(out), 1 << 24))
    return out


def connect_in_process(p):
    """Both ends in this process: one thread alternates connect() and accept(), which works
    only because neither blocks. Returns (listen, send, recv) comms."""
    import ctypes

    handle, listen = p.listen(0)
    buf = ctypes.create_string_buffer(handle, len(handle))
    send = recv = None
    while not (send and recv):
        send = send or p.connect_once(buf)
        recv = recv or p.accept_once(listen)
    return listen, send, recv


def _listen_side(conn, version=12):
    p = Plugin(version)
    p.init()
    handle, listen = p.listen(0)
    conn.send(handle)
    recv = p.accept(listen)
    return p, listen, recv


def _connect_side(conn, version=12):
    p = Plugin(version)
    p.init()
    send = p.connect(conn.recv())
    return p, send


def handshake_listener(conn, version):
    p, listen, recv = _listen_side(conn, version)
    props = p.properties(0)
    buf = bytearray(8)
    size = p.recv(recv, buf)
    p.close_recv(recv)
    p.close_listen(listen)
    p.finalize()
    return {"props": props, "size": size, "data": bytes(buf[:size]), "log": p.log}


def handshake_connector(conn, version):
    p, send = _connect_side(conn, version)
    p.send(send, bytearray(b"bagua"))
    p.close_send(send)
    return {"name": p.name, "log": p.log}


def receive_sizes(conn, sizes, seed):
    """Receive one message per size (buffers a little larger than needed); report matches."""
    p, listen, recv = _listen_side(conn)
    ok = []
    for i, n in enumerate(sizes):
        buf = bytearray(n + 64)
        got = p.recv(recv, buf)
        ok.append(got == n and buf[:n] == payload(seed + i, n))
    p.close_recv(recv)
    p.close_listen(listen)
    return ok


def send_sizes(conn, sizes, seed):
    p, send = _connect_side(conn)
    for i, n in enumerate(sizes):
        assert p.send(send, payload(seed + i, n)) == n
    p.close_send(send)
    return len(sizes)


def receive_window(conn, count, seed):
    """Post ``count`` receives at once (as many as the plugin takes), complete them out of
    order, and post the rest as slots free up."""
    p, listen, recv = _listen_side(conn)
    sizes = [((i * 7919) % 300_000) for i in range(count)]
    bufs = [bytearray(s) for s in sizes]
    pending, posted, results, refused = {}, 0, [None] * count, 0
    while posted < count or pending:
        while posted < count:
            req = p.irecv(recv, bufs[posted], sizes[posted])
            if req is None:
                refused += 1
                break
            pending[posted] = req
            posted += 1
        for i in sorted(pending, reverse=True):  # newest first: out of order
            done, size = p.test(pending[i])
            if done:
                results[i] = size == sizes[i] and bufs[i] == payload(seed + i, sizes[i])
                del pending[i]
    p.close_recv(recv)
    p.close_listen(listen)
    return results, refused


def send_window(conn, count, seed):
    p, send = _connect_side(conn)
    sizes = [((i * 7919) % 300_000) for i in range(count)]
    bufs = [payload(seed + i, s) for i, s in enumerate(sizes)]
    pending, posted, max_outstanding = [], 0, 0
    while posted < count or pending:
        while posted < count:
            req = p.isend(send, bufs[posted], sizes[posted])
            if req is None:
                break
            pending.append(req)
            posted += 1
        max_outstanding = max(max_outstanding, len(pending))
        pending = [r for r in pending if not p.test(r)[0]]
    p.close_send(send)
    return max_outstanding


def receive_many_connections(conn, nconn, size, seed):
    """Accept ``nconn`` connections (half on one shared listen comm) and receive on all of
    them with requests interleaved."""
    p = Plugin()
    p.init()
    shared_handle, shared = p.listen(0)
    own = [p.listen(0) for _ in range(nconn // 2)]
    conn.send([shared_handle] * (nconn - len(own)) + [h for h, _ in own])
    recvs = [p.accept(shared) for _ in range(nconn - len(own))] + [p.accept(lc) for _, lc in own]
    bufs = [bytearray(size) for _ in range(nconn)]
    reqs = [p.irecv(r, b, size) for r, b in zip(recvs, bufs)]
    for req in reqs:
        p.wait(req)
    digests = sorted(hashlib.sha256(b).hexdigest() for b in bufs)
    for r in recvs:
        p.close_recv(r)
    p.close_listen(shared)
    for _, lc in own:
        p.close_listen(lc)
    return digests


def send_many_connections(conn, nconn, size, seed):
    p = Plugin()
    p.init()
    handles = conn.recv()
    sends = [None] * nconn
    while not all(sends):  # connect to all of them at once, as NCCL's proxy does
        for i, h in enumerate(handles):
            sends[i] = sends[i] or p.connect_once(_buf(h))
    bufs = [payload(seed + i, size) for i in range(nconn)]
    reqs = [p.isend(s, b, size) for s, b in zip(sends, bufs)]
    for req in reqs:
        p.wait(req)
    for s in sends:
        p.close_send(s)
    return sorted(hashlib.sha256(b).hexdigest() for b in bufs)


_handle_bufs: dict[bytes, object] = {}


def _buf(handle: bytes):
    """One persistent buffer per handle: NCCL passes the same handle to every connect() try."""
    import ctypes

    if handle not in _handle_bufs:
        _handle_bufs[handle] = ctypes.create_string_buffer(handle, len(handle))
    return _handle_bufs[handle]


# -- peer death -------------------------------------------------------------------------------
def receiver_outlives_sender(conn, size):
    """Post a receive the dying sender never finishes; report test()'s error code."""
    p, _listen, recv = _listen_side(conn)
    buf = bytearray(size)
    req = p.irecv(recv, buf, size)
    conn.send("posted")
    try:
        p.wait(req, timeout=60)
    except PluginError as err:
        return {"code": err.code, "log": p.log}
    return {"code": 0, "log": p.log}


def sender_dies_midway(conn, size):
    p, send = _connect_side(conn)
    conn.recv()
    buf = bytearray(size)  # far more than the kernel buffers of all streams hold
    p.isend(send, buf, size)
    os._exit(0)  # with the message partly on the wire


def sender_outlives_receiver(conn, size):
    """Keep sending until the plugin reports the dead receiver."""
    p, send = _connect_side(conn)
    conn.recv()
    buf = payload(2, size)
    try:
        for _ in range(1000):
            p.send(send, buf, timeout=60)
    except PluginError as err:
        return {"code": err.code, "log": p.log}
    return {"code": 0, "log": p.log}


def receiver_dies_midway(conn, size):
    p, _listen, recv = _listen_side(conn)
    buf = bytearray(size)
    p.irecv(recv, buf, size)
    conn.send("ready")
    time.sleep(0.05)
    os._exit(0)


def listener_dies_before_connect(conn):
    p = Plugin()
    p.init()
    handle, _ = p.listen(0)
    conn.send(handle)
    os._exit(0)


def connect_to_dead_listener(conn):
    p = Plugin()
    p.init()
    handle = conn.recv()
    time.sleep(0.5)  # the listener is gone by now
    try:
        p.connect(handle, timeout=60)
    except PluginError as err:
        return {"code": err.code, "log": p.log}
    return {"code": 0, "log": p.log}


# -- network namespaces -------------------------------------------------------------------------
def _enter_netns(name: str) -> None:
    """Move this (still single-threaded) process into network namespace ``name``."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), f"setns into {name} failed")
    finally:
        os.close(fd)


def netns_receive(conn, namespaces, ifnames, sizes, seed):
    """The first side of a veth pair: ``namespaces[0]``, ``ifnames[0]``."""
    _enter_netns(namespaces[0])
    os.environ["NCCL_SOCKET_IFNAME"] = ifnames[0]
    p = Plugin()
    p.init()
    name = p.properties(0)["name"]
    handle, listen = p.listen(0)
    conn.send(handle)
    recv = p.accept(listen)
    ok = []
    for i, n in enumerate(sizes):
        buf = bytearray(n)
        ok.append(p.recv(recv, buf) == n and buf == payload(seed + i, n))
    p.close_recv(recv)
    p.close_listen(listen)
    return name, ok


def netns_send(conn, namespaces, ifnames, sizes, seed):
    """The second side of a veth pair: ``namespaces[1]``, ``ifnames[1]``."""
    _enter_netns(namespaces[1])
    os.environ["NCCL_SOCKET_IFNAME"] = ifnames[1]
    p = Plugin()
    p.init()
    send = p.connect(conn.recv())
    for i, n in enumerate(sizes):
        p.send(send, payload(seed + i, n))
    p.close_send(send)
    return p.properties(0)["name"]
