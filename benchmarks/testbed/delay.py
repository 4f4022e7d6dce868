"""The delay line: one-way latency between the testbed's hosts, in user space.

This kernel has no ``netem`` (nor ``fq`` for earliest-departure-time pacing), so latency is
added by this small process instead.  It owns a TUN device (``dl0``) in every host's network
namespace; the testbed routes each host's peers (``/32`` routes) through that device, so
every IP packet a host sends to another host is read here, held for the pair's one-way delay
(packets wait in one min-heap keyed by due time) and written into the destination host's TUN
device, where its kernel receives it as if from the wire.

Bandwidth stays with the kernel where it can: the testbed puts its ``tbf``/``htb`` shaping on
``dl0``'s egress (the host's uplink).  A host's downlink (several senders into one host) is a
token bucket here, at the same rate and burst as ``tbf``, with a drop-tail queue of 50 ms.

Standard library only; run by the testbed as root (or in its ``unshare`` sandbox)::

    python delay.py '{"netns": ["/run/netns/bt-h0", ...], "addrs": ["198.18.7.1", ...],
                      "delay_ms": [[0, 5], [5, 0]], "down_mbit": 100, "mtu": 9000}'

It prints ``ready`` once every device exists, then reads JSON commands, one a line, on stdin:
``{"delay_ms": matrix}``, ``{"down_mbit": rate or null}``, ``{"stats": true}`` (answers one
JSON line: packets, bytes, drops, CPU seconds, how late packets left).  It exits when stdin
closes (its testbed is gone); its devices, and the routes through them, vanish with it.
"""

from __future__ import annotations

import ctypes
import fcntl
import heapq
import json
import os
import select
import socket
import struct
import sys
import time
from collections import deque

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
CLONE_NEWNET = 0x40000000
IFNAME = "dl0"
_QUEUE_S = 0.05  # a downlink holds at most 50 ms of traffic (as the tbf uplink), then drops


def open_tun(netns_path: str, ifname: str = IFNAME) -> int:
    """A non-blocking TUN device ``ifname`` created inside the namespace at ``netns_path``."""
    libc = ctypes.CDLL(None, use_errno=True)
    own = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(netns_path, os.O_RDONLY)
    try:
        if libc.setns(target, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns({netns_path})")
        try:
            fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
            fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", ifname.encode(), IFF_TUN | IFF_NO_PI))
        finally:
            if libc.setns(own, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back")
    finally:
        os.close(own)
        os.close(target)
    return fd


def burst_bytes(mbit: float) -> int:
    """The token bucket's depth: as the testbed's ``tbf`` (5 ms of traffic, >= 68 KiB)."""
    return max(64 * 1024 + 4096, int(mbit * 1e6 / 8 * 0.005))


class DelayLine:
    """Forwards packets between ``fds`` (one TUN device per host) after ``delay_ms[i][j]``."""

    def __init__(self, fds: list[int], addrs: list[str], delay_ms, down_mbit=None):
        self.fds = fds
        self.n = len(fds)
        self.host_of = {fd: i for i, fd in enumerate(fds)}
        self.index = {socket.inet_aton(a): j for j, a in enumerate(addrs)}
        self.heap: list = []
        self.seq = 0
        self.queues = [deque() for _ in fds]
        self.qbytes = [0] * self.n
        self.ready_at = [0.0] * self.n  # when a downlink's queue head may leave
        self.stats = {"packets": 0, "bytes": 0, "dropped_queue": 0, "dropped_unknown": 0,
                      "late_max_ms": 0.0, "late_over_1ms": 0, "late_over_5ms": 0}
        self.set_delay(delay_ms)
        self.set_rate(down_mbit)

    def set_delay(self, delay_ms) -> None:
        self.delay = [[float(delay_ms[i][j]) / 1e3 for j in range(self.n)]
                      for i in range(self.n)]

    def set_rate(self, down_mbit) -> None:
        self.rate = None if down_mbit is None else float(down_mbit) * 1e6 / 8  # bytes/s
        self.burst = 0 if down_mbit is None else burst_bytes(float(down_mbit))
        self.limit = 0 if down_mbit is None else self.burst + self.rate * _QUEUE_S
        self.tokens = [float(self.burst)] * self.n
        self.last = [time.monotonic()] * self.n
        for j in range(self.n):  # a rate lifted or changed: what waits leaves under the new one
            self._drain(j, time.monotonic())

    def receive(self, fd: int, now: float) -> None:
        """Every packet waiting on ``fd`` enters the line."""
        i = self.host_of[fd]
        for _ in range(256):
            try:
                pkt = os.read(fd, 65536)
            except (BlockingIOError, InterruptedError):
                return
            j = self.index.get(pkt[16:20]) if len(pkt) >= 20 and pkt[0] >> 4 == 4 else None
            if j is None or j == i:
                self.stats["dropped_unknown"] += 1
                continue
            self.seq += 1
            heapq.heappush(self.heap, (now + self.delay[i][j], self.seq, j, pkt))

    def release(self, now: float) -> None:
        """Packets whose delay is over go to their destination (through its downlink)."""
        heap, st = self.heap, self.stats
        while heap and heap[0][0] <= now:
            due, _, j, pkt = heapq.heappop(heap)
            late = now - due
            if late > st["late_max_ms"] / 1e3:
                st["late_max_ms"] = late * 1e3
            if late > 1e-3:
                st["late_over_1ms"] += 1
                if late > 5e-3:
                    st["late_over_5ms"] += 1
            if self.rate is None:
                self._write(j, pkt)
                continue
            if self.qbytes[j] + len(pkt) > self.limit:
                st["dropped_queue"] += 1
                continue
            self.queues[j].append(pkt)
            self.qbytes[j] += len(pkt)
            if len(self.queues[j]) == 1:
                self._drain(j, now)

    def _drain(self, j: int, now: float) -> None:
        q = self.queues[j]
        if self.rate is None:
            while q:
                self._write(j, q.popleft())
            self.qbytes[j] = 0
            return
        self.tokens[j] = min(self.burst, self.tokens[j] + (now - self.last[j]) * self.rate)
        self.last[j] = now
        while q and self.tokens[j] >= len(q[0]):
            pkt = q.popleft()
            self.tokens[j] -= len(pkt)
            self.qbytes[j] -= len(pkt)
            self._write(j, pkt)
        if q:
            self.ready_at[j] = now + (len(q[0]) - self.tokens[j]) / self.rate

    def drain_due(self, now: float) -> None:
        for j in range(self.n):
            if self.queues[j] and self.ready_at[j] <= now:
                self._drain(j, now)

    def _write(self, j: int, pkt: bytes) -> None:
        try:
            os.write(self.fds[j], pkt)
        except OSError:
            self.stats["dropped_queue"] += 1
            return
        self.stats["packets"] += 1
        self.stats["bytes"] += len(pkt)

    def next_event(self) -> float | None:
        times = [self.ready_at[j] for j in range(self.n) if self.queues[j]]
        if self.heap:
            times.append(self.heap[0][0])
        return min(times) if times else None

    def report(self) -> dict:
        t = os.times()
        return {**self.stats, "cpu_s": t.user + t.system, "queued": len(self.heap)}


def _command(line: DelayLine, text: str) -> None:
    msg = json.loads(text)
    if "delay_ms" in msg:
        line.set_delay(msg["delay_ms"])
    if "down_mbit" in msg:
        line.set_rate(msg["down_mbit"])
    if msg.get("stats"):
        print(json.dumps(line.report()), flush=True)


def _prioritize() -> str:
    """Run ahead of the training processes: a packet that leaves late is latency nobody asked
    for.  Real-time (SCHED_FIFO, lowest priority) where allowed: the line sleeps in select()
    and wakes the moment a packet is due, instead of waiting for a busy core's time slice
    (several ms on a loaded machine).  It uses a small share of a core (README), so it cannot
    starve the machine; elsewhere nice -10, or nothing."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        return "fifo"
    except (OSError, AttributeError):
        pass
    try:
        os.nice(-10)
        return "nice"
    except OSError:
        return "normal"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cfg = json.loads(argv[0])
    _prioritize()
    fds = [open_tun(path) for path in cfg["netns"]]
    line = DelayLine(fds, cfg["addrs"], cfg["delay_ms"], cfg.get("down_mbit"))
    print("ready", flush=True)
    stdin = sys.stdin.fileno()
    pending = b""
    watch = [stdin, *fds]
    while True:
        nxt = line.next_event()
        timeout = None if nxt is None else max(0.0, nxt - time.monotonic())
        readable, _, _ = select.select(watch, [], [], timeout)
        now = time.monotonic()
        for fd in readable:
            if fd != stdin:
                line.receive(fd, now)
                continue
            chunk = os.read(stdin, 65536)
            if not chunk:
                return 0  # the testbed closed our stdin: it is gone or done with us
            pending += chunk
            while b"\n" in pending:
                text, pending = pending.split(b"\n", 1)
                if text.strip():
                    _command(line, text.decode())
        now = time.monotonic()
        line.release(now)
        line.drain_due(now)


if __name__ == "__main__":
    sys.exit(main())
