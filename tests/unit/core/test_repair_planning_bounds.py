"""Planning a repair tick: the roomiest destination at its copies' cap does not leave the others
idle, and objects with no destination cost a tick a bounded number of looks, round robin, so one
that can go behind thousands that cannot is still reached (review, stop 68: a new empty segment
at its cap held a tick to 4 copies in flight of 32, and 50,000 objects with no room took 0.5 s a
tick)."""

from __future__ import annotations

from kvfabric.core import repair
from kvfabric.core.repair import PLAN_NO_DESTINATION_MAX, RepairConfig, RepairCore, StartCopy

MB = 1 << 20


def up(core: RepairCore, segment_id: str, zone: str, free_bytes: int) -> None:
    core.segment_up(
        segment_id, incarnation=1, zone=zone, rack=segment_id, host=segment_id, free_bytes=free_bytes
    )


def starts(core: RepairCore, now: int) -> list[StartCopy]:
    return [e for e in core.tick(now) if isinstance(e, StartCopy)]


def test_a_destination_at_its_cap_leaves_the_copies_to_others_as_wide() -> None:
    core = RepairCore(RepairConfig(copies_per_destination_max=4, copies_in_flight_max=32))
    up(core, "a", "z1", 100 * MB)
    up(core, "b", "z2", 100 * MB)
    up(core, "d", "z3", 10_000 * MB)  # new and empty: the most room
    for i in range(20):
        core.object_known(i, size_bytes=MB, replica_target=2, segments=["a"])
    started = starts(core, 0)
    assert sorted(s.destination for s in started) == ["b"] * 4 + ["d"] * 4  # was d × 4 only
    core.check_invariants()


def test_the_cap_still_never_narrows_a_copys_failure_domain() -> None:
    core = RepairCore(RepairConfig(copies_per_destination_max=2, copies_in_flight_max=32))
    up(core, "a", "z1", 100 * MB)
    up(core, "b", "z2", 100 * MB)
    up(core, "a2", "z1", 100 * MB)  # in a's zone: narrower
    for i in range(5):
        core.object_known(i, size_bytes=MB, replica_target=2, segments=["a"])
    assert [s.destination for s in starts(core, 0)] == ["b", "b"]
    core.check_invariants()


def test_objects_without_a_destination_cost_a_tick_a_bounded_number_of_looks() -> None:
    core = RepairCore(RepairConfig(copies_in_flight_max=32, burst_bytes=1 << 40))
    up(core, "a", "z1", 100 * MB)
    up(core, "b", "z2", 10 * MB)
    n = 2_000
    for i in range(n):  # hot and larger than any room: ahead of the small one, never placed
        core.object_known(i, size_bytes=50 * MB, replica_target=2, segments=["a"], hot=1)
    core.object_known("small", size_bytes=MB, replica_target=2, segments=["a"])
    looks = [0]
    destination = core._destination

    def counted(obj: object) -> object:
        looks[0] += 1
        return destination(obj)  # type: ignore[arg-type]

    core._destination = counted  # type: ignore[method-assign,assignment]
    started: list[StartCopy] = []
    ticks = 0
    while not started:
        looks[0] = 0
        started = starts(core, 100 * ticks)
        ticks += 1
        assert looks[0] <= PLAN_NO_DESTINATION_MAX + 1  # was every object below target, each tick
        assert ticks <= n // PLAN_NO_DESTINATION_MAX + 2
    assert [s.object_id for s in started] == ["small"]
    core.check_invariants()
    looks[0] = 0
    starts(core, 100 * ticks)
    assert looks[0] <= PLAN_NO_DESTINATION_MAX
    core.check_invariants()


def test_deferred_objects_come_back_hottest_first_when_room_appears() -> None:
    core = RepairCore(RepairConfig(copies_in_flight_max=4, burst_bytes=1 << 40))
    up(core, "a", "z1", 100 * MB)
    up(core, "b", "z2", 0)
    for i in range(10):
        core.object_known(i, size_bytes=MB, replica_target=2, segments=["a"], hot=i)
    assert starts(core, 0) == []
    up(core, "b", "z2", 100 * MB)  # room: the hottest go first
    assert [s.object_id for s in starts(core, 100)] == [9, 8, 7, 6]
    core.check_invariants()
    assert repair.PLAN_NO_DESTINATION_MAX >= 1


def test_segment_reports_and_copies_do_not_restart_the_round_robin() -> None:
    """Merging the deferred back in order at any segment change (the scan re-reports every
    segment every 2 s; each copy started or ended) restarted the walk at the top each time:
    a cold object that fits, behind thousands of hot ones that cannot, was never reached
    (review of stop 68's fix)."""
    core = RepairCore(RepairConfig(copies_in_flight_max=32, burst_bytes=1 << 40))
    up(core, "a", "z1", 100 * MB)
    up(core, "b", "z2", 10 * MB)
    n = 2_000
    for i in range(n):
        core.object_known(i, size_bytes=50 * MB, replica_target=2, segments=["a"], hot=1)
    core.object_known("small", size_bytes=MB, replica_target=2, segments=["a"])
    started: list[StartCopy] = []
    for tick in range(n // PLAN_NO_DESTINATION_MAX + 3):
        up(core, "a", "z1", 100 * MB)  # unchanged reports, every tick
        up(core, "b", "z2", 10 * MB)
        started = starts(core, 100 * tick)
        if started:
            break
    assert [s.object_id for s in started] == ["small"]
    core.check_invariants()
