"""GPU, one NCCL rank: the algorithms whose one-rank run still communicates order that work
after the gradients of a non-default training stream.

The risk: communication (on the group's stream, or on a Runner helper thread, whose current
stream is the default stream) must be ordered after the gradients on the *training* stream.
Each case trains the same model twice on one NCCL rank: on the default stream, and on a side
stream whose backward is delayed on the GPU (``torch.cuda._sleep``) so that communication
ordered after the wrong stream reads stale or unwritten gradients.  The two runs must agree
bit for bit-close (deterministic kernels are forced), and the loss must go down.

What one rank cannot check, and so is not claimed here: hierarchical modes (one node of one
rank runs flat), the peer exchanges of Decentralized and LowPrecisionDecentralized (nothing is
sent at world size 1, so their cases below check only the weight copies; the grouping of their
exchanges is checked on CPU by tests/test_fake_nccl.py).
TopK, LowRank and AsyncModelAverage exchange nothing at one rank (the first two return before
their collectives; the averaging thread averages with itself), so a one-rank run of them
checked nothing its name claimed (issue 46): they run on two GPUs, one NCCL rank each
(NCCL refuses two ranks on one device, and bagua_comm's gloo backend carries CPU tensors only),
each rank on its own batches, and skip with that reason on a one-GPU machine.  Both ranks must
end with the same weights (the exchange ran), equal to the default stream's run; the async
case, whose rounds follow the wall clock, must have averaged (rounds > 0), finite.
Marked ``gpu``: skipped without CUDA, failing instead when BAGUA_TEST_GPU=1.
"""

import os
import time

import pytest
import torch
from _common import batch, loss_fn, make_model

import bagua_comm as bc
from bagua_algos import (
    AsyncModelAverage,
    ByteGrad,
    Decentralized,
    GradientAllReduce,
    LowPrecisionDecentralized,
    LowRank,
    QAdam,
    QAdamOptimizer,
    TopK,
    with_bagua,
)
from bagua_comm.compression import MinMaxUInt4, MinMaxUInt8
from bagua_comm.testing import run_ranks

pytestmark = pytest.mark.gpu

CASES = {
    # gradient allreduce on the group's stream
    "allreduce-on-the-nccl-stream": lambda opt: GradientAllReduce(hierarchical=False),
    # CuPy compression kernels and compressed_allreduce on the group's stream
    "bytegrad-compression-kernels": lambda opt: ByteGrad(hierarchical=False),
    # at one rank these exchange nothing: only their weight copies in and out of the
    # buckets (around forward, after the step) are ordered against the training stream
    "decentralized-weight-copies-only": lambda opt: Decentralized(hierarchical=False),
    "lpdecentralized-weight-copies-only": lambda opt: LowPrecisionDecentralized(
        hierarchical=False),
    "qadam-compressed-momentum": lambda opt: QAdam(opt, hierarchical=False),
    # the 4-bit compressor's CUDA path (torch operations) inside compressed_allreduce
    "bytegrad-4bit-compressor": lambda opt: ByteGrad(hierarchical=False,
                                                     compressor=MinMaxUInt4(1)),
}
# These exchange nothing at one rank (TopK and LowRank return before their collectives, the
# averaging thread averages with itself), so they need two ranks, and two GPUs: NCCL refuses
# two ranks on one device, and bagua_comm's gloo backend carries CPU tensors only (it refused
# these cases' CUDA tensors on the one-GPU H200 of 2026-11-28). On CPU, their ordering
# against the training stream is checked by test_stream_order.py's stream model.
TWO_RANK_CASES = {
    # top-k selection, allgathers of indices (with the unused flags) and values, error
    # feedback through the overflow scratch buffer; then 8-bit values and DGC momentum
    "topk-allgathers-and-residuals": lambda opt: TopK(density=0.1, hierarchical=False),
    "topk-8bit-values-dgc": lambda opt: TopK(density=0.1, compressor=MinMaxUInt8(1),
                                             momentum=0.9, hierarchical=False),
    # the P then Q allreduces chained per matrix, orthogonalisation, warm-started Q
    "low-rank-chained-factors": lambda opt: LowRank(rank=2, min_compression_rate=0),
    # the averaging thread's device, stream and events against the training stream
    "async-averaging-thread": lambda opt: AsyncModelAverage(sync_interval_ms=5),
}
STEPS = 12
DELAY_CYCLES = 20_000_000   # ~10 ms of GPU spinning before each backward


def _device():
    return torch.device("cuda", torch.cuda.current_device())


def _run(case, side_stream, cases=CASES):
    dev = _device()
    rank = bc.get_rank()
    model = make_model(0).to(dev)
    if case.startswith("qadam"):
        opt = QAdamOptimizer(model.parameters(), lr=1e-2, warmup_steps=4)
    elif case.endswith("dgc"):      # DGC applies the momentum itself
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    wrapped = with_bagua(model, [opt], cases[case](opt), bucket_size=256)
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    losses = []
    with torch.cuda.stream(stream):
        for step in range(STEPS):
            x, y = (t.to(dev, non_blocking=False) for t in batch(step, rank))
            opt.zero_grad()
            loss = loss_fn(wrapped, x, y)
            if side_stream:
                torch.cuda._sleep(DELAY_CYCLES)   # gradients arrive late on this stream
            loss.backward()
            opt.step()
            losses.append(loss.detach())
            if case.startswith("async"):
                time.sleep(0.02)       # the host waits: the averaging thread's rounds run
    torch.cuda.synchronize()
    exchanged = getattr(wrapped.impl, "rounds", None)
    if case.startswith("async"):
        wrapped.abort()
    wrapped.detach_algorithm()
    return ([p.detach().cpu().clone() for p in model.parameters()], [v.item() for v in losses],
            exchanged)


def _compare(case):
    assert bc.get_backend() == "nccl", bc.get_backend()
    torch.use_deterministic_algorithms(True)
    ref, ref_losses, _ = _run(case, side_stream=False)
    got, losses, _ = _run(case, side_stream=True)
    finite = all(torch.isfinite(p).all() for p in got)
    same = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(ref, got))
    return finite, same, losses[0], losses[-1], ref_losses[-1]


@pytest.mark.parametrize("case", list(CASES))
def test_one_rank_training_on_a_side_stream_matches_the_default_stream(case):
    env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8",
           "BAGUA_COMM_BACKEND": os.environ.get("BAGUA_COMM_BACKEND", "nccl")}
    finite, same, first, last, ref_last = run_ranks(_compare, 1, args=(case,), backend="nccl",
                                                    timeout=600, env=env)[0]
    assert finite, case
    assert last < first, (case, first, last)
    assert same, (case, last, ref_last)


def _compare_two_ranks(case):
    torch.use_deterministic_algorithms(True)
    deterministic = not case.startswith("async")     # its rounds follow the wall clock
    ref, ref_losses, _ = (_run(case, False, TWO_RANK_CASES) if deterministic
                          else (None, [0.0], None))
    got, losses, rounds = _run(case, True, TWO_RANK_CASES)
    finite = all(torch.isfinite(p).all() for p in got)
    same = deterministic and all(torch.allclose(a, b, rtol=1e-5, atol=1e-6)
                                 for a, b in zip(ref, got))
    return finite, same, losses[0], losses[-1], ref_losses[-1], rounds, got


@pytest.mark.parametrize("case", list(TWO_RANK_CASES))
def test_two_gpus_training_on_a_side_stream_matches_the_default_stream(case):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs: at one rank this algorithm exchanges nothing, NCCL refuses "
                    "two ranks on one device and bagua_comm's gloo backend carries CPU tensors")
    env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "BAGUA_COMM_BACKEND": "nccl"}
    r0, r1 = run_ranks(_compare_two_ranks, 2, args=(case,), backend="nccl", timeout=600,
                       env=env)
    # (each rank's loss is on its own batches, step by step: too noisy to go down in 12 steps)
    for finite, same, _first, last, ref_last, rounds, _ in (r0, r1):
        assert finite, case
        if case.startswith("async"):
            assert rounds and rounds > 0, (case, rounds)    # the ranks averaged
        else:
            assert same, (case, last, ref_last)
    if not case.startswith("async"):
        # each rank trained on its own batches: equal weights mean the exchange ran
        for a, b in zip(r0[6], r1[6]):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), case
