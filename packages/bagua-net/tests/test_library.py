"""The wheel carries the plugin library, with NCCL's tables exported and nothing else leaked."""

import ctypes
import os

import pytest

import bagua_net
from bagua_net.testing import Plugin

REQUIRED = ["init", "devices", "getProperties", "listen", "connect", "accept", "regMr",
            "deregMr", "isend", "irecv", "iflush", "test", "closeSend", "closeRecv",
            "closeListen"]
# NCCL checks these for NULL; a host-memory plugin without offload leaves them empty.
OPTIONAL = {7: ["regMrDmaBuf", "getDeviceMr", "irecvConsumed"],
            9: ["regMrDmaBuf", "getDeviceMr", "irecvConsumed", "makeVDevice"],
            11: ["regMrDmaBuf", "getDeviceMr", "irecvConsumed", "makeVDevice", "setNetAttr"]}


def test_library_is_installed_and_loads():
    path = bagua_net.library_path()
    assert os.path.isabs(path) and path.endswith("libnccl-net-bagua.so")
    assert ctypes.CDLL(path).baguaNetName


@pytest.mark.parametrize("version", [6, 7, 8, 9, 10, 11, 12])
def test_every_version_nccl_probes_is_exported_as_baguanet(version):
    plugin = Plugin(version)
    assert plugin.name == "BaguaNet"
    for slot in REQUIRED + (["finalize"] if version >= 11 else []):
        assert plugin.slot(slot), slot
    optional = OPTIONAL[max(v for v in OPTIONAL if v <= version)] if version >= 7 else \
        ["regMrDmaBuf"]
    for slot in optional:
        assert not plugin.slot(slot), slot


def test_only_the_plugin_tables_and_helpers_are_exported():
    lib = ctypes.CDLL(bagua_net.library_path())
    for old in (2, 3, 4, 5):  # NCCL 2.20+ ignores these; Bagua's plugin exported only v3/v4
        with pytest.raises(AttributeError):
            getattr(lib, f"ncclNetPlugin_v{old}")
    for internal in ("bn_isend", "bn_init", "bn_find_devices", "bn_log"):
        with pytest.raises(AttributeError):
            getattr(lib, internal)
    for collnet in ("ncclCollNetPlugin_v12", "ncclCollNetPlugin_v6"):
        with pytest.raises(AttributeError):
            getattr(lib, collnet)


def test_enable_sets_the_environment(monkeypatch):
    monkeypatch.setenv("LD_LIBRARY_PATH", "/somewhere")
    monkeypatch.delenv("NCCL_NET_PLUGIN", raising=False)
    path = bagua_net.enable()
    assert os.environ["NCCL_NET_PLUGIN"] == path
    assert os.environ["LD_LIBRARY_PATH"].split(":") == [os.path.dirname(path), "/somewhere"]
    bagua_net.enable()  # idempotent
    assert os.environ["LD_LIBRARY_PATH"].count(os.path.dirname(path)) == 1
