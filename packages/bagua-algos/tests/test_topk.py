"""TopK: density 1.0 is GradientAllReduce bit for bit (2 ranks); sparse steps match a numpy
reference of top-k with error feedback (and of DGC's momentum correction); ranks stay
bit-identical; residuals and velocities follow re-bucketing and checkpoints by parameter name;
bad arguments raise before communicating."""

import math

import numpy as np
import pytest
import torch
from _common import batch, loss_fn, make_model, params
from _ef_harness import checkpoint_cycle, resume_elsewhere, sgd, train

from bagua_algos import Algorithm, GradientAllReduce, TopK
from bagua_comm.compression import MinMaxUInt8
from bagua_comm.testing import run_ranks

STEPS, DENSITY = 6, 0.1


def _topk():
    return TopK(density=DENSITY)


def _topk_uint8():
    return TopK(density=DENSITY, compressor=MinMaxUInt8(1))


def _dgc():
    return TopK(density=DENSITY, momentum=0.9, start_step=2)


def _refused(make_opt):
    from bagua_algos import with_bagua

    model = make_model(seed=1)
    try:
        with_bagua(model, [make_opt(model)], TopK(density=DENSITY, momentum=0.9))
    except ValueError as e:
        return str(e)
    return None


def _all():
    out = {"dgc": train(_dgc, STEPS, momentum=0.0)[0],
           "dgc_rebucketed": train(_dgc, STEPS, rebucket_at=3, momentum=0.0),
           "dgc_ckpt": checkpoint_cycle(_dgc, momentum=0.0),
           # both ranks on one node: with_bagua runs the flat mode (one log line)
           "dgc_one_node": train(lambda: TopK(density=DENSITY, momentum=0.9, hierarchical=True),
                                 STEPS, momentum=0.0)[0],
           "dgc_refused": [_refused(lambda m: sgd(m, momentum=0.9)),
                           _refused(lambda m: torch.optim.Adam(m.parameters()))],
           "gar": train(GradientAllReduce, STEPS)[0],
           "dense": train(lambda: TopK(density=1.0), STEPS)[0],
           "sparse": train(_topk, STEPS),
           "warm": train(lambda: TopK(density=DENSITY, start_step=2), STEPS)[0],
           "rebucketed": train(_topk, STEPS, rebucket_at=3),
           "uint8": train(_topk_uint8, STEPS)[0],
           "hier": train(lambda: TopK(density=DENSITY, hierarchical=True), 2)[0],
           "ckpt": checkpoint_cycle(_topk)}
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all, 2, timeout=240)


def test_density_one_is_gradient_allreduce_bit_for_bit(results):
    for r in results:
        for a, b in zip(r["gar"], r["dense"]):
            assert all(torch.equal(x, y) for x, y in zip(a, b))


def reference(steps, world, density, lr=0.05, start_step=0, momentum=0.0):
    """Single process, numpy: each rank's top-k of gradient + residual per parameter, the
    residual keeps the rest, the optimizer steps on the mean of the sparse vectors (the
    plain mean, residuals untouched, for the first ``start_step`` steps).

    ``momentum`` > 0: DGC (Lin et al. 2018, Algorithm 1 with momentum factor masking), with
    SGD without momentum: u <- m u + g; v <- v + u; send top-k of v; clear the sent entries
    of u and v; during the warm-up, the mean of the u (SGD's momentum) and nothing cleared."""
    model = make_model(seed=1)
    opt = sgd(model, lr, momentum=0.0 if momentum else 0.9)
    ps = list(model.parameters())
    residual = [[np.zeros(p.numel(), np.float32) for p in ps] for _ in range(world)]
    velocity = [[np.zeros(p.numel(), np.float32) for p in ps] for _ in range(world)]
    history = []
    for step in range(steps):
        grads = []
        for r in range(world):
            opt.zero_grad()
            loss_fn(model, *batch(step, r)).backward()
            grads.append([p.grad.detach().reshape(-1).numpy().copy() for p in ps])
        for j, p in enumerate(ps):
            total = np.zeros(p.numel(), np.float32)
            for r in range(world):
                g = grads[r][j]
                if momentum:
                    velocity[r][j] = np.float32(momentum) * velocity[r][j] + g
                    g = velocity[r][j]
                c = g + residual[r][j]
                k = min(c.size, max(1, math.ceil(density * c.size)))
                if step < start_step:
                    total += g
                    continue
                keep = np.argsort(-np.abs(c), kind="stable")[:k]
                sent = np.zeros_like(c)
                sent[keep] = c[keep]
                residual[r][j] = c - sent
                velocity[r][j][keep] = 0
                total += sent
            p.grad = torch.from_numpy(total / np.float32(world)).reshape(p.shape)
        opt.step()
        history.append(params(model))
    return history


def test_sparse_steps_match_numpy_reference_and_ranks_stay_identical(results):
    want = reference(STEPS, 2, DENSITY)
    for step in range(STEPS):
        a, b = results[0]["sparse"][0][step], results[1]["sparse"][0][step]
        assert all(torch.equal(x, y) for x, y in zip(a, b)), step      # bit-identical ranks
        for x, w in zip(a, want[step]):
            torch.testing.assert_close(x, w, atol=1e-6, rtol=1e-5)
    # sparse is not dense: the run differs from the plain average
    assert not all(torch.equal(x, y) for x, y in zip(results[0]["sparse"][0][-1],
                                                      results[0]["dense"][-1]))


def test_start_step_sends_the_plain_average_first_then_top_k(results):
    want = reference(STEPS, 2, DENSITY, start_step=2)
    for step in range(STEPS):
        a, b = results[0]["warm"][step], results[1]["warm"][step]
        assert all(torch.equal(x, y) for x, y in zip(a, b)), step
        for x, w in zip(a, want[step]):
            torch.testing.assert_close(x, w, atol=1e-6, rtol=1e-5)
    for step in range(2):       # the warm-up steps are GradientAllReduce's, bit for bit
        assert all(torch.equal(x, y) for x, y in zip(results[0]["warm"][step],
                                                      results[0]["gar"][step])), step
    assert not all(torch.equal(x, y) for x, y in zip(results[0]["warm"][2],
                                                      results[0]["gar"][2]))


def test_momentum_correction_matches_dgc_reference(results):
    want = reference(STEPS, 2, DENSITY, start_step=2, momentum=0.9)
    for step in range(STEPS):
        a, b = results[0]["dgc"][step], results[1]["dgc"][step]
        assert all(torch.equal(x, y) for x, y in zip(a, b)), step
        for x, w in zip(a, want[step]):
            torch.testing.assert_close(x, w, atol=1e-6, rtol=1e-5)
    # Its warm-up is SGD's momentum: GradientAllReduce with SGD(momentum=0.9), up to rounding
    for step in range(2):
        for x, y in zip(results[0]["dgc"][step], results[0]["gar"][step]):
            torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5)
    # ... and after it, not plain TopK with the optimizer's momentum
    assert not all(torch.allclose(x, y) for x, y in zip(results[0]["dgc"][-1],
                                                         results[0]["warm"][-1]))


def test_momentum_correction_from_the_first_step_hierarchical_on_one_node(results):
    # hierarchical=True on a single node runs flat: DGC from step 0, as the reference
    want = reference(STEPS, 2, DENSITY, momentum=0.9)
    for step in range(STEPS):
        a, b = results[0]["dgc_one_node"][step], results[1]["dgc_one_node"][step]
        assert all(torch.equal(x, y) for x, y in zip(a, b)), step
        for x, w in zip(a, want[step]):
            torch.testing.assert_close(x, w, atol=1e-6, rtol=1e-5)


def _alone():
    dgc = train(lambda: TopK(density=DENSITY, momentum=0.9), 4, momentum=0.0)[0]
    model = make_model(seed=1)
    opt = sgd(model, momentum=0.9)
    plain = []
    for step in range(4):
        opt.zero_grad()
        loss_fn(model, *batch(step, 0)).backward()
        opt.step()
        plain.append(params(model))
    return dgc, plain


def test_momentum_correction_on_one_rank_is_sgd_momentum():
    # one rank: nothing to exchange or sparsify; the momentum (which the optimizer lacks) holds
    dgc, plain = run_ranks(_alone, 1, timeout=120)[0]
    for a, b in zip(dgc, plain):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5)


def test_momentum_correction_state_follows_rebucketing_and_checkpoints(results):
    for r in results:
        history, (before, after, _) = r["dgc_rebucketed"]
        assert any(t.any() for t in before["velocities"].values())
        assert all(torch.equal(before["velocities"][k], after["velocities"][k])
                   for k in before["velocities"])
        for a, b in zip(history, r["dgc"]):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
        exact, saved, _ = r["dgc_ckpt"]
        assert exact and any(t.any() for t in saved["velocities"].values())
    lines, state, _ = run_ranks(resume_elsewhere, 1,
                                args=(_dgc, results[0]["dgc_ckpt"][2], 0.0), timeout=120)[0]
    assert len(lines) == 1 and "velocities" in lines[0]
    assert not any(t.any() for t in state["velocities"].values())


def test_momentum_correction_refuses_an_optimizer_with_its_own_momentum(results):
    for r in results:
        sgd_msg, adam_msg = r["dgc_refused"]
        assert "optimizers[0]" in sgd_msg and "momentum=0.9" in sgd_msg
        assert "optimizers[0]" in adam_msg and "betas" in adam_msg


@pytest.mark.parametrize("momentum", [-0.1, 1.0, 2, float("nan"), True, "0.9"])
def test_bad_momentum_raises_naming_it(momentum):
    with pytest.raises(ValueError, match="momentum"):
        TopK(momentum=momentum)


def test_quantised_values_and_hierarchical_keep_ranks_identical(results):
    for case in ("uint8", "hier"):
        for a, b in zip(results[0][case], results[1][case]):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), case
    # 8-bit values: close to the full-precision sparse run, not equal
    last, exact = results[0]["uint8"][-1], results[0]["sparse"][0][-1]
    assert not all(torch.equal(x, y) for x, y in zip(last, exact))
    for x, y in zip(last, exact):
        torch.testing.assert_close(x, y, atol=2e-2, rtol=0)


def test_residuals_survive_rebucketing_by_parameter_name(results):
    for r in results:
        history, (before, after, buckets) = r["rebucketed"]
        assert buckets == 1 and before["residuals"].keys() == after["residuals"].keys()
        assert any(t.any() for t in before["residuals"].values())
        assert all(torch.equal(before["residuals"][k], after["residuals"][k])
                   for k in before["residuals"])
        # per-parameter selection: the bucket layout does not change the maths
        for a, b in zip(history, r["sparse"][0]):
            assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_checkpoint_resumes_exactly_and_at_another_world_size(results):
    for r in results:
        exact, saved, _ = r["ckpt"]
        assert exact
        assert any(t.any() for t in saved["residuals"].values())
    lines, state, loss = run_ranks(resume_elsewhere, 1, args=(_topk, results[0]["ckpt"][2]),
                                   timeout=120)[0]
    assert len(lines) == 1 and "world size 2, now 1" in lines[0]
    assert "residuals" in lines[0]
    assert not any(t.any() for t in state["residuals"].values())       # reset, not foreign
    assert math.isfinite(loss)


@pytest.mark.parametrize("density", [0, -0.1, 1.5, float("nan"), True, "0.1"])
def test_bad_density_raises_naming_it(density):
    with pytest.raises(ValueError, match="density"):
        TopK(density=density)
    with pytest.raises(ValueError, match="density"):
        Algorithm.init("topk", density=density)


def test_compressor_with_its_own_error_feedback_is_refused():
    with pytest.raises(ValueError, match="error_feedback"):
        TopK(compressor=MinMaxUInt8(1, error_feedback=True))
    with pytest.raises(ValueError, match="compressor"):
        TopK(compressor="uint8")


@pytest.mark.parametrize("start_step", [-1, 1.5, True, "2"])
def test_bad_start_step_raises_naming_it(start_step):
    with pytest.raises(ValueError, match="start_step"):
        TopK(start_step=start_step)
