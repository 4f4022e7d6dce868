"""A run resumed from a checkpoint continues exactly as the uninterrupted run: the algorithm's
state (residuals, replicas, moments, counters) travels in the optimizer's state_dict."""

import io

import pytest
import torch
from _common import batch, loss_fn, make_model, params

import bagua_comm as bc
from bagua_algos import (
    ByteGrad,
    Decentralized,
    GradientAllReduce,
    LowPrecisionDecentralized,
    QAdam,
    QAdamOptimizer,
    with_bagua,
)
from bagua_comm.testing import run_ranks

TOTAL, SAVE_AT = 8, 5


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _qadam(model):
    return QAdamOptimizer(model.parameters(), lr=1e-2, warmup_steps=3)


CASES = {
    "gradient_allreduce": (_sgd, lambda opt: GradientAllReduce()),
    "decentralized_shift_one": (_sgd, lambda opt: Decentralized(
        hierarchical=False, peer_selection_mode="shift_one", communication_interval=2)),
    "bytegrad_error_feedback": (_sgd, lambda opt: ByteGrad(hierarchical=False,
                                                           error_feedback=True)),
    "low_precision_decentralized": (_sgd, lambda opt: LowPrecisionDecentralized(
        hierarchical=False)),
    "qadam": (_qadam, lambda opt: QAdam(opt, hierarchical=False)),
}


def _save(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _load(blob):
    return torch.load(io.BytesIO(blob), weights_only=False)


def _run(case, checkpoint=None):
    make_opt, make_algo = CASES[case]
    model = make_model(seed=1)
    opt = make_opt(model)
    model = with_bagua(model, [opt], make_algo(opt), bucket_size=300)
    start, saved = 0, None
    if checkpoint is not None:
        ck = _load(checkpoint)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        start = ck["step"]
    rank = bc.get_rank()
    for step in range(start, TOTAL):
        opt.zero_grad()
        loss_fn(model, *batch(step, rank)).backward()
        opt.step()
        if step + 1 == SAVE_AT and checkpoint is None:
            saved = _save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                           "step": step + 1})
    model.detach_algorithm()
    return params(model), saved


def _resume_all():
    out = {}
    for case in CASES:
        full, ck = _run(case)
        resumed, _ = _run(case, ck)
        keys = sorted(_load(ck)["optimizer"])
        out[case] = (all(torch.equal(a, b) for a, b in zip(full, resumed)), keys)
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_resume_all, 2, timeout=240)


@pytest.mark.parametrize("case", list(CASES))
def test_resume_equals_uninterrupted_run(results, case):
    for rank_results in results:
        identical, keys = rank_results[case]
        assert "bagua_algos" in keys          # the algorithm's state is in the checkpoint
        assert identical
