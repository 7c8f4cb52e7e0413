"""The drill runner's lossy links (tools/chaos_links.py) without a cluster: a "segment"
namespace joined like localcluster's (veth pair), moved onto a lossy link, and a client
namespace reaching the host and that segment through its own link. Traffic flows over the
links, the faults change their schedules, and close() leaves nothing behind (root)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from tests.unit.tools.toolkit import load_tool

pytestmark = [pytest.mark.timeout(60)]

lc = load_tool("localcluster")
ll = load_tool("lossylink")
chaos_links = load_tool("chaos_links")


@pytest.fixture
def segment_ns() -> Iterator[dict[str, str]]:
    """A namespace with a veth pair to the host, as localcluster makes for a segment (its own
    addresses, so a drill running meanwhile is not disturbed)."""
    tag = ll.new_tag()
    link = {"ns": f"kvt-{tag}", "host_if": f"kvt{tag}h", "ns_if": f"kvt{tag}n"}
    link.update(host_ip="10.236.7.1", ns_ip="10.236.7.2")
    lc.netns_up(link)
    try:
        yield link
    finally:
        lc.netns_down(link)
    assert ll.leftovers(tag) == []


def echo_server(ns: str | None, ip: str, port: int) -> socket.socket:
    with ll.in_netns(ns):
        server = socket.create_server((ip, port))

    def echo(conn: socket.socket) -> None:
        with conn:
            conn.settimeout(30)
            try:
                while data := conn.recv(65536):
                    conn.sendall(data)
            except OSError:
                return

    def serve() -> None:
        # A thread per connection: a round trip over the lossy link whose FIN was lost, its client
        # namespace then deleted by close(), leaves that connection open for good; answered in
        # turn, it kept the next round trip waiting (the test's one flake, recv timed out).
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=echo, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return server


def round_trip(ip: str, port: int, payload: bytes) -> bytes:
    with socket.create_connection((ip, port), timeout=10) as c:
        c.sendall(payload)
        got = b""
        while len(got) < len(payload):
            got += c.recv(65536)
    return got


def test_segment_and_client_links_carry_traffic_change_schedule_and_leave_nothing(
    segment_ns: dict[str, str],
) -> None:
    links = chaos_links.Links()
    state: dict[str, Any] = {"netns": {"segment-1": segment_ns}}
    topo = {"segments": 1, "lossy_segments": ["segment-1"], "lossy_client": True}
    server = echo_server(segment_ns["ns"], segment_ns["ns_ip"], 47_200)
    host_server = None
    payload = bytes(range(256)) * 400
    try:
        links.lay(state, topo, seed="t")
        # host -> segment: now through the segment's link (its forwarder counts the packets)
        assert round_trip(segment_ns["ns_ip"], 47_200, payload) == payload
        assert links.stats()["segment-1"]["down"]["offered"] > 0
        host_ip = links.client_nats_host
        host_server = echo_server(None, host_ip, 47_201)
        with links.client_side():  # the client's namespace reaches the host and the segment
            assert round_trip(host_ip, 47_201, payload) == payload
            assert round_trip(segment_ns["ns_ip"], 47_200, payload) == payload
            with links.host_side():
                what = links.fire({"action": "link", "target": "client", "delay_ms": 20, "loss_p": 0.05})
            assert round_trip(segment_ns["ns_ip"], 47_200, payload) == payload
        assert what == "link client: delay 20±0 ms, loss 5%"
        assert links.stats()["client"]["up"]["offered"] > 0
        assert links.fire({"action": "link_clear", "target": "client"}) == "link client cleared"
        with pytest.raises(ValueError, match="no lossy link"):
            links.fire({"action": "link", "target": "segment-2", "loss_p": 0.1})
    finally:
        if host_server is not None:
            host_server.close()
        left = links.close()
    try:
        assert left == []
        assert round_trip(segment_ns["ns_ip"], 47_200, payload) == payload  # back on the veth
    finally:
        server.close()


def test_a_drill_naming_a_segment_outside_a_namespace_is_refused_and_leaves_nothing() -> None:
    links = chaos_links.Links()
    with pytest.raises(ValueError, match="own namespace"):
        links.lay({"netns": {}}, {"lossy_segments": ["segment-1"]}, seed="t")
    assert links.close() == []


def test_one_direction_schedules() -> None:
    up, down = chaos_links.schedule_of(
        {"action": "link", "target": "client", "delay_ms": 10, "down": {"loss_p": 0.2}}
    )
    assert up.delay_ms == down.delay_ms == 10 and up.loss_p == 0 and down.loss_p == 0.2
