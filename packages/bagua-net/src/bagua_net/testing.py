"""Drive ``libnccl-net-bagua.so`` through its NCCL function table, the way NCCL's proxy does.

``Plugin`` loads the library with ctypes, looks up ``ncclNetPlugin_v<N>`` and calls its slots:
init, devices, getProperties, listen, connect/accept (retried until both return a comm, as the
non-blocking v6+ interface requires), regMr, isend/irecv, test, close. ``run_pair`` runs two
functions in two spawned processes joined by a pipe (to pass the listen handle), with a hard
timeout and the children's tracebacks reported. Used by the package's tests and by
``benchmarks/micro/net.py``; nothing here needs anything but the standard library.
"""

from __future__ import annotations

import ctypes as C
import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

from . import _abi, library_path

__all__ = ["Plugin", "PluginError", "run_pair"]


_LOGGERS: list = []


class PluginError(RuntimeError):
    """A plugin call returned a non-zero ncclResult_t."""

    def __init__(self, call: str, code: int, log: list[str] | None = None):
        self.call, self.code = call, code
        tail = f"; last log: {log[-1]}" if log else ""
        super().__init__(f"{call} returned ncclResult_t {code}{tail}")

    def __reduce__(self):
        return (PluginError, (self.call, self.code))


class Plugin:
    """The plugin's function table for one interface version (default: the newest, 12)."""

    def __init__(self, version: int = 12, path: str | None = None):
        if version not in _abi.VERSIONS:
            raise ValueError(f"version must be one of {_abi.VERSIONS}, got {version!r}")
        self.version = version
        self.lib = C.CDLL(path or library_path())
        self.table = _abi.table_type(version).in_dll(self.lib, f"ncclNetPlugin_v{version}")
        self.name = self.table.name.decode()
        self._fn = {}
        for slot, proto in _abi.prototypes(version).items():
            addr = getattr(self.table, slot)
            self._fn[slot] = proto(addr) if addr else None
        self.log: list[str] = []
        self._logger = _abi.LOGGER(self._on_log)
        _LOGGERS.append(self._logger)  # the library keeps the last one: never free it
        self._ctx = C.c_void_p()

    def _on_log(self, level, flags, file, line, fmt, msg):
        text = (msg if fmt == b"%s" else fmt or b"").decode(errors="replace")
        self.log.append(f"{'WARN' if level == 2 else 'INFO'} {text}")

    def _call(self, slot: str, *args) -> None:
        rc = self._fn[slot](*args)
        if rc != 0:
            raise PluginError(slot, rc, self.log)

    def slot(self, name: str) -> bool:
        """Whether the table fills slot ``name`` (NULL slots are optional in NCCL)."""
        return bool(getattr(self.table, name))

    # -- set-up -----------------------------------------------------------------------
    def init(self) -> None:
        if self.version < 10:
            self._call("init", self._logger)
        elif self.version == 10:
            self._call("init", self._logger, None)
        else:
            self._call("init", C.byref(self._ctx), 0, None, self._logger, None)

    def finalize(self) -> None:
        if self.version >= 11:
            self._call("finalize", self._ctx)

    def devices(self) -> int:
        n = C.c_int(-1)
        self._call("devices", C.byref(n))
        return n.value

    def properties(self, dev: int = 0) -> dict[str, Any]:
        props = _abi.PROPS[self.version]()
        self._call("getProperties", dev, C.byref(props))
        out = {}
        for name, _ in props._fields_:
            value = getattr(props, name)
            if name == "vProps":
                value = list(value.devs[: value.ndevs])
            elif isinstance(value, bytes):
                value = value.decode()
            out[name] = value
        return out

    def listen(self, dev: int = 0) -> tuple[bytes, int]:
        handle = C.create_string_buffer(_abi.HANDLE_SIZE)
        comm = C.c_void_p()
        args = (dev, handle, C.byref(comm))
        self._call("listen", *((self._ctx, *args) if self.version >= 11 else args))
        return handle.raw, comm.value

    def connect_once(self, handle: C.Array, dev: int = 0) -> int | None:
        """One non-blocking connect() call; ``handle`` must be the same buffer every time."""
        comm, devcomm = C.c_void_p(), C.c_void_p()
        if self.version == 6:
            self._call("connect", dev, handle, C.byref(comm))
        elif self.version < 10:
            self._call("connect", dev, handle, C.byref(comm), C.byref(devcomm))
        elif self.version == 10:
            self._call("connect", dev, None, handle, C.byref(comm), C.byref(devcomm))
        else:
            self._call("connect", self._ctx, dev, handle, C.byref(comm), C.byref(devcomm))
        return comm.value

    def accept_once(self, listen_comm: int) -> int | None:
        comm, devcomm = C.c_void_p(), C.c_void_p()
        if self.version == 6:
            self._call("accept", C.c_void_p(listen_comm), C.byref(comm))
        else:
            self._call("accept", C.c_void_p(listen_comm), C.byref(comm), C.byref(devcomm))
        return comm.value

    def connect(self, handle: bytes, dev: int = 0, timeout: float = 30.0) -> int:
        """Call connect() until it returns a send comm (NCCL's retry loop)."""
        buf = C.create_string_buffer(handle, _abi.HANDLE_SIZE)
        return _retry(lambda: self.connect_once(buf, dev), "connect", timeout)

    def accept(self, listen_comm: int, timeout: float = 30.0) -> int:
        """Call accept() until it returns a receive comm."""
        return _retry(lambda: self.accept_once(listen_comm), "accept", timeout)

    def reg_mr(self, comm: int, buf, size: int | None = None) -> int:
        mh = C.c_void_p()
        size = len(buf) if size is None else size
        self._call("regMr", C.c_void_p(comm), _addr(buf), size, _abi.PTR_HOST, C.byref(mh))
        return mh.value

    def dereg_mr(self, comm: int, mhandle: int) -> None:
        self._call("deregMr", C.c_void_p(comm), C.c_void_p(mhandle))

    # -- data path ----------------------------------------------------------------------
    def isend(self, comm: int, buf, size: int, mhandle: int | None = None) -> int | None:
        """Post a send; None when the plugin cannot take it now (too many outstanding)."""
        req = C.c_void_p()
        args = [C.c_void_p(comm), _addr(buf), size, 0, C.c_void_p(mhandle)]
        if self.version >= 10:
            args.append(None)
        self._call("isend", *args, C.byref(req))
        return req.value

    def irecv(self, comm: int, buf, size: int, mhandle: int | None = None) -> int | None:
        req = C.c_void_p()
        data = (C.c_void_p * 1)(_addr(buf))
        sizes = ((C.c_int if self.version < 9 else C.c_size_t) * 1)(size)
        tags = (C.c_int * 1)(0)
        mhs = (C.c_void_p * 1)(mhandle)
        args = [C.c_void_p(comm), 1, data, sizes, tags, mhs]
        if self.version >= 10:
            args.append(None)
        self._call("irecv", *args, C.byref(req))
        return req.value

    def test(self, request: int) -> tuple[bool, int]:
        done, size = C.c_int(0), C.c_int(-1)
        self._call("test", C.c_void_p(request), C.byref(done), C.byref(size))
        return bool(done.value), size.value

    def wait(self, request: int, timeout: float = 60.0) -> int:
        """Poll test() until the request is done; returns the size it reports."""
        deadline = time.monotonic() + timeout
        spins = 0
        while True:
            done, size = self.test(request)
            if done:
                return size
            spins += 1
            if spins > 1000:
                time.sleep(1e-4)
            if time.monotonic() > deadline:
                raise TimeoutError(f"request not done after {timeout} s")

    def send(self, comm: int, buf, size: int | None = None, timeout: float = 60.0) -> int:
        size = len(buf) if size is None else size
        req = _retry(lambda: self.isend(comm, buf, size), "isend", timeout)
        return self.wait(req, timeout)

    def recv(self, comm: int, buf, size: int | None = None, timeout: float = 60.0) -> int:
        size = len(buf) if size is None else size
        req = _retry(lambda: self.irecv(comm, buf, size), "irecv", timeout)
        return self.wait(req, timeout)

    def close_send(self, comm: int) -> None:
        self._call("closeSend", C.c_void_p(comm))

    def close_recv(self, comm: int) -> None:
        self._call("closeRecv", C.c_void_p(comm))

    def close_listen(self, comm: int) -> None:
        self._call("closeListen", C.c_void_p(comm))


def _addr(buf) -> int | None:
    """Address of a writable buffer (bytearray, ctypes array) or an int address."""
    if buf is None or isinstance(buf, int):
        return buf
    if isinstance(buf, C.Array):
        return C.addressof(buf)
    if len(buf) == 0:
        return C.addressof(C.c_char.from_buffer(bytearray(1)))
    return C.addressof(C.c_char.from_buffer(buf))


def _retry(step: Callable[[], Any], what: str, timeout: float):
    deadline = time.monotonic() + timeout
    while True:
        out = step()
        if out:
            return out
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not complete within {timeout} s")
        time.sleep(1e-4)


# -- two processes ----------------------------------------------------------------------------
def _child(index, fn, conn, args, results):
    try:
        results.put((index, "ok", fn(conn, *args)))
    except BaseException as err:  # report everything, including KeyboardInterrupt
        results.put((index, "error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))


def run_pair(first: Callable, second: Callable, args: tuple = (), timeout: float = 60.0,
             env: dict[str, str] | None = None) -> tuple[Any, Any]:
    """Run ``first(conn, *args)`` and ``second(conn, *args)`` in two spawned processes.

    ``conn`` is one end of a duplex pipe joining them (to pass a listen handle). Returns both
    return values (None for a child that exits with status 0 without returning, e.g. one that
    plays a peer dying with ``os._exit(0)``). Raises ``RuntimeError`` with the child's
    traceback if either fails, and ``TimeoutError`` (after killing both) if they are not done
    within ``timeout`` seconds. ``env`` entries are set in the children only.
    """
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    results = ctx.Queue()
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        procs = [ctx.Process(target=_child, args=(i, fn, c, args, results), daemon=True)
                 for i, (fn, c) in enumerate(((first, a), (second, b)))]
        for p in procs:
            p.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    names = (first.__name__, second.__name__)
    out: dict[int, Any] = {}
    exited_at: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < 2:
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"{names[0]}/{names[1]} still running after {timeout} s")
            try:
                index, status, value = results.get(timeout=0.2)
            except queue.Empty:
                for i, p in enumerate(procs):
                    if i in out or p.exitcode is None:
                        continue
                    if now - exited_at.setdefault(i, now) < 1.0:
                        continue  # its result may still be in the queue
                    if p.exitcode != 0:
                        raise RuntimeError(f"{names[i]} died with exit code {p.exitcode}") from None
                    out[i] = None
                continue
            if status == "error":
                raise RuntimeError(f"{names[index]} failed:\n{value}")
            out[index] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return out[0], out[1]
