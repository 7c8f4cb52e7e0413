"""`free_port`: below the kernel's ephemeral range, bindable, never twice in one process."""

from __future__ import annotations

import socket

import pytest

from kvfabric.testing import ports

# (where the kernel's ephemeral range leaves no room below it, `free_port` falls back to port 0)
pytestmark = pytest.mark.skipif(not ports._below_ephemeral(), reason="no ports below the ephemeral range")


def test_ports_are_distinct_bindable_and_outside_the_range_port_zero_binds_use() -> None:
    low, high = (int(x) for x in ports._RANGE_FILE.read_text().split())
    picked = ports.free_ports(500)
    assert len(set(picked)) == 500
    assert all(ports._LOWEST <= p < low for p in picked)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", picked[-1]))  # free a moment ago, still free
    kernel = ports._kernel_pick("127.0.0.1")
    assert low <= kernel <= high  # what a service binding port 0 gets: never one of ours


def test_a_bound_or_already_handed_out_port_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        given = ports.free_port()
        spare = ports._kernel_pick("127.0.0.1")  # free now, and neither of the others
        choices = iter([taken, given, spare])
        monkeypatch.setattr(ports._rng, "choice", lambda _: next(choices))
        assert ports.free_port() == spare
