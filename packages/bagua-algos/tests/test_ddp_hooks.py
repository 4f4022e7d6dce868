"""bagua_algos.ddp_hooks: our compressors as a torch DDP communication hook (issue #29 B).

2 gloo ranks, real processes.  References: bagua-comm's numpy simulation of MinMaxUInt8's
scatter-reduce-gather (packages/bagua-comm/tests), ByteGrad through with_bagua on the same
seeds, and uncompressed DDP for the loss."""

import io
import os
import pickle
import sys
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _common import IN, batch, eval_loss, loss_fn, make_model, params
from torch.nn.parallel import DistributedDataParallel as DDP

import bagua_comm as bc
from bagua_algos import ByteGrad, with_bagua
from bagua_algos.ddp_hooks import CompressionHookState, compressed_allreduce_hook
from bagua_comm.compression import MinMaxUInt4, MinMaxUInt8
from bagua_comm.testing import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "bagua-comm", "tests"))
from test_compressed_allreduce import _simulate  # numpy, independent of ours

WORLD = 2


def _flat_grads(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _ddp(model, state, **kw):
    ddp = DDP(model, **kw)
    ddp.register_comm_hook(state, compressed_allreduce_hook)
    return ddp


# -- the averaged gradient against the numpy reference -----------------------------------------
def _recorded_buckets(compressor):
    """Two backwards (DDP's first buckets, then its rebuilt ones): for each bucket, the indices
    of its parameters in model.parameters() order, and every averaged gradient."""
    rank = bc.get_rank()
    model = make_model(seed=1)
    index = {id(p): i for i, p in enumerate(model.parameters())}
    state = CompressionHookState(compressor=compressor)
    seen = []

    def recording(st, bucket):
        seen[-1].append([index[id(p)] for p in bucket.parameters()])
        return compressed_allreduce_hook(st, bucket)

    ddp = DDP(model, bucket_cap_mb=0.0005)       # ~500 bytes: several buckets after rebuild
    ddp.register_comm_hook(state, recording)
    grads = []
    for step in range(2):
        seen.append([])
        ddp.zero_grad()
        loss_fn(ddp, *batch(step, rank)).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    return seen, grads


def _local_grads(step, rank):
    model = make_model(seed=1)
    loss_fn(model, *batch(step, rank)).backward()
    return [p.grad.clone() for p in model.parameters()]


def _recorded_both():
    return {chunks: _recorded_buckets(MinMaxUInt8(chunks)) for chunks in (2, 4)}


@pytest.fixture(scope="module")
def recorded():
    return run_ranks(_recorded_both, WORLD, timeout=120)


@pytest.mark.parametrize("chunks", [2, 4])
def test_hook_gradient_is_minmax_uint8_scatter_reduce_gather_of_the_bucket(recorded, chunks):
    (seen0, got0), (seen1, got1) = (r[chunks] for r in recorded)
    assert seen0 == seen1
    assert len(seen0[1]) > 1                     # the rebuilt layout has several buckets
    for step, buckets in enumerate(seen0):
        local = [_local_grads(step, r) for r in range(WORLD)]
        for order in buckets:
            inputs = [torch.cat([local[r][i].reshape(-1) for i in order]).numpy()
                      for r in range(WORLD)]
            want = _simulate(inputs, "float32", chunks, "avg")
            for got in (got0, got1):                           # bit-identical ranks
                flat = torch.cat([got[step][i].reshape(-1) for i in order]).numpy()
                np.testing.assert_array_equal(flat, want)


# -- ByteGrad through with_bagua on the same seeds ----------------------------------------------
def _single_weight_model():
    torch.manual_seed(5)
    return torch.nn.Linear(IN, 1, bias=False)


def _hook_and_bytegrad(make, error_feedback, steps=4):
    rank = bc.get_rank()
    model = make()
    ddp = _ddp(model, CompressionHookState(error_feedback=error_feedback))
    ours = []
    for step in range(steps):
        ddp.zero_grad()
        loss_fn(ddp, *batch(step, rank)).backward()
        ours.append(_flat_grads(model))
    ref = make()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    wrapped = with_bagua(ref, [opt], ByteGrad(hierarchical=False,
                                              error_feedback=error_feedback))
    theirs = []
    for step in range(steps):
        opt.zero_grad()
        loss_fn(wrapped, *batch(step, rank)).backward()
        theirs.append(_flat_grads(ref))
    wrapped.detach_algorithm()
    return ours, theirs


def _bytegrad_cases():
    return {"multi": _hook_and_bytegrad(make_model, False),
            "ef": _hook_and_bytegrad(_single_weight_model, True),
            "chunks": _chunks_not_multiple()}


def _chunks_not_multiple():
    try:
        CompressionHookState(compressor=MinMaxUInt8(3))
    except ValueError as err:
        return str(err)
    return None


@pytest.fixture(scope="module")
def bytegrad_cases():
    return run_ranks(_bytegrad_cases, WORLD, timeout=120)


def test_hook_equals_bytegrad_once_ddp_buckets_match_bagua_s(bytegrad_cases):
    """DDP's first-iteration bucket lists the parameters in another order than with_bagua's
    (so other min/max chunks); from DDP's rebuilt buckets on (the same order) the averaged
    gradients are ByteGrad's bit for bit."""
    for ours, theirs in (r["multi"] for r in bytegrad_cases):
        for step in range(1, 4):
            assert torch.equal(ours[step], theirs[step]), step


def test_hook_with_error_feedback_equals_bytegrad_with_error_feedback(bytegrad_cases):
    """One parameter: the same bucket from the first step, residuals carried step to step."""
    for ours, theirs in (r["ef"] for r in bytegrad_cases):
        for step in range(4):
            assert torch.equal(ours[step], theirs[step]), step


# -- training -----------------------------------------------------------------------------------
def _train(mode, steps=30):
    rank = bc.get_rank()
    model = make_model(seed=1)
    if mode == "ddp":
        ddp = DDP(model)
    else:
        comp = MinMaxUInt4(WORLD, error_feedback=True) if mode == "uint4" else None
        ddp = _ddp(model, CompressionHookState(compressor=comp,
                                               error_feedback=mode == "uint8_ef"),
                   bucket_cap_mb=0.0005)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    before = eval_loss(model, WORLD)
    for step in range(steps):
        opt.zero_grad()
        loss_fn(ddp, *batch(step, rank)).backward()
        opt.step()
    return params(model), before, eval_loss(model, WORLD)


def _all_modes():
    return {m: _train(m) for m in ("ddp", "uint8", "uint8_ef", "uint4")}


def test_training_with_the_hook_keeps_ranks_identical_and_reaches_ddp_s_loss():
    r0, r1 = run_ranks(_all_modes, WORLD, timeout=180)
    ddp_loss = r0["ddp"][2]
    for mode in ("uint8", "uint8_ef", "uint4"):
        for a, b in zip(r0[mode][0], r1[mode][0]):
            assert torch.equal(a, b), mode
        before, after = r0[mode][1], r0[mode][2]
        assert after < 0.5 * before, (mode, before, after)
        assert after == pytest.approx(ddp_loss, rel=0.1, abs=2e-3), (mode, after, ddp_loss)


# -- error-feedback state: keys, rebuilds, checkpoints -----------------------------------------
def _residual_keys_and_resume():
    rank = bc.get_rank()
    model = make_model(seed=1)
    index = {id(p): i for i, p in enumerate(model.parameters())}
    state = CompressionHookState(error_feedback=True)
    layouts = []

    def recording(st, bucket):
        layouts.append(",".join(str(index[id(p)]) for p in bucket.parameters()))
        return compressed_allreduce_hook(st, bucket)

    ddp = DDP(model, bucket_cap_mb=0.0005)
    ddp.register_comm_hook(state, recording)
    keys = []
    for step in range(5):
        layouts.clear()
        ddp.zero_grad()
        loss_fn(ddp, *batch(step, rank)).backward()
        keys.append(sorted({k.rsplit("/", 1)[0]
                            for k in state.state_dict()["compressor"]["residuals"]}))
    last_layouts = list(layouts)
    # a checkpoint: weights_only-loadable, restored into a fresh state
    buf = io.BytesIO()
    torch.save(state.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    fresh = CompressionHookState(error_feedback=True)
    fresh.load_state_dict(saved)
    same = all(torch.equal(a, b) for a, b in zip(
        fresh.state_dict()["compressor"]["residuals"].values(),
        saved["compressor"]["residuals"].values()))
    return keys, last_layouts, same, sorted(saved["compressor"]["residuals"])


def _sparse_refused():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 1))
    ddp = _ddp(model, CompressionHookState())
    with pytest.raises(ValueError, match="does not support sparse gradients") as err:
        ddp(torch.tensor([[1, 2], [3, 4]])).sum().backward()
    return str(err.value)


def _state_cases():
    return {"keys": _residual_keys_and_resume(), "resume": _resume(),
            "resume several buckets": _resume(make=lambda: make_model(seed=1),
                                              bucket_cap_mb=0.0005,
                                              find_unused_parameters=True),
            "sparse": _sparse_refused()}


@pytest.fixture(scope="module")
def state_cases():
    return run_ranks(_state_cases, WORLD, timeout=120)


def test_residuals_follow_bucket_parameters_and_stale_ones_are_dropped(state_cases):
    for keys, layouts, same, saved in (r["keys"] for r in state_cases):
        # first backward: DDP's first bucket; the rebuilt buckets' keys from the second on;
        # the first bucket's residuals dropped once unused for two backwards
        assert len(keys[0]) == 1 and len(keys[1]) == len(layouts) + 1
        assert keys[3] == keys[4] and len(keys[4]) == len(layouts) > 1
        assert not set(keys[0]) & set(keys[4])
        assert same and saved == sorted(f"{k}/{t}" for k in keys[4] for t in ("gather",
                                                                             "scatter"))


def _resume(save_at=3, total=6, make=None, **ddp_kw):
    """Train a single-weight model total steps, and again resumed from a checkpoint of the
    model, optimizer and hook state taken after save_at steps."""
    rank = bc.get_rank()

    def run(start, ckpt=None):
        model = (make or _single_weight_model)()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        state = CompressionHookState(error_feedback=True)
        if ckpt is not None:
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["opt"])
            state.load_state_dict(ckpt["hook"])
        ddp = _ddp(model, state, **ddp_kw)
        saved = None
        for step in range(start, total):
            if step == save_at and ckpt is None:
                buf = io.BytesIO()
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                            "hook": state.state_dict()}, buf)
                buf.seek(0)
                saved = torch.load(buf, weights_only=True)
            opt.zero_grad()
            loss_fn(ddp, *batch(step, rank)).backward()
            opt.step()
        return params(model), saved

    straight, ckpt = run(0)
    resumed, _ = run(save_at, ckpt)
    return straight, resumed


@pytest.mark.parametrize("case", ["resume", "resume several buckets"])
def test_checkpointed_residuals_resume_the_same_training(state_cases, case):
    """Exact where DDP's first buckets are the saved ones: one bucket, or several with
    find_unused_parameters=True (DDP never rebuilds them then), as the docs say."""
    for straight, resumed in (r[case] for r in state_cases):
        for a, b in zip(straight, resumed):
            assert torch.equal(a, b)


def test_sparse_gradients_are_refused_by_name_on_every_rank(state_cases):
    """Before: "send must be contiguous (call .contiguous() first)" from bagua_comm."""
    for r in state_cases:
        assert "Embedding/EmbeddingBag(sparse=True)" in r["sparse"]


# -- process groups and bad input -------------------------------------------------------------
def _torch_initialised(store_path):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # made before any process group (Lightning's DDPStrategy(ddp_comm_state=...)), and
    # pickled (a spawn launcher): set up at the hook's first call
    early = pickle.loads(pickle.dumps(CompressionHookState(error_feedback=True)))
    deferred = early._group is None
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    foreign = dist.new_group([0, 1])               # a torch group bagua_comm did not make
    state = CompressionHookState()                 # adopts torch's default group
    adopted = bc.is_initialized() and state.group is bc.get_default_group()
    try:
        CompressionHookState(process_group=foreign)
        refused = None
    except ValueError as err:
        refused = str(err)
    sub = bc.new_group([0, 1])
    by_torch_group = CompressionHookState(process_group=sub.torch_group).group is sub
    grads = []
    for state in (CompressionHookState(process_group=dist.group.WORLD), early):
        model = make_model(seed=1)
        ddp = _ddp(model, state)
        loss_fn(ddp, *batch(0, rank)).backward()
        grads.append(_flat_grads(model))
    try:
        pickle.dumps(early)
        pickles_once_set_up = True
    except TypeError:
        pickles_once_set_up = False
    return (adopted and deferred and early.group is bc.get_default_group()
            and not pickles_once_set_up), refused, by_torch_group, grads


def test_process_groups_adopted_from_torch_and_unknown_torch_groups_refused(tmp_path):
    res = run_ranks(_torch_initialised, WORLD, args=(str(tmp_path / "store"),), init=False,
                    timeout=90)
    for adopted, refused, by_torch_group, grads in res:
        assert adopted and by_torch_group
        assert refused is not None and refused.startswith("process_group")
        for got, want in zip(grads, res[0][3]):        # bit-identical ranks
            assert torch.equal(got, want)
        assert torch.equal(grads[0], grads[1])      # error feedback: same first step


@pytest.mark.parametrize("kwargs, word", [
    ({"compressor": "minmax"}, "compressor"),
    ({"compressor": MinMaxUInt8}, "compressor"),                   # the class, not an instance
    ({"error_feedback": 1}, "error_feedback"),
    ({"error_feedback": "yes"}, "error_feedback"),
    ({"compressor": MinMaxUInt8(2), "error_feedback": True}, "error_feedback"),
])
def test_bad_arguments_raise_value_error_naming_them_before_any_group(kwargs, word):
    assert not dist.is_initialized()       # raised before a process group is looked for
    with pytest.raises(ValueError, match=word):
        CompressionHookState(**kwargs)


def test_compressor_chunks_must_be_a_multiple_of_the_group_size(bytegrad_cases):
    for msg in (r["chunks"] for r in bytegrad_cases):
        assert msg is not None and "compressor.chunks" in msg
