"""Lightning + ``BaguaStrategy(algorithm="async")``: a rank raising in ``training_step`` makes
every process exit, non-zero, instead of hanging at teardown (issue #29, section C).

The two ranks are independent processes (the environment torchrun would give them, without
its agent, which would kill the survivor and hide a hang)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("lightning")

HERE = Path(__file__).resolve().parent
BOUND_S = 60          # from rank 1's exception to both processes gone
STARTUP_S = 300       # importing torch and Lightning on a loaded 2-core machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_async_rank_raising_in_training_step_ends_every_process(tmp_path):
    port = str(_free_port())
    procs = []
    for rank in range(2):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "2",
               "RANK": str(rank), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
               "GROUP_RANK": "0", "TORCHELASTIC_RUN_ID": "bagua-test"}
        log = open(tmp_path / f"rank{rank}.log", "w")  # noqa: SIM115 (closed below)
        procs.append((subprocess.Popen([sys.executable, str(HERE / "_lightning_raise_job.py")],
                                       stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
                                       env=env), log))
    raised_at = None
    start = time.monotonic()
    try:
        while any(p.poll() is None for p, _ in procs):
            now = time.monotonic()
            if raised_at is None and "raising" in (tmp_path / "rank1.log").read_text():
                raised_at = now
            if now - (start if raised_at is None else raised_at) > (
                    STARTUP_S if raised_at is None else BOUND_S):
                break
            time.sleep(0.2)
    finally:
        alive = [rank for rank, (p, _) in enumerate(procs) if p.poll() is None]
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    logs = {r: (tmp_path / f"rank{r}.log").read_text()[-3000:] for r in range(2)}
    assert "raising" in (tmp_path / "rank1.log").read_text(), f"rank 1 never raised: {logs}"
    assert not alive, f"ranks {alive} still running {BOUND_S} s after rank 1 raised: {logs}"
    for rank, (p, _) in enumerate(procs):
        assert p.returncode != 0, (rank, logs[rank])
        assert "finished fit" not in logs[rank], (rank, logs[rank])
    assert "fails at step 3 on purpose" in logs[1], logs[1]
    # the survivor says why it stops, rather than training on alone and exiting 0
    full = (tmp_path / "rank0.log").read_text()          # the cause is chained, further up
    assert "another rank's training raised" in full, full[-8000:]
