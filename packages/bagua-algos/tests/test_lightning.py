"""bagua_algos.lightning: BaguaStrategy against Lightning's DDPStrategy under torchrun, every
algorithm through Lightning, checkpoints, the registry name, and no Lightning at import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _common import batch, loss_fn, make_model

import bagua_comm as bc
from bagua_algos import AsyncModelAverage, with_bagua
from bagua_comm.testing import run_ranks

HERE = Path(__file__).resolve().parent


def test_importing_bagua_algos_never_imports_lightning():
    code = ("import sys, bagua_algos; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('lightning', 'pytorch_lightning', 'lightning_fabric')); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _async_step_with_closure():
    # Lightning (and any closure-style loop) runs forward+backward inside optimizer.step().
    rank = bc.get_rank()
    model = make_model(seed=rank + 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model = with_bagua(model, [opt], AsyncModelAverage(sync_interval_ms=2, warmup_steps=1))
    for step in range(12):
        def closure(step=step):
            opt.zero_grad()
            loss = loss_fn(model, *batch(step, rank))
            loss.backward()
            return loss
        opt.step(closure)
    model.abort()
    return model.impl.rounds


def test_async_model_average_with_step_closure_does_not_deadlock():
    run_ranks(_async_step_with_closure, timeout=240)


lightning = pytest.importorskip("lightning")


def test_strategy_name_resolves_and_arguments_are_checked():
    from bagua_algos import QAdamOptimizer
    from bagua_algos.lightning import BaguaStrategy
    trainer = lightning.Trainer(strategy="bagua", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, BaguaStrategy)
    assert BaguaStrategy(algorithm="bytegrad", hierarchical=False)._algorithm == "bytegrad"
    with pytest.raises(ValueError, match="unknown algorithm"):
        BaguaStrategy(algorithm="bytegard")
    with pytest.raises(ValueError, match="bytegrad"):
        BaguaStrategy(algorithm="bytegrad", no_such_knob=1)
    qadam = BaguaStrategy(algorithm="qadam", hierarchical=False)
    sgd = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="QAdamOptimizer"):
        qadam._make_algorithm([sgd])
    opt = QAdamOptimizer(torch.nn.Linear(2, 2).parameters(), warmup_steps=2)
    assert qadam._make_algorithm([opt]).__class__.__name__ == "QAdam"


@pytest.fixture(scope="module")
def torchrun_results(tmp_path_factory):
    """One torchrun launch, 2 CPU ranks: DDPStrategy, then BaguaStrategy with every algorithm
    and a checkpoint/resume (packages/bagua-algos/tests/_lightning_job.py)."""
    tmp = tmp_path_factory.mktemp("lightning")
    out = tmp / "res"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(HERE / "_lightning_job.py"), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=tmp, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(2)]


def test_gradient_allreduce_matches_ddp_strategy(torchrun_results):
    for res in torchrun_results:
        ddp = torch.tensor(res["ddp"]["params"])
        ours = torch.tensor(res["gradient_allreduce"]["params"])
        assert not torch.equal(ddp, torch.tensor(torchrun_results[0]["bytegrad"]["params"]))
        torch.testing.assert_close(ours, ddp, rtol=0, atol=1e-5)
        assert res["ddp"]["after"] < 0.8 * res["ddp"]["before"]


@pytest.mark.parametrize("algorithm", ["bytegrad", "decentralized",
                                       "low_precision_decentralized", "async", "qadam",
                                       "diloco"])
def test_every_algorithm_trains(torchrun_results, algorithm):
    for res in torchrun_results:
        run = res[algorithm]
        assert run["after"] < 0.85 * run["before"], run
        assert torch.isfinite(torch.tensor(run["params"])).all()
    # self.log(..., sync_dist=True) went through the strategy's reduce: same value everywhere
    assert torchrun_results[0][algorithm]["logged"] == torchrun_results[1][algorithm]["logged"]
    # bytegrad, qadam: synchronous on gradients; diloco: the last step (16) is a sync
    if algorithm in ("bytegrad", "qadam", "diloco"):    # ranks identical
        assert torchrun_results[0][algorithm]["params"] == torchrun_results[1][algorithm]["params"]


def test_ddp_strategy_with_bagua_s_comm_hook_trains_with_identical_ranks(torchrun_results):
    r0, r1 = torchrun_results
    for res in torchrun_results:
        run = res["ddp_hook"]
        assert run["compressed_bytes"] > 0               # the hook carried the gradients
        assert run["after"] < 0.85 * run["before"], run
        assert run["params"] != res["ddp"]["params"]     # 8-bit, not DDP's float32
    assert r0["ddp_hook"]["params"] == r1["ddp_hook"]["params"]


def test_lightning_checkpoint_carries_algorithm_state_and_resumes(torchrun_results):
    for res in torchrun_results:
        resume = res["resume"]
        assert resume["files"] == ["epoch=0-step=4.ckpt"]
        assert "'algorithm': 'gradient_allreduce'" in resume["bagua_state"]
        assert "'step': 4" in resume["bagua_state"]
        # one epoch, checkpoint, resume to four epochs == four epochs uninterrupted
        torch.testing.assert_close(torch.tensor(resume["params"]),
                                   torch.tensor(res["gradient_allreduce"]["params"]),
                                   rtol=0, atol=0)
