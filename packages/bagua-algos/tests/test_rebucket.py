"""BaguaModule.rebucket(): buckets change between steps, every algorithm's state follows
(keyed by parameter, not bucket), GradientAllReduce is unaffected bit for bit; bucket order
comes from rank 0's first-step gradient order; bad sizes raise before communicating."""

import time

import pytest
import torch
from _common import batch, eval_loss, loss_fn, make_model, params

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

STEPS = 10


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _qadam(model):
    return QAdamOptimizer(model.parameters(), lr=1e-2, warmup_steps=3)


# name: (optimizer, algorithm, synchronous: ranks stay bit-identical)
CASES = {
    "gradient_allreduce": (_sgd, lambda o: GradientAllReduce(), True),
    "bytegrad_error_feedback": (_sgd, lambda o: ByteGrad(hierarchical=False,
                                                         error_feedback=True), True),
    "decentralized_shift_one": (_sgd, lambda o: Decentralized(
        hierarchical=False, peer_selection_mode="shift_one", communication_interval=2), False),
    "low_precision_decentralized": (_sgd, lambda o: LowPrecisionDecentralized(
        hierarchical=False), False),
    "qadam": (_qadam, lambda o: QAdam(o, hierarchical=False), True),
}


def _train(case, schedule):
    """Train STEPS steps; ``schedule[step]`` is a list of bucket sizes to re-bucket to (in
    turn) before that step.  Returns the parameters and what the module reported."""
    make_opt, make_algo, _ = CASES[case]
    model = make_model(seed=1)
    opt = make_opt(model)
    model = with_bagua(model, [opt], make_algo(opt), bucket_size=300)
    rank, seen = bc.get_rank(), []
    for step in range(STEPS):
        for size in schedule.get(step, ()):
            before = model.impl.state_dict()
            model.rebucket(size)
            seen.append((model.bucket_size, len(model.buckets), before,
                         model.impl.state_dict()))
        opt.zero_grad()
        loss_fn(model, *batch(step, rank)).backward()
        opt.step()
    out = (params(model), seen, eval_loss(model, bc.get_world_size()))
    model.detach_algorithm()
    return out


def _equal_state(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            _equal_state(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal_state(x, y) for x, y in zip(a, b))
    return a == b


def _async_across_rebucket():
    rank, world = bc.get_rank(), bc.get_world_size()
    model = make_model(seed=rank + 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model = with_bagua(model, [opt], AsyncModelAverage(sync_interval_ms=5, warmup_steps=2),
                       bucket_size=300)
    impl = model.impl
    before = eval_loss(model, world)
    rounds = None
    for step in range(40):
        if step == 20:
            rounds = impl.rounds
            model.rebucket(10_000)
            restarted = impl.thread is not None and impl.thread.is_alive()
        opt.zero_grad()
        loss_fn(model, *batch(step, rank)).backward()
        opt.step()
        time.sleep(0.002)
    bc.barrier()
    # Two more averaging rounds, counted from the same round on both ranks: each rank reading
    # its own counter could start one round apart, and the rank that got there first aborted
    # while the other waited for a round that needed it (a CI timeout).
    target = torch.tensor([impl.rounds + 2])
    bc.allreduce_inplace(target, op=bc.ReduceOp.MAX)
    while impl.rounds < int(target.item()):  # bounded by run_ranks' timeout
        time.sleep(0.005)
    model.abort()
    return {"restarted": restarted, "rounds": (rounds, impl.rounds), "before": before,
            "after": eval_loss(model, world), "buckets": len(model.buckets),
            "params": params(model)}


def _bad_sizes_and_mid_backward():
    rank = bc.get_rank()
    model = make_model(seed=1)
    opt = _sgd(model)
    model = with_bagua(model, [opt], GradientAllReduce(), bucket_size=300)
    errors = []
    if rank == 0:                           # rank 1 does not call: nothing must be sent
        for bad in (0, -5, 1.5, True, "1MB", None):
            try:
                model.rebucket(bad)
            except ValueError as err:
                errors.append(str(err))
    caught = []

    def inside_backward(_p):
        try:
            model.rebucket(1000)
        except RuntimeError as err:
            caught.append(str(err))

    first = next(model.module.parameters())
    h = first.register_post_accumulate_grad_hook(inside_backward)
    for step in range(3):                   # the ranks still train together afterwards
        opt.zero_grad()
        loss_fn(model, *batch(step, rank)).backward()
        opt.step()
    h.remove()
    return errors, caught, params(model)


class _TwoBranch(torch.nn.Module):
    """Two parallel branches; ``flip`` changes which one forward computes first, and with it
    the order their gradients become ready in backward."""

    def __init__(self, flip: bool):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(6, 3)
        self.b = torch.nn.Linear(6, 3)
        self.c = torch.nn.Linear(6, 3)
        self.flip = flip

    def forward(self, x):
        if self.flip:
            return self.c(x) + self.b(x) + self.a(x)
        return self.a(x) + self.b(x) + self.c(x)


def _bucket_order():
    rank = bc.get_rank()
    model = _TwoBranch(flip=rank == 0)
    names = {id(p): n for n, p in model.named_parameters()}
    observed = []
    hooks = [p.register_post_accumulate_grad_hook(lambda p: observed.append(names[id(p)]))
             for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model = with_bagua(model, [opt], GradientAllReduce(), bucket_size=40)
    initial = [b.names for b in model.buckets]
    for step in range(3):
        opt.zero_grad()
        model(batch(step, rank)[0]).square().mean().backward()
        opt.step()
    for h in hooks:
        h.remove()
    first_step = observed[:6]
    return initial, first_step, [b.names for b in model.buckets], params(model)


def _all():
    out = {}
    for case in CASES:
        plain = _train(case, {})
        # a real change of layout mid-run (several buckets -> one -> one per tensor)
        changed = _train(case, {4: [10 * 2**20], 7: [32]})
        # away and back between two steps: the state must come back unchanged
        roundtrip = _train(case, {5: [10 * 2**20, 300]})
        out[case] = (plain, changed, roundtrip)
    out["async"] = _async_across_rebucket()
    out["bad"] = _bad_sizes_and_mid_backward()
    out["order"] = _bucket_order()
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all, 2, timeout=300)


def test_rebucket_keeps_gradient_allreduce_bit_identical_to_the_unchanged_run(results):
    for r in results:
        plain, changed, roundtrip = r["gradient_allreduce"]
        assert all(torch.equal(a, b) for a, b in zip(plain[0], changed[0]))
        assert all(torch.equal(a, b) for a, b in zip(plain[0], roundtrip[0]))
        sizes = [(s, n) for s, n, _, _ in changed[1]]
        assert sizes[0] == (10 * 2**20, 1) and sizes[1][0] == 32 and sizes[1][1] > 3


@pytest.mark.parametrize("case", list(CASES))
def test_every_algorithm_keeps_its_state_and_trains_across_a_rebucket(results, case):
    sync = CASES[case][2]
    for r in results:
        plain, changed, roundtrip = r[case]
        # away and back: layout and state as before, so the run continues bit for bit
        assert all(torch.equal(a, b) for a, b in zip(plain[0], roundtrip[0]))
        # a layout change carries the state (keyed by parameter) unchanged
        for _, _, before, after in changed[1] + roundtrip[1]:
            if case.startswith("bytegrad") or case == "qadam":
                before, after = before["compressor"], after["compressor"]
                assert _equal_state(before.get("scatter"), after.get("scatter"))
            else:
                assert _equal_state(before, after)
        # and it keeps training as well as the unchanged run
        assert changed[2] < 0.9 * plain_before() and changed[2] < 1.1 * plain[2]
    if sync:
        for which in (1, 2):
            a, b = results[0][case][which][0], results[1][case][which][0]
            assert all(torch.equal(x, y) for x, y in zip(a, b))


def plain_before():
    return eval_loss(make_model(seed=1), 2)


def test_bytegrad_residuals_survive_a_rebucket_exactly_across_ranks(results):
    # every rank's gather residuals, summed over ranks, are the same before and after
    def total(states, key):
        out = {}
        for st in states:
            for name, t in st[key].items():
                out[name] = out.get(name, 0) + t
        return out

    for i in range(2):
        befores = [r["bytegrad_error_feedback"][1][1][i][2]["compressor"] for r in results]
        afters = [r["bytegrad_error_feedback"][1][1][i][3]["compressor"] for r in results]
        assert befores[0]["scatter"]                       # there is something to carry
        tb, ta = total(befores, "gather"), total(afters, "gather")
        assert tb.keys() == ta.keys() and tb
        for k in tb:
            torch.testing.assert_close(tb[k], ta[k], atol=0, rtol=0)


def test_async_model_average_restarts_and_keeps_training_after_rebucket(results):
    for r in results:
        assert r["async"]["restarted"] and r["async"]["buckets"] == 1
        before_rounds, after_rounds = r["async"]["rounds"]
        assert after_rounds > before_rounds
        assert r["async"]["after"] < 0.7 * r["async"]["before"]


def test_bad_bucket_size_raises_on_the_calling_rank_before_communicating(results):
    errors = results[0]["bad"][0]
    assert len(errors) == 6 and all("bucket_size must be a positive int" in e for e in errors)
    assert results[1]["bad"][0] == []
    for r in results:
        assert r["bad"][1] and "during backward" in r["bad"][1][0]
    a, b = results[0]["bad"][2], results[1]["bad"][2]
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_ranks_take_rank0s_first_step_gradient_order(results):
    (init0, seen0, final0, p0), (init1, seen1, final1, p1) = results[0]["order"], \
        results[1]["order"]
    assert seen0 != seen1                         # the ranks really saw different orders
    assert init0 == init1 and [n for b in init0 for n in b] != seen0
    assert final0 == final1
    assert [n for b in final0 for n in b] == seen0
    assert all(torch.equal(x, y) for x, y in zip(p0, p1))
