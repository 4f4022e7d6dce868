"""One collective per training step (docs/design.md §5, "DDP parity"): the "did any rank give this
tensor a gradient" flags ride in the last bucket's allreduce instead of a collective of their
own, for GradientAllReduce (fp32, fp16 and bf16 buckets, across no_sync() accumulation) and
the averaging warmup steps of QAdam and AsyncModelAverage, LowRank and TopK; ByteGrad and QAdam's
compressed steps carry them as an exact tail of their compiled compressed exchange (gloo CPU,
MinMaxUInt8) and get unused parameters right.  (The hierarchical mode,
hierarchical_run, runs in test_hierarchical.py's 4-rank spawn; bit-for-bit parity with DDP's
find_unused_parameters=True is test_ddp_parity.py's.)"""

from __future__ import annotations

import pytest
import torch
from _common import batch
from test_ddp_parity import _Branchy
from test_diloco import _counting_collectives

import bagua_comm as bc
from bagua_algos import (
    AsyncModelAverage,
    ByteGrad,
    GradientAllReduce,
    QAdam,
    QAdamOptimizer,
    with_bagua,
)
from bagua_comm.testing import run_ranks

STEPS = 6


def _step(wrapped, model, step, rank, dtype):
    x, y = batch(step, rank)
    torch.nn.functional.mse_loss(wrapped(x.to(dtype)), y.to(dtype)).backward()


def _run(dtype, bucket_size=None, algo="gradient_allreduce"):
    """Per step: collectives issued (zero_grad to optimizer.step), which grads are None, and
    this rank's b.weight gradient.  ``b`` is used on rank 0 at even steps only, ``c`` never."""
    rank = bc.get_rank()
    model = _Branchy().to(dtype)
    if algo == "qadam":                   # every step a warmup step: averaged gradients
        opt = QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=STEPS)
        algorithm = QAdam(opt, hierarchical=False)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        algorithm = (AsyncModelAverage(warmup_steps=STEPS) if algo == "async"
                     else GradientAllReduce())
    wrapped = with_bagua(model, [opt], algorithm, bucket_size=bucket_size)
    calls, none, b_grads = [], [], []
    for step in range(STEPS):
        model.use_b = rank == 0 and step % 2 == 0
        with _counting_collectives() as issued:
            opt.zero_grad(set_to_none=True)
            _step(wrapped, model, step, rank, dtype)
            none.append([p.grad is None for p in model.parameters()])
            b_grads.append(None if model.b.weight.grad is None
                           else model.b.weight.grad.float().clone())
            opt.step()
        calls.append(len(issued))
    out = {"calls": calls, "buckets": len(wrapped.buckets), "none": none, "b": b_grads}
    wrapped.detach_algorithm()
    return out


def _no_sync_run():
    """``b`` used on rank 1 only, and only in a no_sync() micro-batch: averaged, not None."""
    rank = bc.get_rank()
    model = _Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    wrapped = with_bagua(model, [opt], GradientAllReduce())
    calls, local_b, b_grads = [], [], []
    for step in range(4):
        opt.zero_grad(set_to_none=True)
        with _counting_collectives() as issued:
            with wrapped.no_sync():
                model.use_b = rank == 1
                _step(wrapped, model, step, rank, torch.float32)
                local_b.append(None if model.b.weight.grad is None
                               else model.b.weight.grad.clone())
            model.use_b = False
            _step(wrapped, model, step + 100, rank, torch.float32)
        calls.append(len(issued))
        b_grads.append(None if model.b.weight.grad is None else model.b.weight.grad.clone())
        opt.step()
    c_none = model.c.weight.grad is None
    wrapped.detach_algorithm()
    return {"calls": calls, "local_b": local_b, "b": b_grads, "c_none": c_none}


def _bytegrad_run(algo: str = "bytegrad"):
    """ByteGrad, QAdam past warmup: the flags ride in the last bucket's compiled compressed
    allreduce (an exact tail), which runs on the group's worker, not through the group's own
    channel: no collective there per step."""
    rank = bc.get_rank()
    model = _Branchy()
    if algo == "qadam":                   # past its one warm-up step: compressed momentum
        opt = QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=1)
        algorithm = QAdam(opt, hierarchical=False)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        algorithm = ByteGrad(hierarchical=False)
    wrapped = with_bagua(model, [opt], algorithm)
    none, calls = [], []
    for step in range(4):
        model.use_b = rank == 0 and step % 2 == 0
        with _counting_collectives() as issued:
            opt.zero_grad(set_to_none=True)
            _step(wrapped, model, step, rank, torch.float32)
            none.append([p.grad is None for p in model.parameters()])
            opt.step()
        calls.append(len(issued))
    wrapped.detach_algorithm()
    return {"none": none, "calls": calls}


def _low_rank_run():
    """LowRank carries the flags in its first (exact) allreduce: per bucket that allreduce and,
    where it compresses a matrix, the second one; no collective of their own."""
    from bagua_algos import LowRank

    rank = bc.get_rank()
    model = _Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    wrapped = with_bagua(model, [opt], LowRank(rank=1, start_step=1), bucket_size=128)
    calls, none = [], []
    for step in range(4):
        model.use_b = rank == 0 and step % 2 == 0
        with _counting_collectives() as issued:
            opt.zero_grad(set_to_none=True)
            _step(wrapped, model, step, rank, torch.float32)
            none.append([p.grad is None for p in model.parameters()])
            opt.step()
        calls.append(len(issued))
    plans = wrapped.impl.plans
    out = {"calls": calls, "none": none, "buckets": len(plans),
           "per_step": sum(1 + bool(matrices) for matrices, _ in plans),
           "compiled": wrapped.impl._compiled[-1] is not None}
    wrapped.detach_algorithm()
    return out


def _topk_run(variant: str):
    """TopK carries the flags: in its warm-up allreduce (start_step=1), then beside the sparse
    exchange's indices (exact, also when the values go through a compressor)."""
    from bagua_algos import TopK
    from bagua_comm.compression import MinMaxUInt8

    rank = bc.get_rank()
    model = _Branchy()
    if variant == "momentum_u8":          # DGC's momentum, 8-bit values
        algorithm = TopK(density=0.3, start_step=1, momentum=0.9, compressor=MinMaxUInt8(2))
    else:
        algorithm = TopK(density=0.3, start_step=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    wrapped = with_bagua(model, [opt], algorithm, bucket_size=128)
    calls, none, b_grads = [], [], []
    for step in range(4):
        model.use_b = rank == 0 and step % 2 == 0
        with _counting_collectives() as issued:
            opt.zero_grad(set_to_none=True)
            _step(wrapped, model, step, rank, torch.float32)
            none.append([p.grad is None for p in model.parameters()])
            b_grads.append(None if model.b.weight.grad is None
                           else model.b.weight.grad.clone())
            opt.step()
        calls.append(len(issued))
    out = {"calls": calls, "none": none, "b": b_grads, "buckets": len(wrapped.buckets),
           "compiled": wrapped.impl._compiled[2] is not None}
    wrapped.detach_algorithm()
    return out


def hierarchical_run():
    """For test_hierarchical's 4 ranks (2 nodes of 2): collectives per step of
    GradientAllReduce(hierarchical=True), which grads are None, and b.weight's gradient."""
    rank = bc.get_rank()
    model = _Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    wrapped = with_bagua(model, [opt], GradientAllReduce(hierarchical=True), bucket_size=128)
    calls, none, b_grads = [], [], []
    for step in range(4):
        model.use_b = rank == 0 and step % 2 == 0
        with _counting_collectives() as issued:
            opt.zero_grad(set_to_none=True)
            _step(wrapped, model, step, rank, torch.float32)
            none.append([p.grad is None for p in model.parameters()])
            b_grads.append(None if model.b.weight.grad is None
                           else model.b.weight.grad.clone())
            opt.step()
        calls.append(len(issued))
    out = {"calls": calls, "buckets": len(wrapped.buckets), "none": none, "b": b_grads,
           "leader": wrapped.group.is_node_leader()}
    wrapped.detach_algorithm()
    return out


def check_hierarchical(results):
    """Each bucket: an intra-node reduce, the leaders' allreduce, an intra-node broadcast;
    nothing more for the flags.  ``b`` (used on rank 0 at even steps) is averaged over all
    four ranks, ``c`` (never used) keeps grad None."""
    for r in results:
        per_bucket = 3 if r["leader"] else 2
        assert r["calls"][2:] == [per_bucket * r["buckets"]] * 2, (r["calls"], r["buckets"])
        assert r["none"] == [_expected_none(s) for s in range(4)]
    for step in (0, 2):
        assert all(torch.equal(r["b"][step], results[0]["b"][step]) for r in results)
        assert results[0]["b"][step].abs().sum() > 0


def _all():
    return {"fp32": _run(torch.float32), "fp16": _run(torch.float16, bucket_size=128),
            "bf16": _run(torch.bfloat16, bucket_size=128), "no_sync": _no_sync_run(),
            "bytegrad": _bytegrad_run(), "qadam": _bytegrad_run("qadam"),
            "low_rank": _low_rank_run(),
            "topk": _topk_run("plain"), "topk momentum_u8": _topk_run("momentum_u8"),
            "qadam warmup": _run(torch.float32, algo="qadam"),
            "async warmup": _run(torch.float32, algo="async")}


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_all, 2, timeout=240)


def _expected_none(step):
    """Per parameter of _Branchy (a.w, a.b, b.w, b.b, c.w, c.b, head.w, head.b): None where
    no rank used it in the step."""
    b_unused = step % 2 == 1
    return [False, False, b_unused, b_unused, True, True, False, False]


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16", "qadam warmup", "async warmup"])
def test_one_collective_per_bucket_and_none_for_flags(runs, dtype):
    for r in runs:
        res = r[dtype]
        # from step 2 on (step 0 observes the gradient order, step 1's forward shares it)
        assert res["calls"][2:] == [res["buckets"]] * (STEPS - 2), res["calls"]
        if dtype in ("fp32", "qadam warmup", "async warmup"):
            assert res["buckets"] == 1             # default bucket size: ONE per step
        else:
            assert res["buckets"] > 1              # the flags ride in the last of several
        assert res["none"] == [_expected_none(s) for s in range(STEPS)]


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16", "qadam warmup", "async warmup"])
def test_parameter_used_on_one_rank_is_averaged(runs, dtype):
    rank0, rank1 = runs[0][dtype], runs[1][dtype]
    for step in range(0, STEPS, 2):           # b used on rank 0 only: both ranks hold half
        assert torch.equal(rank0["b"][step], rank1["b"][step])
        assert rank0["b"][step].abs().sum() > 0


def test_no_sync_accumulation_counts_as_used(runs):
    rank0, rank1 = runs[0]["no_sync"], runs[1]["no_sync"]
    assert rank0["calls"][2:] == rank1["calls"][2:] == [1, 1]    # step 1 shares the order
    for step in range(4):
        assert rank0["local_b"][step] is None          # rank 0 never used b
        want = rank1["local_b"][step] / 2              # averaged with rank 0's zero
        torch.testing.assert_close(rank0["b"][step], want, rtol=0, atol=0)
        torch.testing.assert_close(rank1["b"][step], want, rtol=0, atol=0)
    assert rank0["c_none"] and rank1["c_none"]


def test_low_rank_carries_the_flags_in_its_first_allreduce(runs):
    for r in runs:
        res = r["low_rank"]
        assert res["none"] == [_expected_none(s) for s in range(4)]
        assert res["buckets"] > 1 and res["per_step"] > res["buckets"]   # P and Q somewhere
        # step 0 is the warm-up (start_step=1: one plain allreduce a bucket, the flags in
        # the last); then each bucket's compiled job (P with the flags, then Q) on the
        # worker's channel: nothing on the group's own, never a collective for the flags
        assert res["calls"][0] == res["buckets"], res
        assert res["compiled"] and res["calls"][2:] == [0, 0], res


@pytest.mark.parametrize("variant", ["topk", "topk momentum_u8"])
def test_topk_carries_the_flags_beside_its_indices(runs, variant):
    for r in runs:
        res = r[variant]
        assert res["buckets"] > 1
        assert res["none"] == [_expected_none(s) for s in range(4)]
        # step 0, the warm-up: one allreduce a bucket (the flags in the last); then each
        # bucket's two allgathers (indices, values; the flags ride beside the indices, or
        # as extra entries in the compiled job, which runs on the worker's channel: nothing
        # on the group's own); nothing for the flags
        assert res["calls"][0] == res["buckets"], res
        per_step = 0 if variant == "topk" else 2 * res["buckets"]
        assert res["compiled"] == (variant == "topk"), res
        assert res["calls"][2:] == [per_step] * 2, res
    rank0, rank1 = runs[0][variant], runs[1][variant]
    for step in range(4):                 # b used on rank 0 at even steps: the same on both
        if step % 2:
            assert rank0["b"][step] is None and rank1["b"][step] is None
        else:
            assert torch.equal(rank0["b"][step], rank1["b"][step])
            assert rank0["b"][step].abs().sum() > 0


@pytest.mark.parametrize("algo", ["bytegrad", "qadam"])
def test_compressed_steps_carry_the_flags_in_their_own_exchange(runs, algo):
    for r in runs:
        assert r[algo]["none"] == [_expected_none(s) for s in range(4)]
        # from step 2 on: the compressed allreduces run on the worker's channel and carry
        # the flags; nothing on the group's own (it was the flags' allreduce each step)
        assert r[algo]["calls"][2:] == [0, 0], r[algo]["calls"]
