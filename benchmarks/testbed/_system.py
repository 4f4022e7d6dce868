"""Where the testbed's namespaces live, and how commands reach them.

Two modes:

- ``root``: this process may create network namespaces itself (root, or CAP_NET_ADMIN and
  CAP_SYS_ADMIN): ``ip netns add`` in the machine's own namespaces, the bridge in the root
  network namespace.  Nothing is routed to or from the machine's real interfaces.
- ``unshare``: an unprivileged user gets a private user + network + mount namespace from
  ``unshare --user --map-root-user`` (a *sandbox* process holds it); the bridge and the
  host namespaces live inside it and vanish with it.  Every command enters the sandbox
  with ``nsenter``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

_UNSHARE = ["unshare", "--user", "--map-root-user", "--net", "--mount", "--fork"]
# Inside the sandbox: a private /run so that `ip netns add` can bind-mount its files.
_SANDBOX_SCRIPT = ("mount -t tmpfs tmpfs /run && mkdir -p /run/netns && echo ready "
                   "&& exec sleep 2147483647")


#: Where iproute2 installs ``ip`` and ``tc``; a login shell's PATH has them, but a PATH made
#: for a user (``env -i``, cron, some CI runners) often lacks the sbin directories.
_SBIN = ("/usr/local/sbin", "/usr/sbin", "/sbin")


def _find_sbin_tools() -> None:
    """Put the sbin directories on PATH (for this process and the commands it starts) when
    ``ip`` or ``tc`` is missing from PATH but installed there."""
    path = os.environ.get("PATH", "")
    have = path.split(os.pathsep)
    extra = [d for d in _SBIN if d not in have
             and any(shutil.which(t, path=d) for t in ("ip", "tc"))]
    if extra and any(shutil.which(t) is None for t in ("ip", "tc")):
        os.environ["PATH"] = os.pathsep.join([p for p in (path, *extra) if p])


def _tools_missing() -> list[str]:
    _find_sbin_tools()
    return [t for t in ("ip", "tc") if shutil.which(t) is None]


def _probe_root() -> str | None:
    """None if this process can create a network namespace, else why not."""
    if os.geteuid() != 0:
        return "not root"
    probe = f"btprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _probe_unshare() -> str | None:
    if shutil.which("unshare") is None or shutil.which("nsenter") is None:
        return "unshare/nsenter (util-linux) not installed"
    r = subprocess.run([*_UNSHARE, "sh", "-c", "ip link add br0 type bridge"],
                       capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        return f"user namespaces unavailable: {r.stderr.strip() or r.returncode}"
    return None


def detect_mode() -> tuple[str | None, str]:
    """``(mode, why)``: mode is ``"root"``, ``"unshare"`` or None (with the reason)."""
    missing = _tools_missing()
    if missing:
        return None, f"{', '.join(missing)} not found (install iproute2)"
    why_root = _probe_root()
    if why_root is None:
        return "root", "root: network namespaces via `ip netns`"
    why_user = _probe_unshare()
    if why_user is None:
        return "unshare", f"unprivileged ({why_root}): user namespaces via `unshare`"
    return None, f"no network namespaces: {why_root}; {why_user}"


class Sandbox:
    """Runs commands either directly (root mode) or inside an ``unshare`` sandbox."""

    def __init__(self, mode: str):
        if mode not in ("root", "unshare"):
            raise ValueError(f"mode must be 'root' or 'unshare', got {mode!r}")
        self.mode = mode
        self._proc: subprocess.Popen | None = None
        if mode == "unshare":
            self._proc = subprocess.Popen([*_UNSHARE, "sh", "-c", _SANDBOX_SCRIPT],
                                          stdout=subprocess.PIPE, text=True,
                                          start_new_session=True)
            line = self._proc.stdout.readline().strip()
            if line != "ready":
                self.close()
                raise RuntimeError("could not start the unshare sandbox for the testbed")
            # The sandbox's pid as seen from here is `unshare`; its child holds the namespaces.
            self._target = _only_child(self._proc.pid)

    def prefix(self) -> list[str]:
        """argv prefix that runs a command where the testbed's namespaces are."""
        if self.mode == "root":
            return []
        # Entering the user namespace makes us its root (uid 0 maps to our own uid).
        return ["nsenter", "--target", str(self._target), "--user", "--mount", "--net",
                "--preserve-credentials"]

    def run(self, argv: list[str], *, check: bool = True, input: str | None = None,
            **kw) -> subprocess.CompletedProcess:
        r = subprocess.run([*self.prefix(), *argv], capture_output=True, text=True,
                           input=input, **kw)
        if check and r.returncode != 0:
            raise RuntimeError(f"testbed: `{' '.join(argv)}` failed ({r.returncode}): "
                               f"{(r.stderr or r.stdout).strip()}")
        return r

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._proc.wait()
        self._proc = None


def _only_child(pid: int, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    path = f"/proc/{pid}/task/{pid}/children"
    while time.monotonic() < deadline:
        try:
            kids = Path(path).read_text().split()
        except OSError:
            kids = []
        if kids:
            return int(kids[0])
        time.sleep(0.01)
    raise RuntimeError("the unshare sandbox has no child process")
