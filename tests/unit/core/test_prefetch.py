"""Prefetch core scenarios: short scripts of events with the expected outcome inline."""

from __future__ import annotations

from typing import Any

from kvfabric.core.prefetch import (
    Accepted,
    Busy,
    Deduped,
    ExtraReplica,
    Hint,
    HintObject,
    PrefetchConfig,
    PrefetchCore,
    PublishReplica,
    Refused,
    ReleaseCopy,
    StartCopy,
)

T0 = 1_000
DEADLINE = T0 + 5_000


def obj(object_id: str, size: int = 10, replicas: tuple[str, ...] = ("s1",)) -> HintObject:
    return HintObject(object_id, size, replicas)


def hint(hint_id: str, *objects: HintObject, target: str = "t", deadline_ms: int = DEADLINE) -> Hint:
    return Hint(hint_id, "tenant", target, objects, deadline_ms)


def core(**config: Any) -> PrefetchCore:
    return PrefetchCore(PrefetchConfig(**config))


def started(effects: object) -> list[tuple[object, str]]:
    """(object, target) of each StartCopy, in order."""
    assert isinstance(effects, list)
    return [(e.object_id, e.target) for e in effects if isinstance(e, StartCopy)]


def test_identical_hints_are_one_hint_with_two_ids_and_one_copy_each() -> None:
    c = core()
    assert c.add_hint(hint("h1", obj("a"), obj("b")), T0) == Accepted("h1", 2)
    assert c.add_hint(hint("h2", obj("b"), obj("a"), deadline_ms=DEADLINE + 9), T0) == Deduped("h2", "h1")
    assert c.add_hint(hint("h1", obj("a"), obj("b")), T0) == Deduped("h1", "h1")  # a retried message
    assert (c.hint_ids_live, c.objects_queued) == (2, 2)
    effects = c.tick(T0 + 1)
    assert started(effects) == [("a", "t"), ("b", "t")]
    assert c.tick(T0 + 2) == []  # never a second copy of the same object to the same target
    assert c.cancel_hint("h1") and c.has_hint("h2")  # h2 still wants them
    assert c.tick(DEADLINE) == [] and c.has_hint("h2")  # the deadline became the later one
    for e in effects:
        assert isinstance(e, StartCopy)
        assert c.copy_finished(e.copy_id, True, DEADLINE) == [
            PublishReplica(e.copy_id, e.object_id, "t", 10, extra=False)
        ]
    assert not c.has_hint("h2") and c.counters["hints_completed_total"] == 1
    assert (c.counters["hints_deduped_total"], c.counters["copies_started_total"]) == (2, 2)
    c.check_invariants()


def test_an_object_wanted_by_two_hints_is_copied_once_and_released_only_when_neither_wants_it() -> None:
    c = core()
    c.add_hint(hint("h1", obj("a"), obj("b")), T0)
    c.add_hint(hint("h2", obj("a"), obj("c")), T0)
    effects = c.tick(T0)
    assert started(effects) == [("a", "t"), ("b", "t"), ("c", "t")]
    a, b, _ = effects
    assert isinstance(a, StartCopy) and isinstance(b, StartCopy)
    assert c.cancel_hint("h1")
    assert c.want_state("a", "t") == "copying"  # h2 still wants it
    assert c.want_state("b", "t") == "releasing"
    assert c.copy_finished(b.copy_id, True, T0 + 1) == [ReleaseCopy(b.copy_id, "b", "t", "unwanted")]
    assert c.copy_finished(a.copy_id, True, T0 + 1) == [PublishReplica(a.copy_id, "a", "t", 10, False)]
    assert c.has_hint("h2") and c.objects_queued == 1  # c is still copying
    c.check_invariants()


def test_cancel_drops_queued_copies_and_in_flight_ones_end_in_a_release() -> None:
    c = core(bytes_in_flight_max=10)  # one object in flight at a time
    c.add_hint(hint("h1", obj("a"), obj("b"), obj("c")), T0)
    (a,) = c.tick(T0)
    assert isinstance(a, StartCopy) and c.bytes_in_flight == 10
    assert c.cancel_hint("h1")
    assert [c.want_state(o, "t") for o in "abc"] == ["releasing", None, None]
    assert (c.objects_queued, c.hint_ids_live) == (0, 0)
    assert c.tick(T0 + 1) == []  # nothing of it starts any more
    assert c.copy_finished(a.copy_id, False, T0 + 2) == [ReleaseCopy(a.copy_id, "a", "t", "unwanted")]
    assert (c.bytes_in_flight, c.copies_in_flight, c.want_state("a", "t")) == (0, 0, None)
    assert not c.cancel_hint("h1") and c.counters["hint_cancel_unknown_total"] == 1
    assert c.copy_finished(a.copy_id, True, T0 + 3) == []  # a late duplicate completion
    assert c.counters["copy_finished_unknown_total"] == 1
    c.check_invariants()


def test_a_hint_sent_again_revives_a_copy_marked_for_release() -> None:
    c = core()
    c.add_hint(hint("h1", obj("a")), T0)
    (a,) = c.tick(T0)
    assert isinstance(a, StartCopy)
    c.cancel_hint("h1")
    assert c.add_hint(hint("h2", obj("a")), T0 + 1) == Accepted("h2", 1)
    assert c.want_state("a", "t") == "copying" and c.tick(T0 + 1) == []  # no second copy
    assert c.copy_finished(a.copy_id, True, T0 + 2) == [PublishReplica(a.copy_id, "a", "t", 10, False)]
    c.check_invariants()


def test_a_hint_expires_at_its_deadline() -> None:
    c = core(copies_in_flight_max=1)
    c.add_hint(hint("h1", obj("a"), obj("b"), deadline_ms=T0 + 100), T0)
    (a,) = c.tick(T0)
    assert isinstance(a, StartCopy)
    assert c.tick(T0 + 99) == [] and c.has_hint("h1")
    assert c.tick(T0 + 100) == [] and not c.has_hint("h1")
    assert c.counters["hints_expired_total"] == 1
    assert (c.want_state("a", "t"), c.want_state("b", "t")) == ("releasing", None)
    assert c.copy_finished(a.copy_id, True, T0 + 200) == [ReleaseCopy(a.copy_id, "a", "t", "unwanted")]
    assert c.add_hint(hint("h2", obj("a"), deadline_ms=T0 + 200), T0 + 200) == Refused(
        "h2", "deadline_passed"
    )
    c.check_invariants()


def test_full_queues_answer_busy_and_keep_nothing() -> None:
    # one tenant may fill them (its share is a quarter by default: test_prefetch_tenants.py)
    c = core(
        hints_queued_max=2,
        objects_queued_max=3,
        hints_queued_per_tenant_max=2,
        objects_queued_per_tenant_max=3,
    )
    assert c.add_hint(hint("h1", obj("a"), obj("b")), T0) == Accepted("h1", 2)
    assert c.add_hint(hint("h2", obj("c"), obj("d")), T0) == Busy("h2", "objects_full")
    assert c.add_hint(hint("h3", obj("c")), T0) == Accepted("h3", 1)
    assert c.add_hint(hint("h4", obj("a"), obj("b")), T0) == Busy("h4", "hints_full")  # even a duplicate
    assert c.add_hint(hint("h5", *(obj(str(i)) for i in range(4))), T0) == Refused("h5", "too_many_objects")
    assert (c.hint_ids_live, c.objects_queued, c.counters["hints_busy_total"]) == (2, 3, 2)
    c.cancel_hint("h3")
    assert c.add_hint(hint("h2", obj("c")), T0) == Accepted("h2", 1)
    c.check_invariants()


def test_most_urgent_first_head_first_and_nothing_overtakes_what_does_not_fit() -> None:
    c = core(bytes_in_flight_max=30)
    c.add_hint(hint("late", obj("x", 5), deadline_ms=T0 + 900), T0)
    c.add_hint(hint("soon", obj("h", 10), obj("m", 10), obj("tail", 20), deadline_ms=T0 + 500), T0)
    effects = c.tick(T0)
    assert started(effects) == [("h", "t"), ("m", "t")]  # tail (20) does not fit: x (5) waits too
    h = effects[0]
    assert isinstance(h, StartCopy)
    c.copy_finished(h.copy_id, True, T0 + 1)
    assert started(c.tick(T0 + 1)) == [("tail", "t")]
    c.check_invariants()


def test_a_failed_copy_is_retried_from_another_source_then_dropped_and_its_hint_fails() -> None:
    c = core(copy_attempts_max=2, copy_retry_backoff_ms=50)
    c.add_hint(hint("h1", obj("a", replicas=("s1", "s2")), obj("b")), T0)
    first, b = c.tick(T0)
    assert isinstance(first, StartCopy) and isinstance(b, StartCopy) and first.source == "s1"
    assert c.copy_finished(first.copy_id, False, T0) == [ReleaseCopy(first.copy_id, "a", "t", "failed")]
    assert c.tick(T0 + 49) == []  # backing off
    (second,) = c.tick(T0 + 50)
    assert isinstance(second, StartCopy) and second.source == "s2"  # not the source that failed
    assert c.copy_finished(second.copy_id, False, T0 + 60) == [
        ReleaseCopy(second.copy_id, "a", "t", "failed")
    ]
    assert not c.has_hint("h1") and c.want_state("b", "t") == "releasing"  # a tail without its head
    assert (c.counters["copies_dropped_total"], c.counters["hints_failed_total"]) == (1, 1)
    assert c.copy_finished(b.copy_id, True, T0 + 70) == [ReleaseCopy(b.copy_id, "b", "t", "unwanted")]
    c.check_invariants()


def test_refusals_and_objects_already_on_the_target() -> None:
    c = core(bytes_in_flight_max=100)
    assert c.add_hint(hint("e"), T0) == Refused("e", "empty")
    assert c.add_hint(hint("d", obj("a"), obj("a")), T0) == Refused("d", "duplicate_object")
    assert c.add_hint(hint("z", obj("a", 0)), T0) == Refused("z", "bad_size")
    assert c.add_hint(hint("l", obj("a", 101)), T0) == Refused("l", "object_too_large")
    assert c.add_hint(hint("n", obj("a", replicas=())), T0) == Refused("n", "no_source")
    assert c.add_hint(hint("ok", obj("a", 10)), T0) == Accepted("ok", 1)
    assert c.add_hint(hint("m", obj("a", 11), obj("b")), T0) == Refused("m", "size_mismatch")
    assert c.add_hint(hint("there", obj("b", replicas=("s1", "t"))), T0) == Accepted("there", 0)
    assert not c.has_hint("there") and c.counters["hints_refused_total"] == 6
    c.check_invariants()


def test_a_replica_published_elsewhere_satisfies_a_queued_copy() -> None:
    c = core(copies_in_flight_max=1)
    c.add_hint(hint("h1", obj("a"), obj("b")), T0)
    (a,) = c.tick(T0)
    c.replica_added("b", "t")  # the engine saved it itself
    assert c.want_state("b", "t") is None and c.objects_queued == 1
    assert isinstance(a, StartCopy)
    c.copy_finished(a.copy_id, True, T0 + 1)
    assert not c.has_hint("h1") and c.counters["hints_completed_total"] == 1
    c.check_invariants()


def test_a_hot_object_gets_one_extra_replica_within_budget_and_is_reported_cold_later() -> None:
    c = core(hot_window_ms=1_000, hot_reads_per_s=5, cold_reads_per_s=1, hot_extra_replicas_max=1)
    c.set_segments({"s1": 500, "s2": 900, "s3": 700})
    for i in range(4):
        c.read("hot", size_bytes=10, served_from="s1", replicas=("s2",), now_ms=T0 + i)
    assert c.tick(T0 + 4) == []  # 4 reads/s: not yet hot
    c.read("hot", size_bytes=10, served_from="s1", replicas=("s2",), now_ms=T0 + 5)
    (copy,) = c.tick(T0 + 5)
    assert copy == StartCopy(copy.copy_id, "hot", "s1", "s3", 10, extra=True)  # most free, not holding it
    for i in range(20):  # hotter still: still one extra replica, and no budget for another object
        c.read("hot", size_bytes=10, served_from="s1", now_ms=T0 + 6 + i)
        c.read("other", size_bytes=10, served_from="s1", now_ms=T0 + 6 + i)
    assert c.tick(T0 + 30) == [] and c.counters["hot_over_budget_total"] > 0
    assert c.copy_finished(copy.copy_id, True, T0 + 40) == [
        PublishReplica(copy.copy_id, "hot", "s3", 10, True)
    ]
    assert c.extra_replicas() == {"hot": "s3"} and c.cold_extra_replicas(T0 + 500) == []
    (cold,) = c.cold_extra_replicas(T0 + 3_000)  # no reads for two windows
    assert cold == ExtraReplica("hot", "s3", 10, 0.0)
    c.replica_removed("hot", "s3")  # eviction took it: budget back
    assert c.extra_replicas() == {} and c.counters["extra_replicas_removed_total"] == 1
    for i in range(6):
        c.read("other", size_bytes=10, served_from="s1", now_ms=T0 + 3_000 + i)
    assert started(c.tick(T0 + 3_010)) == [("other", "s2")]
    c.check_invariants()


def test_a_replica_that_was_there_already_is_no_extra_of_ours() -> None:
    """Review, 2026-12-05: a hot object's extra target may hold a replica already (repair put it
    there since the group was shown): the copy answers `already_there`, and recording it as an
    extra had the service drop that replica once the object cooled (below its target)."""
    c = core(hot_window_ms=1_000, hot_reads_per_s=5, cold_reads_per_s=1, hot_extra_replicas_max=1)
    c.set_segments({"s1": 500, "s2": 900, "s3": 700})
    for i in range(6):
        c.read("hot", size_bytes=10, served_from="s1", replicas=("s2",), now_ms=T0 + i)
    (copy,) = c.tick(T0 + 6)
    assert isinstance(copy, StartCopy) and copy.extra
    (published,) = c.copy_finished(copy.copy_id, True, T0 + 10, made=False)
    assert isinstance(published, PublishReplica) and not published.extra
    assert c.extra_replicas() == {} and c.cold_extra_replicas(T0 + 3_000) == []
    c.check_invariants()


def test_a_hint_copy_made_anew_where_an_extra_was_is_the_hints_not_the_extra() -> None:
    """A hot object's extra on s3 went unnoticed (evicted, demoted), and a hint then copied the
    object to s3 anew: still recorded as the extra, the object's cooling dropped the replica the
    hint had just made (review, stop 70). The extra is forgotten (its budget back)."""
    c = core(hot_window_ms=1_000, hot_reads_per_s=5, cold_reads_per_s=1, hot_extra_replicas_max=1)
    c.set_segments({"s1": 500, "s2": 900, "s3": 700})
    for i in range(6):
        c.read("hot", size_bytes=10, served_from="s1", replicas=("s2",), now_ms=T0 + i)
    (copy,) = c.tick(T0 + 6)
    assert isinstance(copy, StartCopy) and copy.extra and copy.target == "s3"
    c.copy_finished(copy.copy_id, True, T0 + 10)
    assert c.extra_replicas() == {"hot": "s3"}
    c.add_hint(hint("h1", obj("hot", replicas=("s1",)), target="s3"), T0 + 20)  # s3 lost it unnoticed
    (again,) = c.tick(T0 + 20)
    assert isinstance(again, StartCopy) and not again.extra and again.target == "s3"
    (published,) = c.copy_finished(again.copy_id, True, T0 + 30)
    assert isinstance(published, PublishReplica) and not published.extra
    assert c.extra_replicas() == {} and c.cold_extra_replicas(T0 + 5_000) == []
    assert c.counters["extra_replicas_removed_total"] == 1
    c.check_invariants()


def test_a_queued_object_whose_last_source_goes_is_dropped_and_its_hint_fails() -> None:
    c = core(copies_in_flight_max=1)
    c.add_hint(hint("h1", obj("a", replicas=("s1",)), obj("b", replicas=("s2",))), T0)
    (a,) = c.tick(T0)
    c.replica_removed("b", "s2")  # b was only on s2
    assert not c.has_hint("h1") and c.want_state("a", "t") == "releasing"
    assert (c.counters["copies_dropped_total"], c.counters["hints_failed_total"]) == (1, 1)
    assert isinstance(a, StartCopy)
    assert c.copy_finished(a.copy_id, True, T0 + 1) == [ReleaseCopy(a.copy_id, "a", "t", "unwanted")]
    c.check_invariants()


def test_one_domains_hot_objects_take_at_most_its_share_of_the_extra_budget() -> None:
    """Review, 2026-12-06: the hot-replica budget (256 extras, 8 GiB) was one for the cluster:
    one tenant keeping ~160 of its groups hot held all of it, and no other tenant's hot prefix
    got an extra. A domain holds at most a quarter of each by default."""
    c = core(hot_window_ms=1_000, hot_reads_per_s=5, cold_reads_per_s=1, hot_extra_replicas_max=8)
    c.set_segments({"s1": 10_000, "s2": 10_000})
    for i in range(6):
        for n in range(6):  # bob: six hot objects
            c.read(f"bob-{n}", size_bytes=10, served_from="s1", now_ms=T0 + i, domain=b"bob")
    assert len(c.tick(T0 + 6)) == 2  # his share: 8 // 4
    assert c.counters["hot_over_budget_total"] > 0
    for i in range(6):
        c.read("alice-0", size_bytes=10, served_from="s1", now_ms=T0 + 10 + i, domain=b"alice")
    assert started(c.tick(T0 + 16)) == [("alice-0", "s2")]  # alice still gets hers
    c.check_invariants()


def test_a_busy_target_is_waited_for_without_spending_attempts_or_blaming_the_source() -> None:
    """A target whose copy slots repair holds answers `busy`: that counted as a failed attempt
    against an innocent source, and after copy_attempts_max (0.3 s) the want was dropped and
    every hint needing it failed (review, stop 68). Now: queued again after a doubling backoff."""
    c = core(copy_attempts_max=2, copy_retry_backoff_ms=50)
    c.add_hint(hint("h1", obj("a", replicas=("s1", "s2"))), T0)
    (first,) = c.tick(T0)
    assert isinstance(first, StartCopy) and first.source == "s1"
    now = T0
    for waits in (100, 200, 400, 800):  # 50 x 2, x 4, ... busy after busy
        assert c.copy_finished(first.copy_id, False, now, busy=True) == [
            ReleaseCopy(first.copy_id, "a", "t", "failed")
        ]
        assert c.tick(now + waits - 1) == []
        (first,) = c.tick(now + waits)
        assert isinstance(first, StartCopy) and first.source == "s1"  # not blamed
        now += waits
    assert c.has_hint("h1") and c.counters["copies_busy_total"] == 4
    assert c.counters["copies_failed_total"] == 0  # busy is no failed copy (counted both; stop 70)
    assert c.copy_finished(first.copy_id, True, now) == [PublishReplica(first.copy_id, "a", "t", 10, False)]
    assert c.counters["hints_failed_total"] == 0
    c.check_invariants()


def test_a_copy_that_found_the_replica_there_copied_no_bytes() -> None:
    c = core()
    c.add_hint(hint("h1", obj("a", replicas=("s1",))), T0)
    (first,) = c.tick(T0)
    assert isinstance(first, StartCopy)
    c.copy_finished(first.copy_id, True, T0, made=False)
    assert c.counters["copies_ok_total"] == 1 and c.counters["copies_already_there_total"] == 1
    assert c.counters["bytes_copied_total"] == 0
    c.check_invariants()


def test_a_target_busy_for_ever_ends_the_want_in_bounded_time() -> None:
    """A target busy for hours (repair filling it) held the want, and an extra's budget, for as
    long (review of stop 68's fix): past COPY_BUSY_RETRIES_MAX busy answers in a row one counts
    as a failed attempt."""
    from kvfabric.core.prefetch import COPY_BUSY_RETRIES_MAX

    c = core(copy_attempts_max=1, copy_retry_backoff_ms=1)
    c.add_hint(hint("h1", obj("a", replicas=("s1", "s2")), deadline_ms=T0 + 10**9), T0)
    now = T0
    (copy,) = c.tick(now)
    for _ in range(COPY_BUSY_RETRIES_MAX):
        assert isinstance(copy, StartCopy)
        c.copy_finished(copy.copy_id, False, now, busy=True)
        assert c.has_hint("h1")
        now += 10_000
        (copy,) = c.tick(now)
    assert isinstance(copy, StartCopy)
    c.copy_finished(copy.copy_id, False, now, busy=True)  # one more: a failed attempt, the last
    assert not c.has_hint("h1") and c.counters["hints_failed_total"] == 1
    c.check_invariants()
