"""A small TCP throughput probe: ``recv`` on one host, ``send`` from another.

    python flow.py recv --port 5201 --flows 2            # prints JSON when done
    python flow.py send --host 198.18.7.1 --port 5201 --flows 2 --seconds 2 [--src-ports 40000,40002]
    python flow.py echo --port 5202 --count 20                  # UDP echo, for round trips
    python flow.py ping --host 198.18.7.1 --port 5202 --count 20   # prints JSON round trips

The receiver accepts ``--flows`` connections and reports, per connection, the bytes received
and the rate over the window in which all flows were running (from the last connection's
first byte to the first connection's end), so start-up effects do not blur the comparison.
Standard library only: it runs inside namespaces with any interpreter.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time

_CHUNK = 256 * 1024


def _recv(args) -> None:
    srv = socket.create_server((args.bind, args.port), backlog=args.flows)
    print("listening", flush=True)
    conns = [srv.accept()[0] for _ in range(args.flows)]
    srv.close()
    samples: list[list[tuple[float, int]]] = [[] for _ in conns]

    def pump(k: int, c: socket.socket) -> None:
        total = 0
        buf = bytearray(_CHUNK)
        while True:
            n = c.recv_into(buf)
            if not n:
                break
            total += n
            samples[k].append((time.monotonic(), total))
        c.close()

    threads = [threading.Thread(target=pump, args=(k, c)) for k, c in enumerate(conns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    start = max(s[0][0] for s in samples if s)
    end = min(s[-1][0] for s in samples if s)
    per_flow = []
    for s in samples:
        inside = [(t, b) for t, b in s if start <= t <= end]
        if len(inside) < 2 or end <= start:
            per_flow.append(0.0)
            continue
        (t0, b0), (t1, b1) = inside[0], inside[-1]
        per_flow.append((b1 - b0) * 8 / (t1 - t0) / 1e6)
    print(json.dumps({"flows": len(conns), "per_flow_mbit": per_flow,
                      "total_mbit": sum(per_flow), "window_s": end - start,
                      "bytes": [s[-1][1] if s else 0 for s in samples]}), flush=True)


def _send(args) -> None:
    ports = [int(p) for p in args.src_ports.split(",")] if args.src_ports else []
    socks = []
    for k in range(args.flows):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if k < len(ports):
            s.bind(("0.0.0.0", ports[k]))
        s.connect((args.host, args.port))
        socks.append(s)
    payload = b"\0" * _CHUNK
    deadline = time.monotonic() + args.seconds

    def blast(s: socket.socket) -> None:
        while time.monotonic() < deadline:
            s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        s.close()

    threads = [threading.Thread(target=blast, args=(s,)) for s in socks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _echo(args) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((args.bind, args.port))
    print("listening", flush=True)
    for _ in range(args.count):
        data, peer = s.recvfrom(2048)
        s.sendto(data, peer)


def _ping(args) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(5.0)
    rtts = []
    for k in range(args.count):
        t0 = time.monotonic()
        s.sendto(k.to_bytes(4, "big"), (args.host, args.port))
        while int.from_bytes(s.recv(2048)[:4], "big") != k:
            pass
        rtts.append((time.monotonic() - t0) * 1e3)
        time.sleep(0.005)
    rtts.sort()
    print(json.dumps({"rtt_ms": rtts, "median_ms": rtts[len(rtts) // 2],
                      "min_ms": rtts[0]}), flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("recv")
    r.add_argument("--bind", default="0.0.0.0")
    r.add_argument("--port", type=int, default=5201)
    r.add_argument("--flows", type=int, default=1)
    s = sub.add_parser("send")
    s.add_argument("--host", required=True)
    s.add_argument("--port", type=int, default=5201)
    s.add_argument("--flows", type=int, default=1)
    s.add_argument("--seconds", type=float, default=2.0)
    s.add_argument("--src-ports", default="")
    for name in ("echo", "ping"):
        e = sub.add_parser(name)
        e.add_argument("--bind", default="0.0.0.0")
        e.add_argument("--host", default="")
        e.add_argument("--port", type=int, default=5202)
        e.add_argument("--count", type=int, default=20)
    args = ap.parse_args(argv)
    {"recv": _recv, "send": _send, "echo": _echo, "ping": _ping}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
