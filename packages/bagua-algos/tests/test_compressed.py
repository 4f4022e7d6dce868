"""ByteGrad and QAdam (8-bit compressed communication): bit-identical ranks, training, and
agreement with uncompressed references where the algorithm is exact."""

import pytest
import torch
from _common import batch, eval_loss, global_batch, loss_fn, make_model, params

import bagua_comm as bc
from bagua_algos import ByteGrad, QAdam, QAdamOptimizer, with_bagua
from bagua_comm.testing import run_ranks

STEPS, WARMUP = 20, 4


def _grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


def _bytegrad(error_feedback):
    rank, world = bc.get_rank(), bc.get_world_size()
    model = make_model(seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model = with_bagua(model, [opt], ByteGrad(hierarchical=False,
                                              error_feedback=error_feedback), bucket_size=300)
    # One backward: the communicated gradient is the true average up to 8-bit quantisation.
    loss_fn(model, *batch(0, rank)).backward()
    got = _grads(model)
    ref = make_model(seed=1)
    loss_fn(ref, *global_batch(0, world)).backward()
    local = []
    for r in range(world):                     # every rank's own gradient, for the bound
        m = make_model(seed=1)
        loss_fn(m, *batch(0, r)).backward()
        local += [g.reshape(-1) for g in _grads(m)]
    local = torch.cat(local)
    first = (got, _grads(ref), float(local.max() - local.min()))
    before = eval_loss(model, world)
    for step in range(STEPS):
        opt.zero_grad()
        loss_fn(model, *batch(step, rank)).backward()
        opt.step()
    return first, params(model), before, eval_loss(model, world)


def _qadam():
    rank, world = bc.get_rank(), bc.get_world_size()
    model = make_model(seed=1)
    opt = QAdamOptimizer(model.parameters(), lr=1e-2, warmup_steps=WARMUP)
    model = with_bagua(model, [opt], QAdam(opt, hierarchical=False), bucket_size=300)
    ref = make_model(seed=1)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    before = eval_loss(model, world)
    warm = None
    for step in range(STEPS):
        opt.zero_grad()
        loss_fn(model, *batch(step, rank)).backward()
        opt.step()
        if step < WARMUP:                      # warmup: Adam on the averaged gradient
            ref_opt.zero_grad()
            loss_fn(ref, *global_batch(step, world)).backward()
            ref_opt.step()
        if step == WARMUP - 1:
            warm = (params(model), params(ref))
    return warm, params(model), before, eval_loss(model, world)


def _all():
    return {"bytegrad": _bytegrad(False), "bytegrad_ef": _bytegrad(True), "qadam": _qadam()}


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all, 2, timeout=180)


@pytest.mark.parametrize("case", ["bytegrad", "bytegrad_ef"])
def test_bytegrad_is_the_average_up_to_quantisation_and_trains(results, case):
    for r in results:
        (got, want, span), _, before, after = r[case]
        for g, w in zip(got, want):
            # two 8-bit quantisations (scatter, then gather), each off by <= span / 255 / 2
            torch.testing.assert_close(g, w, atol=2 * span / 255, rtol=0)
        assert after < 0.7 * before
    a, b = results[0][case][1], results[1][case][1]
    assert all(torch.equal(x, y) for x, y in zip(a, b))          # bit-identical ranks


def test_qadam_warmup_is_adam_then_compressed_momentum_keeps_ranks_identical(results):
    for r in results:
        (got, ref), _, before, after = r["qadam"]
        for g, w in zip(got, ref):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
        assert after < 0.7 * before
    a, b = results[0]["qadam"][1], results[1]["qadam"][1]
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_qadam_optimizer_alone_is_adam_during_warmup_then_freezes_the_second_moment():
    model, ref = make_model(seed=3), make_model(seed=3)
    opt = QAdamOptimizer(model.parameters(), lr=1e-2, warmup_steps=3, weight_decay=0.01)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2, weight_decay=0.01)
    for step in range(5):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            loss_fn(m, *batch(step, 0)).backward()
            o.step()
        if step == 2:
            for a, b in zip(params(model), params(ref)):
                torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
            frozen = [opt.state[p]["exp_avg_sq"].clone() for p in model.parameters()]
    assert all(torch.equal(opt.state[p]["exp_avg_sq"], v)
               for p, v in zip(model.parameters(), frozen))


def _compiled_or_not(name, compiled):
    """Parameters after 8 steps of ByteGrad (SGD) or QAdam (2 warmup steps): ``compiled``,
    as built (bagua_comm's compiled compressed launchers, QAdam's compiled fold); else every
    bucket through ``bucket_ready_hook`` and compressed_allreduce's general Python path (a
    MinMaxUInt8 subclass takes it): the code path before issue #46's launchers."""
    from bagua_algos.algorithm import AlgorithmImpl
    from bagua_algos.algorithms.bytegrad import ByteGradImpl
    from bagua_algos.algorithms.q_adam import QAdamImpl
    from bagua_comm.compression import MinMaxUInt8

    class General(MinMaxUInt8):
        pass

    rank, world = bc.get_rank(), bc.get_world_size()
    compressor = (MinMaxUInt8 if compiled else General)(world)
    model = make_model(seed=1)
    if name == "bytegrad":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
        algo = ByteGrad(hierarchical=False, compressor=compressor)
    else:
        opt = QAdamOptimizer(model.parameters(), lr=1e-2, warmup_steps=2, weight_decay=0.01)
        algo = QAdam(opt, hierarchical=False, compressor=compressor)
    impl = ByteGradImpl if name == "bytegrad" else QAdamImpl
    saved = impl.bucket_launchers
    if not compiled:
        impl.bucket_launchers = AlgorithmImpl.bucket_launchers
    try:
        model = with_bagua(model, [opt], algo, bucket_size=300)    # padded buckets
        for step in range(8):
            opt.zero_grad()
            loss_fn(model, *batch(step, rank)).backward()
            opt.step()
        eng = model.engine
        kinds = {type(s).__name__ for _, s in eng.impl.bucket_launchers(eng.ctx, eng.buckets)}
    finally:
        impl.bucket_launchers = saved
    return params(model), kinds


def _both_paths():
    return {(name, compiled): _compiled_or_not(name, compiled)
            for name in ("bytegrad", "qadam") for compiled in (True, False)}


@pytest.mark.parametrize("world", [2, 3])
def test_compiled_launchers_train_bit_for_bit_as_the_python_path(world):
    for r in run_ranks(_both_paths, world, timeout=240):
        for name in ("bytegrad", "qadam"):
            (a, kinds), (b, _) = r[(name, True)], r[(name, False)]
            assert kinds == {"CompressedLauncher" if name == "bytegrad" else "FoldThenStart"}
            assert all(torch.equal(x, y) for x, y in zip(a, b)), name
