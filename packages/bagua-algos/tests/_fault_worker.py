"""One rank of a training job that trains until a peer fails (run by test_failures.py).

``python _fault_worker.py SPEC_JSON``: joins through a FileStore, wraps a small model with the
named algorithm, trains and writes its step count to ``progress.<rank>`` after every step.
When a peer dies or stops answering, a collective raises and the process exits non-zero; it
writes ``error.<rank>`` with the exception first.  A wall-clock deadline makes it exit on its
own if nothing ever fails, so no test can leave it behind.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
import traceback
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _algorithm(name, opt):
    from bagua_algos import (
        AsyncModelAverage,
        ByteGrad,
        Decentralized,
        GradientAllReduce,
        LowPrecisionDecentralized,
        QAdam,
    )

    hier = name.endswith("_hierarchical")
    base = name.removesuffix("_hierarchical")
    return {
        "gradient_allreduce": lambda: GradientAllReduce(hierarchical=hier),
        "bytegrad": lambda: ByteGrad(hierarchical=hier),
        "decentralized": lambda: Decentralized(hierarchical=hier),
        "low_precision_decentralized": lambda: LowPrecisionDecentralized(hierarchical=hier),
        "async": lambda: AsyncModelAverage(sync_interval_ms=20),
        "qadam": lambda: QAdam(opt, hierarchical=hier),
    }[base]()


def main(spec: dict) -> None:
    rank, world, workdir = spec["rank"], spec["world"], spec["dir"]
    deadline = spec["deadline_s"]
    # Nothing may outlive the test: exit after the deadline whatever happens.
    faulthandler.enable(all_threads=True)              # SIGABRT from the test: where it hangs
    timer = threading.Timer(deadline, lambda: os._exit(3))
    timer.daemon = True
    timer.start()

    import torch
    import torch.distributed as dist
    from _common import batch, loss_fn, make_model

    import bagua_comm as bc
    from bagua_algos import QAdamOptimizer, with_bagua

    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(workdir, "store"), world)
    bc.init_process_group("gloo", store=store, rank=rank, world_size=world,
                          local_world_size=spec["local"],
                          timeout=timedelta(seconds=spec["timeout_s"]))
    model = make_model(seed=1)
    if spec["algo"].startswith("qadam"):
        opt = QAdamOptimizer(model.parameters(), lr=1e-2, warmup_steps=2)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model = with_bagua(model, [opt], _algorithm(spec["algo"], opt), bucket_size=400)
    progress = os.path.join(workdir, f"progress.{rank}")
    step = 0
    while step < spec.get("steps", float("inf")):   # then return without any cleanup
        opt.zero_grad()
        loss_fn(model, *batch(step, rank)).backward()
        opt.step()
        step += 1
        with open(progress + ".tmp", "w") as f:
            f.write(str(step))
        os.replace(progress + ".tmp", progress)
        time.sleep(0.01)


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    try:
        main(spec)
    except BaseException:
        with open(os.path.join(spec["dir"], f"error.{spec['rank']}"), "w") as f:
            f.write(f"{time.monotonic()}\n{traceback.format_exc()}")
        raise
