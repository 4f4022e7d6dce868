"""GPU tests skip without CUDA, and run (so fail) instead when BAGUA_TEST_GPU=1.

bagua-net has no Python dependency, so torch is only consulted if it is installed.
"""

import os

import pytest


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if os.environ.get("BAGUA_TEST_GPU") == "1" or _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (BAGUA_TEST_GPU=1 turns this skip into a failure)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _loopback(monkeypatch):
    """Tests talk over loopback unless they say otherwise (children inherit the variable)."""
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "lo")
    for name in ("BAGUA_NET_NSTREAMS", "BAGUA_NET_MIN_CHUNKSIZE", "NCCL_SOCKET_FAMILY"):
        monkeypatch.delenv(name, raising=False)
