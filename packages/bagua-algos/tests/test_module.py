"""with_bagua's contract: validation, registry, broadcast of rank 0's state, buckets,
state_dict, switching algorithms, and a user-written algorithm (the README's example)."""

import warnings

import pytest
import torch
from _common import batch, eval_loss, loss_fn, make_model, params

import bagua_comm as bc
from bagua_algos import (
    Algorithm,
    AlgorithmImpl,
    ByteGrad,
    Decentralized,
    GradientAllReduce,
    QAdam,
    QAdamOptimizer,
    with_bagua,
)
from bagua_comm.testing import run_ranks


# -- the README's custom algorithm --------------------------------------------------------------
class SignSGD(Algorithm, name="test_sign_sgd"):
    """Each rank sends only the signs of its gradients; the update is their average."""

    def __init__(self, scale: float = 1e-2):
        if scale <= 0:
            raise ValueError(f"scale must be > 0, got {scale}")
        self.scale = scale

    def reify(self, group):
        return SignSGDImpl(group, self.scale)


class SignSGDImpl(AlgorithmImpl):
    def __init__(self, group, scale):
        super().__init__(group)
        self.scale = scale

    def bucket_ready_hook(self, module, bucket):
        bucket.grad.sign_().mul_(self.scale)
        return bc.allreduce_inplace(bucket.grad, bc.ReduceOp.AVG, group=self.group,
                                    async_op=True)


class _Probe(Algorithm, name="test_probe"):
    """Records, at each bucket launch, whether the first layer's gradient exists yet."""

    def reify(self, group):
        return _ProbeImpl(group)


class _ProbeImpl(AlgorithmImpl):
    def init_operations(self, module, buckets):
        self.first = next(module.module.parameters())
        self.seen = []

    def bucket_ready_hook(self, module, bucket):
        self.seen.append((bucket.index, self.first.grad is not None))
        return bc.allreduce_inplace(bucket.grad, bc.ReduceOp.AVG, group=self.group,
                                    async_op=True)


# -- single process ------------------------------------------------------------------------------
def test_registry_builds_every_algorithm_by_name():
    assert set(Algorithm.registered()) >= {"gradient_allreduce", "bytegrad", "decentralized",
                                           "low_precision_decentralized", "async", "qadam"}
    assert isinstance(Algorithm.init("bytegrad", hierarchical=False), ByteGrad)
    opt = QAdamOptimizer(make_model().parameters())
    assert Algorithm.init("qadam", q_adam_optimizer=opt).optimizer is opt
    with pytest.raises(ValueError, match="unknown algorithm 'nope'"):
        Algorithm.init("nope")
    with pytest.raises(ValueError, match="bad arguments for algorithm 'decentralized'"):
        Algorithm.init("decentralized", bogus=1)
    with pytest.raises(ValueError, match="hierarchical must be True or False"):
        GradientAllReduce(hierarchical="yes")
    with pytest.raises(ValueError, match="q_adam_optimizer"):
        QAdam(torch.optim.Adam(make_model().parameters()))
    with pytest.raises(ValueError, match="warmup_steps"):
        QAdamOptimizer(make_model().parameters(), warmup_steps=0)


def test_with_bagua_validates_before_communicating():
    model = make_model()
    with pytest.raises(ValueError, match="algorithm must be"):
        with_bagua(model, [], "gradient_allreduce")
    with pytest.raises(ValueError, match=r"optimizers\[0\]"):
        with_bagua(model, [object()], GradientAllReduce())
    with pytest.raises(ValueError, match="bucket_size"):
        with_bagua(model, [], GradientAllReduce(), bucket_size=0)
    with pytest.raises(RuntimeError, match="init_process_group"):
        with_bagua(model, [], GradientAllReduce())


def test_buckets_split_by_dtype_in_reverse_registration_order():
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 4), "b": torch.nn.Linear(4, 4).double(),
                                 "c": torch.nn.Linear(4, 4)})
    impl = AlgorithmImpl(group=None)

    class Holder:
        module = model

    tensors = impl.init_tensors(Holder())
    assert tensors == list(model.parameters())[::-1]
    buckets = impl.tensors_to_buckets(tensors, bucket_size=80)
    names = {id(p): n for n, p in model.named_parameters()}
    # DDP's rule: the tensor that reaches the limit closes its bucket (b.weight overfills
    # b.bias's bucket and is in it)
    assert [[names[id(p)] for p in b] for b in buckets] == [
        ["c.bias", "c.weight"], ["b.bias", "b.weight"], ["a.bias", "a.weight"]]


# -- two ranks ---------------------------------------------------------------------------------
def _contract():
    rank, world = bc.get_rank(), bc.get_world_size()
    out = {}
    model = make_model(seed=rank + 1)
    model.register_buffer("counter", torch.full((3,), float(rank)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss_fn(model, *batch(99, rank)).backward()      # rank-specific optimizer state
    opt.step()
    model = with_bagua(model, [opt], GradientAllReduce())
    out["params"] = params(model)
    out["buffer"] = model.module.counter.clone()
    out["exp_avg"] = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    out["keys"] = sorted(model.state_dict())
    # Switching algorithm on the same model: old hooks are gone, the new algorithm runs.
    model = with_bagua(model, [opt], SignSGD(scale=1e-3), bucket_size=256)
    before = eval_loss(model, world)
    sgd = torch.optim.SGD(model.parameters(), lr=1.0)
    model = with_bagua(model, [sgd], SignSGD(scale=1e-2), bucket_size=256)
    for step in range(15):
        sgd.zero_grad()
        loss_fn(model, *batch(step, rank)).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        sgd.step()
    out["grads"] = grads
    out["after"] = eval_loss(model, world)
    out["before"] = before
    out["trained"] = params(model)
    out["hooks"] = len(model.engine.hooks)
    # Overlap: buckets launch in order while backward still runs (first layer not done),
    # from the second backward on (the first launches at its end: it learns how many times
    # each gradient accumulates, as DDP's static_graph, and the bucket order)
    probe = make_model(seed=1)
    probe_opt = torch.optim.SGD(probe.parameters(), lr=0.1)
    probe = with_bagua(probe, [probe_opt], _Probe(), bucket_size=64)   # 3 buckets (DDP rule)
    for step in range(2):
        probe_opt.zero_grad(set_to_none=True)
        probe.impl.seen = []
        loss_fn(probe, *batch(step, rank)).backward()
        if step == 0:
            out["first_launches"] = probe.impl.seen
    out["launches"] = (probe.impl.seen, len(probe.buckets))
    # A third wrap, as users do when moving to decentralized training, still works.
    model = with_bagua(model, [sgd], Decentralized(hierarchical=False))
    loss_fn(model, *batch(0, rank)).backward()
    # Its checkpoint state restores into a decentralized run: counter kept, a warning said.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.load_bagua_state_dict({"algorithm": "test_sign_sgd", "step": 7, "impl": {}})
    out["switched_load"] = (model.step, [str(w.message) for w in caught])
    return out


@pytest.fixture(scope="module")
def contract():
    return run_ranks(_contract, 2)


def test_rank0_parameters_buffers_and_optimizer_state_are_broadcast(contract):
    a, b = contract
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
    assert not all(torch.equal(x, y) for x, y in zip(b["params"], params(make_model(seed=2))))
    assert torch.equal(b["buffer"], torch.zeros(3))
    assert all(torch.equal(x, y) for x, y in zip(a["exp_avg"], b["exp_avg"]))


def test_state_dict_has_no_module_prefix(contract):
    assert contract[0]["keys"] == sorted([*make_model().state_dict(), "counter"])


def test_custom_algorithm_trains_and_replaces_the_previous_one(contract):
    a, b = contract
    # Only SignSGD's hooks act: every gradient entry is an average of +-0.01 signs.
    for g in a["grads"]:
        assert set(g.abs().unique().tolist()) <= {0.0, torch.tensor(0.01).item()}
    assert all(torch.equal(x, y) for x, y in zip(a["trained"], b["trained"]))
    assert a["after"] < a["before"]


def test_buckets_launch_in_order_during_backward(contract):
    for r in contract:
        seen, n = r["launches"]
        assert [i for i, _ in seen] == list(range(n)) and n > 2
        assert not seen[0][1]          # the first bucket left before backward reached layer 1
        assert all(done for _, done in r["first_launches"])    # the first backward: at its end


def test_state_of_another_algorithm_restores_the_step_counter_with_a_warning(contract):
    step, messages = contract[0]["switched_load"]
    assert step == 7
    assert any("only the step counter is restored" in m for m in messages)


def _wrap_traffic(differ):
    """Bytes with_bagua broadcast at the wrap, for ranks seeded alike, except ``differ``:
    one buffer element or one optimizer moment on rank 1."""
    rank = bc.get_rank()
    model = make_model(seed=1)
    model.register_buffer("counter", torch.zeros(3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss_fn(model, *batch(99, 0)).backward()     # the same optimizer state on every rank
    opt.step()
    if rank == 1 and differ == "buffer":
        model.counter[1] = 1.0
    if rank == 1 and differ == "optimizer":
        opt.state[next(iter(model.parameters()))]["exp_avg"].view(-1)[0] += 1e-7
    bc.traffic.reset()
    wrapped = with_bagua(model, [opt], GradientAllReduce())
    sent = bc.traffic.by_primitive()
    state = [model.counter.clone()] + [opt.state[p]["exp_avg"].clone()
                                       for p in wrapped.parameters()]
    return sent.get("broadcast", 0) + sent.get("broadcast_object", 0), sent, state


@pytest.mark.parametrize("differ", [None, "buffer", "optimizer"])
def test_the_wrap_broadcasts_only_when_the_ranks_differ(differ):
    """Ranks that already hold the same parameters, buffers and optimizer state (seeded
    alike) get nothing broadcast: their digests, sent straight to every peer, prove it; one
    differing element anywhere and rank 0's state is broadcast, as before."""
    (b0, sent0, s0), (b1, _, s1) = run_ranks(_wrap_traffic, 2, args=(differ,))
    assert all(torch.equal(x, y) for x, y in zip(s0, s1))
    if differ is None:
        assert b0 == b1 == 0, sent0
        # the configuration's and the state's 16-byte digests to the one peer, nothing else
        assert sent0 == {"send": 32}, sent0
    else:
        assert b0 > 0 and b1 == 0, sent0
