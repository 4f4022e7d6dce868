"""Two processes drive the plugin's table as NCCL does; every byte must arrive intact."""

import pytest
from _net_scenarios import (
    connect_in_process,
    handshake_connector,
    handshake_listener,
    receive_many_connections,
    receive_sizes,
    receive_window,
    send_many_connections,
    send_sizes,
    send_window,
)

from bagua_net.testing import Plugin, PluginError, run_pair

MiB = 1 << 20
SIZES = [0, 1, 7, 4095, 4096, 65_537, MiB - 1, MiB, MiB + 1, 3 * MiB + 7, 64 * MiB]


@pytest.mark.parametrize("version", [6, 7, 8, 9, 10, 11, 12])
def test_handshake_and_first_message_through_every_table(version):
    listener, connector = run_pair(handshake_listener, handshake_connector, (version,))
    assert connector["name"] == "BaguaNet"
    assert listener["size"] == 5 and listener["data"] == b"bagua"
    props = listener["props"]
    assert props["name"] == "lo" and props["ptrSupport"] == 1 and props["maxRecvs"] == 1
    assert props["maxComms"] > 0 and props["speed"] > 0
    if version >= 9:
        assert props["vProps"] == [0] and props["maxP2pBytes"] >= 1 << 31
    if version == 12:
        assert props["railId"] == -1 and props["planeId"] == -1
    # the handshake is logged through NCCL's logger, with the default of 8 streams
    assert any("accepted a connection" in line and "8 streams" in line
               for line in listener["log"])


@pytest.mark.parametrize(("nstreams", "min_chunk"), [("1", "1M"), ("4", "1M"), ("3", "4096")])
def test_messages_of_0_bytes_to_64_mib_arrive_byte_exact(nstreams, min_chunk):
    env = {"BAGUA_NET_NSTREAMS": nstreams, "BAGUA_NET_MIN_CHUNKSIZE": min_chunk}
    ok, count = run_pair(receive_sizes, send_sizes, (SIZES, 11), env=env, timeout=120)
    assert count == len(SIZES)
    assert ok == [True] * len(SIZES)


def test_many_outstanding_requests_complete_out_of_order():
    (results, refused), max_outstanding = run_pair(
        receive_window, send_window, (100, 5), env={"BAGUA_NET_MIN_CHUNKSIZE": "64K"})
    assert results == [True] * 100
    # the plugin holds NCCL's 32 requests per comm and refuses more (request NULL) meanwhile
    assert max_outstanding == 32
    assert refused > 0


def test_several_connections_at_once():
    got, sent = run_pair(receive_many_connections, send_many_connections, (4, 3 * MiB + 1, 9),
                         env={"BAGUA_NET_NSTREAMS": "2"})
    assert got == sent and len(set(sent)) == 4


def test_a_message_larger_than_the_posted_receive_is_an_error():
    p = Plugin()
    p.init()
    listen, send, recv = connect_in_process(p)
    try:
        small, data = bytearray(50), bytearray(range(100))
        req = p.irecv(recv, small, len(small))
        p.send(send, data)
        with pytest.raises(PluginError) as err:
            p.wait(req, timeout=30)
        assert err.value.code == 5  # ncclInvalidUsage
        assert any("has 100 bytes but the posted receive holds 50" in line for line in p.log)
        assert small == bytearray(50)  # nothing was written past, or into, the small buffer
    finally:
        p.close_send(send)
        p.close_recv(recv)
        p.close_listen(listen)
