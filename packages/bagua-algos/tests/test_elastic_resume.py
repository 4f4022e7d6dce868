"""Elastic resume: a checkpoint written by rank 0 (model and optimizer state_dicts) loads after
``with_bagua`` at another world size (2 -> 3 -> 2) for every algorithm, with parameters and
optimizer state as saved, per-rank algorithm state re-derived or reset, one log line and no
error; at the same world size, rank 0's file resumes bit-exactly wherever the state is shared
by every rank."""

import io
import logging

import pytest
import torch
from _common import batch, loss_fn, make_model, params

import bagua_comm as bc
from bagua_algos import (
    AsyncModelAverage,
    ByteGrad,
    Decentralized,
    GradientAllReduce,
    LowPrecisionDecentralized,
    QAdam,
    QAdamOptimizer,
    with_bagua,
)
from bagua_comm.testing import run_ranks

SAVE_AT, TOTAL, MORE = 4, 6, 3
RESUME_LINE = "resumes from a checkpoint"


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _qadam(model):
    return QAdamOptimizer(model.parameters(), lr=1e-2, warmup_steps=2)


CASES = {
    "gradient_allreduce": (_sgd, lambda opt: GradientAllReduce()),
    "bytegrad_default": (_sgd, lambda opt: ByteGrad()),
    "bytegrad_error_feedback": (_sgd, lambda opt: ByteGrad(hierarchical=False,
                                                           error_feedback=True)),
    "decentralized": (_sgd, lambda opt: Decentralized(hierarchical=False)),
    "low_precision_decentralized": (_sgd, lambda opt: LowPrecisionDecentralized(
        hierarchical=False)),
    "async": (_sgd, lambda opt: AsyncModelAverage(sync_interval_ms=5, warmup_steps=2)),
    "qadam": (_qadam, lambda opt: QAdam(opt, hierarchical=False)),
}
# Every rank holds the same state: resuming all ranks from rank 0's file is bit-exact.
SHARED_STATE = ("gradient_allreduce", "bytegrad_default", "qadam")


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _capture():
    handler = _Lines()
    logger = logging.getLogger("bagua_algos")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return handler


def _save(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _load(blob):
    return torch.load(io.BytesIO(blob), weights_only=False)


def _wrap(case):
    make_opt, make_algo = CASES[case]
    model = make_model(seed=1)
    opt = make_opt(model)
    return with_bagua(model, [opt], make_algo(opt), bucket_size=300), opt


def _train(model, opt, steps):
    rank = bc.get_rank()
    for step in steps:
        opt.zero_grad()
        loss = loss_fn(model, *batch(step, rank))
        loss.backward()
        opt.step()
    return loss.item()


def _close(model):
    if model.algorithm.name == "async":
        model.abort()
    model.detach_algorithm()


def _optimizer_tensors(state_dict):
    out = []
    for _, st in sorted(state_dict["state"].items()):
        out.extend(v for _, v in sorted(st.items()) if isinstance(v, torch.Tensor))
    groups = [{k: v for k, v in g.items() if k != "params"} for g in state_dict["param_groups"]]
    return out, groups


def _residuals(model):
    comp = getattr(getattr(model.impl, "allreduce", None), "compressors", {})
    return {f"{k}:{r}": v.clone() for k, c in comp.items() for r, v in c._residuals.items()}


def _resume(case, blob):
    """Load ``blob`` after with_bagua; report what was loaded, train MORE steps."""
    model, opt = _wrap(case)
    ck = _load(blob)
    lines = _capture()
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optimizer"])
    out = {"params_as_saved": all(torch.equal(a, b) for a, b in
                                  zip(params(model), ck["model"].values())),
           "step": model.step, "saved_step": ck["optimizer"]["bagua_algos"]["step"],
           "saved_world": ck["optimizer"]["bagua_algos"]["world_size"],
           "residuals": _residuals(model)}
    mine, groups = _optimizer_tensors(opt.state_dict())
    theirs, saved_groups = _optimizer_tensors(ck["optimizer"])
    out["optimizer_as_saved"] = (groups == saved_groups and len(mine) == len(theirs)
                                 and all(torch.equal(a, b) for a, b in zip(mine, theirs)))
    out["loss"] = _train(model, opt, range(ck["step"], ck["step"] + MORE))
    out["lines"] = [m for m in lines.lines if RESUME_LINE in m]
    logging.getLogger("bagua_algos").removeHandler(lines)
    out["params"] = params(model)
    if case == "low_precision_decentralized":
        impl = model.impl
        out["lpd"] = ([t.clone() for t in impl.mine], [t.clone() for t in impl.left],
                      [t.clone() for t in impl.right])
    out["next"] = _save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                         "step": ck["step"] + MORE}) if bc.get_rank() == 0 else None
    _close(model)
    return out


def _first_job():
    """World 2: train, rank 0 checkpoints at SAVE_AT, run on to TOTAL; resume all ranks from
    rank 0's file at the same world size; load the optimizer before with_bagua (footgun)."""
    rank = bc.get_rank()
    out = {}
    for case in CASES:
        model, opt = _wrap(case)
        _train(model, opt, range(SAVE_AT))
        blob = _save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                      "step": SAVE_AT})
        own_residuals = _residuals(model)
        blob = bc.broadcast_object(blob if rank == 0 else None, 0)   # "rank 0's file"
        _train(model, opt, range(SAVE_AT, TOTAL))
        full = params(model)
        _close(model)

        model, opt = _wrap(case)
        lines = _capture()
        ck = _load(blob)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        res = {"own_residuals": own_residuals, "loaded_residuals": _residuals(model)}
        _train(model, opt, range(SAVE_AT, TOTAL))
        res["exact"] = all(torch.equal(a, b) for a, b in zip(full, params(model)))
        res["lines"] = [m for m in lines.lines if RESUME_LINE in m]
        logging.getLogger("bagua_algos").removeHandler(lines)
        _close(model)
        res["blob"] = blob if rank == 0 else None
        out[case] = res
        if case == "bytegrad_error_feedback":
            ef_blob = blob

    # Footgun: optimizer.load_state_dict() before with_bagua drops the algorithm's state.
    model = make_model(seed=1)
    opt = _sgd(model)
    opt.load_state_dict(_load(ef_blob)["optimizer"])
    lines = _capture()
    model = with_bagua(model, [opt], ByteGrad(hierarchical=False, error_feedback=True))
    out["early_load_lines"] = list(lines.lines)
    model.detach_algorithm()
    return out


def _next_job(blobs):
    return {case: _resume(case, blob) for case, blob in blobs.items()}


@pytest.fixture(scope="module")
def jobs():
    first = run_ranks(_first_job, 2, timeout=300)
    blobs = {case: first[0][case]["blob"] for case in CASES}
    at3 = run_ranks(_next_job, 3, args=(blobs,), timeout=300)
    back = {case: at3[0][case]["next"] for case in CASES}
    at2 = run_ranks(_next_job, 2, args=(back,), timeout=300)
    return first, at3, at2


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("hop", ["2->3", "3->2"])
def test_resume_at_another_world_size(jobs, case, hop):
    _, at3, at2 = jobs
    ranks, saved_world = (at3, 2) if hop == "2->3" else (at2, 3)
    for rank, res in enumerate(ranks):
        r = res[case]
        assert r["saved_world"] == saved_world          # the world size is in the checkpoint
        assert r["params_as_saved"] and r["optimizer_as_saved"]
        assert r["step"] == r["saved_step"] > 0
        assert r["residuals"] == {}                     # per-rank residuals start afresh
        assert torch.isfinite(torch.tensor(r["loss"]))
        # one line for the job, from rank 0, saying what was re-derived or reset
        assert len(r["lines"]) == (1 if rank == 0 else 0), r["lines"]
        if rank == 0:
            assert f"world size {saved_world}, now {len(ranks)}" in r["lines"][0]


@pytest.mark.parametrize("world", [2, 3])
def test_low_precision_replicas_rederived_consistently(jobs, world):
    """After a resume, each rank's replica of a ring neighbour equals that neighbour's x."""
    ranks = jobs[1] if world == 3 else jobs[2]
    mines = [r["low_precision_decentralized"]["lpd"][0] for r in ranks]
    for rank, res in enumerate(ranks):
        _, left, right = res["low_precision_decentralized"]["lpd"]
        for a, b in zip(left, mines[(rank - 1) % world]):
            assert torch.equal(a, b)
        for a, b in zip(right, mines[(rank + 1) % world]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("case", SHARED_STATE)
def test_same_world_resume_from_rank0_file_is_exact(jobs, case):
    for res in jobs[0]:
        assert res[case]["exact"]
        assert res[case]["lines"] == []


def test_rank0_file_on_every_rank_resets_other_ranks_residuals_with_one_line(jobs):
    r0, r1 = (res["bytegrad_error_feedback"] for res in jobs[0])
    assert r0["own_residuals"]                              # error feedback was active
    assert r0["loaded_residuals"].keys() == r0["own_residuals"].keys()
    assert all(torch.equal(r0["loaded_residuals"][k], v)
               for k, v in r0["own_residuals"].items())     # rank 0: its own, exactly
    assert r1["loaded_residuals"] == {}                     # rank 1: not rank 0's residuals
    assert r0["lines"] == []
    assert len(r1["lines"]) == 1
    assert "each rank's own file" in r1["lines"][0]


def test_loading_the_optimizer_before_with_bagua_warns_with_the_order(jobs):
    lines = [m for m in jobs[0][0]["early_load_lines"] if "already holds state" in m]
    assert len(lines) == 1
    assert "load checkpoints after with_bagua" in lines[0]
    assert jobs[0][1]["early_load_lines"] == []             # said once, by rank 0
