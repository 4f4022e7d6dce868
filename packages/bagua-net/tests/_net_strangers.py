"""Plain-socket strangers and misbehaving peers for ``test_net_stranger.py``.

A *stranger* knows only the listener's address (anyone who can reach the port). A *peer that
holds the handle* also knows its secret and speaks the protocol by hand, to send chunk headers
the plugin itself never would. Both speak the wire version the handle announces (a handle with
a zero version field is wire version 1, before the secret existed), so that the same test can
be run against an older library to show what it let through.
"""

from __future__ import annotations

import hashlib
import os
import random
import resource
import socket
import struct
import time

from bagua_net.testing import Plugin, PluginError

MAGIC = 0x42474E54


def handle_info(handle: bytes) -> tuple[int, tuple[str, int], bytes]:
    """(wire version, (address, port), secret) of an IPv4 listen handle."""
    version = struct.unpack_from("<I", handle, 4)[0] or 1
    port = int.from_bytes(handle[10:12], "big")
    addr = socket.inet_ntoa(handle[12:16])
    return version, (addr, port), (handle[48:64] if version >= 2 else b"")


def hello(handle: bytes, conn_id: int, stream: int, nstreams: int,
          secret: bytes | None = None, version: int | None = None) -> bytes:
    """A well-formed hello for the handle's wire version (``secret`` overrides the handle's)."""
    wire, _, own = handle_info(handle)
    version = wire if version is None else version
    head = struct.pack("<IIQII", MAGIC, version, conn_id, stream, nstreams)
    return head if version == 1 else head + (own if secret is None else secret)


def chunk(wire: int, seq: int, total: int, index: int, nchunks: int,
          offset: int | None = None) -> bytes:
    """The header of chunk ``index`` of ``nchunks`` (wire 1: its offset and length)."""
    base, extra = divmod(total, nchunks)
    off = index * base + min(index, extra)
    length = base + (1 if index < extra else 0)
    off = off if offset is None else offset
    if wire == 1:
        return struct.pack("<IIQQQ", MAGIC, seq, total, off, length)
    return struct.pack("<IIQQII", MAGIC, seq, total, off, index, nchunks)


def dial(handle: bytes, data: bytes = b"") -> socket.socket:
    """A plain TCP connection to the listener, sending ``data`` first."""
    sock = socket.create_connection(handle_info(handle)[1], timeout=10)
    if data:
        sock.sendall(data)
    return sock


def peer_name(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"{host}:{port}"


def closed_by_listener(sock: socket.socket, timeout: float = 5.0) -> bool:
    """Whether the listener closed this connection (EOF or reset) within ``timeout``."""
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def payload(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


# -- run_pair roles ---------------------------------------------------------------------------
def listen_and_receive(conn, size):
    """The real receiver: accept one connection and receive one message of ``size`` bytes."""
    p = Plugin()
    p.init()
    handle, listen = p.listen(0)
    conn.send(handle)
    recv = p.accept(listen, timeout=20)
    p.close_listen(listen)
    buf = bytearray(size + 64)
    got = p.recv(recv, buf, timeout=20)
    p.close_recv(recv)
    return {"data": bytes(buf[:got]), "log": p.log}


def stranger_first_then_connect(conn, size):
    """A stranger greets with a well-formed one-stream hello (without the secret) and sends a
    message before the real peer connects; then the real peer connects and sends its own."""
    handle = conn.recv()
    wire, _, _ = handle_info(handle)
    forged = payload(666, size)
    stranger = dial(handle, hello(handle, 0x5EED, 0, 1, secret=bytes(16))
                    + chunk(wire, 0, size, 0, 1) + forged)
    name = peer_name(stranger)
    time.sleep(0.5)  # the listener has seen the stranger before the peer dials
    p = Plugin()
    p.init()
    real = payload(7, size)
    try:  # a listener that took the stranger for the peer may have stopped listening
        send = p.connect(handle, timeout=20)
        p.send(send, bytearray(real), timeout=20)
        time.sleep(0.2)
        p.close_send(send)
    except PluginError:
        pass
    stranger.close()
    return {"stranger": name, "real": real, "forged": forged}


def listen_with_few_fds(conn, limit, size, nstrangers):
    """The real receiver with RLIMIT_NOFILE lowered to ``limit``: accept while strangers hold
    connections open, close the listen comm (as NCCL does), receive one message."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    p = Plugin()
    p.init()
    before = open_fds()
    handle, listen = p.listen(0)
    conn.send(handle)
    recv = p.accept(listen, timeout=20)
    p.close_listen(listen)
    buf = bytearray(size)
    got = p.recv(recv, buf, timeout=20)
    p.close_recv(recv)
    after = open_fds()
    return {"digest": hashlib.sha256(buf[:got]).hexdigest(), "fds": (before, after),
            "log": p.log}


def strangers_then_connect(conn, limit, size, nstrangers):
    """Open ``nstrangers`` idle connections to the listener, then connect for real and send."""
    handle = conn.recv()
    strangers = [dial(handle) for _ in range(nstrangers)]
    time.sleep(0.3)
    p = Plugin()
    p.init()
    send = p.connect(handle, timeout=20)
    data = payload(3, size)
    p.send(send, bytearray(data), timeout=20)
    time.sleep(0.2)
    p.close_send(send)
    for s in strangers:
        s.close()
    return hashlib.sha256(data).hexdigest()
