"""The lossy link (tools/lossylink.py) with real packets between two network namespaces (root):
measured loss vs configured over more than 10,000 datagrams, delay seen by pings, TCP intact
over a bad link, and nothing left behind (devices, namespaces, the forwarder), even when the
forwarder is SIGKILLed."""

from __future__ import annotations

import os
import signal
import socket
import statistics
import threading
from collections.abc import Iterator

import pytest

from tests.unit.tools.toolkit import load_tool

pytestmark = [pytest.mark.timeout(120)]

ll = load_tool("lossylink")
LinkSchedule = ll.LinkSchedule
IP_A, IP_B = "10.233.1.1", "10.233.1.2"


@pytest.fixture
def pair() -> Iterator[tuple[str, str, str]]:
    """Two fresh namespaces named after a new tag (deleted afterwards); yields (a, b, tag)."""
    tag = ll.new_tag()
    a, b = f"kll-{tag}-a", f"kll-{tag}-b"
    try:
        ll.netns_add(a)
        ll.netns_add(b)
        yield a, b, tag
    finally:
        ll.netns_del(a)
        ll.netns_del(b)
    assert ll.leftovers(tag) == []


@pytest.mark.parametrize(
    "schedule",
    [{"loss_p": 0.05}, {"bursty": {"loss_p": 0.05, "burst_packets": 4}}],
    ids=["independent-5pct", "gilbert-elliott-5pct-bursts-of-4"],
)
def test_measured_loss_over_12000_packets_is_within_one_point_of_the_configured_rate(
    pair: tuple[str, str, str], schedule: dict[str, object]
) -> None:
    a, b, tag = pair
    configured = ll.LinkSchedule.from_dict(schedule)
    expected = load_tool("lossylink_core").expected_loss_p(configured)
    with ll.LossyLink(ll.pair_ports(a, b, IP_A, IP_B), tag=tag, seed="loss", txqueuelen=10_000) as link:
        link.set_schedule(LinkSchedule(), configured)  # toward b only
        blast = ll.udp_blast(a, b, IP_B, 12_000, pps=6_000)
        stats = link.stats()
    assert blast.sent == 12_000 and blast.duplicates == 0
    assert abs(blast.loss_p - expected) <= 0.01, (blast, expected)
    # everything missing was dropped by the schedule, nothing by the kernel or the forwarder
    assert stats["down"]["offered"] >= 12_000 and stats["down"]["lost"] == blast.sent - blast.received


def test_a_delay_shows_in_round_trips_and_clears(pair: tuple[str, str, str]) -> None:
    a, b, tag = pair
    with ll.LossyLink(ll.pair_ports(a, b, IP_A, IP_B), tag=tag) as link:
        link.set_schedule(LinkSchedule(delay_ms=30, jitter_ms=5))  # each way
        slow = ll.udp_rtt_ms(a, b, IP_B, 30)
        link.set_schedule(LinkSchedule())
        fast = ll.udp_rtt_ms(a, b, IP_B, 30)
    assert len(slow) == 30 and min(slow) >= 50.0 and statistics.median(slow) < 90.0
    assert statistics.median(fast) < 10.0


def test_tcp_gets_every_byte_across_loss_reordering_duplication_and_a_rate_cap(
    pair: tuple[str, str, str],
) -> None:
    a, b, tag = pair
    payload = os.urandom(2 << 20)  # ~1,450 segments: none duplicated or reordered at 2% is p ~ 1e-12
    schedule = LinkSchedule(
        delay_ms=5, jitter_ms=2, loss_p=0.03, reorder_p=0.02, duplicate_p=0.02, rate_bytes_per_s=20e6
    )
    with ll.LossyLink(ll.pair_ports(a, b, IP_A, IP_B), tag=tag, schedule=schedule) as link:
        with ll.in_netns(b):
            server = socket.create_server((IP_B, 47_100))
        got = bytearray()

        def receive() -> None:
            conn, _ = server.accept()
            with conn:
                while chunk := conn.recv(1 << 16):
                    got.extend(chunk)

        t = threading.Thread(target=receive)
        t.start()
        with ll.in_netns(a):
            client = socket.create_connection((IP_B, 47_100), timeout=30)
        client.sendall(payload)
        client.close()
        t.join(60)
        server.close()
        stats = link.stats()
    assert bytes(got) == payload
    assert stats["down"]["lost"] > 0 and stats["down"]["duplicated"] > 0 and stats["down"]["reordered"] > 0


def test_nothing_is_left_behind_after_a_stop_or_a_sigkill(pair: tuple[str, str, str]) -> None:
    a, b, tag = pair
    link = ll.LossyLink(ll.pair_ports(a, b, IP_A, IP_B), tag=tag)
    link.start()
    assert len([x for x in ll.leftovers(tag) if x.startswith("device")]) == 2
    pid = link.proc.pid
    link.close()
    assert not [x for x in ll.leftovers(tag) if x.startswith("device")]
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    killed = ll.LossyLink(ll.pair_ports(a, b, IP_A, IP_B), tag=tag)
    killed.start()
    os.kill(killed.proc.pid, signal.SIGKILL)
    killed.proc.wait(5)
    assert not [x for x in ll.leftovers(tag) if x.startswith("device")]  # devices die with it
    killed.close()


def test_a_bad_spec_fails_to_start_and_leaves_nothing(pair: tuple[str, str, str]) -> None:
    a, b, tag = pair
    ports = ll.pair_ports(a, b, IP_A, IP_B)
    ports[1].routes.append(("not-a-prefix", None))
    with pytest.raises(RuntimeError, match="not-a-prefix"):
        ll.LossyLink(ports, tag=tag).start()
    assert not [x for x in ll.leftovers(tag) if x.startswith("device")]
