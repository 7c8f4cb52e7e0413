"""`ConnectionGate`: who may hold a data connection (pure core, no sockets)."""

from __future__ import annotations

import pytest

from kvfabric.dataplane.admission import ConnectionGate, ConnectionLimits
from kvfabric.format.errors import Busy, Unavailable

LIMITS = ConnectionLimits(
    connections_max=3,
    connections_per_source_max=2,
    unauthenticated_max=4,
    unauthenticated_per_source_max=2,
)


def test_a_source_past_its_unauthenticated_share_evicts_its_own_oldest() -> None:
    gate = ConnectionGate(LIMITS)
    assert gate.open(1, "a") == [] and gate.open(2, "a") == []
    assert gate.open(3, "b") == []
    assert gate.open(4, "a") == [1]  # a's oldest, not b's
    assert gate.open(5, "a") == [2]
    assert gate.unauthenticated == 3
    assert isinstance(gate.authenticate(1), Unavailable)  # evicted: it can no longer get in
    assert gate.authenticate(3) is None  # b's connection was never touched


def test_the_segment_wide_unauthenticated_bound_evicts_the_oldest_of_all() -> None:
    gate = ConnectionGate(LIMITS)
    for conn, source in enumerate("abcd", start=1):
        assert gate.open(conn, source) == []
    assert gate.open(5, "e") == [1]
    assert gate.counters["unauthenticated_evicted_total"] == 1


def test_authenticated_connections_are_bounded_in_total_and_per_source() -> None:
    gate = ConnectionGate(LIMITS)
    for conn in (1, 2):
        gate.open(conn, "a")
        assert gate.authenticate(conn) is None
    gate.open(3, "a")
    refused = gate.authenticate(3)
    assert isinstance(refused, Busy) and refused.details["limit"] == 2  # a's share
    gate.close(3)
    gate.open(4, "b")
    assert gate.authenticate(4) is None
    gate.open(5, "c")
    refused = gate.authenticate(5)
    assert isinstance(refused, Busy) and refused.details["limit"] == 3  # everyone's
    gate.close(1)  # a connection closes: room again
    assert gate.authenticate(5) is None
    assert (gate.authenticated, gate.unauthenticated) == (3, 0)


def test_closing_everything_leaves_no_entry_per_source() -> None:
    gate = ConnectionGate(LIMITS)
    for conn in range(1, 200):
        gate.open(conn, f"10.0.{conn // 250}.{conn % 250}")
        if conn % 2:
            gate.authenticate(conn)
    for conn in range(1, 200):
        gate.close(conn)
    gate.close(10_000)  # unknown: ignored
    assert (gate.authenticated, gate.unauthenticated) == (0, 0)
    assert not gate._unauthenticated_by_source and not gate._authenticated_by_source


def test_limits_are_named_with_units_and_positive() -> None:
    limits = ConnectionLimits(frame_timeout_ms=1_000, transfer_rate_min_bytes_per_s=1 << 20)
    assert limits.transfer_ms(0) == 1_000
    assert limits.transfer_ms(4 << 20) == 5_000  # 4 MiB at 1 MiB/s on top of the frame's second
    with pytest.raises(ValueError, match="auth_deadline_ms"):
        ConnectionLimits(auth_deadline_ms=0)
