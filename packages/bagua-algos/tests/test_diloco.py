"""LocalSGD and DiLoCo on 2 gloo ranks against a single-process simulation of the ranks
(tests/_diloco_ref.py), DDP equivalence, bad input, Streaming DiLoCo's fragments and overlap,
and the bytes a fragment sends."""

from __future__ import annotations

import contextlib

import pytest
import torch
from _common import batch, global_batch, loss_fn, make_model
from _diloco_ref import flat, inner_optimizer, simulate

import bagua_comm as bc
from bagua_algos import Algorithm, DiLoCo, LocalSGD, with_bagua
from bagua_comm.testing import run_ranks

STEPS = 9


_COUNTING: list = []      # the lists of the _counting_collectives() contexts now open


@contextlib.contextmanager
def _counting_collectives():
    """Every collective the gloo backend issues meanwhile (an empty one included), also those
    started by an ``allreduce_launcher`` made while a context was open (it outlives it)."""
    from bagua_comm._backends import gloo

    calls, real, real_launcher = [], gloo.finish, gloo.GlooBackend.allreduce_launcher

    def counted(works, *args, **kwargs):
        calls.append(len(works))
        return real(works, *args, **kwargs)

    def counted_launcher(self, *args):
        fast = real_launcher(self, *args)
        if fast is None:
            return None

        def start():
            if _COUNTING:
                _COUNTING[-1].append(1)
            return fast()
        return start

    gloo.finish = counted
    gloo.GlooBackend.allreduce_launcher = counted_launcher
    _COUNTING.append(calls)
    try:
        yield calls
    finally:
        _COUNTING.pop()
        gloo.finish = real
        gloo.GlooBackend.allreduce_launcher = real_launcher


def _train(algo_kwargs, inner="sgd", steps=STEPS, local=False, device="cpu", autotune=False):
    rank = bc.get_rank()
    model = make_model(1).to(device)
    opt = inner_optimizer(model, inner)
    algo = LocalSGD(**algo_kwargs) if local else DiLoCo(**algo_kwargs)
    model = with_bagua(model, [opt], algo, autotune=autotune)
    traj, sent = [], []
    for t in range(steps):
        bc.traffic.reset()
        with _counting_collectives() as calls:
            opt.zero_grad()
            loss_fn(model, *(x.to(device) for x in batch(t, rank))).backward()
            opt.step()
        traj.append(flat(model.module).cpu())
        # bytes, or at least one collective (an empty one still makes the ranks wait)
        sent.append(bc.traffic.bytes_sent() or len(calls) * 1e-3)
    impl = model.impl
    devices = {str(a.device) for a in impl.anchors}
    devices |= {str(s["momentum_buffer"].device) for s in impl.outer.state.values()}
    model.detach_algorithm()
    return traj, sent, devices


def test_local_sgd_every_step_with_plain_sgd_equals_ddp(results):
    out = [r["local_sgd every step"] for r in results]
    ref = make_model(1)
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for t in range(STEPS):
        opt.zero_grad()
        loss_fn(ref, *global_batch(t, 2)).backward()   # mean loss = mean of the ranks' grads
        opt.step()
        for traj, _, _ in out:
            assert torch.allclose(traj[t], flat(ref), rtol=0, atol=1e-6), t


CASES = {
    "diloco adam": (dict(sync_every=3), "adam"),
    "diloco momentum, no nesterov": (dict(sync_every=4, outer_lr=0.5, nesterov=False),
                                     "momentum"),
    "local_sgd": (dict(sync_every=3, outer_lr=1.0, outer_momentum=0.0, nesterov=False), "sgd"),
    "fragments 3": (dict(sync_every=4, fragments=3), "sgd"),
    "overlap 2": (dict(sync_every=4, overlap_steps=2), "momentum"),
    "fragments 2 overlap 1": (dict(sync_every=4, fragments=2, overlap_steps=1), "adam"),
    # the outer momentum ramps over the first 2 outer steps (0.45, then 0.9)
    "outer warm-up 2": (dict(sync_every=2, outer_warmup=2), "adam"),
    "outer warm-up 3, fragments 2 overlap 1": (dict(sync_every=2, fragments=2, overlap_steps=1,
                                                    outer_warmup=3, nesterov=False), "momentum"),
}


def _train_scaled(overflow_step: int):
    """DiLoCo(sync_every=3) under torch.amp.GradScaler, rank 1's loss infinite at
    ``overflow_step`` (0-based): the scaler skips that inner step on rank 1 only."""
    rank = bc.get_rank()
    model = make_model(1)
    opt = inner_optimizer(model, "sgd")
    wrapped = with_bagua(model, [opt], DiLoCo(sync_every=3))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    traj = []
    for t in range(STEPS):
        opt.zero_grad()
        loss = loss_fn(wrapped, *batch(t, rank))
        if t == overflow_step and rank == 1:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        traj.append(flat(model))
    steps = wrapped.impl.steps
    wrapped.detach_algorithm()
    return traj, steps, scaler.get_scale()


def _all_cases():
    # one spawn for the whole file (spawning ranks is the slow part on a loaded machine)
    out = {"bad input": _bad_input()}
    # the skipped step is a sync step (t = 3) / the last step (t = STEPS, a sync step too)
    out["scaler"] = {s: _train_scaled(s) for s in (2, STEPS - 1)}
    out.update({name: _train(kw, inner) for name, (kw, inner) in CASES.items()})
    out["local_sgd every step"] = _train({"sync_every": 1}, local=True)
    out["anchor on cpu"] = _train({"sync_every": 3, "anchor_device": "cpu"}, "adam")
    out["autotuned"] = _train({"sync_every": 3}, "adam", autotune={
        "warmup_steps": 1, "trial_steps": 2, "max_steps": 8, "cache": False})
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all_cases, 2, timeout=240)


@pytest.mark.parametrize("case", list(CASES))
def test_matches_the_single_process_simulation(results, case):
    kw, inner = CASES[case]
    ref = simulate(2, STEPS, inner=inner, **{k.replace("_steps", ""): v for k, v in kw.items()})
    for r in range(2):
        traj, _, _ = results[r][case]
        for t in range(STEPS):
            assert torch.allclose(traj[t], ref[t][r], rtol=0, atol=2e-6), (case, r, t + 1)


@pytest.mark.parametrize("overflow_step", [2, STEPS - 1])
def test_step_skipped_by_grad_scaler_on_one_rank_still_counts(results, overflow_step):
    # Before, rank 1 counted one step fewer: it reached every later sync one step late and
    # the last one never (rank 0 waited for it until gloo's timeout).
    ref = simulate(2, STEPS, sync_every=3, skipped={(overflow_step + 1, 1)})
    for r in range(2):
        traj, steps, scale = results[r]["scaler"][overflow_step]
        assert steps == STEPS                            # every rank counted every step
        assert scale == (1024.0 if r == 0 else 512.0)    # only rank 1 skipped its step
        for t in range(STEPS):
            assert torch.allclose(traj[t], ref[t][r], rtol=0, atol=2e-6), (r, t + 1)


def test_ranks_differ_between_syncs_and_are_identical_after(results):
    (a, sent0, _), (b, _, _) = results[0]["diloco adam"], results[1]["diloco adam"]   # sync_every=3
    for t in range(STEPS):
        if (t + 1) % 3 == 0:
            assert torch.equal(a[t], b[t]), t + 1
            assert sent0[t] > 0
        else:
            assert not torch.equal(a[t], b[t]), t + 1
            assert sent0[t] == 0                  # nothing is communicated between syncs


def test_fragments_send_a_fraction_of_the_model_per_step(results):
    _, plain, _ = results[0]["diloco adam"]
    _, frag, _ = results[0]["fragments 3"]
    n = flat(make_model(1)).numel()
    # ring allreduce of float32: 2 (n-1)/n of the buffer; 3 fragments of n/3 (+-1) elements
    assert max(plain) == int(2 * 4 * n * 1 / 2)
    assert max(frag) <= max(plain) / 3 + 4
    assert sum(1 for s in frag if s) == 7        # steps t with t % 4 in (1, 2, 0)


def _bad_input():
    rank = bc.get_rank()
    model = make_model(1)
    opt = torch.optim.SGD(list(model.parameters())[:2], lr=0.1)
    errors = []
    if rank == 0:   # the peer never calls with_bagua: a check after communication would hang
        for opts, algo in (([], DiLoCo()), ([opt], DiLoCo()),
                           ([torch.optim.SGD(model.parameters(), lr=0.1)],
                            DiLoCo(fragments=7))):
            try:
                with_bagua(model, opts, algo)
            except ValueError as err:
                errors.append(str(err))
    bc.barrier()
    return errors


def test_bad_input_raises_naming_the_argument_before_any_communication(results):
    errors = results[0]["bad input"]
    assert len(errors) == 3
    assert errors[0].startswith("optimizers") and errors[1].startswith("optimizers")
    assert "fragments (7)" in errors[2]
    for kwargs, word in (({"sync_every": 0}, "sync_every"),
                         ({"overlap_steps": 4, "sync_every": 4}, "overlap_steps"),
                         ({"fragments": 0}, "fragments"),
                         ({"outer_momentum": 1.0}, "outer_momentum"),
                         ({"outer_warmup": -1}, "outer_warmup"),
                         ({"outer_warmup": 2, "outer_momentum": 0.0, "nesterov": False},
                          "outer_warmup ramps the outer momentum"),
                         ({"compressor": "int8"}, "compressor"),
                         ({"anchor_device": "nowhere"}, "anchor_device"),
                         # once accepted: inf trained the weights to +-inf; 'meta' (and
                         # 'cuda' without CUDA) failed with a raw error after communicating
                         ({"outer_lr": float("inf")}, "outer_lr must be a number > 0 and < inf"),
                         ({"anchor_device": "meta"}, "'cpu' or 'cuda'"),
                         *([({"anchor_device": "cuda"}, "anchor_device=cuda is not available")]
                           if not torch.cuda.is_available() else [])):
        with pytest.raises(ValueError, match=word):
            DiLoCo(**kwargs)
    with pytest.raises(ValueError, match="sync_every"):
        Algorithm.init("local_sgd", sync_every=0)
    assert isinstance(Algorithm.init("local_sgd", sync_every=2), LocalSGD)


def test_anchor_and_momentum_live_on_the_given_device(results):
    for r in range(2):
        traj, _, devices = results[r]["anchor on cpu"]
        assert devices == {"cpu"}
        assert all(torch.equal(a, b) for a, b in zip(traj, results[r]["diloco adam"][0]))


def _cuda_anchor_on(anchor_device):
    return _train({"sync_every": 3, "anchor_device": anchor_device}, "adam", device="cuda")


@pytest.mark.gpu
def test_cuda_model_with_anchor_on_cpu_matches_anchor_on_gpu():
    on_gpu, _, dev_gpu = run_ranks(_cuda_anchor_on, 1, args=(None,), timeout=240)[0]
    on_cpu, _, dev_cpu = run_ranks(_cuda_anchor_on, 1, args=("cpu",), timeout=240)[0]
    assert dev_gpu == {"cuda:0"} and dev_cpu == {"cpu"}
    for a, b in zip(on_gpu, on_cpu):
        assert torch.allclose(a, b, rtol=0, atol=1e-6)


def test_autotune_leaves_the_maths_alone(results):
    for r in range(2):
        tuned, plain = results[r]["autotuned"][0], results[r]["diloco adam"][0]
        assert all(torch.equal(a, b) for a, b in zip(tuned, plain))



def _frozen_after_wrap(fragments):
    """Layer 0 frozen at step 4 (a sync of the whole model when fragments=1: the ranks hold
    the same value), layer 2 at step 6, in the middle of an interval (their values differ)."""
    rank = bc.get_rank()
    model = make_model(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    net = with_bagua(model, [opt], DiLoCo(sync_every=4, outer_momentum=0.9, fragments=fragments))
    seen = {}
    for step in range(1, 17):
        opt.zero_grad()
        loss_fn(net, *batch(step, rank)).backward()
        opt.step()
        if step == 4:
            model[0].requires_grad_(False)
            seen[4] = model[0].weight.detach().clone()
        if step == 6:
            model[2].requires_grad_(False)
        if step == 10:        # every fragment has synced since both were frozen
            seen[10] = [model[i].weight.detach().clone() for i in (0, 2)]
    return seen, [model[i].weight.detach().clone() for i in (0, 2)], flat(model)


@pytest.mark.parametrize("fragments", [1, 2])
def test_a_parameter_frozen_after_wrapping_takes_no_outer_step(fragments):
    """Before: the outer momentum kept stepping a frozen parameter at every sync (drift
    0.017, 0.032, 0.046 ...), where DDP and LocalSGD leave it alone.  Now it is averaged over
    the ranks at its next sync (so that they agree), then never moves."""
    (seen0, end0, all0), (seen1, end1, all1) = run_ranks(_frozen_after_wrap, 2,
                                                         args=(fragments,), timeout=120)
    for a, b, c, d in zip(seen0[10], end0, seen1[10], end1):
        assert torch.equal(a, b) and torch.equal(c, d) and torch.equal(a, c)
    if fragments == 1:                            # frozen at a sync: never moved at all
        assert torch.equal(seen0[4], end0[0]) and torch.equal(seen1[4], end1[0])
    assert torch.equal(all0, all1)                # step 16 syncs every fragment


def _unfrozen_later(algo, frozen_at_wrap, unfreeze_at=3, steps=8):
    """Layer 0 frozen at the wrap and unfrozen after step ``unfreeze_at`` (the usual
    fine-tuning schedule); the reference run has it trainable from the wrap with its gradient
    zeroed until then (SGD then leaves it where it was, its outer gradient and momentum are 0)."""
    import logging

    rank = bc.get_rank()
    model = make_model(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    if frozen_at_wrap:
        model[0].requires_grad_(False)
    logs = []
    handler = logging.Handler()
    handler.emit = lambda record: logs.append(record.getMessage())
    logging.getLogger("bagua_algos").addHandler(handler)
    net = with_bagua(model, [opt], algo)
    for step in range(1, steps + 1):
        if step == unfreeze_at + 1:
            model[0].requires_grad_(True)
        opt.zero_grad()
        loss_fn(net, *batch(step, rank)).backward()
        if not frozen_at_wrap and step <= unfreeze_at:
            for p in model[0].parameters():
                p.grad.zero_()
        opt.step()
    anchors = torch.cat([a.detach().reshape(-1).cpu() for a in net.impl.anchors])
    return flat(model), anchors, logs


@pytest.mark.parametrize("algo", [LocalSGD(sync_every=2), DiLoCo(sync_every=2),
                                  DiLoCo(sync_every=4, fragments=2, overlap_steps=1)],
                         ids=["localsgd", "diloco", "streaming"])
def test_a_parameter_unfrozen_after_the_wrap_is_averaged(algo):
    """Before: a parameter frozen at the wrap got no anchor, no outer momentum and no sync
    after it was unfrozen: every rank trained its own copy (LocalSGD(sync_every=2): 0.028
    apart after 2 syncs), while the log said it joined the buckets.  Now it joins the flat
    vector at the next forward: the ranks' anchors agree, and with fragments=1 the run equals,
    bit for bit, one where it was trainable from the wrap with a zero gradient until then."""
    got = run_ranks(_unfrozen_later, 2, args=(algo, True), timeout=180)
    (end0, anchor0, logs0), (end1, anchor1, _) = got
    assert torch.equal(anchor0, anchor1)
    n0 = sum(p.numel() for p in make_model(seed=0)[0].parameters())
    assert anchor0.numel() == end0.numel()            # layer 0 has an anchor
    assert not torch.equal(anchor0[:n0], flat(make_model(seed=0))[:n0])   # it took outer steps
    assert any("synchronises them from now on: ['0.weight', '0.bias']" in m for m in logs0)
    if algo.overlap_steps == 0:
        assert torch.equal(end0, end1)                 # step 8 is a sync of the whole model
        ref = run_ranks(_unfrozen_later, 2, args=(algo, False), timeout=180)
        assert torch.equal(end0, ref[0][0]) and torch.equal(end1, ref[1][0])


def _late_peer(overlap_steps, late_s=0.6):
    """Rank 1 sleeps ``late_s`` before step 4's backward, the step whose sync (H = 4) both
    ranks start; rank 0 reaches its sync without waiting."""
    import time

    rank = bc.get_rank()
    model = make_model(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    net = with_bagua(model, [opt], DiLoCo(sync_every=4, overlap_steps=overlap_steps))
    for step in range(1, 9):
        if rank == 1 and step == 4:
            time.sleep(late_s)
        opt.zero_grad()
        loss_fn(net, *batch(step, rank)).backward()
        opt.step()
    waited = net.impl.sync_wait_s
    net.detach_algorithm()
    return waited


@pytest.mark.parametrize("overlap_steps", [0, 2])
def test_the_seconds_a_rank_waits_for_its_syncs_are_counted(overlap_steps):
    """``impl.sync_wait_s``: the part of the syncs' time that no inner step hid.  A peer
    0.6 s late to the sync: the rank on time waits for it where the sync lands (at once
    without overlap, two steps later with it: the steps hide nothing of a late peer's
    0.6 s on these tiny models), the late one barely."""
    on_time, late = run_ranks(_late_peer, 2, args=(overlap_steps,), timeout=120)
    assert 0.4 < on_time < 5.0, on_time
    assert late < on_time - 0.3, (late, on_time)


class _Masked(torch.nn.Module):
    """A constant float buffer with -inf in it (a causal mask, as the main job's model has)
    beside BatchNorm's running statistics, which move at every forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(6, 8)
        self.norm = torch.nn.BatchNorm1d(8)
        self.out = torch.nn.Linear(8, 1)
        self.register_buffer("mask", torch.tensor([0.0, float("-inf"), 1.5]))

    def forward(self, x):
        return self.out(self.norm(self.inp(x))) + self.mask[0]


def _buffers_over_a_sync(overlap_steps, H=4):
    """Each rank's buffers after step H (the sync starts), after the forward of the landing
    step (before the sync lands in its optimizer hook) and after it; and every
    allreduce_inplace call's (step, async_op)."""
    rank = bc.get_rank()
    model = _Masked()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    net = with_bagua(model, [opt], DiLoCo(sync_every=H, overlap_steps=overlap_steps))
    calls, step_now = [], [0]
    real = bc.allreduce_inplace

    def counted(*a, **k):
        calls.append((step_now[0], bool(k.get("async_op", False))))
        return real(*a, **k)

    bc.allreduce_inplace = counted
    seen = {}
    try:
        for step in range(1, H + overlap_steps + 1):
            step_now[0] = step
            opt.zero_grad()
            loss_fn(net, *batch(step, rank)).backward()
            if step == H + overlap_steps:
                seen["landing_forward"] = [b.clone() for b in model.buffers()]
            opt.step()
            if step == H:
                seen["start"] = [b.clone() for b in model.buffers()]
    finally:
        bc.allreduce_inplace = real
    seen["after"] = [b.clone() for b in model.buffers()]
    net.detach_algorithm()
    return seen, calls


@pytest.mark.parametrize("overlap_steps", [0, 2])
def test_buffers_average_beside_the_sync_and_keep_their_own_progress(overlap_steps):
    """The floating-point buffers' average starts with the sync (asynchronously, on a flat
    gloo group) instead of as a blocking ring allreduce where the sync lands (at 50 ms between
    4 hosts a 0.65 s step at every landing).  Landed: the average of the ranks' buffers at
    the sync's start, plus (with overlap) this rank's own progress since; a constant buffer
    with -inf in it stays exactly itself (no inf - inf)."""
    (s0, c0), (s1, c1) = run_ranks(_buffers_over_a_sync, 2, args=(overlap_steps,),
                                   timeout=120)
    H = 4
    for seen, calls in ((s0, c0), (s1, c1)):
        # the outer gradient's and the buffers' averages, both issued at the sync's start,
        # asynchronously: nothing blocks where the sync lands
        assert calls == [(H, True), (H, True)], calls
        names = [n for n, _ in _Masked().named_buffers()]
        for i, name in enumerate(names):
            if not seen["after"][i].is_floating_point():
                continue                             # num_batches_tracked: not averaged
            avg = (s0["start"][i].double() + s1["start"][i].double()) / 2
            if overlap_steps:
                moved = seen["landing_forward"][i] != seen["start"][i]
                want = torch.where(moved, avg + seen["landing_forward"][i].double()
                                   - seen["start"][i].double(), avg)
            else:
                want = avg
            assert torch.allclose(seen["after"][i].double(), want, rtol=1e-6, atol=1e-7), name
    mask = [n for n, _ in _Masked().named_buffers()].index("mask")
    for seen in (s0, s1):
        assert torch.equal(seen["after"][mask], torch.tensor([0.0, float("-inf"), 1.5]))
