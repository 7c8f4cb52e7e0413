"""`kvfabric.format.clock`: the one wall clock and the one monotonic clock, in milliseconds."""

from __future__ import annotations

import time

from kvfabric.format.clock import monotonic_ms, now_ms


def test_now_ms_is_wall_clock_milliseconds() -> None:
    before = time.time_ns() // 1_000_000
    got = now_ms()
    after = time.time_ns() // 1_000_000
    assert isinstance(got, int) and before <= got <= after


def test_monotonic_ms_is_the_monotonic_clock_in_milliseconds_and_never_goes_back() -> None:
    before = time.monotonic_ns() // 1_000_000
    readings = [monotonic_ms() for _ in range(1000)]
    after = time.monotonic_ns() // 1_000_000
    assert all(isinstance(r, int) for r in readings)
    assert before <= readings[0] and readings == sorted(readings) and readings[-1] <= after
