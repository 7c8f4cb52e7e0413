"""Repair core scenarios: short scripts of events with the expected outcome inline."""

from __future__ import annotations

import pytest

from kvfabric.core.repair import CancelCopy, DrainComplete, Effect, RepairConfig, RepairCore, StartCopy
from kvfabric.format.invariant import InvariantViolation

MB = 1 << 20
FREE = 100 * MB


def new_core(segments: dict[str, str] | None = None, **config: int) -> RepairCore:
    """A core with segments given as `id: "zone/rack/host"` (default: a, b, c in three zones)."""
    core = RepairCore(RepairConfig(**config))
    for segment_id, domain in (segments or {"a": "z1/r1/h1", "b": "z2/r1/h1", "c": "z3/r1/h1"}).items():
        zone, rack, host = domain.split("/")
        core.segment_up(segment_id, incarnation=1, zone=zone, rack=rack, host=host, free_bytes=FREE)
    return core


def copies(effects: list[Effect]) -> list[tuple[object, str, str]]:
    """(object, source, destination) of each StartCopy."""
    return [(e.object_id, e.source, e.destination) for e in effects if isinstance(e, StartCopy)]


def only_copy(effects: list[Effect]) -> StartCopy:
    (effect,) = effects
    assert isinstance(effect, StartCopy)
    return effect


def test_a_dead_segment_is_replaced_in_the_zone_the_object_does_not_use() -> None:
    core = new_core()
    core.object_known("o", size_bytes=MB, replica_target=2, segments=["a", "b"])
    assert core.tick(0) == []  # at target
    core.segment_down("b")
    assert core.gauges()["objects_below_target"] == 1
    copy = only_copy(core.tick(10))
    assert (copy.object_id, copy.source, copy.destination, copy.size_bytes) == ("o", "a", "c", MB)
    assert core.tick(20) == []  # one copy per object at a time
    core.check_invariants()
    assert core.copy_ok(copy.copy_id) is True  # the shell registers the replica with the directory
    assert core.replicas("o") == {"a", "c"} and core.tick(30) == []
    assert core.counters["copies_ok_total"] == 1 and core.counters["bytes_copied_total"] == MB
    assert core.gauges()["objects_below_target"] == 0
    core.check_invariants()


def test_the_widest_unused_domain_wins_over_free_bytes() -> None:
    # a and b share zone z1 (other hosts); c is a new zone but has the least room.
    core = new_core({"a": "z1/r1/h1", "b": "z1/r1/h2", "c": "z2/r1/h1", "d": "z1/r2/h1"})
    core.segment_up("b", incarnation=1, zone="z1", rack="r1", host="h2", free_bytes=10 * FREE)
    core.segment_up("c", incarnation=1, zone="z2", rack="r1", host="h1", free_bytes=MB + MB // 2)
    core.object_known("o", size_bytes=MB, replica_target=2, segments=["a"])
    core.object_known("p", size_bytes=MB, replica_target=2, segments=["a"])
    # o takes c's room (new zone) and reserves it; p finds no room in z2: next best is a new rack.
    assert copies(core.tick(0)) == [("o", "a", "c"), ("p", "a", "d")]
    core.check_invariants()


def test_no_room_anywhere_waits_without_copying() -> None:
    core = new_core()
    core.segment_up("c", incarnation=1, zone="z3", rack="r1", host="h1", free_bytes=MB - 1)
    core.object_known("o", size_bytes=MB, replica_target=3, segments=["a", "b"])
    assert core.tick(0) == [] and core.gauges()["objects_below_target"] == 1
    core.segment_up("c", incarnation=1, zone="z3", rack="r1", host="h1", free_bytes=MB)  # room now
    assert copies(core.tick(1)) == [("o", "a", "c")]


def test_the_budget_caps_bytes_per_second() -> None:
    # 100 bytes/s, burst 100: two 50-byte copies at once, then one every half second.
    core = new_core(bandwidth_bytes_per_s=100, burst_bytes=100, copies_in_flight_max=100)
    for i in range(6):
        core.object_known(i, size_bytes=50, replica_target=2, segments=["a"])
    assert [c[0] for c in copies(core.tick(0))] == [0, 1]
    assert core.tokens_bytes == 0 and core.tick(0) == []
    assert core.tick(499) == []  # 49.9 bytes of tokens: not enough for 50
    assert [c[0] for c in copies(core.tick(500))] == [2]
    assert [c[0] for c in copies(core.tick(1_500))] == [3, 4]  # a second of refill: 100 bytes
    assert core.counters["bytes_started_total"] == 250
    assert core.counters["budget_waits_total"] >= 3
    core.check_invariants()


def test_an_idle_bucket_holds_no_more_than_the_burst() -> None:
    core = new_core(bandwidth_bytes_per_s=100, burst_bytes=100, copies_in_flight_max=100)
    assert core.tick(3_600_000) == []
    for i in range(4):
        core.object_known(i, size_bytes=40, replica_target=2, segments=["a"])
    assert len(copies(core.tick(3_600_000))) == 2  # 80 of 100 bytes, not an hour's worth


def test_the_budget_refills_from_the_last_tick_whatever_events_came_between() -> None:
    # A copy result with a time (copy_failed at 500) between two ticks does not lose the refill
    # before it: by 1,000 the bucket holds a second's worth again (100 bytes), not half of it.
    core = new_core(bandwidth_bytes_per_s=100, burst_bytes=100, copies_in_flight_max=100)
    for i in range(2):
        core.object_known(i, size_bytes=100, replica_target=2, segments=["a"])
    first = only_copy(core.tick(0))
    assert core.tokens_bytes == 0
    core.copy_failed(first.copy_id, 500)  # object 0 backs off past 1,000
    assert [c[0] for c in copies(core.tick(1_000))] == [1]
    assert core.tokens_bytes == 0
    core.check_invariants()


def test_copies_in_flight_are_capped() -> None:
    core = new_core(copies_in_flight_max=2)
    for i in range(5):
        core.object_known(i, size_bytes=MB, replica_target=2, segments=["a"])
    started = [only for only in core.tick(0) if isinstance(only, StartCopy)]
    assert len(started) == 2 and core.tick(1) == []
    core.copy_ok(started[0].copy_id)
    assert len(copies(core.tick(2))) == 1  # one slot freed, one more copy
    core.check_invariants()


def test_hot_objects_go_first_then_the_fewest_replicas() -> None:
    core = new_core(
        {"a": "z1/r/h", "b": "z2/r/h", "c": "z3/r/h", "d": "z4/r/h"},
        bandwidth_bytes_per_s=MB,
        burst_bytes=MB,
    )
    core.object_known("cold_two", size_bytes=MB, replica_target=3, segments=["a", "b"])
    core.object_known("cold_one", size_bytes=MB, replica_target=3, segments=["a"])
    core.object_known("hot", size_bytes=MB, replica_target=3, segments=["a", "b"], hot=5)
    assert [c[0] for c in copies(core.tick(0))] == ["hot"]  # the budget allows one
    core.tick(1)  # a millisecond of refill: not enough for the next one
    assert core.counters["copies_started_total"] == 1
    assert [c[0] for c in copies(core.tick(1_000))] == ["cold_one"]  # fewest replicas next


def test_drain_moves_everything_off_then_reports_complete_once() -> None:
    core = new_core()
    core.object_known("only_there", size_bytes=MB, replica_target=1, segments=["a"])
    core.object_known("shared", size_bytes=MB, replica_target=2, segments=["a", "b"])
    core.object_known("elsewhere", size_bytes=MB, replica_target=1, segments=["b"])
    core.segment_draining("a")
    core.scan_complete()  # (the shell's listing: the objects are known)
    assert core.drain_pending("a") == 2
    effects = core.tick(0)
    # only_there can only be read from a; shared is copied from b (not draining) to c (new zone).
    assert sorted(copies(effects)) == [("only_there", "a", "c"), ("shared", "b", "c")]
    assert core.tick(1) == []  # no DrainComplete while copies read from or need the segment
    for effect in effects:
        assert isinstance(effect, StartCopy)
        assert core.copy_ok(effect.copy_id)
    assert core.drain_pending("a") == 0
    assert core.tick(2) == [DrainComplete("a")]
    assert core.tick(3) == []  # once
    assert core.replicas("only_there") == {"a", "c"}  # a stays readable until the shell retires it
    core.segment_down("a")
    assert core.replicas("only_there") == {"c"} and core.tick(4) == []
    core.check_invariants()


def test_no_drain_completes_before_a_listing_after_it_began() -> None:
    """The scan reports the drain flag, then lists the objects below target page by page; a
    tick between them found nothing on the segment below target (nothing known yet) and
    reported the drain complete, the segment still holding everything (review, stop 68)."""
    core = new_core()
    core.segment_draining("a")
    assert core.tick(0) == []  # was [DrainComplete("a")]
    core.object_known("only_there", size_bytes=MB, replica_target=1, segments=["a"])
    core.scan_complete()
    (start,) = core.tick(1)
    assert isinstance(start, StartCopy) and core.copy_ok(start.copy_id)
    assert core.tick(2) == [DrainComplete("a")]
    core.segment_draining("a", False)
    core.segment_draining("a")  # a new drain: a new listing first
    assert core.tick(3) == []
    core.scan_complete()
    assert core.tick(4) == [DrainComplete("a")]
    core.check_invariants()


def test_a_drain_recounts_a_bounded_number_of_objects_per_step_and_completes_after() -> None:
    """A drain flag change recounts `recounts_per_step` of the segment's objects at once and as
    many per tick (2 s of the service's loop at 1,000,000 objects when it recounted them all):
    the rest keep their old count until then, planning recounts what it pops, and the drain
    completes only once every recount is done."""
    core = new_core(recounts_per_step=3)
    for i in range(10):
        core.object_known(i, size_bytes=MB, replica_target=2, segments=["a", "b"])
    core.segment_draining("a")
    core.scan_complete()
    gauges = core.gauges()
    assert (gauges["recounts_pending"], gauges["objects_below_target"]) == (7, 3)
    assert core.drain_pending("a") == 10  # counted now, not from the stale counts
    core.check_invariants()
    started: list[StartCopy] = []
    for now in range(1, 10):
        effects = core.tick(now)
        core.check_invariants()
        assert DrainComplete("a") not in effects or core.gauges()["recounts_pending"] == 0
        started += [e for e in effects if isinstance(e, StartCopy)]
        if DrainComplete("a") in effects:
            break
        for copy in started:
            core.copy_ok(copy.copy_id)
    ids = [c.object_id for c in started]
    assert len(ids) == 10 and set(ids) == set(range(10))  # each once, from b
    assert {(c.source, c.destination) for c in started} == {("b", "c")}
    # ticks 1-3 recount 3, 3 and 1 (planning each); tick 4 finds every copy done
    assert effects == [DrainComplete("a")] and now == 4
    assert core.drain_pending("a") == 0


def test_a_drain_stopped_aborts_its_copies_at_once_whatever_waits_for_a_recount() -> None:
    core = new_core(recounts_per_step=1)
    for i in range(10):
        core.object_known(i, size_bytes=MB, replica_target=2, segments=["a", "b"])
    core.segment_draining("a")  # object 0 recounted: below target
    first = [e for e in core.tick(0) if isinstance(e, StartCopy)]  # object 1 too
    assert {c.object_id for c in first} == {0, 1} and len(first) == 2
    core.segment_draining("a", False)  # a counts again: both copies are redundant now
    assert core.counters["copies_aborted_total"] == 2
    assert not any(core.copy_ok(c.copy_id) for c in first)
    core.check_invariants()
    cancels = {CancelCopy(c.copy_id, c.object_id) for c in first}
    assert set(core.tick(1)) == cancels  # the shell stops them: no replica past the target lands
    for now in range(2, 40):
        assert core.tick(now) == []
    assert core.gauges()["recounts_pending"] == 0 and core.gauges()["objects_below_target"] == 0
    core.check_invariants()


def test_planning_recounts_a_stale_object_before_it_copies_it() -> None:
    """A drain started and stopped again before the FIFO reached object 0: its count says 1
    (below target) and its entry is queued, but a counts again. Planning recounts it instead of
    copying it past its target."""
    core = new_core(recounts_per_step=1)
    for i in range(3):
        core.object_known(i, size_bytes=MB, replica_target=2, segments=["a", "b"])
    core.segment_draining("a")  # object 0 recounted: below target, queued
    core.segment_draining("a", False)  # object 1 recounted; 0 waits in the FIFO with its old count
    assert core.tick(1) == []
    core.check_invariants()


def test_no_drain_completes_while_a_recount_is_pending() -> None:
    """Objects 0 and 1 have their target elsewhere; object 2 needs a copy, and its stale count
    (at target) would let the drain complete if the FIFO were not waited for."""
    core = new_core(recounts_per_step=1)
    core.object_known(0, size_bytes=MB, replica_target=2, segments=["a", "b", "c"])
    core.object_known(1, size_bytes=MB, replica_target=2, segments=["a", "b", "c"])
    core.object_known(2, size_bytes=MB, replica_target=2, segments=["a", "b"])
    core.segment_draining("a")  # one recount now: 2 waits behind 0 or 1
    assert core.drain_pending("a") == 1
    assert core.tick(1) == []  # a tick's allowance (1) recounts the other
    started = core.tick(2)  # object 2 recounted and copied
    assert copies(started) == [(2, "b", "c")]
    core.check_invariants()


def test_stopping_a_drain_recounts_no_more_than_the_allowance_per_tick() -> None:
    """Every object was below target with a stale entry once a drain stops: planning, which
    recounts what it pops, shares the tick's allowance with the FIFO instead of recounting the
    whole ready queue in one tick."""
    core = new_core(recounts_per_step=4, copies_in_flight_max=1)
    for i in range(40):
        core.object_known(i, size_bytes=MB, replica_target=2, segments=["a", "b"])
    core.segment_draining("a")
    now = 0
    while core.gauges()["recounts_pending"]:
        now += 1
        core.tick(now)  # one copy in flight, never answered: the rest stay below target
    assert core.gauges()["objects_below_target"] == 40
    before = core.counters.get("recounts_total", 0)
    core.segment_draining("a", False)
    assert core.counters["recounts_total"] - before <= 4
    ticks = 0
    while core.gauges()["recounts_pending"] or core.gauges()["objects_below_target"]:
        before = core.counters["recounts_total"]
        now += 1
        assert copies(core.tick(now)) == []
        assert core.counters["recounts_total"] - before <= 4
        ticks += 1
        core.check_invariants()
    assert ticks >= 9  # 40 objects, 4 a step


def test_a_segment_down_drops_its_replicas_at_once_and_recounts_a_bounded_number_per_step() -> None:
    """A segment down (2.6 s of the service's loop at 1,000,000 objects when it recounted every
    object in the event) drops its replicas from every object at once, recounts
    `recounts_per_step` of them, its hottest first, and leaves the rest to the ticks."""
    core = new_core(recounts_per_step=3, copies_per_destination_max=32)  # (all copies go to c)
    for i in range(10):
        core.object_known(
            i, size_bytes=MB, replica_target=2, segments=["a", "b"], hot=(i == 7) + 2 * (i == 9)
        )
    core.segment_down("b")
    assert all(core.replicas(i) == {"a"} for i in range(10))  # none counted or read from b
    assert core.gauges()["objects_below_target"] == 3 and core.counters["recounts_total"] == 3
    assert core.gauges()["recounts_pending"] == 7
    core.check_invariants()
    first = copies(core.tick(1))  # the event's 3 and the tick's 3, hottest first
    assert len(first) == 6 and first[:2] == [(9, "a", "c"), (7, "a", "c")]
    started = {c[0] for c in first}
    for now in range(2, 10):
        core.check_invariants()
        started |= {c[0] for c in copies(core.tick(now))}
        assert core.counters["recounts_total"] - (3 + 3) <= 3 * (now - 1)
    assert started == set(range(10)) and core.gauges()["recounts_pending"] == 0
    core.check_invariants()


def test_a_segment_down_recounts_the_objects_with_fewest_replicas_left_first() -> None:
    """Object 100 has one replica left, objects 0-9 two each: it is recounted, and copied,
    first, as the planning order would have it (a review's repro: recounted in the segment's
    set order, 100 waited behind the others)."""
    core = new_core(
        {"s": "z1/r1/h1", "a": "z2/r1/h1", "b": "z3/r1/h1", "c": "z4/r1/h1"},
        recounts_per_step=2,
        copies_in_flight_max=2,
    )
    for i in range(10):
        core.object_known(i, size_bytes=MB, replica_target=3, segments=["s", "a", "b"])
    core.object_known(100, size_bytes=MB, replica_target=2, segments=["s", "a"])
    core.segment_down("s")
    started = [c[0] for c in copies(core.tick(1))]
    assert started[0] == 100 and len(started) == 2
    core.check_invariants()


def test_objects_lost_with_a_segment_are_counted_once_when_recounted_or_touched() -> None:
    core = new_core(recounts_per_step=1)
    for i in range(5):
        core.object_known(i, size_bytes=MB, replica_target=1, segments=["b"])
    core.segment_down("b")
    assert core.counters["objects_lost_total"] == 1 and 0 not in core  # the event's one recount
    assert 1 in core and core.replicas(1) == frozenset()  # kept until recounted, never read
    core.object_known(2, size_bytes=MB, replica_target=1, segments=["a"])  # published again
    assert core.counters["objects_lost_total"] == 2 and core.replicas(2) == {"a"}
    core.object_removed(3)  # lost before it was removed
    assert core.counters["objects_lost_total"] == 3 and 3 not in core
    core.check_invariants()
    for now in range(1, 10):
        assert core.tick(now) == []
        core.check_invariants()
    assert core.counters["objects_lost_total"] == 5 and [i for i in range(5) if i in core] == [2]
    assert core.gauges()["recounts_pending"] == 0


def test_an_object_popped_after_its_last_replica_went_down_is_recounted_not_copied() -> None:
    """Object 10's only replica is on draining a (healthy 0: its count stays right when a goes
    down) and its copy failed; its retry queues it again while its recount still waits behind
    ten others. Planning must not copy an object without a replica: it is recounted (LOST)."""
    core = new_core(recounts_per_step=1)
    core.segment_draining("a")
    for i in range(10):
        core.object_known(i, size_bytes=MB, replica_target=1, segments=["a", "c"])
    core.object_known(10, size_bytes=MB, replica_target=1, segments=["a"])
    copy = only_copy(core.tick(0))
    assert copy.object_id == 10
    core.copy_failed(copy.copy_id, 0)  # back off: ready again at 1 000 ms
    core.segment_down("a")
    assert core.replicas(10) == frozenset() and 10 in core
    for now in range(1_000, 1_011):
        assert core.tick(now) == []
        core.check_invariants()
    assert 10 not in core and core.counters["objects_lost_total"] == 1


def test_a_segment_back_before_the_recounts_of_its_old_incarnation_starts_empty() -> None:
    core = new_core(recounts_per_step=1)
    for i in range(5):
        core.object_known(i, size_bytes=MB, replica_target=2, segments=["a", "b"])
    core.segment_up("b", incarnation=2, zone="z2", rack="r1", host="h1", free_bytes=FREE)  # restarted
    assert all(core.replicas(i) == {"a"} for i in range(5))
    started: set[object] = set()
    for now in range(1, 10):
        effects = core.tick(now)
        core.check_invariants()
        for effect in effects:
            assert isinstance(effect, StartCopy) and effect.source == "a"
            started.add(effect.object_id)
            assert core.copy_ok(effect.copy_id)
    assert started == set(range(5)) and core.gauges()["objects_below_target"] == 0


def test_a_resync_with_the_same_view_changes_nothing() -> None:
    """The scan re-syncs every object below target each pass: an unchanged view is a
    comparison (counted), and plans what re-applying it did (a twin that recounts the object)."""
    import copy as copying

    core = new_core(attempts_max=5)
    core.object_known("copying", size_bytes=MB, replica_target=2, segments=["a"])
    core.object_known("backing_off", size_bytes=MB, replica_target=2, segments=["b"])
    core.object_known("waiting", size_bytes=MB, replica_target=3, segments=["a"], hot=1)
    started = {c.object_id: c for c in core.tick(0) if isinstance(c, StartCopy)}
    core.copy_failed(started["backing_off"].copy_id, 1)
    twin = copying.deepcopy(core)
    for object_id, segments, hot in (("copying", ["a"], 0), ("backing_off", ["b"], 0), ("waiting", ["a"], 1)):
        core.object_known(object_id, size_bytes=MB, replica_target=2 + hot, segments=segments, hot=hot)
        twin._refresh(object_id)
    assert core.counters["objects_known_unchanged_total"] == 3
    core.check_invariants()
    for now in (2, 500, 5_000):
        assert core.tick(now) == twin.tick(now)
    core.object_known("waiting", size_bytes=MB, replica_target=3, segments=["a", "b"], hot=1)  # changed
    core.object_known("waiting", size_bytes=MB, replica_target=3, segments=["a", "b"], hot=2)
    core.object_known("waiting", size_bytes=MB, replica_target=2, segments=["a", "b"], hot=2)
    core.object_known("waiting", size_bytes=2 * MB, replica_target=2, segments=["a", "b"], hot=2)
    core.object_known("waiting", size_bytes=2 * MB, replica_target=2, segments=["a", "b", "x"], hot=2)
    assert core.counters["objects_known_unchanged_total"] == 3  # each of those changed something
    assert core.counters["replicas_on_unknown_segment_total"] == 1  # (x) counted as before
    assert core.replicas("waiting") == {"a", "b"}
    core.check_invariants()


def test_a_draining_segment_is_never_a_destination_and_aborts_copies_to_it() -> None:
    core = new_core()
    core.object_known("o", size_bytes=MB, replica_target=2, segments=["a"])
    copy = only_copy(core.tick(0))
    core.segment_draining(copy.destination)
    assert core.copy_ok(copy.copy_id) is False  # stale: a replica there would not count
    effects = core.tick(1)
    assert effects[0] == CancelCopy(copy.copy_id, "o")  # its ticket given back before it lands
    (again,) = copies(effects)
    assert again[2] not in (copy.destination, "a")
    core.check_invariants()


def test_an_object_with_no_replica_left_is_lost_and_counted() -> None:
    core = new_core()
    core.object_known("o", size_bytes=MB, replica_target=2, segments=["a"])
    copy = only_copy(core.tick(0))
    core.segment_down("a")  # its only source: the copy is aborted, nothing can bring o back
    assert "o" not in core and core.counters["objects_lost_total"] == 1
    assert core.copy_ok(copy.copy_id) is False and core.tick(1) == [CancelCopy(copy.copy_id, "o")]
    assert core.tick(2) == []
    core.object_known("p", size_bytes=MB, replica_target=2, segments=["gone"])  # unknown segment
    assert "p" not in core and core.counters["objects_lost_total"] == 1  # never tracked: no loss
    assert core.counters["objects_known_unreadable_total"] == 1
    core.check_invariants()


def test_a_lost_object_listed_again_is_counted_lost_once() -> None:
    """A lost object stays in the directory's below-target listing until its sweep reaches it:
    each pass's view of it (no replica on a segment up) counted it lost again, and one whose
    recount was pending twice (review, stop 70: 3 objects lost read 6)."""
    core = new_core()
    for name in ("o", "p"):
        core.object_known(name, size_bytes=MB, replica_target=2, segments=["a"])
    core.segment_down("a")
    assert core.counters["objects_lost_total"] == 2
    for _ in range(3):  # later passes, the directory still listing them with no replica up
        for name in ("o", "p"):
            core.object_known(name, size_bytes=MB, replica_target=2, segments=[])
            core.object_known(name, size_bytes=MB, replica_target=2, segments=["a"])  # ("a" unknown now)
    assert core.counters["objects_lost_total"] == 2 and "o" not in core and "p" not in core
    core.check_invariants()


def test_a_failed_copy_is_retried_after_backoff_then_the_object_is_stuck() -> None:
    core = new_core(attempts_max=2, retry_backoff_ms=100, stuck_retry_ms=10_000)
    core.object_known("o", size_bytes=MB, replica_target=2, segments=["a"])
    core.copy_failed(only_copy(core.tick(0)).copy_id, 0)
    assert core.tick(99) == []  # backing off
    core.copy_failed(only_copy(core.tick(100)).copy_id, 100)  # second failure in a row: stuck
    assert core.counters["objects_stuck_total"] == 1 and core.gauges()["objects_stuck"] == 1
    assert core.tick(10_099) == []
    retry = only_copy(core.tick(10_100))  # a fresh set of attempts
    assert core.gauges()["objects_stuck"] == 0
    assert core.copy_ok(retry.copy_id) and core.counters["copies_failed_total"] == 2
    core.check_invariants()


def test_a_copy_without_result_times_out_and_a_late_result_is_stale() -> None:
    core = new_core(copy_timeout_ms=1_000, retry_backoff_ms=0)
    core.object_known("o", size_bytes=MB, replica_target=2, segments=["a"])
    first = only_copy(core.tick(0))
    assert core.tick(999) == []
    # timed out (indeterminate): cancelled (a late confirm is refused), retried at once here
    cancel, second = core.tick(1_000)
    assert cancel == CancelCopy(first.copy_id, "o") and isinstance(second, StartCopy)
    assert core.counters["copies_timed_out_total"] == 1
    assert core.copy_ok(first.copy_id) is False  # late: stale
    assert core.copy_ok(second.copy_id) is True
    assert core.copy_ok(second.copy_id) is False  # duplicate: stale
    assert core.counters["stale_copy_results_total"] == 2
    core.check_invariants()


def test_a_replica_appearing_elsewhere_aborts_the_redundant_copy() -> None:
    core = new_core()
    core.object_known("o", size_bytes=MB, replica_target=2, segments=["a"])
    copy = only_copy(core.tick(0))
    core.object_known("o", size_bytes=MB, replica_target=2, segments=["a", "b"])  # directory re-sync
    assert core.counters["copies_aborted_total"] == 1 and core.copy_ok(copy.copy_id) is False
    assert core.tick(1) == [CancelCopy(copy.copy_id, "o")]  # the shell stops it: no surplus replica
    assert core.tick(2) == []
    core.check_invariants()


def test_a_corrupt_source_aborts_its_copy_and_repair_uses_another() -> None:
    core = new_core({"a": "z1/r/h", "b": "z2/r/h", "c": "z3/r/h", "d": "z4/r/h"})
    core.object_known("o", size_bytes=MB, replica_target=3, segments=["a", "b"])
    copy = only_copy(core.tick(0))
    core.replica_lost("o", copy.source, corrupt=True)  # scrub found a checksum mismatch
    assert core.counters["replicas_corrupt_total"] == 1 and core.copy_ok(copy.copy_id) is False
    cancel, again = core.tick(1)  # the aborted copy cancelled before the next one starts
    assert cancel == CancelCopy(copy.copy_id, "o") and isinstance(again, StartCopy)
    assert again.source != copy.source and again.source in core.replicas("o")
    core.check_invariants()


def test_a_source_that_fails_the_read_is_tried_last_next_time() -> None:
    """Issue 27 clock-skew drill: a source refused every copy (its clock ahead of the directory's by
    the copy TTL: the source token expired on arrival) and repair retried the same source until
    the object was stuck. A copy whose source read failed is retried from another replica."""
    core = new_core({"a": "z1/r/h", "b": "z2/r/h", "c": "z3/r/h", "d": "z4/r/h"}, retry_backoff_ms=100)
    core.object_known("o", size_bytes=MB, replica_target=3, segments=["a", "b"])
    first = only_copy(core.tick(0))
    core.copy_failed(first.copy_id, 0, source_failed=True)
    second = only_copy(core.tick(100))
    assert second.source != first.source and second.source in core.replicas("o")
    assert core.counters["copies_source_failed_total"] == 1
    core.copy_failed(second.copy_id, 100)  # a failure that is not the source's: no new preference
    third = only_copy(core.tick(300))
    assert third.source == second.source
    assert core.copy_ok(third.copy_id)
    core.check_invariants()


def test_the_only_source_that_failed_the_read_is_still_tried_with_a_fresh_copy() -> None:
    core = new_core(retry_backoff_ms=100)
    core.object_known("o", size_bytes=MB, replica_target=2, segments=["a"])
    first = only_copy(core.tick(0))
    core.copy_failed(first.copy_id, 0, source_failed=True)
    again = only_copy(core.tick(100))  # no other replica: the same source, a fresh ticket
    assert again.source == "a" and again.copy_id != first.copy_id
    core.check_invariants()


def test_an_evicted_object_cancels_its_copy() -> None:
    core = new_core()
    core.object_known("o", size_bytes=MB, replica_target=2, segments=["a"])
    copy = only_copy(core.tick(0))
    core.object_removed("o")
    assert "o" not in core and core.gauges()["copies_in_flight"] == 0
    assert core.copy_ok(copy.copy_id) is False
    core.check_invariants()


def test_a_new_incarnation_loses_the_old_replicas_and_an_old_one_is_ignored() -> None:
    core = new_core()
    core.object_known("o", size_bytes=MB, replica_target=2, segments=["a", "b"])
    core.segment_up("b", incarnation=2, zone="z2", rack="r1", host="h1", free_bytes=FREE)  # restarted
    assert core.replicas("o") == {"a"}
    core.segment_up("b", incarnation=1, zone="z2", rack="r1", host="h1", free_bytes=0)  # stale report
    assert core.counters["stale_segment_reports_total"] == 1
    core.segment_up("c", incarnation=1, zone="z3", rack="r1", host="h1", free_bytes=0)  # c is full
    assert copies(core.tick(0)) == [("o", "a", "b")]  # b's new incarnation has room
    core.check_invariants()


def test_reservations_keep_a_destination_from_being_overbooked() -> None:
    core = new_core({"a": "z1/r/h", "b": "z2/r/h"})
    core.segment_up("b", incarnation=1, zone="z2", rack="r", host="h", free_bytes=MB)
    for i in range(3):
        core.object_known(i, size_bytes=MB, replica_target=2, segments=["a"])
    (first,) = core.tick(0)  # b has room for one
    assert copies([first]) == [(0, "a", "b")]
    core.segment_up("b", incarnation=1, zone="z2", rack="r", host="h", free_bytes=0)  # filled meanwhile
    assert core.counters["reports_below_reserved_total"] == 1
    core.check_invariants()  # reserved > free after a report is an operating condition, not a bug
    assert core.tick(1) == []
    assert isinstance(first, StartCopy) and core.copy_ok(first.copy_id)
    assert core.tick(2) == [] and core.gauges()["objects_below_target"] == 2
    core.check_invariants()


def test_a_bad_config_or_time_going_backwards_is_a_bug() -> None:
    with pytest.raises(InvariantViolation):
        RepairConfig(burst_bytes=0)
    core = new_core()
    core.tick(10)
    with pytest.raises(InvariantViolation):
        core.tick(9)


class _NoIteration(set[object]):
    """A set the metrics thread must not walk: the event loop changes it meanwhile."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        raise AssertionError("gauges() iterated the objects below target")


def test_gauges_never_walk_the_objects_below_target() -> None:
    """`gauges()` is read from the metrics server's thread: walking the set of objects below
    target while the event loop changes it can raise "Set changed size during iteration" (and
    cost O(objects) a scrape). Stuck and oversize counts are kept as objects change."""
    core = new_core(attempts_max=1, burst_bytes=2 * MB)
    core.object_known("big", size_bytes=4 * MB, replica_target=2, segments=["a"])
    core.object_known("o", size_bytes=MB, replica_target=2, segments=["a"])
    failed = only_copy(core.tick(10))
    core.copy_failed(failed.copy_id, 20)  # attempts_max 1: stuck
    core.check_invariants()
    core._below = _NoIteration(core._below)
    assert core.gauges()["objects_stuck"] == 1 and core.gauges()["objects_oversize"] == 1
    core._below = set(core._below)
    core.object_known("o", size_bytes=MB, replica_target=2, segments=["a", "b"])  # at target
    core.object_removed("big")
    core.check_invariants()
    core._below = _NoIteration(core._below)
    assert core.gauges()["objects_stuck"] == 0 and core.gauges()["objects_oversize"] == 0


def test_tenants_take_turns_and_a_late_tenant_starts_at_the_turn_served() -> None:
    """Objects of one hotness and replica count went in the order first known, which is the
    listing's (by shard, then domain digest): after a segment loss tenants were repaired whole,
    one after another, and the last in hash order kept single replicas for hours (review, stop
    70). Each tenant's k-th object now goes with the others' k-th."""
    core = new_core(copies_in_flight_max=1)
    for tenant in ("A", "B"):
        for i in range(4):
            core.object_known(f"{tenant}{i}", size_bytes=MB, replica_target=2, segments=["a"], tenant=tenant)
    order = []
    now = 0
    for _ in range(4):
        copy = only_copy(core.tick(now))
        order.append(copy.object_id)
        assert core.copy_ok(copy.copy_id)
        now += 10
    assert order == ["A0", "B0", "A1", "B1"]
    for i in range(3):  # C comes now: it starts at the turn being served, not ahead of everyone
        core.object_known(f"C{i}", size_bytes=MB, replica_target=2, segments=["a"], tenant="C")
    for _ in range(7):
        copy = only_copy(core.tick(now))
        order.append(copy.object_id)
        assert core.copy_ok(copy.copy_id)
        now += 10
    assert order[4:] == ["C0", "A2", "B2", "C1", "A3", "B3", "C2"]  # C at turn 1, then in step
    core.check_invariants()
    for name in order:  # (gone: no turn kept for a tenant with no object)
        core.object_removed(name)
    assert not core._tenant_turn and not core._tenant_objects
