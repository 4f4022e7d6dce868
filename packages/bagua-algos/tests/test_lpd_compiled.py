"""LowPrecisionDecentralized's compiled round (one ``bagua_comm`` ring job per bucket on the
gloo worker, issue #46) trains bit for bit as its Python path, at 2 and 3 ranks, with padded
buckets and through a resume's replica re-derivation."""

import pytest
import torch
from _common import batch, loss_fn, make_model, params

import bagua_comm as bc
from bagua_algos import LowPrecisionDecentralized, with_bagua
from bagua_comm.compression import MinMaxUInt8
from bagua_comm.testing import run_ranks

STEPS = 8


class General(MinMaxUInt8):
    """A MinMaxUInt8 subclass: the same codec, through the Python path (the compiled round
    takes plain MinMaxUInt8 only)."""


def _train(compiled: bool, chunks: int | None):
    rank = bc.get_rank()
    if chunks is None:                  # the default compressor, MinMaxUInt8(1)
        compressor = None if compiled else General(1)
    else:
        compressor = (MinMaxUInt8 if compiled else General)(chunks)
    model = make_model(seed=5)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
    model = with_bagua(model, [opt], LowPrecisionDecentralized(hierarchical=False,
                                                              compressor=compressor),
                       bucket_size=300)          # several buckets, padded when chunks=4
    impl = model.impl
    took = impl._compiled() is not None
    for step in range(STEPS):
        if step == 4:                   # a resume: the replicas are re-derived next round
            impl.load_state_dict(impl.state_dict())
        opt.zero_grad()
        loss_fn(model, *batch(step, rank)).backward()
        opt.step()
    state = {k: {n: t.clone() for n, t in v.items()} if isinstance(v, dict) else v
             for k, v in impl.state_dict().items()}
    padded = any(b.weight.numel() > b.numel for b in model.buckets)
    out = took, params(model), state, impl.rounds, padded
    model.detach_algorithm()
    return out


def _both_paths():
    return {(compiled, chunks): _train(compiled, chunks)
            for chunks in (None, 4) for compiled in (True, False)}


@pytest.mark.parametrize("world", [2, 3])
def test_compiled_round_trains_bit_for_bit_as_the_python_path(world):
    for r in run_ranks(_both_paths, world, timeout=240):
        for chunks in (None, 4):
            took, p_fast, s_fast, rounds, padded = r[(True, chunks)]
            took_slow, p_slow, s_slow, rounds_slow, _ = r[(False, chunks)]
            assert took and not took_slow
            assert rounds == rounds_slow == STEPS
            assert padded == (chunks == 4)
            assert all(torch.equal(a, b) for a, b in zip(p_fast, p_slow)), chunks
            for name in ("mine", "left", "right"):
                assert s_fast[name].keys() == s_slow[name].keys()
                assert all(torch.equal(s_fast[name][k], s_slow[name][k])
                           for k in s_fast[name]), (chunks, name)
            # the weights moved: a test of something
            assert not all(torch.equal(a, b) for a, b in zip(p_fast, params(make_model(5))))
