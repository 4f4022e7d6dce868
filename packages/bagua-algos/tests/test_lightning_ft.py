"""BaguaStrategy(fault_tolerant=...): arguments checked at construction, torchft imported only
when asked, and a fit of 2 replicas (2 processes, a torchft Lighthouse on loopback) that
matches plain Lightning on the two replicas' data at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")
HERE = Path(__file__).resolve().parent


def test_importing_the_strategy_never_imports_torchft():
    code = ("import sys, bagua_algos.lightning as m; m.BaguaStrategy('bytegrad'); "
            "assert 'torchft' not in sys.modules, 'torchft imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("value, rule", [
    ({"lighthouse": "http://h:1", "no_such": 1}, "unknown keys"),
    ("yes", "must be a bool or a dict"),
    ({"replica_id": "r"}, "Lighthouse's address"),
])
def test_bad_fault_tolerant_is_refused_at_construction(value, rule, monkeypatch):
    from bagua_algos.lightning import BaguaStrategy
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ValueError, match=rule):
        BaguaStrategy("gradient_allreduce", fault_tolerant=value)


def test_async_is_refused_even_without_torchft():
    from bagua_algos.lightning import BaguaStrategy
    with pytest.raises(ValueError, match="'async' cannot run with fault_tolerant"):
        BaguaStrategy("async", fault_tolerant={"lighthouse": "http://h:1"})


def test_the_address_comes_from_the_environment(monkeypatch):
    pytest.importorskip("torchft")
    from bagua_algos.lightning import BaguaStrategy
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://h:2")
    monkeypatch.setenv("REPLICA_GROUP_ID", "host7")
    s = BaguaStrategy("bytegrad", fault_tolerant={"timeout": timedelta(seconds=3)})
    assert s._ft_options == {"lighthouse": "http://h:2", "replica_id": "host7",
                             "timeout": timedelta(seconds=3)}


def test_without_torchft_the_error_names_the_extra(monkeypatch):
    import importlib.util

    from bagua_algos.lightning import BaguaStrategy
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchft" else real(name, *a))
    with pytest.raises(RuntimeError, match=r"bagua-algos\[ft\]"):
        BaguaStrategy("bytegrad", fault_tolerant={"lighthouse": "http://h:1"})


@pytest.mark.timeout(240)
def test_two_fault_tolerant_replicas_match_plain_lightning(tmp_path):
    pytest.importorskip("torchft")
    from bagua_algos.ft import lighthouse

    lh = lighthouse(min_replicas=2, heartbeat_timeout_ms=1000, join_timeout_ms=1000)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "RUST_LOG": "error"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    procs = [subprocess.Popen([sys.executable, str(HERE / "_lightning_ft_job.py"), "--lighthouse",
                               lh.address(), "--replica", str(r), "--out", str(tmp_path / f"{r}")],
                              env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=200)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        lh.shutdown()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
    r0, r1 = (json.loads((tmp_path / f"{r}").read_text()) for r in range(2))
    assert r0["committed"] == r1["committed"] == 8          # 2 epochs of 4 steps, none lost
    assert r0["ft"] == r1["ft"]                              # the replicas stayed identical
    # Lightning stepped the scheduler once per step, FaultTolerant did not step it again
    assert r0["lr"] == r0["plain_lr"] == 0.1 * 0.5 ** 2
    torch.testing.assert_close(torch.tensor(r0["ft"]), torch.tensor(r0["plain"]),
                               rtol=0, atol=1e-6)
    moved = (torch.tensor(r0["ft"]) - torch.tensor(r0["init"])).abs().max()
    assert moved > 1e-2, "training moved the parameters"
