"""Runs shared by the error-feedback algorithms' tests (TopK, LowRank): training with a step
record, a re-bucketing midway, a checkpoint resumed on the same ranks and one resumed at
another world size.  Each function runs inside a rank (``bagua_comm.testing.run_ranks``)."""

from __future__ import annotations

import io
import logging

import torch
from _common import batch, loss_fn, make_model, params

import bagua_comm as bc
from bagua_algos import with_bagua

SAVE_AT, TOTAL = 4, 8
RESUME_LINE = "resumes from a checkpoint"


def sgd(model, lr=0.05, momentum=0.9):
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)


def train(make_algo, steps, *, bucket_size=300, rebucket_at=None, lr=0.05, momentum=0.9):
    """Parameters after each of ``steps`` steps (optionally re-bucketing to 10 kB before step
    ``rebucket_at``), and the algorithm's state just before and after that re-bucketing."""
    model = make_model(seed=1)
    opt = sgd(model, lr, momentum)
    model = with_bagua(model, [opt], make_algo(), bucket_size=bucket_size)
    rank, history, around = bc.get_rank(), [], None
    for step in range(steps):
        if step == rebucket_at:
            before = model.impl.state_dict()
            model.rebucket(10_000)
            around = (before, model.impl.state_dict(), len(model.buckets))
        opt.zero_grad()
        loss_fn(model, *batch(step, rank)).backward()
        opt.step()
        history.append(params(model))
    model.detach_algorithm()
    return history, around


def _save(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _steps(model, opt, steps):
    rank = bc.get_rank()
    for step in steps:
        opt.zero_grad()
        loss = loss_fn(model, *batch(step, rank))
        loss.backward()
        opt.step()
    return loss.item()


def checkpoint_cycle(make_algo, momentum=0.9):
    """Each rank saves its own checkpoint at SAVE_AT and resumes from it: exact?  Returns
    that, and rank 0's checkpoint (for a resume at another world size)."""
    def wrap():
        model = make_model(seed=1)
        opt = sgd(model, momentum=momentum)
        return with_bagua(model, [opt], make_algo(), bucket_size=300), opt

    model, opt = wrap()
    _steps(model, opt, range(SAVE_AT))
    blob = _save({"model": model.state_dict(), "optimizer": opt.state_dict()})
    _steps(model, opt, range(SAVE_AT, TOTAL))
    full = params(model)
    model.detach_algorithm()
    model, opt = wrap()
    ck = torch.load(io.BytesIO(blob), weights_only=False)
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optimizer"])
    _steps(model, opt, range(SAVE_AT, TOTAL))
    exact = all(torch.equal(a, b) for a, b in zip(full, params(model)))
    model.detach_algorithm()
    return exact, ck["optimizer"]["bagua_algos"]["impl"], (blob if bc.get_rank() == 0 else None)


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def resume_elsewhere(make_algo, blob, momentum=0.9):
    """Load rank 0's checkpoint of a job of another size; train on.  Returns the log lines
    about the resume, the algorithm's state right after loading, and the last loss."""
    model = make_model(seed=1)
    opt = sgd(model, momentum=momentum)
    model = with_bagua(model, [opt], make_algo(), bucket_size=300)
    handler = _Lines()
    log = logging.getLogger("bagua_algos")
    log.addHandler(handler)
    ck = torch.load(io.BytesIO(blob), weights_only=False)
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optimizer"])
    log.removeHandler(handler)
    state = model.impl.state_dict()
    loss = _steps(model, opt, range(SAVE_AT, TOTAL))
    model.detach_algorithm()
    return [m for m in handler.lines if RESUME_LINE in m], state, loss
