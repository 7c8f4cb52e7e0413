"""A directory that cannot hear (its NATS connection down) does not declare segments down for
their silence (review, 2026-12-05): on a NATS cluster a leader keeps acting for 12.5 s, longer
than the 5 s heartbeat timeout, and a disconnect of that long declared every segment down, each
then restarting empty. While deaf every up segment's silence is shifted by the time missed;
once it hears again, a segment that stays silent is declared down a timeout later."""

from __future__ import annotations

from kvfabric.proto import directory as m
from tests.unit.core.dirkit import new_core, register


def test_silence_while_deaf_is_excused_and_silence_after_is_not() -> None:
    core = new_core(heartbeat_timeout_ms=5_000)
    register(core, "s1")
    core.handle(m.Heartbeat(segment_id="s1", incarnation=1, used_bytes=0), 0)
    core.tick(0)
    for now in range(100, 10_001, 100):  # 10 s without NATS: ticking, hearing nothing
        core.tick(now, deaf=True)
    assert core.segments["s1"].up
    assert core.counters["segment_silence_excused_total"] == 100
    for now in range(10_100, 14_901, 100):  # heard again, but s1 stays silent: < 5 s
        core.tick(now)
    assert core.segments["s1"].up
    core.tick(15_200)  # 5.2 s of real silence: down
    assert not core.segments["s1"].up
    core.check_invariants()


def test_without_the_excuse_the_same_silence_is_a_segment_down() -> None:
    core = new_core(heartbeat_timeout_ms=5_000)
    register(core, "s1")
    core.handle(m.Heartbeat(segment_id="s1", incarnation=1, used_bytes=0), 0)
    for now in range(0, 10_001, 100):
        core.tick(now)
    assert not core.segments["s1"].up
