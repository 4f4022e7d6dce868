"""bagua_comm._peer_average.peer_average_launcher (issue #46): Decentralized's exchange of one
round as one compiled job on the gloo worker.  "all" against numpy's mean (and bit for bit
torch.distributed's allreduce and division, which the Python path runs), "shift_one" bit for
bit against a numpy simulation of the rotating pairing over several rounds; the weights are
written by ``copy_out`` only; traffic; the cases left to the Python path (None)."""

import numpy as np
import pytest
import torch
import torch.distributed as dist

import bagua_comm as bc
from bagua_comm._peer_average import peer_average_launcher
from bagua_comm.testing import run_ranks

SIZES = (5, 1000)


def _weights(rank, round_):
    g = torch.Generator().manual_seed(97 * rank + round_)
    return [torch.randn(n, generator=g) * (i + 1) for i, n in enumerate(SIZES)]


def _pairs(world, round_):
    """Lower-half rank i meets upper-half rank half + (i + round) % half."""
    half = world // 2
    peer = {}
    for i in range(half):
        j = half + (i + round_) % half
        peer[i], peer[j] = j, i
    return peer


def _rounds(mode, rounds):
    """Each round: fresh weights (a training step's), the exchange, copy_out."""
    rank, world = bc.get_rank(), bc.get_world_size()
    weights = [torch.zeros(n) for n in SIZES]
    bufs = [torch.empty(n) for n in SIZES]
    theirs = [torch.empty(n) for n in SIZES] if mode == "shift_one" else []
    launch = peer_average_launcher(weights, bufs, theirs, mode)
    assert launch is not None
    out, torch_ref = [], []
    bc.traffic.reset()
    for r in range(rounds):
        for w, v in zip(weights, _weights(rank, r)):
            w.copy_(v)
        done = launch(r)
        done.wait()
        assert all(torch.equal(w, v) for w, v in zip(weights, _weights(rank, r)))
        launch.copy_out()
        out.append([w.clone() for w in weights])
        if mode == "all":                 # what the Python path runs
            ref = [v.clone() for v in _weights(rank, r)]
            for t in ref:
                dist.all_reduce(t)
                t.div_(world)
            torch_ref.append(ref)
    return out, torch_ref, dict(bc.traffic._bytes)


@pytest.mark.parametrize("world", [2, 3])
def test_all_is_the_mean(world):
    rounds = 2
    for rank, (out, torch_ref, traffic) in enumerate(run_ranks(_rounds, world,
                                                               args=("all", rounds))):
        for r in range(rounds):
            every = [_weights(q, r) for q in range(world)]
            for i in range(len(SIZES)):
                mean = np.mean([e[i].numpy() for e in every], axis=0, dtype=np.float64)
                np.testing.assert_allclose(out[r][i].numpy(), mean, rtol=1e-6, atol=1e-6)
                assert torch.equal(out[r][i], torch_ref[r][i]), (rank, r, i)
            if world == 2:                # two terms: exact in float32
                for i in range(len(SIZES)):
                    a, b = (e[i].numpy() for e in every)
                    np.testing.assert_array_equal(out[r][i].numpy(), (a + b) / np.float32(2))
        per_round = sum(int(2 * n * 4 * (world - 1) / world) for n in SIZES)
        assert traffic.get("allreduce") == rounds * per_round


def test_shift_one_follows_the_rotating_pairing():
    world, rounds = 4, 3
    for rank, (out, _, traffic) in enumerate(run_ranks(_rounds, world,
                                                       args=("shift_one", rounds))):
        for r in range(rounds):
            peer = _pairs(world, r)[rank]
            for i in range(len(SIZES)):
                a = _weights(rank, r)[i].numpy()
                b = _weights(peer, r)[i].numpy()
                np.testing.assert_array_equal(out[r][i].numpy(), (a + b) / np.float32(2))
        assert traffic.get("send") == rounds * sum(SIZES) * 4


def _refusals():
    w = [torch.randn(4), torch.randn(6)]
    b = [torch.empty(4), torch.empty(6)]
    t = [torch.empty(4), torch.empty(6)]
    got = {
        "float64": peer_average_launcher([x.double() for x in w], [x.double() for x in b],
                                         [], "all"),
        "strided": peer_average_launcher([torch.randn(8)[::2], w[1]], b, [], "all"),
        "numel": peer_average_launcher(w, [torch.empty(5), b[1]], [], "all"),
        "no theirs": peer_average_launcher(w, b, [], "shift_one"),
        "mode": peer_average_launcher(w, b, t, "ring"),
        "empty": peer_average_launcher([], [], [], "all"),
        "grad": peer_average_launcher([w[0].requires_grad_(), w[1]], b, [], "all"),
        "odd shift_one": peer_average_launcher(w, b, t, "shift_one")
        if bc.get_world_size() % 2 else None,
        "ok": peer_average_launcher([torch.randn(4), torch.randn(6)], b, t, "shift_one")
        if bc.get_world_size() % 2 == 0 else peer_average_launcher(w[1:], b[1:], [], "all"),
    }
    return {k: v is None for k, v in got.items()}


@pytest.mark.parametrize("world", [2, 3])
def test_what_is_not_compiled_returns_none(world):
    for got in run_ranks(_refusals, world):
        assert not got.pop("ok")
        assert all(got.values()), got
