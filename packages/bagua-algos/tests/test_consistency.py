"""Ranks that disagree on the configuration get one clear ValueError each, at with_bagua,
before anything is communicated (not gloo's size check killing the process, not a hang); a
checkpoint with emptied algorithm state names what is missing."""

import pytest
import torch
from _common import batch, loss_fn, make_model

import bagua_comm as bc
from bagua_algos import ByteGrad, Decentralized, GradientAllReduce, with_bagua
from bagua_algos._engine.consistency import describe
from bagua_comm.compression import MinMaxUInt8
from bagua_comm.testing import run_ranks


class _Opaque:
    """No __repr__: the default one holds id(), which differs between processes."""

    def __init__(self, k):
        self.k = k


def test_describe_ignores_object_identity_but_sees_settings():
    assert describe(_Opaque(3)) == describe(_Opaque(3))
    assert describe(_Opaque(3)) != describe(_Opaque(4))
    assert describe(ByteGrad(compressor=MinMaxUInt8(2))) != describe(
        ByteGrad(compressor=MinMaxUInt8(4)))
    assert describe({"b": 1, "a": [1, (2, None)]}) == describe({"a": [1, (2, None)], "b": 1})


def _wrap_with(case):
    rank = bc.get_rank()
    model = make_model()
    kw, algo = {}, GradientAllReduce()
    if case == "compressor":
        algo = ByteGrad(hierarchical=False, compressor=MinMaxUInt8(2 if rank == 0 else 4))
    elif case == "autotune":
        kw["autotune"] = rank == 1
    elif case == "model":
        if rank == 1:
            model.append(torch.nn.Linear(1, 1))
    elif case == "bucket_size":
        kw["bucket_size"] = 1 << 20 if rank == 0 else 1 << 21
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        model = with_bagua(model, [opt], algo, **kw)
    except ValueError as err:
        # The group still works afterwards: nothing was left half-sent.
        t = torch.ones(3)
        bc.allreduce_inplace(t)
        return str(err), t.tolist()
    return None, None


CASES = {"compressor": "algorithm", "autotune": "autotune", "model": "model",
         "bucket_size": "bucket_size"}


def _every_case():
    return {case: _wrap_with(case) for case in CASES}


@pytest.fixture(scope="module")
def mismatches():
    return run_ranks(_every_case, 2, timeout=120)


@pytest.mark.parametrize("case", CASES)
def test_a_rank_that_differs_is_named_on_every_rank(mismatches, case):
    field = CASES[case]
    for rank, by_case in enumerate(mismatches):
        msg, after = by_case[case]
        assert msg is not None, f"rank {rank} was not told: {case}"
        assert "every rank must pass the same model and configuration" in msg
        assert field in msg
        assert after == [2.0, 2.0, 2.0]
    # rank 1 sees both values (its own and rank 0's)
    msg1 = mismatches[1][case][0]
    assert "rank 0 has" in msg1 and "rank 1 has" in msg1
    if case == "compressor":
        assert "chunks=2" in msg1 and "chunks=4" in msg1


def _collectives_of_an_agreeing_wrap():
    """The collectives with_bagua sends on gloo when every rank agrees and holds the same
    values (seeded alike): counted at bagua_comm's entry points."""
    from bagua_algos._engine import consistency

    seen = []
    real = {name: getattr(bc, name) for name in ("allgather", "broadcast_object",
                                                 "allreduce_inplace", "broadcast",
                                                 "batch_isend_irecv")}
    for name, fn in real.items():
        def counting(*a, _name=name, _fn=fn, **k):
            seen.append(_name)
            return _fn(*a, **k)
        setattr(bc, name, counting)
    try:
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with_bagua(model, [opt], GradientAllReduce())
    finally:
        for name, fn in real.items():
            setattr(bc, name, fn)
    assert consistency.bc is bc      # the counting reached the module's calls
    return seen


def test_an_agreeing_wrap_sends_two_digests_and_nothing_else():
    """Every collective costs the group's latency rounds (~0.3 s each at 50 ms one way on 4
    hosts): ranks that agree are proven so by one allgather of a configuration digest and one
    of a state digest; nothing is broadcast (it was a broadcast of rank 0's description, its
    length, and a MAX of one flag per field)."""
    a, b = run_ranks(_collectives_of_an_agreeing_wrap, 2, timeout=120)
    # each digest straight to every peer (one round; gloo's ring allgather took n - 1)
    assert a == b == ["batch_isend_irecv", "batch_isend_irecv"]


def _emptied_checkpoint():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model = with_bagua(model, [opt], Decentralized(hierarchical=False))
    for step in range(2):
        opt.zero_grad()
        loss_fn(model, *batch(step, bc.get_rank())).backward()
        opt.step()
    state = opt.state_dict()
    state["bagua_algos"]["impl"] = {}
    try:
        opt.load_state_dict(state)
    except ValueError as err:
        return str(err)
    return None


def test_an_emptied_algorithm_state_is_refused_with_its_cause():
    for msg in run_ranks(_emptied_checkpoint, 2, timeout=90):
        assert msg is not None
        assert "decentralized state is incomplete" in msg and "rounds" in msg
