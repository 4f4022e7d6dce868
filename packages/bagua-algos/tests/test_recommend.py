"""Choosing the algorithm from the network: the rule, the measurement, with_bagua(..., "auto")."""

from __future__ import annotations

import os
import time

import pytest
import torch

import bagua_comm as bc
from bagua_algos import ByteGrad, recommend, with_bagua
from bagua_algos._recommend import NetworkMeasurement, choose
from bagua_comm.testing import run_ranks

MB = 13.2e6  # a 3.3M-parameter model's float32 gradients (the trade-off map's workload)


# -- the rule, on synthetic measurements ----------------------------------------------------
def _pick(bw, lat, n=4, nbytes=MB, compute=0.0):
    return choose(bw, lat, n, nbytes, compute_s=compute)[0]


def test_fast_network_keeps_the_exact_allreduce():
    assert _pick(10_000, 0.05) == "gradient_allreduce"
    # Communication negligible next to computation: nothing to gain from approximating.
    assert _pick(1000, 0.1, compute=5.0) == "gradient_allreduce"


def test_low_bandwidth_picks_compression_and_high_latency_decentralized():
    # The Bagua paper's trade-off: low precision on slow links, decentralized on slow RTTs.
    assert _pick(10, 0.1) in ("bytegrad", "low_precision_decentralized")
    name, _, why, _ = choose(1000, 50, 4, MB)
    assert name in ("decentralized", "low_precision_decentralized") and "latency" in why
    name, kwargs, _, _ = choose(10_000, 50, 4, MB)
    assert name == "decentralized" and kwargs["peer_selection_mode"] == "shift_one"
    # More ranks: more allreduce rounds, so latency starts to matter sooner.
    lat = next(x for x in (0.5, 1, 2, 5, 10, 20, 50) if _pick(10_000, x, n=16) != "gradient_allreduce")
    lat2 = next(x for x in (0.5, 1, 2, 5, 10, 20, 50, 100, 200) if _pick(10_000, x, n=4) != "gradient_allreduce")
    assert lat < lat2


def test_scores_follow_the_cost_model():
    """Reference: the ring allreduce's 2(n-1) rounds and 2(n-1)/n of the bytes, computed here."""
    n, bw, lat, nbytes = 4, 100, 5, 4e6
    _, _, _, scores = choose(bw, lat, n, nbytes)
    ring = 2 * (n - 1) * lat / 1e3 + 2 * (n - 1) / n * nbytes * 8 / (bw * 1e6)
    assert scores["gradient_allreduce"] == pytest.approx(ring)
    assert scores["decentralized"] == pytest.approx(1.25 * (lat / 1e3 + nbytes * 8 / 1e8))


def test_one_node_and_bad_input():
    assert choose(10, 50, 8, MB, nodes=1)[0] == "gradient_allreduce"
    for kw, arg in (({"bandwidth_mbit": 0}, "bandwidth_mbit"), ({"latency_ms": -1}, "latency_ms"),
                    ({"world_size": 0}, "world_size")):
        args = {"bandwidth_mbit": 100, "latency_ms": 1, "world_size": 2, "model_bytes": MB, **kw}
        with pytest.raises(ValueError, match=arg):
            choose(**args)


# -- on real ranks ---------------------------------------------------------------------------
def _auto(limit: float, model_bytes: float):
    model = torch.nn.Linear(64, 64)
    t = time.monotonic()
    rec = recommend(model, model_bytes=model_bytes, time_limit_s=limit)
    took = time.monotonic() - t
    m = rec.measurement
    # Pretend the measured network is a slow, far one: the same rule, every rank, one answer.
    far = NetworkMeasurement(10.0, 50.0, m.world_size, m.world_size, 0.0)
    rec_far = recommend(model, model_bytes=model_bytes, measurement=far)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    auto = with_bagua(model, [opt], "auto")
    explicit = with_bagua(model, [opt], ByteGrad())  # an explicit algorithm: no measuring
    return {"name": rec.name, "bw": m.bandwidth_mbit, "lat": m.latency_ms, "took": took,
            "elapsed": m.elapsed_s, "far": rec_far.name, "auto": type(auto.algorithm).__name__,
            "explicit": type(explicit.algorithm).__name__, "rank": bc.get_rank()}


@pytest.mark.timeout(300)
def test_every_rank_chooses_the_same_within_the_time_bound():
    limit = 1.0
    a, b = run_ranks(_auto, 2, args=(limit, MB), timeout=200)
    assert a["name"] == b["name"] and a["far"] == b["far"] and a["auto"] == b["auto"]
    # Reduced measurements: both ranks hold the very same numbers.
    assert a["bw"] == b["bw"] and a["lat"] == b["lat"] and a["elapsed"] == b["elapsed"]
    assert a["bw"] > 0 and 0 <= a["lat"] < 50
    assert a["took"] < limit + 1.0 and b["took"] < limit + 1.0
    assert a["far"] in ("bytegrad", "low_precision_decentralized", "decentralized")
    assert a["explicit"] == "ByteGrad"


def _forced():
    model = torch.nn.Linear(8, 8)
    return type(with_bagua(model, [torch.optim.SGD(model.parameters(), lr=0.1)],
                           "auto").algorithm).__name__


@pytest.mark.timeout(300)
def test_bagua_algorithm_overrules_auto():
    assert run_ranks(_forced, 2, env={"BAGUA_ALGORITHM": "decentralized"},
                     timeout=200) == ["Decentralized"] * 2


def test_measurement_time_limit_is_checked():
    from bagua_algos._recommend import measure_network

    with pytest.raises(ValueError, match="time_limit_s"):
        measure_network(time_limit_s=0)
    assert os.environ.get("BAGUA_ALGORITHM") in (None, "", "auto")
