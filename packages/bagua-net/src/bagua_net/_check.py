"""Would a given libnccl load this plugin? Answered from the symbols, without a GPU.

NCCL opens ``NCCL_NET_PLUGIN`` with dlopen and looks up ``ncclNetPlugin_v<N>`` for each
interface version it knows, newest first; it uses the first table found. The versions a libnccl
knows are the ``ncclNetPlugin_v<N>`` names compiled into it, so reading them from the file and
comparing with the symbols the plugin exports tells which table NCCL would take, if any.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import re
import sys
from dataclasses import dataclass, field

_PROBE = re.compile(rb"ncclNetPlugin_v(\d+)\x00")
_VERSION = re.compile(rb"NCCL version (\d+\.\d+\.\d+)")


@dataclass
class NcclCheck:
    """What :func:`check_nccl` found: ``loads`` and the interface version NCCL would use."""

    nccl_path: str
    nccl_version: str | None
    probed: list[int]                      # versions the libnccl looks up, newest first
    exported: list[int]                    # versions the plugin exports
    chosen: int | None                     # the table NCCL would take
    names: dict[int, str] = field(default_factory=dict)  # plugin name in each exported table

    @property
    def loads(self) -> bool:
        return self.chosen is not None and self.names.get(self.chosen) == "BaguaNet"


def find_libnccl() -> str | None:
    """A libnccl to check when none is given: the nvidia-nccl wheel's, torch's, the system's."""
    for base in sys.path:
        for pattern in ("nvidia/nccl/lib/libnccl.so*", "torch/lib/libnccl.so*"):
            hits = sorted(glob.glob(os.path.join(base, pattern)))
            if hits:
                return hits[0]
    return ctypes.util.find_library("nccl")


def check_nccl(nccl_path: str, plugin_path: str | None = None) -> NcclCheck:
    """Compare the plugin versions ``nccl_path`` probes with those the plugin exports."""
    from . import library_path

    if not os.path.isfile(nccl_path):
        raise ValueError(f"nccl_path must be an existing libnccl file, got {nccl_path!r}")
    with open(nccl_path, "rb") as f:
        blob = f.read()
    probed = sorted({int(m) for m in _PROBE.findall(blob)}, reverse=True)
    match = _VERSION.search(blob)
    version = match.group(1).decode() if match else None
    plugin = ctypes.CDLL(plugin_path or library_path())
    exported, names = [], {}
    for v in range(2, 33):
        try:
            table = ctypes.c_char_p.in_dll(plugin, f"ncclNetPlugin_v{v}")
        except ValueError:
            continue
        exported.append(v)
        names[v] = (table.value or b"").decode()  # every table starts with its name pointer
    chosen = next((v for v in probed if v in exported), None)
    return NcclCheck(nccl_path, version, probed, sorted(exported, reverse=True), chosen, names)
