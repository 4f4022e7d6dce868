"""Decentralized and LowPrecisionDecentralized against straightforward reference
implementations of their update rules written here with torch.distributed."""

import pytest
import torch
import torch.distributed as dist
from _common import batch, eval_loss, loss_fn, make_model

import bagua_comm as bc
from bagua_algos import Decentralized, LowPrecisionDecentralized, with_bagua
from bagua_comm.testing import run_ranks

STEPS, LR = 30, 0.15


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _set_flat(model, flat):
    off = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(flat[off:off + p.numel()].view_as(p))
            off += p.numel()


def _grad(model, step, rank):
    model.zero_grad()
    loss_fn(model, *batch(step, rank)).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _pairs(world, round_):
    """Bagua's shift_one: lower-half rank i meets upper-half rank half + (i + round) % half."""
    half = world // 2
    peer = {}
    for i in range(half):
        j = half + (i + round_) % half
        peer[i], peer[j] = j, i
    return peer


def reference_dpsgd(mode, interval, steps=STEPS):
    """x <- average over peers of x (every `interval` steps), minus lr * grad at x."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(seed=1)
    rounds = 0
    for step in range(steps):
        x = _flat(model)
        g = _grad(model, step, rank)
        if step % interval == 0:
            if mode == "all":
                dist.all_reduce(x)
                x /= world
            else:
                theirs = torch.empty_like(x)
                peer = _pairs(world, rounds)[rank]
                reqs = [dist.isend(x.clone(), peer), dist.irecv(theirs, peer)]
                for r in reqs:
                    r.wait()
                x = (x + theirs) / 2
            rounds += 1
        _set_flat(model, x - LR * g)
    return _flat(model)


def reference_low_precision(steps=STEPS):
    """The ring update with weights 1/3, exchanging MinMaxUInt8-compressed differences."""
    from bagua_comm.compression import MinMaxUInt8

    rank, world = dist.get_rank(), dist.get_world_size()
    left, right = (rank - 1) % world, (rank + 1) % world
    q = MinMaxUInt8(1)
    model = make_model(seed=1)
    x = _flat(model)
    replica = {left: x.clone(), right: x.clone()}
    for step in range(steps):
        w = _flat(model) - LR * _grad(model, step, rank)           # plain SGD step
        z = w + replica[left] / 3 + replica[right] / 3 - x * (5 / 3)
        payload = q.compress(z)
        dz = torch.empty_like(z)
        x = x + q.decompress(payload, dz)
        received = {}
        for peer in {left, right}:
            received[peer] = torch.empty_like(payload)
            reqs = [dist.isend(payload, peer), dist.irecv(received[peer], peer)]
            for r in reqs:
                r.wait()
        for peer in {left, right}:
            replica[peer] = replica[peer] + q.decompress(received[peer], torch.empty_like(z))
        _set_flat(model, x)
    return _flat(model)


def _run(algorithm, bucket_size=300, do_flatten=True, eval_mode=False):
    model = make_model(seed=bc.get_rank() + 1)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model = with_bagua(model, [opt], algorithm, bucket_size=bucket_size, do_flatten=do_flatten)
    if eval_mode:       # training with the whole model in eval mode (frozen BatchNorm
        model.eval()    # statistics): DDP communicates as in train mode; so must we
    before = eval_loss(model, bc.get_world_size())
    rank = bc.get_rank()
    for step in range(STEPS):
        opt.zero_grad()
        loss_fn(model, *batch(step, rank)).backward()
        opt.step()
    flat = all(b.check_flat(grads=False) and b.weight is not None for b in model.buckets)
    flat = flat if model.do_flatten else not any(b.check_flat(grads=False)
                                                 for b in model.buckets)
    return _flat(model), before, eval_loss(model, bc.get_world_size()), flat


def _scenarios(world_kinds):
    out = {}
    for name, algo, ref in world_kinds():
        # one bucket for the low-precision ring: the reference quantises the whole model
        # as one chunk (MinMaxUInt8's min/max is per bucket)
        got = _run(algo, bucket_size=None if name.startswith("low_precision") else 300,
                   do_flatten=not name.endswith("unflattened"),
                   eval_mode=name.endswith("eval_mode"))
        out[name] = (got, ref())
    return out


def _two_rank_cases():
    return [
        ("all", Decentralized(hierarchical=False), lambda: reference_dpsgd("all", 1)),
        ("all_interval2", Decentralized(hierarchical=False, communication_interval=2),
         lambda: reference_dpsgd("all", 2)),
        ("all_unflattened", Decentralized(hierarchical=False), lambda: reference_dpsgd("all", 1)),
        ("all_eval_mode", Decentralized(hierarchical=False), lambda: reference_dpsgd("all", 1)),
        ("shift_one", Decentralized(hierarchical=False, peer_selection_mode="shift_one"),
         lambda: reference_dpsgd("shift_one", 1)),
        ("low_precision", LowPrecisionDecentralized(hierarchical=False),
         reference_low_precision),
    ]


def _two_ranks():
    return _scenarios(_two_rank_cases)


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_two_ranks, 2, timeout=240)


@pytest.mark.parametrize("case", ["all", "all_interval2", "all_unflattened", "all_eval_mode",
                                  "shift_one", "low_precision"])
def test_matches_reference_update_rule(two_ranks, case):
    for rank_results in two_ranks:
        (got, before, after, flat), ref = rank_results[case]
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=0)
        assert after < 0.8 * before                     # it trains
        assert flat                  # parameters are views of the buckets iff do_flatten


def test_shift_one_pairing_rotates_halves():
    from bagua_algos.algorithms.decentralized import shift_one_peer

    for world in (2, 4, 6, 8):
        for round_ in range(world):
            want = _pairs(world, round_)
            got = {r: shift_one_peer(r, world, round_) for r in range(world)}
            assert got == want
    with pytest.raises(ValueError, match="peer_selection_mode"):
        Decentralized(peer_selection_mode="ring")
    with pytest.raises(ValueError, match="communication_interval"):
        Decentralized(communication_interval=0)


def test_peer_exchanges_are_one_grouped_call_receives_first(monkeypatch):
    """Each exchange is one batch_isend_irecv (NCCL needs send and recv grouped, or two
    ranks that both receive first deadlock; tests/test_fake_nccl.py shows it), receives
    listed first: on gloo a send waits for its peer's "ready to receive" notice, which,
    posted after the peer's own large send, queues behind it."""
    from types import SimpleNamespace

    import bagua_algos.algorithms.decentralized as dec
    import bagua_algos.algorithms.low_precision_decentralized as lpd

    calls = []

    def batch(ops, *, group=None, async_op=False):
        calls.extend((op.op, op.peer) for op in ops)
        calls.append("end")

    monkeypatch.setattr(dec.bc, "batch_isend_irecv", batch)
    monkeypatch.setattr(dec.bc, "send", None)      # never called on their own
    monkeypatch.setattr(dec.bc, "recv", None)
    dec.exchange_shift_one(torch.ones(4), SimpleNamespace(rank=0, size=4), 1)
    assert calls == [("recv", 3), ("send", 3), "end"]

    class Codec:  # identity "compression": only the order of the exchange matters here
        def payload_numel(self, numel):
            return numel

        def compress(self, t, key=None, out=None):
            out.copy_(t)
            return out

        def decompress(self, payload, out):
            out.copy_(payload)

    bucket = SimpleNamespace(numel=4, name="b0")
    for method, args in (("_ring_step", (0, torch.ones(4), bucket)), ("_resync_replicas", (0,))):
        calls.clear()
        state = SimpleNamespace(mine=[torch.zeros(4)], left=[torch.zeros(4)],
                                right=[torch.zeros(4)], diff=[torch.zeros(4)],
                                decoded=[torch.zeros(4)], payload=[None], from_left=[None],
                                from_right=[None], compressor=Codec())
        impl = SimpleNamespace(ring=SimpleNamespace(rank=1, size=3), state=state)
        getattr(lpd.LowPrecisionDecentralizedImpl, method)(impl, *args)
        assert calls[-1] == "end" and calls.count("end") == 1, method
        assert sorted(calls[:-1]) == [("recv", 0), ("recv", 2), ("send", 0), ("send", 2)]
        assert [k for k, _ in calls[:-1]] == ["recv", "recv", "send", "send"], method


class _FreshTensors(torch.overrides.TorchFunctionMode):
    """Records every torch function that returns a tensor of at least ``numel`` elements in
    storage none of its arguments had: a new bucket-sized allocation."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.fresh = numel, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if getattr(func, "__name__", "") == "__get__":     # reading p.grad allocates nothing
            return out
        flat = torch.utils._pytree.tree_leaves((args, kwargs))
        known = {t.untyped_storage().data_ptr() for t in flat if isinstance(t, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if (isinstance(t, torch.Tensor) and t.numel() >= self.numel
                    and t.untyped_storage().data_ptr() not in known):
                self.fresh.append(getattr(func, "__name__", str(func)))
        return out


def _allocations_per_step(algorithm):
    """Bucket-sized tensors the algorithm's hooks (and its exchange thread) create in steps
    2 and 3 (step 1 may set buffers up), for one bucket of the whole model."""
    rank = bc.get_rank()
    model = make_model(seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model = with_bagua(model, [opt], algorithm)
    impl = model.impl
    mode = _FreshTensors(model.buckets[0].numel // 2)
    counting = [False]

    def counted(fn):
        def wrapper(*args, **kwargs):
            if not counting[0]:
                return fn(*args, **kwargs)
            with mode:
                return fn(*args, **kwargs)
        return wrapper

    for name in ("forward_pre_hook", "post_backward_hook", "post_optimizer_step_hook"):
        setattr(impl, name, counted(getattr(impl, name)))
    exchange = impl.reducer.exchange
    impl.reducer.exchange = lambda fn: exchange(counted(fn))   # runs on the runner thread
    for step in range(3):
        counting[0] = step > 0
        opt.zero_grad()
        loss_fn(model, *batch(step, rank)).backward()
        opt.step()
    model.detach_algorithm()
    return mode.fresh


def _allocation_cases():
    return {name: _allocations_per_step(algo) for name, algo in (
        ("all", Decentralized(hierarchical=False)),
        ("shift_one", Decentralized(hierarchical=False, peer_selection_mode="shift_one")),
        ("low_precision", LowPrecisionDecentralized(hierarchical=False)))}


def test_steps_reuse_their_buffers():
    """Decentralized's peer and receive buffers and LowPrecisionDecentralized's temporaries
    (difference, decoding, payloads) are allocated once, not every step."""
    for per_rank in run_ranks(_allocation_cases, 2, timeout=120):
        assert per_rank == {"all": [], "shift_one": [], "low_precision": []}, per_rank
