"""bagua_algos.ft without a job: importing, bad input, an unreachable Lighthouse.
(The kill/heal scenario is tests/test_ft.py at the repository root.)"""

import collections
import os
import subprocess
import sys
import time

import pytest
import torch


def test_import_bagua_algos_never_imports_torchft():
    code = ("import sys, bagua_algos, bagua_algos.ft; "
            "assert 'torchft' not in sys.modules, 'torchft imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def _args():
    import bagua_algos as ba

    model = torch.nn.Linear(2, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), ba.GradientAllReduce()


@pytest.mark.parametrize("kwargs, rule", [
    ({"lighthouse": ""}, "lighthouse must be"),
    ({"replica_id": ""}, "replica_id must be"),
    ({"min_replicas": 0}, "min_replicas must be"),
    ({"timeout": 5}, "timeout must be"),
    ({"data": [1, 2]}, "data must be"),
])
def test_bad_arguments_raise_before_connecting(kwargs, rule):
    from bagua_algos.ft import FaultTolerant

    full = {"lighthouse": "http://127.0.0.1:9", "replica_id": "r", **kwargs}
    with pytest.raises(ValueError, match=rule):
        FaultTolerant(*_args(), **full)


def test_async_algorithm_is_refused():
    import bagua_algos as ba
    from bagua_algos.ft import FaultTolerant

    model, opt, _ = _args()
    with pytest.raises(ValueError, match="async"):
        FaultTolerant(model, opt, ba.AsyncModelAverage(), lighthouse="http://127.0.0.1:9",
                      replica_id="r")


def test_shift_one_decentralized_is_refused_naming_why():
    import bagua_algos as ba
    from bagua_algos.ft import FaultTolerant

    model, opt, _ = _args()
    with pytest.raises(ValueError, match=r"shift_one.*even number of replicas"):
        FaultTolerant(model, opt, ba.Decentralized(peer_selection_mode="shift_one"),
                      lighthouse="http://127.0.0.1:9", replica_id="r")


def test_unreachable_lighthouse_fails_within_connect_timeout():
    pytest.importorskip("torchft", reason="torchft is not installed: pip install "
                        "'bagua-algos[ft]'")
    code = """
import time, torch
from datetime import timedelta
import bagua_algos as ba
from bagua_algos.ft import FaultTolerant
m = torch.nn.Linear(2, 1)
t0 = time.time()
try:
    FaultTolerant(m, torch.optim.SGD(m.parameters(), lr=0.1), ba.GradientAllReduce(),
                  lighthouse="http://127.0.0.1:9", replica_id="r",
                  connect_timeout=timedelta(seconds=2))
except RuntimeError as e:
    assert "Lighthouse" in str(e), e
    print(round(time.time() - t0, 1))
else:
    raise SystemExit("no error")
"""
    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    # torchft's client retries the connection within connect_timeout, then the manager
    # server gives up (about 11 s measured at load 9 on 2 cores): bounded, with a clear error
    assert float(out.stdout.split()[-1]) < 30 and time.time() - t0 < 60


def test_lighthouse_lost_mid_run_is_a_clear_error_within_quorum_timeout():
    """The host holding the Lighthouse dies (its process killed): the replica's next step
    gets no quorum and raises a RuntimeError naming the Lighthouse and the timeout, after
    quorum_timeout, instead of hanging or torchft's bare TimeoutError."""
    pytest.importorskip("torchft", reason="torchft is not installed: pip install "
                        "'bagua-algos[ft]'")
    code = """
import os, subprocess, sys, time, torch
from datetime import timedelta
import bagua_algos as ba
from bagua_algos.ft import FaultTolerant
lh = subprocess.Popen([sys.executable, "-c", "import time; from bagua_algos.ft import "
                       "lighthouse; lh = lighthouse(); print(lh.address(), flush=True); "
                       "time.sleep(100)"], stdout=subprocess.PIPE, text=True)
try:
    addr = lh.stdout.readline().strip()
    m = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    ft = FaultTolerant(m, opt, ba.GradientAllReduce(), lighthouse=addr, replica_id="r",
                       quorum_timeout=timedelta(seconds=3))
    for i in range(3):
        with ft.step() as step:
            ft.model(torch.ones(1, 2)).sum().backward()
        assert step.committed
finally:
    lh.kill()           # the Lighthouse's host is lost
    lh.wait()
t0 = time.time()
try:
    with ft.step():
        pass
except RuntimeError as e:
    assert addr in str(e) and "quorum_timeout=0:00:03" in str(e) and "lost" in str(e), e
    print(round(time.time() - t0, 1))
else:
    raise SystemExit("no error")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "RUST_LOG": "error"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert 2.5 < float(out.stdout.split()[-1]) < 15, out.stdout


def test_a_host_whose_rebuild_failed_still_serves_the_algorithm_state():
    """A rebuild fails half-way (a peer died while the group was set up): the module is
    detached from its algorithm, and the state this host serves to a joiner must still carry
    the algorithm's state (DiLoCo's step counter, anchor, outer momentum), not lose it."""
    pytest.importorskip("torchft", reason="torchft is not installed: pip install "
                        "'bagua-algos[ft]'")
    code = """
import torch
import bagua_algos as ba
import bagua_algos.ft._rebuild as reb
from bagua_algos.ft import FaultTolerant, lighthouse
lh = lighthouse()
torch.manual_seed(0)
m = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
ft = FaultTolerant(m, opt, ba.DiLoCo(sync_every=2), lighthouse=lh.address(), replica_id="r")
for i in range(3):
    with ft.step() as step:
        ft.model(torch.ones(2, 4)).sum().backward()
    assert step.committed
live = ft.state_dict()["bagua"]
assert live is not None and live["step"] == 3, live

def dead_peer(pg):
    raise RuntimeError("gloo: connection closed by peer (injected)")
reb.bagua_group = dead_peer
try:
    ft._rebuild(None)
except RuntimeError as e:
    assert "injected" in str(e)
else:
    raise SystemExit("the injected failure did not happen")
served = ft._send()["optimizer"]
assert "bagua_algos" in served, sorted(served)
got = served["bagua_algos"]
assert got["step"] == live["step"] and got["algorithm"] == "diloco", got
for k, v in live["impl"].items():
    if isinstance(v, torch.Tensor):
        assert torch.equal(v, got["impl"][k]), k
ft.close()
lh.shutdown()
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "RUST_LOG": "error"})
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


def test_too_few_replicas_for_min_replicas_raise_after_quorum_timeout():
    """FaultTolerant(min_replicas=2) with one replica alive (the Lighthouse's own minimum is
    1, so quorums of one form): it must raise after quorum_timeout naming min_replicas, not
    run uncommittable steps forever."""
    pytest.importorskip("torchft", reason="torchft is not installed: pip install "
                        "'bagua-algos[ft]'")
    code = """
import time, torch
from datetime import timedelta
import bagua_algos as ba
from bagua_algos.ft import FaultTolerant, lighthouse
lh = lighthouse()
m = torch.nn.Linear(2, 1)
ft = FaultTolerant(m, torch.optim.SGD(m.parameters(), lr=0.1), ba.GradientAllReduce(),
                   lighthouse=lh.address(), replica_id="r", min_replicas=2,
                   quorum_timeout=timedelta(seconds=3))
t0 = time.time()
steps = 0
try:
    while time.time() - t0 < 25:
        with ft.step() as step:
            ft.model(torch.ones(1, 2)).sum().backward()
        steps += 1
        assert not step.committed
except RuntimeError as e:
    assert "min_replicas=2" in str(e) and "quorum_timeout" in str(e), e
    print(round(time.time() - t0, 1), steps)
else:
    raise SystemExit(f"no error after {steps} uncommitted steps")
lh.shutdown()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "RUST_LOG": "error"})
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    took, steps = out.stdout.split()[-2:]
    # no step ran its forward while the quorum was too small
    assert 2.5 < float(took) < 20 and steps == "0", out.stdout


# -- the heal transport: authenticated, tensors and plain data only ---------------------------
SECRET = b"0123456789abcdef-job"


def _transport(secret=SECRET):
    pytest.importorskip("torchft", reason="torchft is not installed: pip install "
                        "'bagua-algos[ft]'")
    from datetime import timedelta

    from bagua_algos.ft._transport import make_transport

    return make_transport(secret, timedelta(seconds=5))


def _state():
    torch.manual_seed(0)
    return {"user": {"default": {"model": {"w": torch.randn(3, 2)}, "step": 7,
                                 "optimizer": {"state": {0: {"exp_avg": torch.ones(2)}},
                                               "param_groups": [{"lr": 0.1, "params": [0]}]}}},
            "torchft": {"step": 7, "batches_committed": 14}}


def test_heal_transport_carries_the_state_to_a_replica_with_the_secret():
    from datetime import timedelta

    sender, receiver = _transport(), _transport()      # skips without torchft
    from torchft.checkpointing.transport import CheckpointTransport

    try:
        assert isinstance(sender, CheckpointTransport)
        state = _state()
        sender.send_checkpoint([1], 7, state, timedelta(seconds=5))
        got = receiver.recv_checkpoint(0, sender.metadata(), 7, timedelta(seconds=5))
        assert torch.equal(got["user"]["default"]["model"]["w"], state["user"]["default"]["model"]["w"])
        assert got["torchft"] == state["torchft"]
        sender.disallow_checkpoint()        # after the step's vote: nothing served any more
        with pytest.raises(Exception, match=r"404|timed out"):   # waits for a staged state
            receiver.recv_checkpoint(0, sender.metadata(), 7, timedelta(seconds=1))
    finally:
        sender.shutdown()
        receiver.shutdown()


def test_heal_transport_serves_nothing_without_the_secret():
    """A peer without the job's secret (a stranger, or a replica of another job) gets a 403
    and no byte of the state; a request replayed is refused too."""
    import urllib.error
    import urllib.request
    from datetime import timedelta

    from bagua_algos.ft._transport import SecretRefused

    sender, stranger = _transport(), _transport(b"another-secret-0123456789")
    try:
        sender.send_checkpoint([1], 3, _state(), timedelta(seconds=5))
        with pytest.raises(SecretRefused, match="not the job's"):
            stranger.recv_checkpoint(0, sender.metadata(), 3, timedelta(seconds=5))
        with pytest.raises(urllib.error.HTTPError, match=r"40[03]"):   # no MAC at all
            urllib.request.urlopen(f"{sender.metadata()}/checkpoint/3", timeout=5)
        # a request seen once (sniffed and replayed) is refused
        seen = []
        real = urllib.request.urlopen

        def record(url, **kw):
            seen.append(url)
            return real(url, **kw)
        urllib.request.urlopen = record
        try:
            _transport_recv = _transport()
            _transport_recv.recv_checkpoint(0, sender.metadata(), 3, timedelta(seconds=5))
            _transport_recv.shutdown()
        finally:
            urllib.request.urlopen = real
        with pytest.raises(urllib.error.HTTPError, match="403"):
            urllib.request.urlopen(seen[0], timeout=5)
    finally:
        sender.shutdown()
        stranger.shutdown()


def test_heal_transport_applies_nothing_a_stranger_sends(tmp_path):
    """A server without the secret answers with a pickle that would run code: the joiner
    refuses it (its MAC does not match) before reading it; and even with the secret, a
    payload that is not tensors and plain data is refused by weights_only=True."""
    import io
    import threading
    from datetime import timedelta
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from bagua_algos.ft._transport import _mac, check_plain

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    buf = io.BytesIO()
    torch.save({"user": Evil()}, buf)
    payload = buf.getvalue()
    macs = {"key": b"wrong-secret-0123456789"}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            from urllib.parse import parse_qs, urlsplit
            q = parse_qs(urlsplit(self.path).query)
            self.send_response(200)
            self.send_header("X-Bagua-Mac", _mac(macs["key"], "answer", 5, q["nonce"][0],
                                                 payload))
            self.end_headers()
            self.wfile.write(payload)

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    receiver = _transport()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        with pytest.raises(PermissionError, match="not authenticated"):
            receiver.recv_checkpoint(0, url, 5, timedelta(seconds=5))
        assert not marker.exists()
        macs["key"] = SECRET              # a peer with the secret sending code: still refused
        with pytest.raises(Exception, match=r"[Ww]eights only"):
            receiver.recv_checkpoint(0, url, 5, timedelta(seconds=5))
        assert not marker.exists()
    finally:
        server.shutdown()
        receiver.shutdown()
    with pytest.raises(TypeError, match="plain data only"):
        check_plain({"user": {"f": Evil()}})


def test_fault_tolerant_needs_the_job_secret(monkeypatch):
    from bagua_algos.ft import FaultTolerant

    monkeypatch.delenv("BAGUA_FT_SECRET", raising=False)
    with pytest.raises(ValueError, match="BAGUA_FT_SECRET"):
        FaultTolerant(*_args(), lighthouse="http://127.0.0.1:9", replica_id="r")
    with pytest.raises(ValueError, match="at least 16 bytes"):
        FaultTolerant(*_args(), lighthouse="http://127.0.0.1:9", replica_id="r", secret="short")


def _authenticate(secrets_by_rank):
    import bagua_comm as bc
    from bagua_algos.ft._source import authenticate, choose_source

    group = bc.get_default_group()
    try:
        authenticate(group, secrets_by_rank[group.rank])
    except RuntimeError as err:
        return str(err)
    return choose_source(group, 5, True)[:2]


def test_a_group_member_without_the_secret_is_named_before_anything_is_exchanged():
    """The Lighthouse admits any replica into the quorum: every member of a rebuilt group
    proves it holds the job's secret (HMAC over every rank's fresh nonce) before any state
    goes through the group; a member that cannot is named on every rank."""
    from bagua_comm.testing import run_ranks

    ok = run_ranks(_authenticate, 2, args=([SECRET, SECRET],))
    assert ok == [(0, True), (0, True)], ok
    bad = run_ranks(_authenticate, 2, args=([SECRET, b"a-stranger-guessing-0000"],))
    assert "peer rank(s) [1]" in bad[0] and "did not prove" in bad[0], bad
    assert "peer rank(s) [0]" in bad[1], bad
    from bagua_algos.ft import is_comm_error
    assert is_comm_error(RuntimeError(bad[0]))      # the step is voted down, not raised


def _agree_with_secret(secrets_by_rank):
    """agree(secret=) on rank 0 and 1 with every byte sent recorded, and agree without."""
    import bagua_comm as bc
    from bagua_algos.ft._source import agree

    group = bc.get_default_group()
    sent, real = [], bc.batch_isend_irecv

    def recording(ops, **kw):
        sent.extend(p.tensor.numpy().tobytes() for p in ops if p.op == "send")
        return real(ops, **kw)
    bc.batch_isend_irecv = recording
    step, old_rank = 123456789 + group.rank, 1 - group.rank
    config, state = b"c" * 16, bytes([group.rank]) * 16
    try:
        got = agree(group, step, True, old_rank, config, state, secret=secrets_by_rank[group.rank])
    except RuntimeError as err:
        return str(err)
    finally:
        bc.batch_isend_irecv = real
    plain = torch.tensor([step, 1, old_rank], dtype=torch.int64).numpy().tobytes()
    return got, agree(group, step, True, old_rank, config, state), any(plain in b for b in sent)


def _agree_shared(shared_by_rank, old_ranks, own_ranks):
    import bagua_comm as bc
    from bagua_algos.ft._source import agree

    r = bc.get_default_group().rank
    got = agree(bc.get_default_group(), 7, True, old_ranks[r], b"c" * 16, b"s" * 16,
                secret=SECRET, shared=shared_by_rank[r], own_rank=own_ranks[r])
    return got.same_shared, got.own_ranks


def test_the_source_state_is_not_broadcast_only_where_every_survivor_holds_it():
    """The rebuild skips the broadcast of the source's algorithm state only where every
    member was in the group before and their digests of what it would send are equal; the
    rank each member's state was saved at travels with the agreement (the source's is loaded
    in its place)."""
    from bagua_comm.testing import run_ranks

    same, other, unknown = b"v" * 16, b"w" * 16, b""
    assert run_ranks(_agree_shared, 2, args=([same, same], [0, 2], [0, 2])) == [
        (True, (0, 2))] * 2
    assert run_ranks(_agree_shared, 2, args=([same, other], [0, 1], [0, 1]))[0][0] is False
    assert run_ranks(_agree_shared, 2, args=([same, same], [0, -1], [0, 1]))[0][0] is False
    assert run_ranks(_agree_shared, 2, args=([unknown, unknown], [0, 1], [0, 1]))[0][0] is False


def test_the_agreement_goes_with_the_secrets_proof_and_is_unreadable_without_it():
    """agree(secret=) authenticates the group and agrees in the same two rounds: the same
    Agreement as without the secret, the values never on the wire in the clear (a member
    without the secret reads nothing), and a member without the secret named on every rank."""
    from bagua_comm.testing import run_ranks

    out = run_ranks(_agree_with_secret, 2, args=([SECRET, SECRET],))
    for with_secret, without, in_clear in out:
        assert with_secret == without, (with_secret, without)
        # rank 1 is at the highest step; states differ, configurations match
        assert tuple(with_secret) == (1, False, [1, 0], True, False, False, (-1, -1))
        assert not in_clear
    bad = run_ranks(_agree_with_secret, 2, args=([SECRET, b"a-stranger-guessing-0000"],))
    assert "peer rank(s) [1]" in bad[0] and "did not prove" in bad[0], bad
    assert "peer rank(s) [0]" in bad[1], bad


def _replicas(n, batch):
    """``replica(world, rank)``: CommittedBatches over n samples (complexity i % 7)."""
    pytest.importorskip("bagua_data")
    from bagua_algos.ft import CommittedBatches
    from bagua_data import LoadBalancingDistributedSampler

    data = torch.utils.data.TensorDataset(torch.arange(n))
    complexity = [float(i % 7) for i in range(n)]

    def replica(world, rank):
        s = LoadBalancingDistributedSampler(data, complexity, num_replicas=world, rank=rank,
                                            seed=3)
        return CommittedBatches(data, s, batch)
    return replica


@pytest.mark.parametrize("n, batch", [(10, 2), (97, 4), (96, 5)])
def test_committed_batches_deal_every_sample_once_across_a_membership_change(n, batch):
    """3 replicas take an epoch's batches in lockstep, one is lost after 2 steps, the other 2
    finish the epoch: every sample exactly once. The sampler pads a table to whole rows by
    repeating samples (and pads again when it re-deals over 2): a repeat is not dealt."""
    replica = _replicas(n, batch)

    seen = []
    group = [replica(3, r) for r in range(3)]
    for _ in range(2):
        for b in group:
            seen += b.next()[0].tolist()
        for b in group:
            b.commit()
    state = group[0].state_dict()
    group = group[:2]
    for r, b in enumerate(group):
        b.rebind(2, r, state)
    while group[0].sampler.epoch == 0:
        rows = group[0].rows
        if rows >= group[0]._table().shape[0]:
            break
        for b in group:
            seen += b.next()[0].tolist()
        for b in group:
            b.commit()
    counts = collections.Counter(seen)
    assert sorted(counts) == list(range(n)), sorted(set(range(n)) - set(counts))
    assert set(counts.values()) == {1}, {k: v for k, v in counts.items() if v > 1}


def _source_of(old_ranks):
    import bagua_comm as bc
    from bagua_algos.ft._source import choose_source

    group = bc.get_default_group()
    return choose_source(group, 5, True, old_ranks[group.rank])


def test_the_source_is_a_member_of_the_old_group_before_a_joiner():
    """Among replicas equally up to date, one that was in the group before is the source (its
    parameters hold its own local steps; a joiner's are another's), lowest rank first."""
    from bagua_comm.testing import run_ranks

    assert run_ranks(_source_of, 2, args=([-1, 0],)) == [(1, True, [-1, 0])] * 2
    assert run_ranks(_source_of, 2, args=([1, 0],)) == [(0, True, [1, 0])] * 2


@pytest.mark.parametrize("n, batch, sync_every", [(96, 4, 4), (97, 3, 3), (50, 2, 5)])
def test_local_steps_lost_with_their_replicas_are_dealt_again(n, batch, sync_every):
    """LocalSGD over 3 replicas simulated in lockstep, a sync every ``sync_every`` committed
    steps: one replica is lost 2 steps after a sync, and the rebuild keeps replica 0's
    parameters.  The samples that replicas 1 and 2 trained on since the sync left with their
    parameters: after ``give_back`` every sample of the epoch is in exactly one step whose
    training survived (replica 1's steps since the sync do not count, nor the lost one's)."""
    replica = _replicas(n, batch)

    kept, since_sync = [], [[], [], []]
    group = [replica(3, r) for r in range(3)]
    for step in range(1, sync_every + 3):
        for r, b in enumerate(group):
            since_sync[r] += b.next()[0].tolist()
        for b in group:
            b.commit()
            if step % sync_every == 0:
                b.mark_synced()
        if step % sync_every == 0:
            kept += [i for s in since_sync for i in s]
            since_sync = [[], [], []]
    kept += since_sync[0]              # replica 0's parameters go on
    group = group[:2]                  # replica 2 is lost
    for b in group:
        b.give_back(0)
    state = group[0].state_dict()
    assert state == group[1].state_dict()
    for r, b in enumerate(group):
        b.rebind(2, r, state)
    while group[0].rows < group[0]._table().shape[0]:
        for b in group:
            kept += b.next()[0].tolist()
        for b in group:
            b.commit()
    counts = collections.Counter(kept)
    assert sorted(counts) == list(range(n)), sorted(set(range(n)) - set(counts))
    assert set(counts.values()) == {1}, {k: v for k, v in counts.items() if v > 1}


@pytest.mark.parametrize("n, batch, prepared", [(97, 4, 2), (96, 5, 2), (97, 4, 3), (50, 3, 1)])
def test_a_re_deal_computed_ahead_is_the_re_deal(n, batch, prepared):
    """After a failed step the survivors compute the re-deal over one replica less on a
    thread while the Lighthouse waits for the lost one (``prepare``); ``rebind`` takes it
    where the size and the position match: every batch is then the one a re-deal made at
    the rebind gives, on every rank, and a guess of the wrong size changes nothing either.
    The first-appearance mask (one scatter, no sort) is the one ``torch.unique`` gives."""
    replica = _replicas(n, batch)

    def epoch(group):
        out = []
        while group[0].rows < group[0]._table().shape[0]:
            out.append([b.next()[0].tolist() for b in group])
            for b in group:
                b.commit()
        return out

    plain, ahead = [replica(3, r) for r in range(3)], [replica(3, r) for r in range(3)]
    for group in (plain, ahead):
        for _ in range(3):
            for b in group:
                b.next()
                b.commit()
        group[1].next()                 # a step voted down: its samples go back
        group[1].rollback()
    boxes = []
    for b in ahead[:2]:
        b.prepare(prepared)
        boxes.append(b._ahead[2])
    state = plain[0].state_dict()
    assert state == ahead[0].state_dict()
    for r in range(2):
        plain[r].rebind(2, r, state)
        ahead[r].rebind(2, r, state)
        assert ahead[r]._ahead is None
    for r, guess in enumerate(boxes):    # taken where the guess was right, else not
        assert (ahead[r].sampler is guess.result()[0]) == (prepared == 2), r
        assert (ahead[r].sampler.num_replicas, ahead[r].sampler.rank) == (2, r)
    assert epoch(ahead[:2]) == epoch(plain[:2])

    # the mask against torch.unique's first appearances
    table = ahead[0]._table()
    flat = table.reshape(-1)
    _, inverse = torch.unique(flat, return_inverse=True)
    first = torch.full((int(inverse.max()) + 1,), flat.numel(), dtype=torch.long)
    first.scatter_reduce_(0, inverse, torch.arange(flat.numel()), "amin")
    reference = torch.zeros(flat.numel(), dtype=torch.bool)
    reference[first] = True
    assert torch.equal(ahead[0]._fresh(table).reshape(-1), reference)


def test_a_re_deal_computed_ahead_of_another_position_is_not_taken():
    """The position moved after ``prepare`` (a step committed after all): ``rebind`` deals
    anew from the position it is given, so no sample is lost or used twice."""
    pytest.importorskip("bagua_data")
    from bagua_algos.ft import CommittedBatches
    from bagua_data import LoadBalancingDistributedSampler

    data = torch.utils.data.TensorDataset(torch.arange(97))
    s = LoadBalancingDistributedSampler(data, [float(i % 7) for i in range(97)],
                                        num_replicas=3, rank=0, seed=3)
    b = CommittedBatches(data, s, 4)
    b.next()
    b.commit()
    b.prepare(2)
    guess = b._ahead[2]
    b.next()
    b.commit()
    state = b.state_dict()
    b.rebind(2, 0, state)
    assert b._ahead is None
    assert b.sampler is not guess.result()[0]
    fresh = CommittedBatches(data, LoadBalancingDistributedSampler(
        data, [float(i % 7) for i in range(97)], num_replicas=2, rank=0, seed=3), 4)
    fresh.load_state_dict(state)
    assert b.next()[0].tolist() == fresh.next()[0].tolist()
