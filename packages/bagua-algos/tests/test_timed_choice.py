"""with_bagua(model, [opt], "auto") times the first steps, then chooses (tuning/timed_choice.py).

The network is the one the ranks would measure on a far link (the measurement and the node
count are replaced: on loopback every rank is on one node, where nothing is deferred).  A CPU
job whose nodes are far apart measures beside the timed steps, on a thread; a near one at
the wrap.  References: DiLoCo wrapped with the chosen H from the start, the ranks' own local
training averaged by hand, and GradientAllReduce from that average.
"""

from __future__ import annotations

import pytest
import torch
from _common import batch, loss_fn, make_model, params

import bagua_comm as bc
from bagua_algos import DiLoCo, GradientAllReduce, with_bagua
from bagua_algos.tuning.recommend import NetworkMeasurement, choose, diloco_kwargs
from bagua_comm.testing import run_ranks

pytestmark = pytest.mark.timeout(300)


def _far_link(bandwidth=100.0, latency=50.0, seconds=0.0):
    """Every rank on a node of its own, ``bandwidth`` and ``latency`` measured in
    ``seconds`` (a list: each rank's)."""
    import time

    import bagua_algos.tuning.recommend as rec

    world = bc.get_world_size()
    wait = seconds[bc.get_rank()] if isinstance(seconds, list) else seconds

    def measure(group, time_limit_s, device, agree):
        time.sleep(wait)
        return NetworkMeasurement(bandwidth, latency, world, world, wait), agree

    rec._measure = measure
    rec._nodes = lambda group: (group.size, 1)
    # the exact allreduce's latency alone (2(n - 1) tiny exchanges) not negligible: far apart
    rec.far_apart = lambda group: 2 * (group.size - 1) * latency / 1e3 >= rec.NEGLIGIBLE_S

#: the links of the two paths: far apart (measured beside the timed steps), and near but
#: slow (measured at the wrap, where the exact allreduce may still win from the first step)
LINKS = {"beside the steps": (100.0, 50.0), "at the wrap": (0.1, 0.1)}


def _step(model, opt, i):
    opt.zero_grad()
    loss_fn(model, *batch(i, bc.get_rank())).backward()
    opt.step()


def _timed_then_diloco(where):
    _far_link(*LINKS[where])
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    m = with_bagua(model, [opt], "auto")
    kind = type(m.algorithm).__name__
    for i in range(4):
        _step(m, opt, i)
    before = params(model)                 # 4 local steps: nothing sent yet
    i = 4
    while m.impl.choice is None:           # the 5th, or a step or two later beside a probe
        _step(m, opt, i)
        i += 1
    name, kwargs = m.impl.choice
    h, tau = m.impl.H, m.impl.tau
    steps = h + tau + 3                    # one sync landed, then inner steps after it
    for j in range(i, steps):
        _step(m, opt, j)
    got = params(model)

    ref = make_model(0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    r = with_bagua(ref, [ref_opt], DiLoCo(**diloco_kwargs(h, tau, False,
                                                        bc.get_world_size())))
    for i in range(steps):
        _step(r, ref_opt, i)
    return {"kind": kind, "name": name, "kwargs": repr(kwargs), "h": h, "tau": tau,
            "at": m.impl.chosen_at, "beside": m.impl._probe is not None,
            "compute": m.impl.compute_s, "before": before, "got": got, "ref": params(ref),
            "syncs": m.impl.outer_steps[0], "same": all(
                torch.equal(a, b) for a, b in zip(got, params(ref)))}


@pytest.mark.parametrize("where", ["beside the steps", "at the wrap"])
def test_a_slow_link_trains_locally_while_timing_then_goes_on_as_diloco(where):
    a, b = run_ranks(_timed_then_diloco, 2, args=(where,), timeout=240)
    assert a["kind"] == b["kind"] == "TimedChoice"
    assert a["beside"] == b["beside"] == (where == "beside the steps")
    # every rank chose at the same step, the 5th where measured at the wrap
    assert a["at"] == b["at"] and (a["at"] == 5 if where == "at the wrap" else 5 <= a["at"] < a["h"])
    # every rank agreed on one step time, so on one choice
    assert a["compute"] == b["compute"] > 0
    assert (a["name"], a["kwargs"], a["h"]) == (b["name"], b["kwargs"], b["h"])
    # ... the rule's, for the measured network and that time
    nbytes = sum(p.numel() * 4 for p in make_model(0).parameters())
    name, kwargs, _, _ = choose(*LINKS[where], 2, nbytes, compute_s=a["compute"], nodes=2)
    assert (a["name"], a["kwargs"]) == (name, repr(kwargs)) and name == "diloco"
    assert a["h"] == kwargs["sync_every"] and a["tau"] == kwargs.get("overlap_steps", 0)
    # the timed steps were local: the ranks' models differed before the first sync
    assert any(not torch.equal(x, y) for x, y in zip(a["before"], b["before"]))
    # ... and the run is DiLoCo with that H (and T) from the wrap, bit for bit, one sync in
    assert a["syncs"] == b["syncs"] == 1
    assert a["same"] and b["same"]
    assert all(torch.equal(x, y) for x, y in zip(a["got"], a["ref"]))


def _timed_then_per_step():
    import bagua_algos.tuning.timed_choice as tc

    _far_link()
    # the rule told to answer the exact allreduce (its choice is the other test's subject)
    tc.choose = lambda *args, **kw: ("gradient_allreduce", {"hierarchical": False},
                                     "the test's", {})
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    m = with_bagua(model, [opt], "auto")
    local = make_model(0)
    local_opt = torch.optim.SGD(local.parameters(), lr=0.05, momentum=0.9)
    i = 0
    while m.impl.choice is None:           # the 5th step, or one or two later
        _step(m, opt, i)
        _step(local, local_opt, i)
        i += 1
    averaged, at = params(model), i
    kind = type(m.algorithm).__name__
    for i in range(at, at + 4):
        _step(m, opt, i)
    # the reference: GradientAllReduce from the average, with rank 0's optimizer state
    ref = make_model(0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    with torch.no_grad():
        for p, q in zip(ref.parameters(), averaged):
            p.copy_(q)
    ref_opt.load_state_dict(local_opt.state_dict())
    r = with_bagua(ref, [ref_opt], GradientAllReduce())
    for i in range(at, at + 4):
        _step(r, ref_opt, i)
    return {"local": params(local), "averaged": averaged, "kind": kind,
            "after": type(m.algorithm).__name__, "got": params(model), "ref": params(ref),
            "same": all(torch.equal(x, y) for x, y in zip(params(model), params(ref)))}


def test_a_per_step_choice_averages_the_timed_steps_and_switches_in_place():
    a, b = run_ranks(_timed_then_per_step, 2, timeout=240)
    assert a["kind"] == "TimedChoice" and a["after"] == b["after"] == "GradientAllReduce"
    # after the timed steps: the average of the ranks' own local training, by hand
    for x, y, got_a, got_b in zip(a["local"], b["local"], a["averaged"], b["averaged"]):
        assert not torch.equal(x, y)
        assert torch.equal(got_a, (x + y) / 2) and torch.equal(got_b, got_a)
    # then the exact allreduce, as wrapped from that average and rank 0's momentum
    assert a["same"] and b["same"]
    assert all(torch.equal(x, y) for x, y in zip(a["got"], b["got"]))


def _slow_measurement():
    """The measurement beside the steps outlasts many of them, and one rank's by far: every
    rank chooses at one step, after both measured; the chosen H = 4 is shorter than the
    local training so far, so the first sync starts at the choice, the next H steps later."""
    import bagua_algos.tuning.timed_choice as tc

    _far_link(seconds=[0.2, 1.0])
    world = bc.get_world_size()
    tc.choose = lambda *args, **kw: ("diloco", diloco_kwargs(4, 0, False, world), "the test's",
                                     {})
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    m = with_bagua(model, [opt], "auto")
    i = 0
    while m.impl.choice is None and i < 100_000:
        _step(m, opt, i)
        i += 1
    at, syncs = m.impl.chosen_at, [m.impl.outer_steps[0]]
    synced = [params(model)]
    for _ in range(4):
        _step(m, opt, i)
        i += 1
        syncs.append(m.impl.outer_steps[0])
        synced.append(params(model))
    return {"at": at, "steps": i, "syncs": syncs, "measured_at": m.impl._measured_at,
            "synced": synced}


def test_a_measurement_beside_the_steps_is_waited_for_at_one_agreed_step():
    a, b = run_ranks(_slow_measurement, 2, timeout=240)
    # one step for both: after each rank's end of measurement (the slow rank's ~1 s)
    assert a["at"] == b["at"] >= max(a["measured_at"], b["measured_at"]) + 3 > 8
    assert a["steps"] == b["steps"]
    # the first sync at the choice (its steps were a period already), then every 4
    assert a["syncs"] == b["syncs"] == [1, 1, 1, 1, 2]
    for k in (0, 4):                       # just synced: every rank holds the same model
        assert all(torch.equal(x, y) for x, y in zip(a["synced"][k], b["synced"][k]))
    assert any(not torch.equal(x, y) for x, y in zip(a["synced"][2], b["synced"][2]))


def _measured_beside_on_loopback():
    """The real measurement of loopback, made beside the steps (the ranks told they are far
    apart): its probes go from the measuring thread while the training thread steps."""
    import bagua_algos.tuning.recommend as rec

    rec._nodes = lambda group: (group.size, 1)
    rec.far_apart = lambda group: True
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    m = with_bagua(model, [opt], "auto")
    kind = type(m.algorithm).__name__
    i = 0
    while m.impl.choice is None and i < 100_000:
        _step(m, opt, i)
        i += 1
    mm = m.impl.measurement
    return (kind, m.impl.choice[0], m.impl.chosen_at, m.impl._probe is not None,
            mm.bandwidth_mbit, mm.latency_ms, mm.elapsed_s)


def test_the_measurement_beside_the_steps_is_real_and_the_same_on_every_rank():
    a, b = run_ranks(_measured_beside_on_loopback, 2, timeout=200)
    assert a == b                              # one choice at one step, from one measurement
    kind, _name, at, beside, bandwidth, latency, elapsed = a
    assert kind == "TimedChoice" and beside and at >= 5
    assert bandwidth > 100 and 0 < latency < 100 and elapsed > 0


def _one_node_or_no_optimizer(case):
    if case == "far, no optimizer":
        _far_link()
        m = with_bagua(make_model(0), [], "auto")
    elif case == "fast":               # the exact allreduce's communication negligible
        _far_link(bandwidth=10_000.0, latency=0.1)
        model = make_model(0)
        m = with_bagua(model, [torch.optim.SGD(model.parameters(), lr=0.1)], "auto")
    else:                              # loopback, measured: one node
        model = make_model(0)
        m = with_bagua(model, [torch.optim.SGD(model.parameters(), lr=0.1)], "auto")
    return type(m.algorithm).__name__


@pytest.mark.parametrize("case", ["far, no optimizer", "fast", "one node"])
def test_nothing_is_timed_where_diloco_has_no_chance(case):
    a, b = run_ranks(_one_node_or_no_optimizer, 2, args=(case,), timeout=200)
    assert a == b != "TimedChoice"


def test_at_least_two_steps_are_timed():
    from bagua_algos.tuning.timed_choice import TimedChoice

    far = NetworkMeasurement(100.0, 50.0, 4, 4, 0.0)
    with pytest.raises(ValueError, match="timed_steps"):
        TimedChoice(far, 1e6, timed_steps=1)
    assert TimedChoice(far, 1e6, timed_steps=2).sync_every > 10**9    # no sync before it


def _near():
    import bagua_algos.tuning.recommend as rec

    rec._nodes = lambda group: (group.size, 1)
    return rec.far_apart(bc.get_default_group())


def test_loopback_is_not_far_apart():
    """Two tiny exchanges on loopback take well under the 5 ms a rank pair would need for
    the exact allreduce's latency to matter: measured at the wrap."""
    assert run_ranks(_near, 2, timeout=120) == [False, False]


def _rewrapped_while_measuring():
    """A re-wrap during the measurement beside the steps: the measurement ends first (its
    exchanges and the re-wrap's share the group), then the new algorithm runs."""
    _far_link(seconds=[0.3, 0.6])
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    m = with_bagua(model, [opt], "auto")
    for i in range(2):
        _step(m, opt, i)
    timed = m.impl
    alive = timed._probe.is_alive()
    m = with_bagua(m, [opt], GradientAllReduce())
    after = timed._probe.is_alive()           # the re-wrap's exchanges came after it
    for i in range(2, 5):
        _step(m, opt, i)
    return alive, after, timed.measurement is not None, type(m.algorithm).__name__, \
        params(model)


def test_a_rewrap_while_measuring_waits_for_the_measurement():
    a, b = run_ranks(_rewrapped_while_measuring, 2, timeout=120)
    assert a[:3] == b[:3] == (True, False, True)   # measuring at the re-wrap, done after it
    assert a[3] == b[3] == "GradientAllReduce"
    assert all(torch.equal(x, y) for x, y in zip(a[4], b[4]))
