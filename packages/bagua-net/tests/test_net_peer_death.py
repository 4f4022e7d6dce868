"""A peer that disappears yields an error from test()/connect(), never a hang or an abort."""

from _net_scenarios import (
    connect_to_dead_listener,
    listener_dies_before_connect,
    receiver_dies_midway,
    receiver_outlives_sender,
    sender_dies_midway,
    sender_outlives_receiver,
)

from bagua_net.testing import run_pair

REMOTE_ERROR = 6
SYSTEM_ERROR = 2


def _warned(log, *words):
    return any(line.startswith("WARN") and all(w in line for w in words) for line in log)


def test_receiver_gets_an_error_when_the_sender_dies():
    res, _ = run_pair(receiver_outlives_sender, sender_dies_midway, (256 << 20,), timeout=90)
    assert res["code"] == REMOTE_ERROR
    assert _warned(res["log"], "closed by peer")


def test_sender_gets_an_error_when_the_receiver_dies():
    _, res = run_pair(receiver_dies_midway, sender_outlives_receiver, (8 << 20,), timeout=90)
    assert res["code"] == REMOTE_ERROR
    assert _warned(res["log"], "send to")


def test_connect_to_a_listener_that_is_gone_fails():
    _, res = run_pair(listener_dies_before_connect, connect_to_dead_listener, timeout=90)
    assert res["code"] == SYSTEM_ERROR
    assert _warned(res["log"], "connect to 127.0.0.1")
