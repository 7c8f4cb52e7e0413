"""The directory core's tables (issue 26 item 1): every queue stays within its named bound while
it keeps doing its job, and the tables' own checks catch a drift between them."""

from __future__ import annotations

import pytest

from kvfabric.core.directory.base import HEAP_SLACK_MIN
from kvfabric.format.invariant import InvariantViolation
from kvfabric.proto import directory as m

from .dirkit import groups, key, lookup, new_core, put, register, spec

ROUNDS = 3 * HEAP_SLACK_MIN


def test_renewing_a_lease_keeps_its_expiry_heap_bounded_and_its_expiry_right() -> None:
    core = new_core()
    register(core, "s1")
    (g,) = groups(1)
    put(core, [key(g)])
    lease = lookup(core, [g], ttl=1_000)
    for now in range(1, ROUNDS + 1):  # each renewal pushes a later expiry
        renewed = core.handle(
            m.LeaseRenew(holder_id="reader", lease_id=lease.lease_id, lease_ttl_ms=1_000), now
        )
        assert isinstance(renewed.reply, m.LeaseReply) and renewed.reply.expires_ms == now + 1_000
        register(core, "s1", now=now)  # keep the segment's heartbeat fresh
    assert len(core.lease_table._heap) <= 2 * core.leases_held + HEAP_SLACK_MIN
    core.check_invariants()
    core.tick(ROUNDS + 999)
    assert core.leases_held == 1
    core.tick(ROUNDS + 1_000)
    assert core.leases_held == 0 and core.counters["leases_expired_total"] == 1
    core.check_invariants()


def test_aborted_writes_leave_the_deadline_heap_bounded() -> None:
    core = new_core()
    register(core, "s1")
    (g,) = groups(1)
    for i in range(ROUNDS):
        core.handle(m.PutBegin(writer_id="w", request_id=f"b{i}", objects=[spec(key(g))]), 0)
        aborted = core.handle(m.PutAbort(writer_id="w", request_id=f"a{i}", keys=[key(g)]), 0).reply
        assert isinstance(aborted, m.PutAbortReply) and aborted.aborted == 1
    assert len(core.write_table._deadlines) <= 2 * core.pending_objects + HEAP_SLACK_MIN
    core.check_invariants()


def test_aborted_replica_copies_leave_the_deadline_heap_bounded() -> None:
    core = new_core()
    register(core, "s1")
    register(core, "s2")
    (g,) = groups(1)
    put(core, [key(g)])
    for i in range(ROUNDS):
        begin = core.handle(
            m.ReplicateBegin(writer_id="repair", request_id=f"r{i}", key=key(g), segment_id="s2"), 0
        ).reply
        assert isinstance(begin, m.ReplicateBeginReply) and begin.status == "placed"
        core.handle(m.PutAbort(writer_id="repair", request_id=f"a{i}", keys=[key(g)]), 0)
    assert len(core.replica_table._deadlines) <= 2 * len(core.replica_table.tickets) + HEAP_SLACK_MIN
    core.check_invariants()


def test_the_sweep_queue_holds_each_group_once_however_many_segments_die() -> None:
    core = new_core()
    register(core, "s1", capacity=1 << 30)
    gs = groups(10)
    put(core, [key(g) for g in gs])
    for incarnation in range(1, 51):  # a segment holding nothing restarts 50 times
        register(core, "s9", incarnation=incarnation)
    assert len(core.published_table._sweep_queue) == len(core.published) == 10
    core.check_invariants()
    core.tick(0)
    assert not core.published_table._sweep_queue and len(core.published) == 10
    assert lookup(core, gs).hit_chunks == 10
    core.check_invariants()


def test_the_checks_catch_a_lease_count_that_no_lease_holds() -> None:
    core = new_core()
    register(core, "s1")
    (g,) = groups(1)
    put(core, [key(g)])
    lookup(core, [g])
    core.check_invariants()
    gid = next(iter(core.published))
    core.published_table.lease_count[gid] += 1
    with pytest.raises(InvariantViolation, match="lease counts differ"):
        core.check_invariants()
