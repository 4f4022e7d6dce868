"""Finds libnccl without importing CUDA.

Search order: ``BAGUA_NCCL_LIBRARY``; a libnccl already mapped into this process (torch's
own, for instance); the ``nvidia-nccl-cu12``/``cu13`` wheels (those built for torch's CUDA
major version first); the system loader.  Nothing here runs at import time; the first call
loads the library once, under a lock.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import threading

_lock = threading.Lock()
_loaded: tuple[str, object] | None = None
_error: Exception | None = None

INSTALL_HINT = ("pip install 'bagua-comm[cu12]' (CUDA 12) or 'bagua-comm[cu13]' (CUDA 13)  "
                "(or: pip install nvidia-nccl-cu12 / nvidia-nccl-cu13)")
# Where the NVIDIA wheels put libnccl under a site-packages ``nvidia/`` directory:
# nvidia-nccl-cu12 and nvidia-nccl-cu13 (2.2x-2.3x) both use nccl/lib/; the per-CUDA
# cuXX/lib/ layout of the other CUDA 13 wheels is searched too.
WHEEL_LAYOUTS = ("nccl/lib", "cu13/lib", "cu12/lib")


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


def _torch_cuda_major() -> str | None:
    """"12" or "13" for a CUDA build of torch (read from its version, without CUDA)."""
    import sys

    torch = sys.modules.get("torch")
    cuda = getattr(getattr(torch, "version", None), "cuda", None)
    return cuda.split(".")[0] if cuda else None


def _wheel_flavour(nvidia_root: str, lib: str) -> str | None:
    """Which CUDA the wheel that installed ``lib`` targets ("12", "13"), from its dist-info."""
    rel = os.path.relpath(lib, nvidia_root)
    if rel.startswith(("cu12/", "cu13/")):
        return rel[2:4]
    site = os.path.dirname(nvidia_root)
    for major in ("13", "12"):
        if glob.glob(os.path.join(site, f"nvidia_nccl_cu{major}-*.dist-info")):
            return major
    return None


def _nvidia_roots() -> list[str]:
    spec = importlib.util.find_spec("nvidia")
    return list(spec.submodule_search_locations or []) if spec else []


def _from_wheels(roots: list[str] | None = None, cuda_major: str | None = None) -> list[str]:
    """libnccl files of the NVIDIA wheels under each ``nvidia/`` root (site-packages order),
    those built for ``cuda_major`` (default: torch's CUDA) first."""
    roots = _nvidia_roots() if roots is None else roots
    cuda_major = _torch_cuda_major() if cuda_major is None else cuda_major
    found = []
    for root in roots:
        for layout in WHEEL_LAYOUTS:
            for lib in sorted(glob.glob(os.path.join(root, layout, "libnccl.so*"))):
                found.append((_wheel_flavour(root, lib), lib))
    if cuda_major:  # stable: site-packages order within each rank
        found.sort(key=lambda item: 0 if item[0] == cuda_major else 1 if item[0] is None else 2)
    return [lib for _flavour, lib in found]


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
    nccl = load()
    return nccl._decode_version(nccl.get_version())
