"""Restart-free fault tolerance (bagua_algos.ft on torchft): 2 replicas of one process each,
gloo, a Lighthouse on loopback.  One replica is killed with SIGKILL in a step, the survivor
goes on alone, the replica is relaunched, heals from the survivor and both go on together.

Needs torchft (``pip install 'bagua-algos[ft]'``); skipped without it.  CI runs the
kill-and-heal scenario; the tests marked ``slow`` (other faults) run with ``nox -s ft``.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchft", reason="torchft is not installed: pip install 'bagua-algos[ft]'")
pytest.importorskip("bagua_data")

WORKER = Path(__file__).with_name("_ft_worker.py")
KILL_AT, HOLD_AT, STEPS = 3, 8, 18
SECRET = "test-job-secret-0123456789"


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(WORKER.parent), *sys.path])
    env["RUST_LOG"] = "error"
    env["BAGUA_FT_SECRET"] = SECRET           # the job's secret, the same on every replica
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def _spawn(tmp, lighthouse, tag, replica, *extra):
    (tmp / tag).mkdir(exist_ok=True)
    cmd = [sys.executable, str(WORKER), "--lighthouse", lighthouse, "--replica-id", replica,
           "--tag", tag, "--sync-dir", str(tmp), "--log", str(tmp / f"{tag}.log"),
           "--dump", str(tmp / tag), "--steps", str(STEPS), "--algo", "bytegrad", *extra]
    return subprocess.Popen(cmd, env=_env(), stdout=open(tmp / f"{tag}.out", "w"),
                            stderr=subprocess.STDOUT)


def _check_alive(procs) -> None:
    """Fail at once when a replica exited with an error (a kill -9 is a scenario's own)."""
    for p in procs:
        if p.poll() is not None and p.returncode not in (0, -signal.SIGKILL):
            raise AssertionError(f"a replica failed ({p.returncode}): {p.args}")


def _wait(path: Path, procs, limit=120.0):
    end = time.time() + limit
    while not path.exists():
        _check_alive(procs)
        assert time.time() < end, f"{path.name} did not appear within {limit} s"
        time.sleep(0.05)


def _waiting(lighthouse: str) -> int:
    """How many replicas wait in the Lighthouse's next quorum (its ``/status`` page), -1
    when the page says no count (a quorum just formed)."""
    with urllib.request.urlopen(f"{lighthouse}/status", timeout=5) as page:
        found = re.search(r"only have (\d+) participants", page.read().decode())
    return int(found.group(1)) if found else -1


def _release_when_asked(tmp: Path, lighthouse: str, held: str, joiners: int, procs,
                        limit=120.0):
    """Let the replicas held at ``--hold-at`` go on once all of them are held (``held``:
    their tags) and ``joiners`` replicas wait in the Lighthouse's next quorum.

    A held replica released first asks alone and gets torchft's fast quorum (every member
    of the previous quorum asked): it may run to the end of the job before the joiner asks,
    which then trains alone from step 0 (seen in a clean-clone CI run under load).  Asked in
    this order, the next quorum holds the joiners and every held replica, at the hold step.
    """
    for tag in held:
        _wait(tmp / f"held-{tag}", procs, limit)
    end = time.time() + limit
    while _waiting(lighthouse) != joiners:
        _check_alive(procs)
        assert time.time() < end, f"{joiners} joiner(s) did not ask within {limit} s"
        time.sleep(0.05)
    (tmp / "release").touch()


def _log(tmp, tag):
    return [json.loads(line) for line in (tmp / f"{tag}.log").read_text().splitlines()]


def _flat(obj, prefix=""):
    """{path: tensor or value} of a nested state, for bit-for-bit comparison."""
    out = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_flat(v, f"{prefix}/{k}"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(_flat(v, f"{prefix}/{i}"))
    else:
        out[prefix] = obj
    return out


def _assert_identical(a, b, what, skip=()):
    fa, fb = _flat(a), _flat(b)
    fa = {k: v for k, v in fa.items() if not any(s in k for s in skip)}
    fb = {k: v for k, v in fb.items() if not any(s in k for s in skip)}
    assert fa.keys() == fb.keys(), f"{what}: keys differ: {set(fa) ^ set(fb)}"
    for k in fa:
        x, y = fa[k], fb[k]
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), f"{what}: {k}"
        else:
            assert x == y, f"{what}: {k}: {x!r} != {y!r}"


def _contributions(tmp, tags, sync_every, offsets=(0,)):
    """Epoch-0 sample indices of the committed steps whose training survived, counted.

    A committed local step (LocalSGD, DiLoCo) lives in its replica's parameters only until
    every fragment has synced (fragment p after the inner steps s with ``s % sync_every ==
    offsets[p]``).  A
    membership change before that sync keeps one replica's parameters (the source: rank 0 of
    the new group) and drops every other's, the dead replicas' included: their steps since
    the last sync did not survive.  A record's ``step`` is the committed count after it (t)."""
    logs = {t: [r for r in _log(tmp, t) if r["committed"]] for t in tags}
    # the changes: the last committed step before each new world, and who went on from it
    changes = {}
    for tag, recs in logs.items():
        for prev, r in itertools.pairwise(recs):
            if r["world"] != prev["world"]:
                changes.setdefault(prev["step"], set())
                if r["rank"] == 0:
                    changes[prev["step"]].add(tag)
    seen = collections.Counter()
    for tag, recs in logs.items():
        for r in recs:
            t = r["step"]
            lost = any(t <= b and tag not in kept and not all(
                any(s % sync_every == o for s in range(t, b + 1)) for o in offsets)
                for b, kept in changes.items())
            if not lost and r["epoch"] == 0:
                seen.update(r["indices"])
    return seen


@pytest.fixture
def lighthouse():
    from bagua_algos.ft import lighthouse as start

    lh = start(heartbeat_timeout_ms=1000, join_timeout_ms=1000)
    yield lh.address()
    lh.shutdown()


@pytest.mark.timeout(280)
def test_kill_survive_heal(tmp_path, lighthouse):
    a = _spawn(tmp_path, lighthouse, "a", "a", "--hold-at", str(HOLD_AT))
    b = _spawn(tmp_path, lighthouse, "b", "b", "--kill-at", str(KILL_AT))
    procs = [a, b]
    try:
        _wait(tmp_path / "ready-a", procs)
        _wait(tmp_path / "ready-b", procs)
        (tmp_path / "go-a").touch()
        (tmp_path / "go-b").touch()
        assert b.wait(120) == -signal.SIGKILL
        b2 = _spawn(tmp_path, lighthouse, "b2", "b")
        procs.append(b2)
        _wait(tmp_path / "ready-b2", procs)
        (tmp_path / "go-b2").touch()
        _release_when_asked(tmp_path, lighthouse, "a", 1, procs)
        assert a.wait(150) == 0, (tmp_path / "a.out").read_text()[-3000:]
        assert b2.wait(60) == 0, (tmp_path / "b2.out").read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()

    la, lb, lb2 = _log(tmp_path, "a"), _log(tmp_path, "b"), _log(tmp_path, "b2")
    # the relaunched replica healed at the step the survivor was held at (it asked first),
    # and never ran a step on its own
    heal = lb2[0]["step"] - 1
    assert heal == HOLD_AT and all(r["world"] == 2 for r in lb2), lb2
    # the survivor: steps 1..3 at 2 replicas, exactly one step lost, alone, then 2 again
    failed = [r for r in la if not r["committed"]]
    assert len(failed) == 1 and failed[0]["step"] == KILL_AT, failed
    worlds = {r["step"]: r["world"] for r in la if r["committed"]}
    assert [worlds[s] for s in range(1, STEPS + 1)] == (
        [2] * KILL_AT + [1] * (heal - KILL_AT) + [2] * (STEPS - heal)), worlds
    assert la[-1]["step"] == STEPS and lb2[-1]["step"] == STEPS

    # healing copied every piece of state bit for bit: sent by a == received by b2
    sent = torch.load(tmp_path / "a" / f"sent-{heal}.pt", weights_only=False)
    received = torch.load(tmp_path / "b2" / "received.pt", weights_only=False)
    got = received
    _assert_identical({k: sent[k] for k in got}, got, "healing transfer")
    residuals = [k for k, v in _flat(got["optimizer"]).items()
                 if "compressor" in k and isinstance(v, torch.Tensor) and v.abs().sum() > 0]
    assert residuals, "the transfer carries ByteGrad's error-feedback residuals"
    assert got["scheduler"]["last_epoch"] == heal and got["data"]["consumed"] > 0
    # ... and both replicas hold the same state after the rebuild and at the end (the
    # residuals are per rank: after the rebuild reset on both, at the end each rank's own)
    qa = torch.load(tmp_path / "a" / f"quorum-{heal}-2.pt", weights_only=False)
    qb = torch.load(tmp_path / "b2" / f"quorum-{heal}-2.pt", weights_only=False)
    _assert_identical(qa, qb, "after healing", skip=("/rank",))
    ea = torch.load(tmp_path / "a" / "end.pt", weights_only=False)
    eb = torch.load(tmp_path / "b2" / "end.pt", weights_only=False)
    _assert_identical(ea, eb, "at the end", skip=("/rank", "compressor"))

    # epoch 0's samples: each exactly once over the committed steps of all three processes
    seen = collections.Counter(i for log in (la, lb, lb2) for r in log
                               if r["committed"] and r["epoch"] == 0 for i in r["indices"])
    assert sorted(seen) == list(range(96)) and set(seen.values()) == {1}, seen


@pytest.mark.timeout(200)
@pytest.mark.parametrize("variant, why", [
    pytest.param(("--shape-bug",), "parameter shapes differ", marks=pytest.mark.slow),
    (("--variant", "double"), "float64"),
    pytest.param(("--variant", "sync_every"), "sync_every", marks=pytest.mark.slow),
    (("--secret", "another-job-secret-0123"), "is not the job's")],
    ids=["shape", "dtype", "settings", "secret"])
def test_a_replica_with_another_model_is_refused_and_the_job_goes_on(tmp_path, lighthouse,
                                                                    variant, why):
    """A host that comes back with a different model (other shapes; the same shapes in
    another dtype; the same algorithm with other settings), or with another job's secret
    (its heal request is refused: it gets no state), must not join (nor hang or take
    down the job): it alone is refused with a message naming what differs, and the running
    replica trains on unharmed."""
    algo = ("--algo", "diloco")
    a = _spawn(tmp_path, lighthouse, "a", "a", *algo, "--hold-at", "4", "--step-sleep", "0.05")
    procs = [a]
    try:
        _wait(tmp_path / "ready-a", procs)
        (tmp_path / "go-a").touch()
        _wait(tmp_path / "a.log", procs)
        bad = _spawn(tmp_path, lighthouse, "bad", "bad", *algo, *variant)
        procs.append(bad)
        _wait(tmp_path / "ready-bad", procs)
        (tmp_path / "go-bad").touch()
        (tmp_path / "release").touch()
        rc = bad.wait(120)
        out = (tmp_path / "bad.out").read_text()
        expected = (why,) if "--secret" in variant else ("cannot join", why)
        assert rc != 0 and all(e in out for e in expected), out[-3000:]
        assert a.wait(120) == 0, (tmp_path / "a.out").read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    la = _log(tmp_path, "a")
    assert la[-1]["step"] == STEPS and la[-1]["committed"]
    # the stranger never took part in a committed step: a trained alone throughout
    assert all(r["world"] == 1 for r in la if r["committed"]), la
    assert sum(not r["committed"] for r in la) <= 1, [r for r in la if not r["committed"]]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_stopped_replica_is_dropped_then_heals_when_it_wakes(tmp_path, lighthouse):
    """SIGSTOP (a host frozen: swapped out, paused VM): the other replica drops it and goes on
    alone; on SIGCONT it rejoins, heals from the live peer (its committed step jumps to the
    peer's), and both end identical.  Whether its step in flight when it froze fails depends
    on where the stop landed (a step already past its collectives commits on its own), so
    that is not asserted."""
    a = _spawn(tmp_path, lighthouse, "a", "a", "--step-sleep", "0.05", "--timeout", "5",
               "--hold-at", str(HOLD_AT))
    b = _spawn(tmp_path, lighthouse, "b", "b", "--step-sleep", "0.05", "--timeout", "5")
    procs = [a, b]
    try:
        _wait(tmp_path / "ready-a", procs)
        _wait(tmp_path / "ready-b", procs)
        (tmp_path / "go-a").touch()
        (tmp_path / "go-b").touch()
        end = time.time() + 120
        while not (tmp_path / "b.log").exists() or len(_log(tmp_path, "b")) < 3:
            assert time.time() < end and b.poll() is None, "b did not start training"
            time.sleep(0.05)
        b.send_signal(signal.SIGSTOP)
        frozen = len(_log(tmp_path, "a"))
        end = time.time() + 60
        while not any(r["committed"] and r["world"] == 1 for r in _log(tmp_path, "a")[frozen:]):
            assert time.time() < end, "a did not go on alone while b was stopped"
            time.sleep(0.05)
        _wait_for_hold = time.time() + 60     # a waits at HOLD_AT, so b cannot be left behind
        while len(_log(tmp_path, "a")) < HOLD_AT:
            assert time.time() < _wait_for_hold, "a did not reach its hold step"
            time.sleep(0.05)
        b.send_signal(signal.SIGCONT)
        (tmp_path / "release").touch()
        assert a.wait(150) == 0, (tmp_path / "a.out").read_text()[-3000:]
        assert b.wait(60) == 0, (tmp_path / "b.out").read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
    la, lb = _log(tmp_path, "a"), _log(tmp_path, "b")
    assert la[-1]["step"] == STEPS and lb[-1]["step"] == STEPS
    assert any(r["committed"] and r["world"] == 1 for r in la)      # a went on alone
    # b took the steps a committed alone from a, by healing: its committed step jumps
    steps = [r["step"] for r in lb if r["committed"]]
    assert any(y > x + 1 for x, y in itertools.pairwise(steps)), lb
    assert len({r["heal_s"] for r in lb if r["heal_s"] is not None}) > len(
        {r["heal_s"] for r in lb[:2] if r["heal_s"] is not None}), lb    # a heal after waking
    assert la[-1]["world"] == lb[-1]["world"] == 2                   # and they ended together
    ea = torch.load(tmp_path / "a" / "end.pt", weights_only=False)
    eb = torch.load(tmp_path / "b" / "end.pt", weights_only=False)
    _assert_identical(ea, eb, "at the end", skip=("/rank", "compressor"))


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_two_of_three_replicas_lost_at_once(tmp_path, lighthouse):
    """Two hosts die in the same step: the last one loses that step only and trains on alone,
    every epoch-0 sample still used exactly once."""
    a = _spawn(tmp_path, lighthouse, "a", "a")
    b = _spawn(tmp_path, lighthouse, "b", "b", "--kill-at", str(KILL_AT))
    c = _spawn(tmp_path, lighthouse, "c", "c", "--kill-at", str(KILL_AT))
    procs = [a, b, c]
    try:
        for t in "abc":
            _wait(tmp_path / f"ready-{t}", procs)
        for t in "abc":
            (tmp_path / f"go-{t}").touch()
        assert b.wait(120) == -signal.SIGKILL and c.wait(120) == -signal.SIGKILL
        assert a.wait(120) == 0, (tmp_path / "a.out").read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    la = _log(tmp_path, "a")
    failed = [r for r in la if not r["committed"]]
    assert len(failed) == 1 and failed[0]["step"] == KILL_AT, failed
    worlds = [r["world"] for r in la if r["committed"]]
    assert worlds == [3] * KILL_AT + [1] * (STEPS - KILL_AT), worlds
    seen = collections.Counter(i for t in "abc" for r in _log(tmp_path, t)
                               if r["committed"] and r["epoch"] == 0 for i in r["indices"])
    assert sorted(seen) == list(range(96)) and set(seen.values()) == {1}, seen


@pytest.mark.timeout(200)
@pytest.mark.parametrize("algo, kill_at", [
    ("local_sgd", KILL_AT), ("local_sgd", KILL_AT + 1),
    pytest.param("diloco", KILL_AT, marks=pytest.mark.slow),
    pytest.param("diloco", KILL_AT + 1, marks=pytest.mark.slow),
    pytest.param("diloco_fragments", KILL_AT, marks=pytest.mark.slow),
    pytest.param("low_precision_decentralized", KILL_AT, marks=pytest.mark.slow)],
    ids=["local_sgd-sync", "local_sgd-local", "diloco-sync", "diloco-local",
         "diloco_fragments-sync", "low_precision_decentralized"])
def test_a_peer_killed_in_the_optimizer_step_exchange_spares_the_survivor(
        tmp_path, lighthouse, algo, kill_at):
    """LocalSGD, DiLoCo and LowPrecisionDecentralized exchange weights in the optimizer step:
    ``b`` dies in a step where ``a`` syncs (the 4th: sync_every=2; LowPrecisionDecentralized
    every step).  The exchange runs before the commit vote, so its failure votes the step
    down on ``a`` (which goes on alone) instead of raising gloo's error out of ``a``.  When
    ``b`` dies in a local step (the 5th: no exchange), ``a`` must not commit it either: ``b``'s
    batch of that step would be marked consumed and never trained on; it is dealt again."""
    extra = ("--algo", algo, "--timeout", "5")
    a = _spawn(tmp_path, lighthouse, "a", "a", *extra)
    b = _spawn(tmp_path, lighthouse, "b", "b", *extra, "--kill-at", str(kill_at))
    procs = [a, b]
    try:
        for t in "ab":
            _wait(tmp_path / f"ready-{t}", procs)
        for t in "ab":
            (tmp_path / f"go-{t}").touch()
        assert b.wait(120) == -signal.SIGKILL
        assert a.wait(120) == 0, (tmp_path / "a.out").read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    la = _log(tmp_path, "a")
    failed = [r for r in la if not r["committed"]]
    assert len(failed) == 1 and failed[0]["step"] == kill_at, failed
    worlds = [r["world"] for r in la if r["committed"]]
    assert worlds == [2] * kill_at + [1] * (STEPS - kill_at), worlds
    # no sample of epoch 0 used twice, none lost (the step voted down gave its samples back;
    # b's local step since the last sync, lost with it, is dealt again to a)
    # (DiLoCo's fragments of sync_every=4 sync at the offsets 2 and 0)
    every, offsets = {"local_sgd": (2, (0,)), "diloco": (2, (0,)),
                      "diloco_fragments": (4, (2, 0))}.get(algo, (1, (0,)))
    seen = _contributions(tmp_path, "ab", every, offsets)
    assert set(seen.values()) == {1} and len(seen) == 4 * (2 * kill_at + STEPS - kill_at), seen


@pytest.mark.timeout(200)
@pytest.mark.parametrize("algo", ["local_sgd", pytest.param("diloco", marks=pytest.mark.slow)])
def test_a_host_lost_before_a_sync_gives_its_local_steps_back(tmp_path, lighthouse, algo):
    """sync_every=4, 3 hosts: ``c`` is killed in the 7th step, after its 5th and 6th (local,
    committed) steps and before the sync of the 8th.  Those two steps lived in ``c``'s
    parameters only, and ``b``'s in ``b``'s, which the rebuild replaces by ``a``'s: their
    samples are dealt again to ``a`` and ``b``.  Every epoch-0 sample is in exactly one step
    whose training survived (against the whole dataset: an epoch is a permutation of it)."""
    extra = ("--algo", algo, "--variant", "sync_every", "--timeout", "5")
    a = _spawn(tmp_path, lighthouse, "a", "a", *extra)
    b = _spawn(tmp_path, lighthouse, "b", "b", *extra)
    c = _spawn(tmp_path, lighthouse, "c", "c", *extra, "--kill-at", "6")
    procs = [a, b, c]
    try:
        for t in "abc":
            _wait(tmp_path / f"ready-{t}", procs)
        for t in "abc":
            (tmp_path / f"go-{t}").touch()
        assert c.wait(120) == -signal.SIGKILL
        assert a.wait(120) == 0, (tmp_path / "a.out").read_text()[-3000:]
        assert b.wait(120) == 0, (tmp_path / "b.out").read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    la = _log(tmp_path, "a")
    failed = [r for r in la if not r["committed"]]
    assert len(failed) == 1 and failed[0]["step"] == 6, failed
    assert [r["world"] for r in la if r["committed"]] == [3] * 6 + [2] * (STEPS - 6)
    seen = _contributions(tmp_path, "abc", 4)
    assert sorted(seen) == list(range(96)) and set(seen.values()) == {1}, seen


@pytest.mark.timeout(200)
def test_a_join_between_two_syncs_deals_the_replaced_local_steps_again(tmp_path):
    """sync_every=4, LocalSGD: ``a`` and ``b`` hold after 6 steps (5th and 6th local), ``c``
    joins.  The rebuild puts ``a``'s parameters on every host (``c``'s came from its heal
    sender), so ``b``'s local steps since the sync are gone; their samples are owed, and the
    joiner, whose state was sent before the change, deals its share of them too."""
    from bagua_algos.ft import lighthouse as start

    # the joiner asks before the held replicas go on; a quorum waits up to join_timeout for
    # the replicas that have not asked yet (as in test_ft_heal: 1 s is short under load)
    lh = start(heartbeat_timeout_ms=1000, join_timeout_ms=5000)
    extra = ("--algo", "local_sgd", "--variant", "sync_every", "--timeout", "5")
    a = _spawn(tmp_path, lh.address(), "a", "a", *extra, "--hold-at", "6")
    b = _spawn(tmp_path, lh.address(), "b", "b", *extra, "--hold-at", "6")
    c = _spawn(tmp_path, lh.address(), "c", "c", *extra, "--connect-after-go")
    procs = [a, b, c]
    try:
        for t in "abc":
            _wait(tmp_path / f"ready-{t}", procs)
        for t in "ab":
            (tmp_path / f"go-{t}").touch()
        end = time.time() + 120
        while not (tmp_path / "a.log").exists() or len(_log(tmp_path, "a")) < 6:
            assert time.time() < end, "a did not reach the step where the joiner comes"
            time.sleep(0.05)
        (tmp_path / "go-c").touch()                 # the joiner connects and asks to join,
        _release_when_asked(tmp_path, lh.address(), "ab", 1, procs)   # then the held go on
        for p, t in zip(procs, "abc", strict=True):
            assert p.wait(150) == 0, (tmp_path / f"{t}.out").read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        lh.shutdown()
    lc = _log(tmp_path, "c")
    assert all(r["committed"] and r["world"] == 3 for r in lc)
    # the join came between two syncs (else nothing was owed and this tests nothing)
    assert lc[0]["step"] == 7, lc[0]["step"]
    seen = _contributions(tmp_path, "abc", 4)
    assert sorted(seen) == list(range(96)) and set(seen.values()) == {1}, seen
