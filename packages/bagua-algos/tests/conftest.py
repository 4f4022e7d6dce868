"""GPU tests skip without CUDA, and run (so fail) instead when BAGUA_TEST_GPU=1."""

import os

import pytest
import torch

# bagua_algos.ft needs a per-job secret (FaultTolerant(secret=...) or BAGUA_FT_SECRET); the
# tests' jobs, their subprocesses included, share this one
os.environ.setdefault("BAGUA_FT_SECRET", "bagua-algos-tests-secret")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available() or os.environ.get("BAGUA_TEST_GPU") == "1":
        return
    skip = pytest.mark.skip(reason="needs CUDA (BAGUA_TEST_GPU=1 turns this skip into a failure)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
