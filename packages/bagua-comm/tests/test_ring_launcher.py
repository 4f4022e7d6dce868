"""bagua_comm._ring.low_precision_ring_launcher (issue #46): LowPrecisionDecentralized's ring
round of one bucket as one compiled job on the gloo worker.  Against a numpy simulation of
every rank's round (the float32 difference, the ``minmax_ref`` format, the decode-adds), bit
for bit: 2 ranks (one neighbour) and 3 (two), with and without padding, two rounds in a row;
traffic; the cases left to the Python path (None)."""

import minmax_ref as ref
import numpy as np
import pytest
import torch

import bagua_comm as bc
from bagua_comm._ring import low_precision_ring_launcher
from bagua_comm.compression import MinMaxUInt8
from bagua_comm.testing import run_ranks

NAMES = ("w", "x", "left", "right")


def _state(rank, n, live):
    g = torch.Generator().manual_seed(11 * rank + n)
    s = {k: torch.randn(n, generator=g) * (i + 1) for i, k in enumerate(NAMES)}
    s["w"][live:] = 0
    return s


def _simulate(world, n, live, chunks, rounds):
    """Every rank's (w, x, left, right) after ``rounds`` rounds, in numpy."""
    states = [{k: v.numpy().copy() for k, v in _state(r, n, live).items()}
              for r in range(world)]
    three, c = np.float32(3), np.float32(5 / 3)
    for _ in range(rounds):
        payloads = []
        for s in states:
            d = ((s["left"] / three + s["w"]) + s["right"] / three) - s["x"] * c
            d[live:] = 0
            payloads.append(ref.compress(d.astype(np.float32), "float32", chunks))
        for r, s in enumerate(states):
            s["x"] = s["x"] + ref.decompress(payloads[r], "float32", n, chunks)
            s["w"] = s["x"].copy()
            s["left"] = s["left"] + ref.decompress(payloads[(r - 1) % world], "float32", n,
                                                   chunks)
            s["right"] = s["right"] + ref.decompress(payloads[(r + 1) % world], "float32", n,
                                                     chunks)
    return states


def _rounds(n, live, chunks, rounds):
    rank, world = bc.get_rank(), bc.get_world_size()
    s = _state(rank, n, live)
    comp = MinMaxUInt8(chunks)
    size = comp.payload_numel(n)
    payload, from_left = torch.empty(size, dtype=torch.uint8), torch.empty(size,
                                                                           dtype=torch.uint8)
    from_right = torch.empty_like(from_left) if world > 2 else from_left
    start = low_precision_ring_launcher(s["w"], s["x"], s["left"], s["right"],
                                        torch.empty(n), payload, from_left, from_right, live,
                                        comp)
    bc.traffic.reset()
    for _ in range(rounds):
        start().wait()
    sent = bc.traffic.bytes_sent("send")
    return {k: v.numpy().copy() for k, v in s.items()}, sent, size


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("n, live, chunks", [(96, 96, 1), (96, 90, 4), (1000, 997, 1)])
def test_rounds_equal_numpy_bit_for_bit(world, n, live, chunks):
    want = _simulate(world, n, live, chunks, rounds=2)
    for rank, (got, sent, size) in enumerate(run_ranks(_rounds, world,
                                                       args=(n, live, chunks, 2),
                                                       timeout=120)):
        for k in NAMES:
            assert np.array_equal(got[k].view(np.int32), want[rank][k].view(np.int32)), \
                (rank, k)
        assert sent == 2 * size * (1 if world == 2 else 2)     # one payload per neighbour


def _fallbacks():
    n = 16
    comp = MinMaxUInt8(1)
    size = comp.payload_numel(n)

    def launcher(compressor=comp, dtype=torch.float32, world_pair=True, **kw):
        fl = torch.empty(size, dtype=torch.uint8)
        fr = fl if world_pair else torch.empty_like(fl)
        t = {k: torch.zeros(n, dtype=dtype) for k in ("w", "x", "l", "r", "d")}
        t.update(kw)
        return low_precision_ring_launcher(t["w"], t["x"], t["l"], t["r"], t["d"],
                                           torch.empty(size, dtype=torch.uint8), fl, fr, n,
                                           compressor)

    class Sub(MinMaxUInt8):
        pass

    return {
        "plain": launcher() is not None,
        "subclass": launcher(Sub(1)),
        "error_feedback": launcher(MinMaxUInt8(1, error_feedback=True)),
        "float16": launcher(dtype=torch.float16),
        "strided": launcher(w=torch.zeros(2 * n)[::2]),
        "chunks": launcher(MinMaxUInt8(3)),
        "two_buffers_for_one_neighbour": launcher(world_pair=False),
    }


def test_everything_else_takes_the_python_path():
    for got in run_ranks(_fallbacks, 2, timeout=60):
        assert got.pop("plain") is True
        assert got == dict.fromkeys(got), got
