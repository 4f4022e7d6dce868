"""Healing under bagua_algos.ft, algorithm by algorithm: two replicas train together, a third
joins at a step boundary and copies the live state of one of them; right after the rebuild all
three hold the same parameters, optimizer state, algorithm state, LR scheduler and sampler
position, bit for bit, and the state shared by every rank (DiLoCo's anchor, outer momentum and
step counter, LowRank's warm-start Q, round counters) is the one the job had before the join.

Three real processes (gloo, a torchft Lighthouse on loopback).  A quick subset runs by
default; the rest is marked ``slow`` (``nox -s ft``).  Needs torchft; skipped without it.
"""

from __future__ import annotations

import signal
import time

import pytest
import torch
from test_ft import _assert_identical, _flat, _log, _release_when_asked, _spawn, _wait

pytest.importorskip("torchft", reason="torchft is not installed: pip install 'bagua-algos[ft]'")
pytest.importorskip("bagua_data")

HOLD, STEPS = 4, 8

# State that belongs to one rank (its own quantisation error, its view of its neighbours): on a
# change of world size every rank restarts it by the algorithm's documented rule, so it is
# compared across replicas but not against the job's state before the join.
PER_RANK = ("/rank", "compressor", "residuals", "/left", "/right", "/mine", "/diff",
            "/decoded", "/payload",
            "/start")    # DiLoCo with overlap: a sync in flight starts from each rank's model

# Where each algorithm keeps state that must be non-trivial in the transfer (so the check has
# something to carry), as (path fragment in the flattened optimizer state, what it is).
CARRIED = {
    "bytegrad": ("compressor", "error-feedback residuals"),
    "qadam": ("exp_avg", "QAdam momenta"),
    "decentralized": ("rounds", "the round counter"),
    "low_precision_decentralized": ("/mine", "the compressed replicas"),
    "local_sgd": ("anchor", "the anchor"),
    "diloco": ("momentum", "the outer momentum"),
    "diloco_fragments": ("/steps", "the inner step counter"),
    "topk": ("residuals", "TopK residuals"),
    "low_rank": ("/q/", "the warm-start Q"),
    "gradient_allreduce": ("exp_avg_sq", "Adam's state"),
}
QUICK = ("diloco",)   # the richest state (anchor, outer momentum, counters); the rest: slow


@pytest.fixture
def lighthouse():
    from bagua_algos.ft import lighthouse as start

    # the joiner connects only when it comes: a quorum waits up to join_timeout for a live
    # replica that has not asked yet, and on a loaded machine 1 s is not always enough for
    # the two held replicas to ask after the joiner did (the joiner would then train alone)
    lh = start(heartbeat_timeout_ms=1000, join_timeout_ms=5000)
    yield lh.address()
    lh.shutdown()


def _nonzero(value) -> bool:
    if isinstance(value, torch.Tensor):
        return bool(value.ne(0).any())
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value != 0


def _run_join(tmp, lighthouse, algo):
    extra = ("--algo", algo, "--steps", str(STEPS))
    # all three start at once (the joiner waits for go-c), so process start-up overlaps
    procs = [_spawn(tmp, lighthouse, t, t, *extra, *(
        ("--hold-at", str(HOLD)) if t != "c" else ("--connect-after-go",))) for t in "abc"]
    try:
        for t in "abc":
            _wait(tmp / f"ready-{t}", procs)
        (tmp / "go-a").touch()
        (tmp / "go-b").touch()
        end = time.time() + 120
        while not (tmp / "a.log").exists() or len(_log(tmp, "a")) < HOLD:
            assert time.time() < end, "a did not reach the step where the joiner comes"
            for p in procs:
                assert p.poll() is None, (tmp / "a.out").read_text()[-3000:]
            time.sleep(0.05)
        (tmp / "go-c").touch()                 # the joiner connects and asks to join,
        _release_when_asked(tmp, lighthouse, "ab", 1, procs)   # then the held ones go on
        for p, t in zip(procs, "abc"):
            assert p.wait(120) == 0, (tmp / f"{t}.out").read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)


def _check_join(tmp, algo):
    logs = {t: _log(tmp, t) for t in "abc"}
    heal = logs["c"][0]["step"] - 1
    assert all(r["world"] == 2 for t in "ab" for r in logs[t][:HOLD] if r["committed"])
    assert all(r["world"] == 3 and r["committed"] for r in logs["c"]), logs["c"]
    sender = [t for t in "ab" if (tmp / t / f"sent-{heal}.pt").exists()]
    assert len(sender) == 1, sender
    sent = torch.load(tmp / sender[0] / f"sent-{heal}.pt", weights_only=False)
    received = torch.load(tmp / "c" / "received.pt", weights_only=False)
    # 1. the transfer: every piece of state, bit for bit, with the algorithm's own state in it
    _assert_identical(sent, received, "healing transfer")
    frag, what = CARRIED[algo]
    assert any(frag in k and _nonzero(v) for k, v in _flat(received["optimizer"]).items()), (
        f"the transfer carries {what}", sorted(_flat(received["optimizer"])))
    assert received["scheduler"]["last_epoch"] == heal and received["data"]["consumed"] > 0
    # 2. applied: once the quorum of 3 is built, the joiner holds what the replica it healed
    # from holds, and the other one the same apart from its own per-rank state
    quorum = {t: torch.load(tmp / t / f"quorum-{heal}-3.pt", weights_only=False) for t in "abc"}
    other = "b" if sender[0] == "a" else "a"
    _assert_identical(quorum[sender[0]], quorum["c"], "the sender and the joiner after healing",
                      skip=("/rank",))
    _assert_identical(quorum[other], quorum["c"], "the other replica and the joiner",
                      skip=PER_RANK)
    # 3. nothing the job shared was lost by the rebuild: it equals what was sent (the sampler
    # now deals over 3 replicas from the same position; a join between two syncs adds the
    # samples of the local steps that the rebuild replaced: owed, equal on every replica, 2.)
    shared = {k: v for k, v in received.items() if k != "meta"}
    _assert_identical(shared, {k: quorum["c"][k] for k in shared}, "the job's state kept",
                      skip=(*PER_RANK, "/world_size", "/data/history", "/data/num_replicas",
                            "/data/owed"))
    return heal


@pytest.mark.timeout(200)
@pytest.mark.parametrize("algo", [
    pytest.param(a, marks=() if a in QUICK else pytest.mark.slow) for a in CARRIED])
def test_a_joining_replica_heals_bit_for_bit(tmp_path, lighthouse, algo):
    _run_join(tmp_path, lighthouse, algo)
    _check_join(tmp_path, algo)


def _run_failed_heal(tmp, lighthouse, algo, hold=4, steps=8):
    """Host ``b`` trains alone; ``a`` (rank 0 of the pair: ids sort) joins at step ``hold``
    and its first heal transfer fails (a reset connection while the sender lives)."""
    extra = ("--algo", algo, "--steps", str(steps), "--timeout", "5")
    procs = [_spawn(tmp, lighthouse, "b", "b", *extra, "--hold-at", str(hold)),
             _spawn(tmp, lighthouse, "a", "a", *extra, "--connect-after-go", "--fail-heals", "1")]
    try:
        _wait(tmp / "ready-b", procs)
        _wait(tmp / "ready-a", procs)
        (tmp / "go-b").touch()
        end = time.time() + 120
        while not (tmp / "b.log").exists() or len(_log(tmp, "b")) < hold:
            assert time.time() < end, "b did not reach the step where the joiner comes"
            assert procs[0].poll() is None, (tmp / "b.out").read_text()[-3000:]
            time.sleep(0.05)
        (tmp / "go-a").touch()
        _release_when_asked(tmp, lighthouse, "b", 1, procs)
        for p, t in zip(procs, "ba"):
            assert p.wait(120) == 0, (tmp / f"{t}.out").read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("algo", [
    "diloco", pytest.param("gradient_allreduce", marks=pytest.mark.slow),
    pytest.param("bytegrad", marks=pytest.mark.slow)])
def test_a_failed_heal_never_replaces_the_running_model(tmp_path, lighthouse, algo):
    """The joiner's first heal fails: the running host's trained model must not be replaced
    by the joiner's initial one (with_bagua broadcast rank 0's, and the joiner was rank 0);
    the joiner heals at the next quorum and both end identical."""
    _run_failed_heal(tmp_path, lighthouse, algo)
    sent = sorted(int(p.stem.split("-")[1]) for p in (tmp_path / "b").glob("sent-*.pt"))
    assert len(sent) >= 2, "the joiner healed at its first try: the fault was not injected"
    before = torch.load(tmp_path / "b" / f"sent-{sent[0]}.pt", weights_only=False)
    pair = torch.load(tmp_path / "b" / f"quorum-{sent[0]}-2.pt", weights_only=False)
    # the host's model when the pair formed: its own trained one, bit for bit
    _assert_identical(before["model"], pair["model"], "the host's model after the failed heal")
    end = {t: torch.load(tmp_path / t / "end.pt", weights_only=False) for t in "ab"}
    _assert_identical(end["a"]["model"], end["b"]["model"], "the replicas at the end")
    # the host's losses never jump back to the untrained model's
    lb = [r for r in _log(tmp_path, "b") if r["committed"]]
    la = [r for r in _log(tmp_path, "a") if r["committed"]]
    assert la and la[-1]["step"] == lb[-1]["step"]
