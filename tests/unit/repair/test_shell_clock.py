"""The repair core runs on the monotonic clock (review, 2026-12-06): on the wall clock, an NTP
step back of X held the core's time still for X (the driver never lets it go back), so the
bandwidth bucket never refilled and no copy started for X."""

from __future__ import annotations

import time

import pytest

from kvfabric.repair import shell


def test_the_cores_clock_does_not_follow_a_wall_clock_step_back(monkeypatch: pytest.MonkeyPatch) -> None:
    before = shell.now_ms()
    wall = time.time()
    monkeypatch.setattr(time, "time", lambda: wall - 600)  # NTP steps the wall clock back 10 min
    monkeypatch.setattr(time, "time_ns", lambda: int((wall - 600) * 1e9))
    after = shell.now_ms()
    assert 0 <= after - before < 5_000
