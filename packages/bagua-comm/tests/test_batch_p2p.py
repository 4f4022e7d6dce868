"""batch_isend_irecv: both directions of an exchange as one operation, on gloo and through the
NCCL backend's code path over the fake NCCL (bagua_comm.testing_nccl), which blocks an
ungrouped recv until the peer's send runs, as NCCL does on a GPU."""

import torch

import bagua_comm as bc
from bagua_comm.testing import run_ranks


def _mine(rank, n=6, dtype=torch.float32):
    return (torch.arange(n, dtype=torch.float64) * 10 + rank).to(dtype)


def _exchange(kind_send="send", kind_recv="recv"):
    """Each rank sends two tensors to the other and receives two, receives listed first."""
    r = bc.get_rank()
    peer = 1 - r
    a, b = _mine(r), _mine(r, 3, torch.int64) + 100
    got_a, got_b = torch.empty(6), torch.empty(3, dtype=torch.int64)
    ops = [bc.P2POp(kind_recv, got_a, peer), bc.P2POp(kind_recv, got_b, peer),
           bc.P2POp(kind_send, a, peer), bc.P2POp(kind_send, b, peer)]
    assert bc.batch_isend_irecv(ops) is None
    ok = torch.equal(got_a, _mine(peer)) and torch.equal(got_b, _mine(peer, 3, torch.int64) + 100)
    got_a.zero_()
    got_b.zero_()
    work = bc.batch_isend_irecv(ops, async_op=True)
    work.wait()
    return ok and torch.equal(got_a, _mine(peer)) and torch.equal(got_b,
                                                                   _mine(peer, 3, torch.int64) + 100)


def _gloo_job():
    ok1 = _exchange()
    ok2 = _exchange(bc.send, bc.recv)     # the functions name the direction too
    errors = []
    for bad in ([], [bc.P2POp("put", torch.ones(1), 1 - bc.get_rank())],
                [bc.P2POp("send", torch.ones(1), bc.get_rank())],
                [bc.P2POp("send", torch.ones(4)[::2], 1 - bc.get_rank())],
                [bc.P2POp("send", torch.ones(1), 5)], (torch.ones(1),)):
        try:
            bc.batch_isend_irecv(bad)
        except ValueError as err:
            errors.append(str(err))
    return ok1 and ok2, errors


def test_batch_isend_irecv_on_gloo_exchanges_and_checks_its_arguments():
    for ok, errors in run_ranks(_gloo_job, 2):
        assert ok
        assert len(errors) == 6, errors
        assert "non-empty list" in errors[0] and "'send' or 'recv'" in errors[1]
        assert "another rank" in errors[2] and "contiguous" in errors[3]
        assert "[0, 2)" in errors[4] and "P2POp" in errors[5]


def _fake_nccl_job():
    from bagua_comm.testing_nccl import FakeNcclDeadlock, fake_communicators, use_fake_nccl

    use_fake_nccl(timeout=3.0)
    ok = _exchange()
    grouped_only = fake_communicators()[0].ungrouped_p2p == 0
    # the pattern the algorithms used before: recv, then send, as two launches
    r = bc.get_rank()
    theirs = torch.empty(6)
    try:
        works = [bc.recv(theirs, 1 - r, async_op=True), bc.send(_mine(r), 1 - r, async_op=True)]
        for w in works:
            w.wait()
        deadlocked = False
    except FakeNcclDeadlock:
        deadlocked = True
    return ok, grouped_only, deadlocked


def test_fake_nccl_groups_the_exchange_and_deadlocks_an_ungrouped_recv_first():
    for ok, grouped_only, deadlocked in run_ranks(_fake_nccl_job, 2, timeout=120):
        assert ok and grouped_only
        assert deadlocked, "two ranks that both recv first must deadlock on (fake) NCCL"
