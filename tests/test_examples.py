"""Every example in examples/ runs in its --quick form (each is linked from the docs).

The fused-optimizer and sampler examples run with every other bagua package (and Lightning)
made unimportable, as on a machine where only bagua-optim or bagua-data is installed.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _run(cmd, tmp_path, timeout=300):
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp_path,
                         env=ENV)
    assert out.returncode == 0, (out.stdout + out.stderr)[-5000:]
    return out.stdout


def _alone(script: str, keep: str, tmp_path) -> str:
    """Run ``script --quick`` with every bagua package but ``keep`` (and Lightning) blocked."""
    blocked = [m for m in ("bagua_comm", "bagua_algos", "bagua_optim", "bagua_data", "bagua_net",
                           "lightning", "pytorch_lightning") if m != keep]
    code = (f"import runpy, sys; sys.modules.update(dict.fromkeys({blocked!r})); "
            f"sys.argv = [{str(EXAMPLES / script)!r}, '--quick']; "
            f"runpy.run_path(sys.argv[0], run_name='__main__')")
    return _run([sys.executable, "-c", code], tmp_path)


def _torchrun(script: str, tmp_path, *args) -> str:
    return _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc_per_node=2", str(EXAMPLES / script), "--quick", *args], tmp_path)


def test_fused_optimizer_example_alone(tmp_path):
    out = _alone("fused_optimizer.py", "bagua_optim", tmp_path)
    assert "bit-identical parameters: True; checkpoint loads unfused: True" in out
    assert "fused AdamW: step 20/20" in out and "1 thread(s)" in out     # progress, one thread


def test_load_balanced_sampler_example_alone(tmp_path):
    out = _alone("load_balanced_sampler.py", "bagua_data", tmp_path)
    m = re.search(r"DistributedSampler ([\d.]+), LoadBalancingDistributedSampler ([\d.]+)", out)
    assert float(m.group(2)) < 1.05 < float(m.group(1))     # balanced vs torch's random deal
    assert "batches left" in out


def test_custom_algorithm_example(tmp_path):
    out = _torchrun("custom_algorithm.py", tmp_path)
    assert "8 averagings" in out
    assert "ranks identical after the last averaging: True" in out


def test_diloco_example(tmp_path):
    out = _torchrun("diloco.py", tmp_path)
    assert "ranks identical after the last sync: True" in out
    assert "'anchor'" in out and "'momentum'" in out and "'steps'" in out
    ratio = float(re.search(r"DDP: \d+, ([\d.]+)x more", out).group(1))
    assert ratio > 20          # 8 bits every 8 steps: ~32x fewer bytes than DDP


def test_choose_algorithm_example(tmp_path):
    out = _torchrun("choose_algorithm.py", tmp_path)
    # two processes on one machine: one node, so the exact allreduce, on every rank
    assert re.search(r"measured: [\d.]+ Mbit/s, [\d.]+ ms a tiny exchange, 1 nodes of 2 ranks", out)
    assert "chosen: gradient_allreduce" in out and "bagua auto: gradient_allreduce" in out
    # the same rule on other networks: a far, slow link is not the exact allreduce's
    far = re.search(r"on a far, slow link \(10 Mbit/s, 50 ms\): (\w+)", out).group(1)
    assert far != "gradient_allreduce"
    assert "on a fast, near link (10 Gbit/s, 0.05 ms): gradient_allreduce" in out
    assert "ranks identical: True" in out and "every rank chose the same: True" in out
    assert "with_bagua(..., 'auto') chose GradientAllReduce" in out


def test_sparse_algorithm_example(tmp_path):
    out = _torchrun("sparse_algorithm.py", tmp_path)
    m = re.search(r"validation loss ([\d.]+) -> ([\d.]+)", out)
    assert float(m.group(2)) < float(m.group(1))
    assert "ranks identical: True" in out and "'0.weight'" in out


def test_ddp_hook_example(tmp_path):
    out = _torchrun("ddp_hook.py", tmp_path)
    ddp, hook = map(float, re.search(r"DDP ([\d.]+), DDP \+ uint8 hook ([\d.]+)", out).groups())
    assert hook == pytest.approx(ddp, rel=0.05)
    ratio = float(re.search(r"\(([\d.]+)x\)", out).group(1))
    assert 0.24 < ratio < 0.27           # 8 bits a value + a 32-byte header per chunk
    assert "ranks identical: True" in out and "checkpoint residuals: 2" in out


def test_accelerate_bytegrad_example(tmp_path):
    """An unchanged Accelerate loop gets ByteGrad's 8-bit allreduce through DDP's comm hook:
    the same loss as Accelerate's own DDP, a quarter of the bytes, identical ranks."""
    pytest.importorskip("accelerate")
    out = _torchrun("accelerate_bytegrad.py", tmp_path)
    plain, hook = map(float, re.search(r"Accelerate ([\d.]+), Accelerate \+ ByteGrad hook "
                                       r"([\d.]+)", out).groups())
    assert hook == pytest.approx(plain, rel=0.05)
    ratio = float(re.search(r"\(([\d.]+)x\)", out).group(1))
    assert 0.24 < ratio < 0.27           # 8 bits a value + a 32-byte header per chunk
    assert "ranks identical: True" in out


def test_train_example_quick(tmp_path):
    out = _torchrun("train.py", tmp_path, "--algorithm", "bytegrad", "--backend", "gloo")
    before = float(re.search(r"before training val loss ([\d.]+)", out).group(1))
    final = float(re.search(r"final: val loss ([\d.]+)", out).group(1))
    assert final < before


def test_lightning_example_with_lightnings_launcher(tmp_path):
    pytest.importorskip("lightning")
    out = _run([sys.executable, str(EXAMPLES / "lightning_train.py"), "--devices", "2",
                "--quick", "--algorithm", "low_precision_decentralized"], tmp_path)
    assert "BaguaStrategy('low_precision_decentralized') on 2 processes" in out


def test_every_example_is_in_the_docs():
    page = (EXAMPLES.parent / "docs" / "examples.md").read_text()
    missing = [p.name for p in sorted(EXAMPLES.glob("*.py"))
               if f'--8<-- "examples/{p.name}"' not in page]
    assert not missing, f"examples not included in docs/examples.md: {missing}"
