"""LowRank: full rank is GradientAllReduce up to rounding; low-rank steps match a numpy
reference of PowerSGD with error feedback and warm start; ranks stay bit-identical; Q and
residuals follow re-bucketing and checkpoints by parameter name; bad arguments raise."""

import math

import numpy as np
import pytest
import torch
from _common import batch, loss_fn, make_model, params
from _ef_harness import SAVE_AT, checkpoint_cycle, resume_elsewhere, sgd, train

from bagua_algos import Algorithm, GradientAllReduce, LowRank
from bagua_algos.algorithms.low_rank import initial_q, matrix_shape
from bagua_comm._compressed import padded_numel
from bagua_comm.compression import MinMaxUInt8
from bagua_comm.testing import run_ranks

STEPS = 6
WARMUP = 2


def _low_rank():
    return LowRank(rank=2)


def _quantised():
    return LowRank(rank=2, compressor=MinMaxUInt8(2))


def _all():
    return {"quantised": train(_quantised, STEPS)[0],
            "gar": train(GradientAllReduce, STEPS)[0],
            "full": train(lambda: LowRank(rank=12, min_compression_rate=0), STEPS)[0],
            "low": train(_low_rank, STEPS),
            "rebucketed": train(_low_rank, STEPS, rebucket_at=3),
            "cold": train(lambda: LowRank(rank=1, warm_start=False), 3)[0],
            "warmup": train(lambda: LowRank(rank=2, start_step=WARMUP), STEPS)[0],
            "ckpt": checkpoint_cycle(_low_rank),
            "ckpt_warmup": checkpoint_cycle(lambda: LowRank(rank=2, start_step=SAVE_AT + 2))}


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all, 2, timeout=240)


def test_full_rank_is_gradient_allreduce_up_to_rounding(results):
    for r in results:
        for a, b in zip(r["gar"], r["full"]):
            for x, y in zip(a, b):
                torch.testing.assert_close(x, y, atol=2e-5, rtol=1e-4)


def quantised_mean(xs, world, chunks=2):
    """``compressed_allreduce``'s average written out in one process: each rank's input
    quantised in ``chunks`` chunks (zero-padded), decoded and averaged per segment, each
    segment re-quantised in ``chunks / world`` chunks and decoded."""
    comp = MinMaxUInt8(chunks)
    numel = xs[0].size
    padded = padded_numel(comp, numel, world)

    def roundtrip(v, c):
        t = torch.from_numpy(v.astype(np.float32))
        return comp.decompress(comp.compress(t, chunks=c), torch.empty_like(t),
                               chunks=c).double().numpy()

    mean = sum(roundtrip(np.pad(x.reshape(-1), (0, padded - numel)), chunks)
               for x in xs) / world
    seg = padded // world
    out = np.concatenate([roundtrip(mean[j * seg:(j + 1) * seg], chunks // world)
                          for j in range(world)])
    return out[:numel].reshape(xs[0].shape)


def reference(steps, world, rank=2, rate=2.0, lr=0.05, start_step=0, quantised=False):
    """Single process, numpy float64: PowerSGD with error feedback and warm start (QR for
    the orthogonalisation, so only the column signs of P may differ, which M̂ ignores),
    after ``start_step`` steps of the plain average.  ``quantised``: P and Q averaged by
    :func:`quantised_mean`, Q orthonormalised before ``P = M Q``."""
    mean = (lambda xs: quantised_mean(xs, world)) if quantised else (lambda xs: sum(xs) / world)
    model = make_model(seed=1)
    opt = sgd(model, lr)
    named = list(model.named_parameters())
    err = [{} for _ in range(world)]
    qs, history = {}, []
    for step in range(steps):
        grads = []
        for r in range(world):
            opt.zero_grad()
            loss_fn(model, *batch(step, r)).backward()
            grads.append({n: p.grad.detach().double().numpy().copy() for n, p in named})
        for name, p in named:
            shape = matrix_shape(p)
            rr = min(rank, *shape) if shape else 0
            if (shape is None or shape[0] * shape[1] < rate * rr * sum(shape)
                    or step < start_step):
                p.grad = torch.from_numpy(sum(g[name] for g in grads) / world).float()
                continue
            ms = [g[name].reshape(shape) + err[r].get(name, 0) for r, g in enumerate(grads)]
            if name not in qs:
                qs[name] = initial_q(name, shape[1], rr, 0, 0, "cpu").double().numpy()
            q = np.linalg.qr(qs[name])[0] if quantised else qs[name]
            pm = np.linalg.qr(mean([m @ q for m in ms]))[0]
            qs[name] = mean([m.T @ pm for m in ms])
            approx = pm @ qs[name].T
            for r, m in enumerate(ms):
                err[r][name] = m - approx
            p.grad = torch.from_numpy(approx).float().reshape(p.shape)
        opt.step()
        history.append(params(model))
    return history


def test_low_rank_steps_match_numpy_reference_and_ranks_stay_identical(results):
    want = reference(STEPS, 2)
    for step in range(STEPS):
        a, b = results[0]["low"][0][step], results[1]["low"][0][step]
        assert all(torch.equal(x, y) for x, y in zip(a, b)), step      # bit-identical ranks
        for x, w in zip(a, want[step]):
            torch.testing.assert_close(x, w, atol=2e-5, rtol=1e-4)
    # rank 2 is not the full gradient
    assert not all(torch.allclose(x, y, atol=1e-4) for x, y in zip(results[0]["low"][0][-1],
                                                                   results[0]["gar"][-1]))
    for a, b in zip(results[0]["cold"], results[1]["cold"]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_quantised_factors_match_the_reference_and_ranks_stay_identical(results):
    want, exact = reference(STEPS, 2, quantised=True), reference(STEPS, 2)
    for step in range(STEPS):
        a, b = results[0]["quantised"][step], results[1]["quantised"][step]
        assert all(torch.equal(x, y) for x, y in zip(a, b)), step      # bit-identical ranks
        for x, w in zip(a, want[step]):
            torch.testing.assert_close(x, w, atol=2e-5, rtol=1e-4)
    # 8-bit factors are not the float32 ones: the reference tells them apart
    assert max(float((w - e).abs().max()) for w, e in zip(want[-1], exact[-1])) > 2e-4


def test_start_step_warms_up_with_the_plain_average_then_compresses(results):
    want = reference(STEPS, 2, start_step=WARMUP)
    for r in results:
        for step in range(STEPS):
            if step < WARMUP:   # the plain average: GradientAllReduce
                for x, y in zip(r["warmup"][step], r["gar"][step]):
                    torch.testing.assert_close(x, y, atol=1e-6, rtol=0)
            for x, w in zip(r["warmup"][step], want[step]):
                torch.testing.assert_close(x, w, atol=2e-5, rtol=1e-4)
    # compression starts at WARMUP: after it the model leaves GradientAllReduce's path
    assert not all(torch.allclose(x, y, atol=1e-4) for x, y in zip(results[0]["warmup"][-1],
                                                                   results[0]["gar"][-1]))
    for r in results:   # a resume inside the warm-up finishes it, then compresses, exactly
        exact, saved, _ = r["ckpt_warmup"]
        assert exact and saved["rounds"] == SAVE_AT and not saved["residuals"]


def test_state_survives_rebucketing_by_parameter_name(results):
    for r in results:
        history, (before, after, buckets) = r["rebucketed"]
        assert buckets == 1
        for part in ("q", "residuals"):
            assert before[part].keys() == after[part].keys() and before[part]
            assert all(torch.equal(before[part][k], after[part][k]) for k in before[part])
        for a, b in zip(history, r["low"][0]):
            for x, y in zip(a, b):
                torch.testing.assert_close(x, y, atol=1e-6, rtol=0)


def test_checkpoint_resumes_exactly_and_at_another_world_size(results):
    for r in results:
        exact, saved, _ = r["ckpt"]
        assert exact
        assert any(t.any() for t in saved["residuals"].values())
    saved = results[0]["ckpt"][1]
    lines, state, loss = run_ranks(resume_elsewhere, 1,
                                   args=(_low_rank, results[0]["ckpt"][2]), timeout=120)[0]
    assert len(lines) == 1 and "world size 2, now 1" in lines[0] and "residuals" in lines[0]
    assert state["residuals"] == {}
    assert state["q"].keys() == saved["q"].keys()                       # Q is shared: kept
    assert all(torch.equal(state["q"][k], saved["q"][k]) for k in saved["q"])
    assert math.isfinite(loss)


def test_conv_weights_are_viewed_as_matrices():
    conv = torch.nn.Conv2d(3, 8, 3)
    assert matrix_shape(conv.weight) == (8, 27) and matrix_shape(conv.bias) is None


@pytest.mark.parametrize("kwargs, name", [({"rank": 0}, "rank"), ({"rank": 1.5}, "rank"),
                                          ({"min_compression_rate": -1}, "min_compression_rate"),
                                          ({"warm_start": 1}, "warm_start"),
                                          ({"start_step": -1}, "start_step"),
                                          ({"start_step": 1.5}, "start_step"),
                                          ({"start_step": True}, "start_step")])
def test_bad_arguments_raise_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=name):
        LowRank(**kwargs)
    with pytest.raises(ValueError, match=name):
        Algorithm.init("low_rank", **kwargs)


def test_compressor_with_its_own_error_feedback_or_wrong_chunks_is_refused():
    with pytest.raises(ValueError, match="error_feedback"):
        LowRank(compressor=MinMaxUInt8(2, error_feedback=True))
    with pytest.raises(ValueError, match="compressor"):
        LowRank(compressor="uint8")
    with pytest.raises(ValueError, match=r"LowRank\(compressor=\).*chunks \(3\).*\(2\)"):
        LowRank(compressor=MinMaxUInt8(3)).reify(type("G", (), {"size": 2})())
