"""bagua-net throughput against iperf3, over loopback and over a per-flow-capped veth link.

    python benchmarks/micro/net.py            # 64 KiB .. 256 MiB, 1/2/4/8 streams, both links
    python benchmarks/micro/net.py --quick    # a few sizes, 1 and 4 streams (well under a minute)
    python benchmarks/micro/net.py --link loopback --streams 1,4 --sizes 1M,64M
    python benchmarks/micro/net.py --baseline-lib /tmp/old/libnccl-net-bagua.so --quick

Two processes drive libnccl-net-bagua.so through its NCCL table (``bagua_net.testing``): the
receiver listens, the sender connects with ``BAGUA_NET_NSTREAMS`` streams, then for each size
the receiver posts receives (8 in flight, as NCCL's proxy keeps), starts its clock, lets the
sender go, and stops when the last byte is in. GB/s = bytes / that time (1 GB = 1e9 bytes).

The reference is iperf3 on the same link, with 1 and with N parallel streams. On the
network-namespace link (``benchmarks/testbed``: two hosts on a bridge, htb + u32 capping every
TCP flow, told apart by source port, at ``--per-flow-mbit``), connections whose streams would
share a cap class are re-made, for the plugin and iperf3 alike, so that N streams really are
N capped flows. Targets (printed, never asserted): on the capped link N streams reach
0.8 x N x the 1-stream figure and 0.9 x iperf3 -P N; on loopback 0.8 x iperf3 -P N.

``--baseline-lib PATH`` compares this build against another build of the library instead
(loopback only, no iperf3): for every point the two run back to back, alternating which goes
first, and the report gives both figures and their ratio, plus the median time to set up a
connection (listen, connect and accept with N streams, 30 times in one process).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE.parent))  # benchmarks/
import _results  # noqa: E402

DEPTH = 8
KiB, MiB = 1 << 10, 1 << 20
FULL = [64 * KiB, 256 * KiB, MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]  # the default sizes


# -- the two roles (run as child processes, possibly inside a namespace) ----------------------
def _role_recv(args) -> None:
    from bagua_net.testing import Plugin

    p = Plugin(path=args.lib)
    p.init()
    handle, listen = p.listen(0)
    print("HANDLE", handle.hex(), flush=True)
    recv = p.accept(listen, timeout=120)
    for size, count in _plan(args.sizes, args.budget):
        bufs = [bytearray(size) for _ in range(min(DEPTH, count))]
        free, pending, done = list(range(len(bufs))), [], 0
        posted = _post_receives(p, recv, bufs, size, free, pending, count)
        t0 = time.perf_counter()
        print("READY", size, flush=True)  # the parent lets the sender go
        while done < count:
            still = []
            for i, req in pending:
                if p.test(req)[0]:
                    done += 1
                    free.append(i)
                else:
                    still.append((i, req))
            if len(still) == len(pending):
                time.sleep(1e-4)  # nothing finished: do not spin a core the streams need
            pending[:] = still
            posted += _post_receives(p, recv, bufs, size, free, pending, count - posted)
        seconds = time.perf_counter() - t0
        print("RESULT", json.dumps({"size": size, "count": count, "seconds": seconds}),
              flush=True)
    p.close_recv(recv)
    p.close_listen(listen)


def _post_receives(p, recv, bufs, size, free, pending, left) -> int:
    """Post receives into free buffers (at most ``left``); returns how many were posted."""
    n = 0
    while free and n < left:
        req = p.irecv(recv, bufs[free[-1]], size)
        if req is None:  # the plugin cannot take it now: try again later
            break
        pending.append((free.pop(), req))
        n += 1
    return n


def _role_send(args) -> None:
    from bagua_net.testing import Plugin

    p = Plugin(path=args.lib)
    p.init()
    send = p.connect(bytes.fromhex(args.handle), timeout=120)
    print("PORTS", ",".join(map(str, _own_tcp_ports())), flush=True)
    for size, count in _plan(args.sizes, args.budget):
        buf = bytearray(size)
        if sys.stdin.readline().strip() != "GO":
            return
        pending, posted = [], 0
        while posted < count or pending:
            while posted < count and len(pending) < DEPTH:
                req = p.isend(send, buf, size)
                if req is None:
                    break
                pending.append(req)
                posted += 1
            still = [r for r in pending if not p.test(r)[0]]
            if len(still) == len(pending):
                time.sleep(1e-4)
            pending = still
    p.close_send(send)


def _role_setup(args) -> None:
    """Median seconds to set up a connection (listen, connect/accept until both are up)."""
    import ctypes

    from bagua_net.testing import Plugin

    p = Plugin(path=args.lib)
    p.init()
    times = []
    for _ in range(args.budget):
        t0 = time.perf_counter()
        handle, listen = p.listen(0)
        buf = ctypes.create_string_buffer(handle, len(handle))
        send = recv = None
        while not (send and recv):
            send = send or p.connect_once(buf)
            recv = recv or p.accept_once(listen)
        times.append(time.perf_counter() - t0)
        p.close_send(send)
        p.close_recv(recv)
        p.close_listen(listen)
    print("RESULT", json.dumps({"seconds": statistics.median(times)}), flush=True)


def _own_tcp_ports() -> list[int]:
    """Local ports of this process's TCP sockets (the plugin's streams, here)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ports = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if cols[9] in inodes and cols[3] == "01":  # ESTABLISHED
                ports.append(int(cols[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


def _plan(sizes: list[int], budget: int) -> list[tuple[int, int]]:
    """(size, how many messages) so that each point moves about ``budget`` bytes."""
    return [(s, max(1, budget // s)) for s in sizes]


# -- the parent: places the roles on a link and collects their figures ------------------------
class Loopback:
    name = "loopback"
    addr = "127.0.0.1"

    def popen(self, host, argv, env, **kw):
        return subprocess.Popen(argv, env=dict(env, NCCL_SOCKET_IFNAME="lo"), **kw)

    def run(self, host, argv, **kw):
        return subprocess.run(argv, **kw)

    def distinct(self, ports) -> bool:
        return True


class Namespaces:
    """Two testbed hosts with every TCP flow capped at ``per_flow_mbit``."""

    def __init__(self, tb, flow_class, per_flow_mbit):
        self.tb, self.flow_class = tb, flow_class
        self.name = f"veth, {per_flow_mbit:g} Mbit/s per flow"
        self.addr = tb.hosts[1].addr

    def popen(self, host, argv, env, **kw):
        return self.tb.popen(host, argv, env=env, **kw)

    def run(self, host, argv, **kw):
        return self.tb.run(host, argv, **kw)

    def distinct(self, ports) -> bool:
        classes = [self.flow_class(p) for p in ports]
        return len(set(classes)) == len(classes)


class _Lines:
    """A role's stdout read by a thread, so that waiting for a line can time out."""

    def __init__(self, proc):
        self.proc, self.lines = proc, queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")

    def expect(self, word: str, timeout: float = 300.0) -> str:
        """The rest of the next line, which must start with ``word``."""
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no {word} from a benchmark role within {timeout:g} s") from None
        if not line.startswith(word):
            self.proc.wait(timeout=10)
            err = self.proc.stderr.read()
            raise RuntimeError(f"expected {word} from a benchmark role, got {line!r}: "
                               f"{err[-2000:]}")
        return line.split(maxsplit=1)[1].strip()


def run_plugin(link, nstreams: int, sizes: list[int], budget: int,
               lib: str | None = None) -> dict[int, float]:
    """GB/s per size for the plugin (``lib``, default the installed one) with ``nstreams``
    streams from host 0 to host 1."""
    env = dict(os.environ, BAGUA_NET_NSTREAMS=str(nstreams), PYTHONUNBUFFERED="1")
    common = ["--sizes", ",".join(map(str, sizes)), "--budget", str(budget)]
    if lib:
        common += ["--lib", lib]
    me = [sys.executable, str(Path(__file__).resolve())]
    kw = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE,
          "text": True}
    for _attempt in range(20):
        recv = link.popen(1, [*me, "--role", "recv", *common], env, **kw)
        send = None
        try:
            recv_out = _Lines(recv)
            handle = recv_out.expect("HANDLE")
            send = link.popen(0, [*me, "--role", "send", "--handle", handle, *common], env, **kw)
            ports = [int(x) for x in _Lines(send).expect("PORTS").split(",")]
            if len(ports) != nstreams:
                raise RuntimeError(f"sender has {len(ports)} TCP streams, expected {nstreams}")
            if not link.distinct(ports):
                continue  # two streams in one cap class: make the connection again
            out = {}
            for _ in sizes:
                recv_out.expect("READY")
                send.stdin.write("GO\n")
                send.stdin.flush()
                res = json.loads(recv_out.expect("RESULT"))
                out[res["size"]] = res["size"] * res["count"] / res["seconds"] / 1e9
            send.wait(timeout=120)
            recv.wait(timeout=120)
            return out
        finally:
            for proc in (send, recv):
                if proc is not None and proc.poll() is None:
                    proc.kill()
                    proc.wait()
    raise RuntimeError("could not get distinct cap classes for the plugin's streams")


def run_iperf3(link, nstreams: int, seconds: float) -> float:
    """GB/s iperf3 -P nstreams measures from host 0 to host 1 (receiver's figure)."""
    for _attempt in range(20):
        port = 20000 + (os.getpid() * 7 + _attempt) % 20000
        server = link.popen(1, ["iperf3", "-s", "-1", "-p", str(port)], dict(os.environ),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            res = None
            for _ in range(50):  # until the server listens
                res = link.run(0, ["iperf3", "-c", link.addr, "-p", str(port), "-P",
                                   str(nstreams), "-t", str(seconds), "-J"],
                               capture_output=True, text=True, timeout=seconds + 60)
                if res.returncode == 0:
                    break
                time.sleep(0.1)
            report = json.loads(res.stdout)
            if "error" in report or "sum_received" not in report.get("end", {}):
                continue  # e.g. the port was taken: another port
            ports = [c["local_port"] for c in report["start"]["connected"]]
            if link.distinct(ports):
                return report["end"]["sum_received"]["bits_per_second"] / 8e9
        finally:
            if server.poll() is None:
                server.kill()
            server.wait()
    raise RuntimeError("could not get distinct cap classes for iperf3's streams")


def measure(link, streams, sizes, budget, iperf_seconds, repeat):
    """Median GB/s over ``repeat`` rounds, each running the plugin and iperf3 for every N
    back to back (so a busy machine slows both alike)."""
    runs_p = {n: [] for n in streams}
    runs_i = {n: [] for n in streams}
    for _ in range(repeat):
        for n in streams:
            runs_p[n].append(run_plugin(link, n, sizes, budget))
            runs_i[n].append(run_iperf3(link, n, iperf_seconds))
    plugin = {n: {s: statistics.median(r[s] for r in runs_p[n]) for s in sizes} for n in streams}
    iperf = {n: statistics.median(runs_i[n]) for n in streams}
    return plugin, iperf


def run_setup(nstreams: int, lib: str | None, cycles: int = 30) -> float:
    """Median seconds to set up one loopback connection with ``nstreams`` streams."""
    env = dict(os.environ, BAGUA_NET_NSTREAMS=str(nstreams), NCCL_SOCKET_IFNAME="lo")
    argv = [sys.executable, str(Path(__file__).resolve()), "--role", "setup", "--sizes", "0",
            "--budget", str(cycles)] + (["--lib", lib] if lib else [])
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, check=True)
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line.split(maxsplit=1)[1])["seconds"]


def compare(baseline: str, streams, sizes, budget, repeat) -> dict:
    """This build against ``baseline`` on loopback, interleaved; prints both and the ratio and
    returns the medians: ``{"gbs": {(size, N): (this, baseline)}, "setup_s": {N: (...)}}``."""
    import bagua_net

    ours_lib = bagua_net.library_path()
    runs = {(lib, n): [] for lib in (ours_lib, baseline) for n in streams}
    setup = {(lib, n): [] for lib in (ours_lib, baseline) for n in streams}
    for r in range(repeat):
        for n in streams:
            for lib in ((ours_lib, baseline) if r % 2 == 0 else (baseline, ours_lib)):
                runs[lib, n].append(run_plugin(Loopback(), n, sizes, budget, lib))
                setup[lib, n].append(run_setup(n, lib))
    print(f"\n== loopback: this build / baseline ({baseline}), median of {repeat} interleaved "
          f"rounds; GB/s")
    print(f"{'size':>10} {'N':>3} {'this':>9} {'baseline':>9} {'ratio':>7}")
    out: dict = {"gbs": {}, "setup_s": {}}
    for n in streams:
        for s in sizes:
            ours = statistics.median(x[s] for x in runs[ours_lib, n])
            base = statistics.median(x[s] for x in runs[baseline, n])
            out["gbs"][s, n] = (ours, base)
            print(f"{_fmt_size(s):>10} {n:>3} {ours:9.4f} {base:9.4f} {ours / base:7.3f}")
    print(f"{'set-up ms':>10} {'N':>3} {'this':>9} {'baseline':>9} {'ratio':>7}")
    for n in streams:
        ours = statistics.median(setup[ours_lib, n])
        base = statistics.median(setup[baseline, n])
        out["setup_s"][n] = (ours, base)
        print(f"{'connect':>10} {n:>3} {ours * 1e3:9.3f} {base * 1e3:9.3f} {ours / base:7.3f}")
    return out


def figures(links: dict | None = None, baseline: dict | None = None) -> dict:
    """What docs/results.json keeps of a run (benchmarks/_results.py). ``links``: per link
    name, ``(sizes, plugin, iperf)`` as ``measure`` returns them; ``baseline``: ``compare``'s
    medians. GB/s per size and streams, and times as multiples (< 1: faster): bagua-net's
    time to move the largest size's bytes / iperf3's (-P N), this build's / the baseline's."""
    out: dict = {}
    for name, (sizes, plugin, iperf) in (links or {}).items():
        big = max(sizes)
        out[name] = {
            "gbs": {f"{_fmt_size(s)} | N={n}": plugin[n][s] for n in plugin for s in sizes},
            "iperf3_gbs": {f"N={n}": iperf[n] for n in iperf},
            "x_iperf3_time": {f"N={n}": iperf[n] / plugin[n][big] for n in plugin},
            "largest": _fmt_size(big)}
    if baseline:
        out["vs_baseline"] = {
            "gbs": {f"{_fmt_size(s)} | N={n}": {"this": a, "baseline": b, "x_baseline_time": b / a}
                    for (s, n), (a, b) in baseline["gbs"].items()},
            "setup_ms": {f"N={n}": {"this": 1e3 * a, "baseline": 1e3 * b, "x_baseline_time": a / b}
                         for n, (a, b) in baseline["setup_s"].items()}}
    return _results.rounded(out, 4)


# -- report -----------------------------------------------------------------------------------
def _fmt_size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def report(link_name, streams, sizes, plugin, iperf, capped) -> None:
    print(f"\n== {link_name}: bagua-net GB/s by message size and streams "
          f"(iperf3 -P N below, same link)")
    print(f"{'size':>10} " + " ".join(f"{f'N={n}':>9}" for n in streams))
    for s in sizes:
        print(f"{_fmt_size(s):>10} " + " ".join(f"{plugin[n][s]:9.4f}" for n in streams))
    print(f"{'iperf3':>10} " + " ".join(f"{iperf[n]:9.4f}" for n in streams))
    big = max(sizes)
    print(f"{'ratio':>10} " + " ".join(f"{plugin[n][big] / iperf[n]:9.2f}" for n in streams)
          + f"   (bagua-net at {_fmt_size(big)} / iperf3 -P N)")
    for n in streams:
        ours, ref = plugin[n][big], iperf[n]
        if capped:
            one = plugin[min(streams)][big] / min(streams)
            scale = ours / (one * n)
            print(f"  N={n}: scaling {scale:.2f} of N x 1-stream (target >= 0.80: "
                  f"{'met' if scale >= 0.8 else 'MISSED'}); vs iperf3 {ours / ref:.2f} "
                  f"(target >= 0.90: {'met' if ours >= 0.9 * ref else 'MISSED'})")
        else:
            print(f"  N={n}: vs iperf3 {ours / ref:.2f} (target >= 0.80: "
                  f"{'met' if ours >= 0.8 * ref else 'MISSED'})")


def _sizes(text: str) -> list[int]:
    out = []
    for item in text.split(","):
        item = item.strip().upper()
        mult = {"K": KiB, "M": MiB}.get(item[-1:], 1)
        out.append(int(item[:-1] if mult > 1 else item) * mult)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few points, well under a minute")
    ap.add_argument("--link", choices=["loopback", "netns", "both"], default="both")
    ap.add_argument("--streams", default=None, help="comma list (default 1,2,4,8)")
    ap.add_argument("--sizes", default=None, help="comma list, K/M suffixes (64K..256M)")
    ap.add_argument("--per-flow-mbit", type=float, default=100.0)
    ap.add_argument("--repeat", type=int, default=0,
                    help="rounds per point, median reported (default: loopback 3, quick 2; "
                         "veth 1)")
    ap.add_argument("--baseline-lib", metavar="PATH",
                    help="compare this build with another libnccl-net-bagua.so (loopback)")
    ap.add_argument("--role", choices=["recv", "send", "setup"], help=argparse.SUPPRESS)
    ap.add_argument("--lib", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--handle", help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=int, default=0, help=argparse.SUPPRESS)
    _results.add_options(ap)
    args = ap.parse_args(argv)
    if args.role:
        args.sizes = [int(s) for s in args.sizes.split(",")]
        {"recv": _role_recv, "send": _role_send, "setup": _role_setup}[args.role](args)
        return 0

    import bagua_net

    start = _results.started()
    streams = [int(s) for s in (args.streams or ("1,4" if args.quick else "1,2,4,8")).split(",")]
    print(f"bagua-net {bagua_net.__version__} ({bagua_net.library_path()}), host "
          f"{socket.gethostname()}, {os.cpu_count()} cores")
    if args.baseline_lib:
        sizes = _sizes(args.sizes) if args.sizes else ([64 * KiB, MiB, 16 * MiB] if args.quick
                                                        else FULL)
        base = compare(str(Path(args.baseline_lib).resolve()), streams, sizes,
                       (64 if args.quick else 512) * MiB, args.repeat or (4 if args.quick else 6))
        _results.record_from_args(args, "benchmarks/micro/net.py", figures(baseline=base), argv,
                                  start)
        return 0
    if shutil.which("iperf3") is None:
        print("iperf3 is missing (apt-get install -y iperf3): it is the reference")
        return 1
    links: dict = {}
    rc = _links(args, streams, links)
    if links:
        _results.record_from_args(args, "benchmarks/micro/net.py", figures(links), argv, start)
    return rc


def _links(args, streams, links: dict) -> int:
    """Measure and report each link ``--link`` names; ``links`` gets each one measured."""
    if args.link in ("loopback", "both"):
        sizes = _sizes(args.sizes) if args.sizes else ([64 * KiB, MiB, 16 * MiB] if args.quick
                                                        else FULL)
        budget = (64 if args.quick else 512) * MiB
        plugin, iperf = measure(Loopback(), streams, sizes, budget, 1 if args.quick else 3,
                                args.repeat or (2 if args.quick else 3))
        report(f"loopback, median of {args.repeat or (2 if args.quick else 3)} runs", streams,
               sizes, plugin, iperf, capped=False)
        links["loopback"] = (sizes, plugin, iperf)
    if args.link in ("netns", "both"):
        import _paths  # noqa: F401  (testbed on sys.path)
        try:
            from testbed import Testbed, flow_class, testbed_available
        except ImportError as err:
            print(f"\n== veth link skipped: benchmarks/testbed is not here ({err})")
            return 0
        ok, why = testbed_available()
        if not ok:
            print(f"\n== veth link skipped: {why}")
            return 0
        sizes = _sizes(args.sizes) if args.sizes else ([MiB, 16 * MiB] if args.quick else FULL)
        budget = (16 if args.quick else 48) * MiB
        with Testbed(n_hosts=2, bandwidth_mbit=None, per_flow_mbit=args.per_flow_mbit,
                     name="bnet") as tb:
            link = Namespaces(tb, flow_class, args.per_flow_mbit)
            plugin, iperf = measure(link, streams, sizes, budget, 2 if args.quick else 5,
                                    args.repeat or 1)
        report(link.name, streams, sizes, plugin, iperf, capped=True)
        links[link.name] = (sizes, plugin, iperf)
    return 0


if __name__ == "__main__":
    sys.exit(main())
