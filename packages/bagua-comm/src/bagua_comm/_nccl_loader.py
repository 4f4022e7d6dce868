"""Finds libnccl without importing CUDA (DESIGN.md section 3).

Search order: ``BAGUA_NCCL_LIBRARY``; a libnccl already mapped into this process (torch's
own, for instance); the ``nvidia-nccl-cu12``/``cu13`` wheels; the system loader.  Nothing here
runs at import time; the first call loads the library once, under a lock.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import threading

_lock = threading.Lock()
_loaded: tuple[str, object] | None = None
_error: Exception | None = None

INSTALL_HINT = "pip install 'bagua-comm[cu12]'  (or: pip install nvidia-nccl-cu12)"


def _mapped_in_process() -> str | None:
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip().split(maxsplit=5)[-1]
                if "/libnccl.so" in path and os.path.exists(path):
                    return path
    except OSError:
        pass
    return None


def _from_wheels() -> list[str]:
    found = []
    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations or []) if spec else []
    for root in roots:
        for pattern in ("nccl/lib/libnccl.so*", "cu13/lib/libnccl.so*", "cu12/lib/libnccl.so*"):
            found += sorted(glob.glob(os.path.join(root, pattern)))
    return found


def candidates() -> list[tuple[str, str]]:
    """(where, path) pairs in search order."""
    out = []
    env = os.environ.get("BAGUA_NCCL_LIBRARY")
    if env:
        out.append(("BAGUA_NCCL_LIBRARY", env))
    mapped = _mapped_in_process()
    if mapped:
        out.append(("process", mapped))
    out += [("wheel", p) for p in _from_wheels()]
    out.append(("system", "libnccl.so.2"))
    return out


def load():
    """The loaded library module (``bagua_comm._nccl``), loading it on first use.

    Raises RuntimeError (naming the pip command) when no libnccl can be loaded.
    """
    global _loaded, _error
    with _lock:
        if _loaded is not None:
            return _loaded[1]
        from . import _nccl

        errors = []
        env_set = bool(os.environ.get("BAGUA_NCCL_LIBRARY"))
        for where, path in candidates():
            try:
                _nccl.load_library(path)
            except OSError as err:
                errors.append(f"{where}: {err}")
                if where == "BAGUA_NCCL_LIBRARY" and env_set:
                    _error = RuntimeError(f"BAGUA_NCCL_LIBRARY={path} could not be loaded: {err}")
                    raise _error from err
                continue
            _loaded = (path, _nccl)
            return _nccl
        _error = RuntimeError("libnccl was not found (" + "; ".join(errors) + "). "
                              f"Install it with: {INSTALL_HINT}")
        raise _error


def nccl_available() -> bool:
    """True when libnccl can be loaded in this process (no GPU needed)."""
    try:
        load()
    except RuntimeError:
        return False
    return True


def nccl_library_path() -> str | None:
    return _loaded[0] if nccl_available() and _loaded else None


def nccl_version() -> tuple[int, int, int] | None:
    """(major, minor, patch) of the loadable libnccl, or None."""
    if not nccl_available():
        return None
    code = load().get_version()
    major, rest = divmod(code, 10000) if code >= 10000 else divmod(code, 1000)
    minor, patch = divmod(rest, 100)
    return major, minor, patch
