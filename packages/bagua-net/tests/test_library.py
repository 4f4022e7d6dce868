"""The wheel carries a loadable C shared library, and enable() points NCCL at it."""

import ctypes
import os

import bagua_net


def test_library_is_installed_and_loads():
    path = bagua_net.library_path()
    assert os.path.isabs(path) and path.endswith("libnccl-net-bagua.so")
    lib = ctypes.CDLL(path)
    assert lib is not None


def test_enable_sets_the_environment(monkeypatch):
    monkeypatch.setenv("LD_LIBRARY_PATH", "/somewhere")
    monkeypatch.delenv("NCCL_NET_PLUGIN", raising=False)
    path = bagua_net.enable()
    assert os.environ["NCCL_NET_PLUGIN"] == path
    assert os.environ["LD_LIBRARY_PATH"].split(":") == [os.path.dirname(path), "/somewhere"]
    bagua_net.enable()  # idempotent
    assert os.environ["LD_LIBRARY_PATH"].count(os.path.dirname(path)) == 1
