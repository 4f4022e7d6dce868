"""bagua_net: locate and enable libnccl-net-bagua.so, the multi-stream TCP plugin for NCCL."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from ._version import __version__

LIBRARY_NAME = "libnccl-net-bagua.so"
PLUGIN_NAME = "BaguaNet"

__all__ = ["LIBRARY_NAME", "PLUGIN_NAME", "__version__", "enable", "interfaces", "library_path"]


def library_path() -> str:
    """Absolute path of the installed ``libnccl-net-bagua.so``."""
    path = Path(__file__).resolve().parent / LIBRARY_NAME
    if not path.exists():
        raise RuntimeError(f"{LIBRARY_NAME} is missing from {path.parent}: reinstall bagua-net "
                           "(pip install --force-reinstall bagua-net)")
    return str(path)


def enable() -> str:
    """Make NCCL in this process and its children load the plugin; returns its path.

    Sets ``NCCL_NET_PLUGIN`` to the library's absolute path and puts its folder first on
    ``LD_LIBRARY_PATH`` (for NCCL versions that resolve the plugin by name).
    """
    path = library_path()
    os.environ["NCCL_NET_PLUGIN"] = path
    folder = str(Path(path).parent)
    parts = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
    if folder not in parts:
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join([folder, *parts])
    return path


def interfaces() -> list[tuple[str, str, int]]:
    """The network interfaces the plugin would use here, as ``(name, address, speed_mbps)``.

    Selected exactly as the plugin does at ``init``: ``NCCL_SOCKET_IFNAME`` (NCCL's syntax:
    ``eth0,eth1`` prefixes, ``=eth0`` exact names, ``^docker,lo`` exclusions) and
    ``NCCL_SOCKET_FAMILY``; unset, as NCCL: ``ib*``, else all but ``docker*``/``lo*``/``virbr*``,
    else ``docker*``, else ``lo``.
    Loads the library but starts nothing.
    """
    lib = ctypes.CDLL(library_path())
    fn = lib.baguaNetListInterfaces
    fn.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    fn.restype = ctypes.c_int
    buf = ctypes.create_string_buffer(8192)
    fn(buf, len(buf))
    out = []
    for line in buf.value.decode().splitlines():
        name, addr, speed = line.split(" ")
        out.append((name, addr, int(speed)))
    return out
