"""Autotuning: the search on simulated costs, option checks, and the tuner on 2 gloo ranks
(same configuration on every rank at every step, within budget, env switch, cache)."""

from __future__ import annotations

import json
import math
import os
import random

import pytest
import torch
from _common import BATCH

import bagua_comm as bc
from bagua_algos import GradientAllReduce, with_bagua
from bagua_algos.tuning.autotune import resolve_options
from bagua_algos.tuning.search import Search, log_spaced_sizes
from bagua_comm.testing import run_ranks

SIZES = log_spaced_sizes(2 ** 12, 2 ** 27)


def _run_search(cost, start=2 ** 23, categorical=None, max_trials=28, **kw):
    s = Search(SIZES, {"bucket_size": start, **{k: v[0] for k, v in (categorical or {}).items()}},
               categorical, max_trials=max_trials, **kw)
    while not s.done:
        s.tell(cost(s.ask()))
    return s


def _bowl(opt: int, noise: float = 0.0, seed: int = 0):
    """Seconds per step, unimodal in log2(bucket size) with its minimum at ``opt``."""
    rnd = random.Random(seed)

    def cost(c):
        return 1.0 + 0.2 * abs(math.log2(c["bucket_size"] / opt)) ** 1.3 + rnd.gauss(0, noise)

    return cost


@pytest.mark.parametrize("opt", [2 ** 12, 2 ** 15, 3 * 2 ** 18, 2 ** 22, 2 ** 27])
@pytest.mark.parametrize("noise", [0.0, 0.01])
def test_search_lands_near_the_optimum_within_budget(opt, noise):
    cost = _bowl(opt, noise, seed=opt)
    s = _run_search(cost, max_trials=20)
    best_possible = min(_bowl(opt)({"bucket_size": x}) for x in SIZES)
    assert _bowl(opt)(s.best) <= 1.05 * best_possible
    assert len(s.trials) <= 20
    # (warmup + measured) steps per trial at the defaults: within 200 steps
    assert len(s.trials) * 10 <= 200


def test_search_is_deterministic_and_respects_max_trials():
    a = _run_search(_bowl(2 ** 16, 0.02, seed=3))
    b = _run_search(_bowl(2 ** 16, 0.02, seed=3))
    assert a.trials == b.trials and a.best == b.best
    short = _run_search(_bowl(2 ** 16), max_trials=4)
    assert len(short.trials) == 4 and short.done
    assert short.best in [t["config"] for t in short.trials]


def test_search_keeps_the_start_on_a_flat_cost():
    s = _run_search(lambda c: 1.0 + 1e-4 * (c["bucket_size"] % 7))
    assert s.best == {"bucket_size": 2 ** 23}


@pytest.mark.parametrize("wobble, moves", [(0.0, True), (0.04, False)])
def test_search_moves_off_the_start_only_by_more_than_the_noise(wobble, moves):
    seen: dict = {}

    def cost(c):   # 2**12 is 3% faster; re-measuring a config moves it by 2 * wobble
        n = seen[c["bucket_size"]] = seen.get(c["bucket_size"], 0) + 1
        return (0.97 if c["bucket_size"] == 2 ** 12 else 1.0) * (1 + wobble * (-1) ** n)

    s = _run_search(cost)
    assert s.best == ({"bucket_size": 2 ** 12} if moves else {"bucket_size": 2 ** 23})


@pytest.mark.parametrize("gain, moves", [(1.0, False), (0.9, True)])
def test_search_final_is_immune_to_a_drifting_machine(gain, moves):
    calls = []

    def cost(c):   # the machine slows down 2% per trial; 2**16 is `gain` times the rest
        calls.append(c)
        return (gain if c["bucket_size"] == 2 ** 16 else 1.0) * (1 + 0.02 * len(calls))

    s = _run_search(cost, max_trials=20)
    assert s.best == ({"bucket_size": 2 ** 16} if moves else {"bucket_size": 2 ** 23})
    final = [t["config"]["bucket_size"] for t in s.trials[-6:]]
    assert final == final[::-1] and 2 ** 23 in final        # A B C C B A, the start in it


def test_search_picks_the_better_categorical_value():
    def cost(c):
        return _bowl(2 ** 20)(c) * (0.7 if c["hierarchical"] else 1.0)

    s = _run_search(cost, categorical={"hierarchical": [False, True]})
    assert s.best["hierarchical"] is True
    assert s.best["bucket_size"] in (2 ** 19, 2 ** 20, 2 ** 21)
    # and keeps the start's value when the other one does not pay
    s = _run_search(lambda c: _bowl(2 ** 20)(c) * (1.3 if c["hierarchical"] else 1.0),
                    categorical={"hierarchical": [False, True]})
    assert s.best["hierarchical"] is False


# -- options ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    ({"autotune": "yes"}, "autotune must be True, False or a dict"),
    ({"autotune": 1}, "autotune must be True, False or a dict"),
    ({"autotune": {"max_step": 10}}, "unknown options"),
    ({"autotune": {"max_steps": 0}}, "max_steps must be an integer >= 1"),
    ({"autotune": {"max_steps": 3, "trial_steps": 5}}, "must hold the first trial"),
    ({"autotune": {"knobs": ["compression"]}}, "unknown knobs"),
    ({"bucket_size": 0}, "bucket_size must be a positive integer"),
    ({"bucket_size": -5}, "bucket_size must be a positive integer"),
    ({"bucket_size": True}, "bucket_size must be a positive integer"),
    ({"bucket_size": 1.5e6}, "bucket_size must be a positive integer"),
])
def test_bad_values_raise_before_any_communication(kwargs, match):
    # bagua_comm is not initialised here: a ValueError (not "not initialised") proves the
    # check runs before anything that would communicate.
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=match):
        with_bagua(model, [], GradientAllReduce(), **kwargs)


def test_environment_switch(monkeypatch):
    monkeypatch.setenv("BAGUA_AUTOTUNE", "1")
    assert resolve_options(False)["max_steps"] == 200
    monkeypatch.setenv("BAGUA_AUTOTUNE_MAX_STEPS", "30")
    assert resolve_options(False)["max_steps"] == 30
    monkeypatch.setenv("BAGUA_AUTOTUNE", "0")
    assert resolve_options(True) is None
    monkeypatch.setenv("BAGUA_AUTOTUNE", "on")
    with pytest.raises(ValueError, match="BAGUA_AUTOTUNE must be 0 or 1"):
        resolve_options(False)
    monkeypatch.delenv("BAGUA_AUTOTUNE")
    assert resolve_options(False) is None
    monkeypatch.setenv("BAGUA_AUTOTUNE_TRIAL_STEPS", "x")
    with pytest.raises(ValueError, match="BAGUA_AUTOTUNE_TRIAL_STEPS must be an integer"):
        resolve_options(True)


# -- on 2 ranks ---------------------------------------------------------------------------------
BUDGET = {"max_steps": 45, "warmup_steps": 1, "trial_steps": 2}


def _model(seed=0):
    torch.manual_seed(seed)     # ~70 KB of float32 in 8 tensors: several distinct layouts
    return torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 128), torch.nn.Tanh(),
                               torch.nn.Linear(128, 96), torch.nn.Tanh(),
                               torch.nn.Linear(96, 1))


def _train(steps, autotune, bucket_size=None, seed=0):
    """Train ``steps`` steps; return per-step (config, layout), report and parameters."""
    rank = bc.get_rank()
    model = _model(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model = with_bagua(model, [opt], GradientAllReduce(), autotune=autotune,
                       bucket_size=bucket_size)
    seen = []
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x = torch.randn(BATCH, 8, generator=g)
        opt.zero_grad()
        loss = model(x).square().mean()   # the config of this step is fixed by now
        seen.append((model.bucket_size, tuple(len(b.params) for b in model.buckets),
                     model.impl.hierarchical))
        loss.backward()
        opt.step()
    return {"seen": seen, "report": model.autotune_report(),
            "params": [p.detach().clone() for p in model.parameters()]}


def _scenarios(cache_dir, log):
    os.environ["BAGUA_CACHE_DIR"] = cache_dir
    os.environ["BAGUA_AUTOTUNE_LOG"] = log
    out = {"off": _train(3, False)}
    out["tuned"] = _train(BUDGET["max_steps"] + 5, BUDGET, bucket_size=2 ** 20)
    out["again"] = _train(4, BUDGET, bucket_size=2 ** 20)      # same job: from the cache
    os.environ["BAGUA_AUTOTUNE"] = "1"                        # no code change: autotune=False
    os.environ["BAGUA_AUTOTUNE_CACHE"] = "0"
    for k, v in BUDGET.items():
        os.environ[f"BAGUA_AUTOTUNE_{k.upper()}"] = str(v)
    out["env"] = _train(BUDGET["max_steps"] + 2, False, seed=1)
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("autotune")
    log = tmp / "trials.jsonl"
    results = run_ranks(_scenarios, 2, args=(str(tmp / "cache"), str(log)), timeout=240)
    return results, tmp, log


def test_autotune_settles_within_budget_with_ranks_in_lockstep(two_ranks):
    results, _, _ = two_ranks
    a, b = (r["tuned"] for r in results)
    assert a["seen"] == b["seen"]                 # same configuration at every step
    assert a["report"] == b["report"]
    rep = a["report"]
    assert rep["done"] and not rep["cached"]
    assert rep["steps"] <= BUDGET["max_steps"]
    assert len(rep["trials"]) >= 3
    assert all(t["score"] > 0 for t in rep["trials"])
    sizes = {s for s, _, _ in a["seen"]}
    assert len(sizes) >= 3                        # it really tried several bucket sizes
    assert a["seen"][-1][0] == rep["best"]["bucket_size"]
    # after settling, it stays fixed
    settled = rep["settled_step"]
    assert len({c for c in a["seen"][settled - 1:]}) == 1
    # GradientAllReduce stays bit-identical across ranks through the re-bucketing
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))


def test_autotune_report_is_none_when_off(two_ranks):
    results, _, _ = two_ranks
    assert results[0]["off"]["report"] is None


def test_trials_are_logged_as_json_lines(two_ranks):
    results, _, log = two_ranks
    records = [json.loads(line) for line in log.read_text().splitlines()]
    first = records[:[r["event"] for r in records].index("done")]    # the "tuned" run's
    trials = [r for r in first if r["event"] == "trial"]
    assert len(trials) == len(results[0]["tuned"]["report"]["trials"])
    assert [r["config"] for r in trials] == [
        t["config"] for t in results[0]["tuned"]["report"]["trials"]]
    assert any(r["event"] == "cached" for r in records)


def test_second_run_starts_from_the_cache(two_ranks):
    results, tmp, _ = two_ranks
    tuned, again = results[0]["tuned"]["report"], results[0]["again"]["report"]
    assert again["cached"] and again["done"] and again["steps"] == 0
    assert again["best"] == tuned["best"]
    for r in results:   # the tuned bucket size from the very first step, on every rank
        assert {s for s, _, _ in r["again"]["seen"]} == {tuned["best"]["bucket_size"]}
    assert len(list((tmp / "cache" / "autotune").glob("*.json"))) == 1


def test_environment_turns_autotune_on_without_code_changes(two_ranks):
    results, _, _ = two_ranks
    a, b = (r["env"] for r in results)
    assert a["report"] is not None and not a["report"]["cached"]
    assert a["report"]["done"] and a["seen"] == b["seen"]


def _one_rank(cache_dir):
    os.environ["BAGUA_CACHE_DIR"] = cache_dir
    return _train(2, BUDGET, bucket_size=2 ** 20)["report"]


def test_another_world_size_tunes_afresh(two_ranks):
    _, tmp, _ = two_ranks
    (report,) = run_ranks(_one_rank, 1, args=(str(tmp / "cache"),), timeout=120)
    assert not report["cached"] and not report["done"]


def _two_nodes():
    return _train(BUDGET["max_steps"] + 2, {**BUDGET, "cache": False}, bucket_size=2 ** 20)


def test_hierarchical_is_tuned_where_nodes_hold_several_ranks():
    results = run_ranks(_two_nodes, 4, local_world_size=2, timeout=240)
    first = results[0]
    assert all(r["seen"] == first["seen"] for r in results)
    rep = first["report"]
    assert rep["knobs"] == {"hierarchical": [False, True]}
    assert {t["config"]["hierarchical"] for t in rep["trials"]} == {False, True}
    assert {h for _, _, h in first["seen"]} >= {False, True}   # it really switched
    for r in results:
        assert all(torch.equal(x, y) for x, y in zip(r["params"], first["params"]))
