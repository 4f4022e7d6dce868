"""The testbed: N emulated hosts on a shaped, private switch.

Host ``i`` is the network namespace ``<name>-h<i>`` with interface ``eth0`` at
``198.18.<s>.<i+1>/24`` (198.18.0.0/15 is reserved for benchmarking; ``s`` is derived from
the name).  Its veth peer ``<name>-v<i>`` sits on the bridge ``<name>-br`` in the root (or
sandbox) network namespace, which has no address, so traffic only flows between the hosts.
Both ends of every veth are shaped (:mod:`._shaping`): each host has a full-duplex link of
``bandwidth_mbit`` to the switch.  With ``latency_ms`` the hosts reach each other through the
delay line instead (:mod:`._latency`): a TUN device ``dl0`` per host, shaped the same way.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from ._latency import DelayLineProcess, latency_matrix
from ._shaping import shape_commands, validate_rates
from ._system import Sandbox, detect_mode
from .delay import IFNAME as DELAY_IFNAME

_NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,7}$")
_STATE_DIR = Path(os.environ.get("BAGUA_TESTBED_STATE", "/run/bagua-testbed"))
_MAX_HOSTS = 250
_ETC_NETNS = Path("/etc/netns")
IFNAME = "eth0"


@dataclass(frozen=True)
class Host:
    """One emulated host: ``netns`` is its namespace, ``addr`` its IPv4 address."""

    name: str
    netns: str
    addr: str
    ifname: str


_mode_cache: tuple[str | None, str] | None = None


def testbed_available() -> tuple[bool, str]:
    """``(ok, why)``: whether a testbed can be made here, and how (or why not)."""
    global _mode_cache
    if _mode_cache is None:
        _mode_cache = detect_mode()
    mode, why = _mode_cache
    return mode is not None, why


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"name must be 1-8 lowercase letters/digits starting with a letter "
                         f"(it prefixes interface names, limited to 15 bytes), got {name!r}")


def _subnet(name: str) -> int:
    return zlib.crc32(name.encode()) % 256


def _state_file(name: str) -> Path:
    return _STATE_DIR / f"{name}.json"


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def leftovers(name: str) -> dict[str, list[str]]:
    """Namespaces and links of testbed ``name`` that exist now (root mode only)."""
    _check_name(name)
    ns_re = re.compile(rf"^{name}-h\d+$")
    link_re = re.compile(rf"^{name}-(br|v\d+)$")
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    netns = [ln.split()[0] for ln in r.stdout.splitlines() if ln.strip()]
    links = sorted(os.listdir("/sys/class/net")) if os.path.isdir("/sys/class/net") else []
    return {"netns": sorted(n for n in netns if ns_re.match(n)),
            "links": [ln for ln in links if link_re.match(ln)]}


def _kill_netns_processes(sandbox: Sandbox | None, netns: str) -> None:
    run = sandbox.run if sandbox else (lambda argv, check=False: subprocess.run(
        argv, capture_output=True, text=True))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [int(p) for p in run(["ip", "netns", "pids", netns], check=False).stdout.split()]
        if not pids:
            return
        for p in pids:
            try:
                os.kill(p, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and any(_pid_alive(p) for p in pids):
            time.sleep(0.05)


def sweep(name: str, *, force: bool = False) -> dict[str, list[str]]:
    """Remove what a killed run of testbed ``name`` left behind (root mode); returns it.

    Refuses (``RuntimeError``) while the process that made the testbed is still alive,
    unless ``force``.
    """
    _check_name(name)
    state = _state_file(name)
    if state.exists() and not force:
        try:
            info = json.loads(state.read_text())
        except (OSError, ValueError):
            info = {}
        owner, kept = int(info.get("pid", 0)), bool(info.get("kept", False))
        if kept:
            raise RuntimeError(f"testbed {name!r} was brought up to stay; take it down with "
                               f"`python benchmarks/testbed down --name {name}`")
        if owner == os.getpid() or (owner and _pid_alive(owner)):
            raise RuntimeError(f"testbed {name!r} is in use by pid {owner}; pick another "
                               f"name= or stop that process")
    found = leftovers(name)
    for ns in found["netns"]:
        _kill_netns_processes(None, ns)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    for link in found["links"]:
        subprocess.run(["ip", "link", "del", link], capture_output=True)
    ns_re = re.compile(rf"^{name}-h\d+$")
    if _ETC_NETNS.is_dir():
        for d in _ETC_NETNS.iterdir():
            if ns_re.match(d.name):
                shutil.rmtree(d, ignore_errors=True)
    state.unlink(missing_ok=True)
    return found


class Testbed:
    """N emulated hosts with shaped links; a context manager that always tears down.

    ``bandwidth_mbit`` caps each host's link (both directions; None: unshaped),
    ``per_flow_mbit`` caps each TCP flow (told apart by source port; None: no cap).
    ``latency_ms`` is the one-way delay between two hosts (a number, or an n x n matrix, see
    :func:`regions`; 0/None: none), added by a user-space delay line (:mod:`.delay`).
    ``tcp_slow_start_after_idle`` sets that kernel switch in every host's namespace (None:
    the kernel's default, on). On, a TCP connection idle for one retransmission timeout
    restarts from its initial window, so a step's burst over a far link pays several round
    trips of slow start; WAN-tuned hosts turn it off.  Linux skips that restart under BBR,
    and the hosts inherit the machine's congestion control (:meth:`tcp_settings`).
    ``mode`` is ``"auto"`` (root if possible, else ``unshare``), ``"root"`` or ``"unshare"``.
    With ``keep=True`` the hosts outlive this object (``python benchmarks/testbed up``).
    """

    __test__ = False  # not a pytest test class, despite the name

    def __init__(self, n_hosts: int = 2, bandwidth_mbit: float | None = 100,
                 per_flow_mbit: float | None = None, name: str = "bt", *,
                 mode: str = "auto", keep: bool = False, latency_ms=None,
                 tcp_slow_start_after_idle: bool | None = None):
        _check_name(name)
        if tcp_slow_start_after_idle is not None and not isinstance(tcp_slow_start_after_idle,
                                                                     bool):
            raise ValueError(f"tcp_slow_start_after_idle must be True, False or None (the "
                             f"kernel's default), got {tcp_slow_start_after_idle!r}")
        if isinstance(n_hosts, bool) or not isinstance(n_hosts, int) or not (
                1 <= n_hosts <= _MAX_HOSTS):
            raise ValueError(f"n_hosts must be an int in [1, {_MAX_HOSTS}], got {n_hosts!r}")
        validate_rates(bandwidth_mbit, per_flow_mbit)
        latency_matrix(latency_ms, n_hosts)  # validates before anything is made
        if mode not in ("auto", "root", "unshare"):
            raise ValueError(f"mode must be 'auto', 'root' or 'unshare', got {mode!r}")
        if mode == "auto":
            ok, why = testbed_available()
            if not ok:
                raise RuntimeError(f"cannot make a testbed here: {why}")
            mode = _mode_cache[0]
        self.name = name
        self.mode = mode
        self.n_hosts = n_hosts
        self.bandwidth_mbit = bandwidth_mbit
        self.per_flow_mbit = per_flow_mbit
        self.keep = keep
        s = _subnet(name)
        self.hosts = [Host(f"h{i}", f"{name}-h{i}", f"198.18.{s}.{i + 1}", IFNAME)
                      for i in range(n_hosts)]
        self._owner = os.getpid()
        self._lock = threading.Lock()
        self._up = False
        self._procs: list[subprocess.Popen] = []
        self._old_handlers: dict[int, object] = {}
        self._sandbox: Sandbox | None = None
        self._line: DelayLineProcess | None = None
        self.latency_ms = None
        self.tcp_slow_start_after_idle = tcp_slow_start_after_idle
        self._bring_up()
        if latency_ms:
            self.set_latency(latency_ms)

    # -- lifecycle --------------------------------------------------------------------------
    def _bring_up(self) -> None:
        if self.mode == "root":
            sweep(self.name)  # a killed earlier run's leftovers (refuses if still in use)
            _STATE_DIR.mkdir(parents=True, exist_ok=True)
            _state_file(self.name).write_text(json.dumps(
                {"pid": self._owner, "kept": self.keep, "n_hosts": self.n_hosts,
                 "bandwidth_mbit": self.bandwidth_mbit, "per_flow_mbit": self.per_flow_mbit}))
        self._sandbox = Sandbox(self.mode)
        self._up = True
        if not self.keep:
            atexit.register(self.close)
        try:
            self._create()
        except BaseException:
            self.close(force=True)
            raise

    def _create(self) -> None:
        run = self._sandbox.run
        br = f"{self.name}-br"
        cmds = [f"link add {br} type bridge", f"link set {br} up"]
        for i, h in enumerate(self.hosts):
            run(["ip", "netns", "add", h.netns])
            cmds += [f"link add {self.name}-v{i} type veth peer name {h.ifname} netns {h.netns}",
                     f"link set {self.name}-v{i} master {br} up"]
        run(["ip", "-batch", "-"], input="\n".join(cmds) + "\n")
        if self.mode == "root":
            self._write_hosts_files()
        for h in self.hosts:
            run(["ip", "-n", h.netns, "-batch", "-"], input=(
                f"link set lo up\nlink set {h.ifname} up\n"
                f"addr add {h.addr}/24 dev {h.ifname}\n"))
        if self.tcp_slow_start_after_idle is not None:
            flag = int(self.tcp_slow_start_after_idle)
            for h in self.hosts:
                run(["ip", "netns", "exec", h.netns, "sysctl", "-q", "-w",
                     f"net.ipv4.tcp_slow_start_after_idle={flag}"])
        self.reshape(self.bandwidth_mbit, self.per_flow_mbit)
        # Wait for the links to leave IPv4 DAD-free "tentative" states / carrier down.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            states = [run(["ip", "-n", h.netns, "-o", "link", "show", h.ifname]).stdout
                      for h in self.hosts]
            if all("LOWER_UP" in s for s in states):
                break
            time.sleep(0.05)

    def _write_hosts_files(self) -> None:
        # `ip netns exec` bind-mounts /etc/netns/<ns>/hosts over /etc/hosts: the hosts know
        # each other by name (and reverse lookups of their addresses stop failing).
        table = "127.0.0.1 localhost\n" + "".join(f"{h.addr} {h.netns}\n" for h in self.hosts)
        for h in self.hosts:
            d = _ETC_NETNS / h.netns
            d.mkdir(parents=True, exist_ok=True)
            (d / "hosts").write_text(table)

    def torchrun_argv(self, i: int, script_argv, *, nproc_per_node: int = 1,
                      port: int = 29400, rdzv_id: str = "bagua", python: str | None = None,
                      extra=(), nnodes: str | None = None, rdzv_conf: str = "") -> list[str]:
        """torchrun command line for host ``i`` of a job spanning every host.

        c10d rendezvous at host 0; ``is_host`` and ``--local-addr`` are explicit because the
        namespaces share the machine's hostname, which resolves to none of their addresses.
        ``nnodes`` overrides ``--nnodes`` (e.g. ``"2:3"`` for an elastic job); ``rdzv_conf``
        adds ``key=value`` pairs to ``--rdzv-conf`` (e.g. ``"last_call_timeout=2"``).
        """
        if not 0 <= i < self.n_hosts:
            raise ValueError(f"host index must be in [0, {self.n_hosts}), got {i!r}")
        conf = ",".join(filter(None, [f"is_host={int(i == 0)}", rdzv_conf]))
        return [python or sys.executable, "-m", "torch.distributed.run",
                "--nnodes", nnodes or str(self.n_hosts), "--nproc-per-node", str(nproc_per_node),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.hosts[0].addr}:{port}",
                "--rdzv-id", rdzv_id, "--rdzv-conf", conf,
                "--local-addr", self.hosts[i].addr, *extra, *map(str, script_argv)]

    def set_link(self, i: int, up: bool) -> None:
        """Bring host ``i``'s interface up or down: down, its peers see silence (no FIN, no
        RST), as when a machine loses power or its network."""
        self._argv(i, ["true"])  # validates i, requires up
        self._sandbox.run(["ip", "-n", self.hosts[i].netns, "link", "set", self.hosts[i].ifname,
                           "up" if up else "down"])

    def kill_host(self, i: int) -> int:
        """SIGKILL every process running in host ``i`` (a lost machine); returns how many."""
        self._argv(i, ["true"])
        out = self._sandbox.run(["ip", "netns", "pids", self.hosts[i].netns], check=False).stdout
        pids = [int(p) for p in out.split()]
        if pids:
            self._sandbox.run(["kill", "-9", *map(str, pids)], check=False)
        return len(pids)

    def reshape(self, bandwidth_mbit: float | None = None,
                per_flow_mbit: float | None = None) -> None:
        """Give every link a new shape (both directions), without restarting anything."""
        validate_rates(bandwidth_mbit, per_flow_mbit)
        self._require_up()
        for i, h in enumerate(self.hosts):
            up = shape_commands(h.ifname, bandwidth_mbit, per_flow_mbit)
            down = shape_commands(f"{self.name}-v{i}", bandwidth_mbit, per_flow_mbit)
            self._tc(["-n", h.netns], up)
            self._tc([], down)
        self.bandwidth_mbit = bandwidth_mbit
        self.per_flow_mbit = per_flow_mbit
        if self._line is not None:
            self._shape_line()

    def _shape_line(self) -> None:
        # Uplink: the kernel's tbf/htb on dl0's egress; downlink: the line's token bucket.
        for h in self.hosts:
            self._tc(["-n", h.netns], shape_commands(self.data_ifname, self.bandwidth_mbit,
                                                     self.per_flow_mbit))
        self._line.send(down_mbit=self.bandwidth_mbit)

    def set_latency(self, latency_ms=None) -> None:
        """Set the one-way delay between hosts (ms; a number or an n x n matrix; 0/None:
        none).  Connections survive the change only while the delay line keeps running
        (delay to delay); switching latency on or off reroutes the hosts' traffic."""
        matrix = latency_matrix(latency_ms, self.n_hosts)
        self._require_up()
        if matrix is None:
            if self._line is not None:
                self._line.stop()
                self._line = None
        elif self._line is None:
            self._line = DelayLineProcess(self._sandbox, self.hosts, matrix,
                                          self.bandwidth_mbit)
            self._shape_line()
        else:
            self._line.send(delay_ms=matrix)
        self.latency_ms = None if matrix is None else latency_ms

    @property
    def data_ifname(self) -> str:
        """The interface a host's traffic to other hosts leaves by: ``eth0``, or the delay
        line's ``dl0`` while latency is on (count bytes there)."""
        return DELAY_IFNAME if self._line is not None else IFNAME

    def delay_stats(self) -> dict | None:
        """The delay line's counters (None without latency): ``packets``, ``bytes``,
        ``dropped_queue``, ``cpu_s``, ``late_max_ms`` (how late the latest packet left),
        ``late_over_1ms`` (packets more than 1 ms late: the line falling behind)."""
        return self._line.stats() if self._line is not None else None

    def _tc(self, ns: list[str], lines: list[str]) -> None:
        # The first line (deleting the old root qdisc) may fail harmlessly: run it alone.
        self._sandbox.run(["tc", *ns, *lines[0].split()], check=False)
        if len(lines) > 1:
            self._sandbox.run(["tc", *ns, "-batch", "-"], input="\n".join(lines[1:]) + "\n")

    def close(self, force: bool = False) -> None:
        """Kill processes started in the hosts, delete the namespaces and links (idempotent)."""
        if os.getpid() != self._owner:
            return  # a forked child must not tear down its parent's testbed
        with self._lock:
            if not self._up or (self.keep and not force):
                return
            self._up = False
        for p in self._procs:
            if p.poll() is None:
                p.kill()
        if self._line is not None:
            self._line.stop()
            self._line = None
        for h in self.hosts:
            _kill_netns_processes(self._sandbox, h.netns)
        for p in self._procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if self.mode == "root":
            sweep(self.name, force=True)
        if self._sandbox is not None:
            self._sandbox.close()
        self._restore_signals()
        try:
            atexit.unregister(self.close)
        except Exception:
            pass

    def __enter__(self) -> Testbed:
        if threading.current_thread() is threading.main_thread() and not self.keep:
            for sig in (signal.SIGINT, signal.SIGTERM):
                if signal.getsignal(sig) is signal.SIG_IGN:
                    continue  # an ignored signal stays ignored (e.g. jobs started with `&`)
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _on_signal(self, signum, frame) -> None:
        self.close()
        self._restore_signals()
        signal.raise_signal(signum)  # the previous behaviour (KeyboardInterrupt, exit...)

    def _restore_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)
        self._old_handlers.clear()

    def _require_up(self) -> None:
        if not self._up:
            raise RuntimeError(f"testbed {self.name!r} is down")

    # -- running things in a host -----------------------------------------------------------
    def _argv(self, i: int, argv) -> list[str]:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.n_hosts:
            raise ValueError(f"host index must be in [0, {self.n_hosts}), got {i!r}")
        if isinstance(argv, str) or not argv:
            raise ValueError("argv must be a non-empty list of strings (no shell string)")
        self._require_up()
        return [*self._sandbox.prefix(), "ip", "netns", "exec", self.hosts[i].netns,
                *map(str, argv)]

    def env(self, i: int, base: dict | None = None) -> dict:
        """Environment for host ``i``: gloo and torch bind to the host's interface."""
        env = dict(os.environ if base is None else base)
        env.setdefault("GLOO_SOCKET_IFNAME", self.hosts[i].ifname)
        env.setdefault("TP_SOCKET_IFNAME", self.hosts[i].ifname)
        env.setdefault("NCCL_SOCKET_IFNAME", self.hosts[i].ifname)
        return env

    def popen(self, i: int, argv, **popen_kw) -> subprocess.Popen:
        """Start ``argv`` inside host ``i``'s namespace (killed at teardown)."""
        popen_kw["env"] = self.env(i, popen_kw.get("env"))
        p = subprocess.Popen(self._argv(i, argv), **popen_kw)
        self._procs.append(p)
        return p

    def run(self, i: int, argv, **run_kw) -> subprocess.CompletedProcess:
        """Run ``argv`` inside host ``i``'s namespace to completion."""
        run_kw["env"] = self.env(i, run_kw.get("env"))
        return subprocess.run(self._argv(i, argv), **run_kw)

    def tcp_settings(self, i: int = 0) -> dict:
        """The TCP switches host ``i``'s connections run under (strings as the kernel writes
        them; None where unreadable): ``tcp_congestion_control``, which a host inherits from
        the machine (a namespace may not change it here), and ``tcp_slow_start_after_idle``,
        which has no effect under BBR (Linux exempts it from the restart after idle)."""
        out = {}
        for key in ("tcp_congestion_control", "tcp_slow_start_after_idle"):
            r = self.run(i, ["cat", f"/proc/sys/net/ipv4/{key}"], capture_output=True,
                         text=True, check=False)
            out[key] = r.stdout.strip() if r.returncode == 0 else None
        return out

    def __repr__(self) -> str:
        return (f"Testbed(name={self.name!r}, mode={self.mode!r}, hosts={self.n_hosts}, "
                f"bandwidth_mbit={self.bandwidth_mbit}, per_flow_mbit={self.per_flow_mbit}, "
                f"latency_ms={self.latency_ms})")
