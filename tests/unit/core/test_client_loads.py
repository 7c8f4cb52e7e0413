"""Scenario scripts for the client load table: coalescing, cancel, late completion, failure,
timeout, busy, and the write fence."""

from __future__ import annotations

import pytest

from kvfabric.core.client_loads import (
    Busy,
    CancelTransfer,
    Deliver,
    Effect,
    Fail,
    LoadTable,
    ReleaseStaging,
    StartTransfer,
    TransferId,
)
from kvfabric.format.errors import BadRequest, StaleGeneration
from kvfabric.format.generations import RequestGeneration as G
from kvfabric.format.invariant import InvariantViolation

T1 = TransferId(1)
T2 = TransferId(2)


def table(**kw: int) -> LoadTable:
    return LoadTable(transfers_max=kw.pop("transfers_max", 4), **kw)


def want(
    t: LoadTable, load: int, gen: int, obj: bytes, dest: str, now: int = 0, deadline: int = 100
) -> list[Effect]:
    effects = t.want(load, G(gen), obj, dest, now_ms=now, deadline_ms=deadline)
    t.check_invariants()
    return effects


def test_coalescing_two_wants_one_transfer_two_delivers() -> None:
    t = table()
    assert want(t, 1, 1, b"x", "d1") == [StartTransfer(T1, b"x", 0)]
    assert want(t, 2, 1, b"x", "d2") == []
    assert t.transfer_done(T1, ok=True) == [Deliver(1, G(1), "d1", T1), Deliver(2, G(1), "d2", T1)]
    assert t.may_write(1, G(1), "d1") and t.may_write(2, G(1), "d2")
    assert t.delivered(1, G(1), "d1") == []
    assert t.delivered(2, G(1), "d2") == [ReleaseStaging(T1)]
    t.check_invariants()
    assert t.waiters_live == 0 and t.transfers_held == 0
    assert t.counters["joins_total"] == 1 and t.counters["waiters_delivered_total"] == 2


def test_join_after_bytes_arrived_delivers_at_once() -> None:
    t = table()
    want(t, 1, 1, b"x", "d1")
    t.transfer_done(T1, ok=True)
    assert want(t, 2, 1, b"x", "d2") == [Deliver(2, G(1), "d2", T1)]


def test_cancel_one_of_two_transfer_continues() -> None:
    t = table()
    want(t, 1, 1, b"x", "d1")
    want(t, 2, 1, b"x", "d2")
    assert t.cancel(1) == []
    assert not t.may_write(1, G(1), "d1")
    assert t.transfer_done(T1, ok=True) == [Deliver(2, G(1), "d2", T1)]
    assert t.delivered(2, G(1), "d2") == [ReleaseStaging(T1)]


def test_cancel_last_cancels_transfer_and_late_completion_only_releases_staging() -> None:
    t = table()
    want(t, 1, 1, b"x", "d1")
    want(t, 2, 1, b"x", "d2")
    assert t.cancel(1) == []
    assert t.cancel(2) == [CancelTransfer(T1)]
    assert t.transfers_held == 1  # the transport may still write into the staging buffer
    assert t.cancel(2) == [] and t.counters["cancel_unknown_total"] == 1
    # A new want for the object starts a new transfer; the cancelled one is no longer joinable.
    assert want(t, 3, 2, b"x", "d1") == [StartTransfer(T2, b"x", 0)]
    assert t.transfer_done(T1, ok=True) == [ReleaseStaging(T1)]
    assert t.counters["late_completions_total"] == 1
    assert not t.may_write(1, G(1), "d1") and not t.may_write(3, G(2), "d1")  # T2 still fetching
    assert t.transfer_done(T1, ok=True) == [] and t.counters["transfer_done_unknown_total"] == 1
    t.check_invariants()


def test_failure_wakes_every_waiter_and_counts_cause() -> None:
    t = table()
    want(t, 1, 1, b"x", "d1")
    want(t, 2, 1, b"x", "d2")
    assert t.transfer_done(T1, ok=False, cause="segment_down") == [
        Fail(1, "segment_down"),
        Fail(2, "segment_down"),
        ReleaseStaging(T1),
    ]
    t.check_invariants()
    assert t.counters["transfers_failed_segment_down_total"] == 1
    assert t.counters["waiters_failed_segment_down_total"] == 2
    assert t.waiters_live == 0 and t.transfers_held == 0
    # Retry (the shell's budget): a new generation for the same dest starts a new transfer.
    assert want(t, 3, 2, b"x", "d1") == [StartTransfer(T2, b"x", 0)]


def test_timeout_fails_waiter_and_fences_its_late_completion() -> None:
    t = table()
    want(t, 1, 1, b"x", "d1", deadline=50)
    want(t, 2, 1, b"x", "d2", deadline=80)
    assert t.expire(49) == []
    assert t.expire(50) == [Fail(1, "timeout")]
    t.check_invariants()
    assert t.expire(80) == [Fail(2, "timeout"), CancelTransfer(T1)]
    assert t.transfer_done(T1, ok=True) == [ReleaseStaging(T1)]
    assert not t.may_write(1, G(1), "d1") and not t.may_write(2, G(1), "d2")
    assert t.counters["waiters_failed_timeout_total"] == 2


def test_timeout_while_delivering_fences_the_copy() -> None:
    t = table()
    want(t, 1, 1, b"x", "d1", deadline=50)
    t.transfer_done(T1, ok=True)
    assert t.expire(60) == [Fail(1, "timeout"), ReleaseStaging(T1)]
    assert not t.may_write(1, G(1), "d1")
    with pytest.raises(InvariantViolation):
        t.delivered(1, G(1), "d1")


def test_busy_when_transfers_max_reached_and_joins_still_accepted() -> None:
    t = table(transfers_max=1)
    want(t, 1, 1, b"x", "d1")
    assert want(t, 2, 1, b"y", "d2") == [Busy(2, "transfers")]
    assert want(t, 3, 1, b"x", "d3") == []  # joining needs no new transfer
    assert t.waiters_live == 2 and t.counters["busy_transfers_total"] == 1
    t.cancel(1)
    t.cancel(3)  # CANCELLED still holds the staging buffer: still busy
    assert want(t, 4, 2, b"y", "d2") == [Busy(4, "transfers")]
    t.transfer_done(T1, ok=False, cause="cancelled")
    assert want(t, 5, 3, b"y", "d2") == [StartTransfer(T2, b"y", 0)]


def test_busy_when_inflight_bytes_full() -> None:
    t = LoadTable(transfers_max=8, inflight_bytes_max=100)
    assert t.want(1, G(1), b"x", "d1", now_ms=0, deadline_ms=9, size_bytes=60) == [
        StartTransfer(T1, b"x", 60)
    ]
    assert t.want(2, G(1), b"y", "d2", now_ms=0, deadline_ms=9, size_bytes=60) == [Busy(2, "bytes")]
    with pytest.raises(BadRequest):
        t.want(3, G(1), b"z", "d3", now_ms=0, deadline_ms=9, size_bytes=101)
    t.check_invariants()
    assert t.held_bytes == 60


def test_may_write_fence_old_generation_and_stale_want() -> None:
    t = table()
    want(t, 1, 5, b"x", "d1")
    assert not t.may_write(1, G(5), "d1")  # not delivering yet
    t.transfer_done(T1, ok=True)
    assert not t.may_write(1, G(4), "d1") and not t.may_write(1, G(5), "d2")
    assert t.may_write(1, G(5), "d1")
    t.cancel(1)
    assert not t.may_write(1, G(5), "d1")
    with pytest.raises(StaleGeneration):
        want(t, 2, 5, b"x", "d1")  # the dest's generation must grow
    assert t.counters["stale_generation_total"] == 1
    assert want(t, 2, 6, b"x", "d1") == [StartTransfer(T2, b"x", 0)]
    t.transfer_done(T2, ok=True)
    assert not t.may_write(1, G(5), "d1") and t.may_write(2, G(6), "d1")


def test_caller_bugs_are_invariant_violations() -> None:
    t = table()
    want(t, 1, 1, b"x", "d1", now=10)
    with pytest.raises(InvariantViolation):
        want(t, 1, 1, b"y", "d2", now=10)  # load id live
    with pytest.raises(InvariantViolation):
        want(t, 2, 2, b"y", "d1", now=10)  # dest held
    with pytest.raises(InvariantViolation):
        t.expire(9)  # time went backwards
    with pytest.raises(InvariantViolation):
        t.delivered(1, G(1), "d1")  # not delivering
