"""Slot table scenarios: short scripts of events with the expected outcome inline."""

from __future__ import annotations

import pytest

from kvfabric.core.segment_slots import Alloc, ReadGrant, SlotTable
from kvfabric.format.errors import BadRequest, NoCapacity, NotFound, StaleGeneration
from kvfabric.format.invariant import InvariantViolation

SUM = b"\x01" * 16  # a checksum; the table only stores and returns it
T0 = 1_000
TTL_MS = 500


def new_table(arena_bytes: int = 1024, *, alignment: int = 64, slots_max: int = 64) -> SlotTable:
    return SlotTable(arena_bytes, alignment=alignment, slots_max=slots_max)


def put(table: SlotTable, size: int, now_ms: int = T0) -> Alloc:
    a = table.alloc(size, now_ms, now_ms + TTL_MS)
    table.stored(a.slot, a.generation, SUM)
    return a


def test_alloc_write_store_read_free() -> None:
    t = new_table()
    a = t.alloc(100, T0, T0 + TTL_MS)
    assert a == Alloc(slot=0, generation=1, offset=0, size=100)
    assert (t.used_bytes, t.free_bytes, t.slots_in_use) == (128, 1024 - 128, 1)
    with pytest.raises(NotFound):  # nothing is readable before `stored`
        t.acquire(a.slot, a.generation, 100)
    t.stored(a.slot, a.generation, SUM)
    g = t.acquire(a.slot, a.generation, 100)
    assert g == ReadGrant(slot=0, generation=1, offset=0, size=100, checksum=SUM)
    t.release(a.slot, a.generation)
    assert t.free(a.slot, a.generation) == "freed"
    assert (t.used_bytes, t.slots_in_use, t.free_extents()) == (0, 0, [(0, 1024)])
    with pytest.raises(StaleGeneration):
        t.acquire(a.slot, a.generation, 100)
    t.check_invariants()


def test_free_during_read_is_deferred_and_the_extent_is_kept_until_release() -> None:
    t = new_table(256)
    a = put(t, 256)  # the whole arena
    t.acquire(a.slot, a.generation, 256)
    t.acquire(a.slot, a.generation, 256)  # two readers
    assert t.free(a.slot, a.generation) == "deferred"
    assert t.deferred_frees == 1 and t.used_bytes == 256
    with pytest.raises(StaleGeneration):  # no new reader from now on
        t.acquire(a.slot, a.generation, 256)
    with pytest.raises(NoCapacity):  # the extent is still held
        t.alloc(1, T0, T0 + TTL_MS)
    assert t.free(a.slot, a.generation) == "already_freed"
    t.release(a.slot, a.generation)
    with pytest.raises(NoCapacity):  # one reader left
        t.alloc(1, T0, T0 + TTL_MS)
    t.check_invariants()
    t.release(a.slot, a.generation)
    assert (t.deferred_frees, t.used_bytes, t.slots_in_use) == (0, 0, 0)
    b = t.alloc(256, T0, T0 + TTL_MS)
    assert (b.slot, b.generation, b.offset) == (a.slot, 2, 0)  # same id and extent, next generation
    assert t.counters["deferred_frees_completed_total"] == 1
    t.check_invariants()


def test_stale_generation_read_fails_and_is_counted() -> None:
    t = new_table()
    a = put(t, 64)
    assert t.free(a.slot, a.generation) == "freed"
    b = put(t, 64)
    assert (b.slot, b.generation, b.offset) == (a.slot, a.generation + 1, a.offset)  # reused
    with pytest.raises(StaleGeneration) as err:
        t.acquire(a.slot, a.generation, 64)
    assert err.value.details == {"kind": "slot_generation", "seen": 1, "current": 2}
    assert t.counters["stale_generation_rejected_total"] == 1
    assert t.acquire(b.slot, b.generation, 64).generation == 2
    with pytest.raises(NotFound):  # a generation never handed out
        t.acquire(b.slot, b.generation + 1, 64)
    with pytest.raises(NotFound):  # a slot id never used
        t.acquire(99, 1, 64)
    with pytest.raises(BadRequest):  # the size must match the stored object
        t.acquire(b.slot, b.generation, 65)
    t.check_invariants()


def test_double_free_is_idempotent_and_never_frees_the_next_object() -> None:
    t = new_table()
    a = put(t, 64)
    assert t.free(a.slot, a.generation) == "freed"
    assert t.free(a.slot, a.generation) == "already_freed"
    b = put(t, 64)
    assert b.slot == a.slot
    assert t.free(a.slot, a.generation) == "already_freed"  # a retried free of the old object
    assert t.acquire(b.slot, b.generation, 64).offset == b.offset
    with pytest.raises(NotFound):  # never handed out
        t.free(b.slot, b.generation + 1)
    assert t.counters["frees_already_freed_total"] == 2
    t.check_invariants()


def test_write_deadline_expiry_fences_the_write_and_reclaims_when_the_transport_lets_go() -> None:
    t = new_table(256)
    a = t.alloc(128, T0, T0 + 100)
    b = t.alloc(128, T0, T0 + 200)
    assert t.expire_writes(T0 + 99) == []
    assert t.expire_writes(T0 + 100) == [a.slot]  # at the deadline
    assert t.deferred_frees == 1 and t.used_bytes == 256  # the transport may still be writing
    with pytest.raises(StaleGeneration):  # the late write is never published...
        t.stored(a.slot, a.generation, SUM)
    assert t.used_bytes == 128  # ...and its extent comes back once the transport is done
    t.abort(a.slot, a.generation)  # always safe after a failed `stored`: a no-op now
    t.stored(b.slot, b.generation, SUM)
    assert t.expire_writes(T0 + 10_000) == []  # stored before its deadline
    c = t.alloc(64, T0 + 300, T0 + 400)
    assert (c.slot, c.offset) == (a.slot, 0)
    assert t.expire_writes(T0 + 400) == [c.slot]
    t.abort(c.slot, c.generation)  # the transport gives up: reclaimed
    assert (t.used_bytes, t.deferred_frees, t.writing) == (128, 0, 0)
    assert t.counters["writes_expired_total"] == 2
    t.check_invariants()


def test_abort_frees_a_write_and_free_of_a_write_waits_for_the_writer() -> None:
    t = new_table(256)
    a = t.alloc(100, T0, T0 + TTL_MS)
    t.abort(a.slot, a.generation)
    assert (t.used_bytes, t.slots_in_use) == (0, 0)
    b = t.alloc(100, T0, T0 + TTL_MS)
    assert (b.slot, b.generation) == (a.slot, 2)
    assert t.free(b.slot, b.generation) == "deferred"  # the transport still owns the bytes
    assert t.used_bytes == 128
    t.abort(b.slot, b.generation)
    assert (t.used_bytes, t.deferred_frees) == (0, 0)
    t.check_invariants()


def test_coalescing_and_fragmentation() -> None:
    t = new_table(512)
    a, b, c, d = (put(t, 128) for _ in range(4))
    assert t.free_bytes == 0 and t.fragmentation == 0.0
    t.free(b.slot, b.generation)
    t.free(d.slot, d.generation)
    assert t.free_extents() == [(128, 128), (384, 128)]
    assert (t.free_bytes, t.largest_free_bytes, t.fragmentation) == (256, 128, 0.5)
    with pytest.raises(NoCapacity):  # 256 free, but not in one piece
        t.alloc(129, T0, T0 + TTL_MS)
    t.free(c.slot, c.generation)  # merges with both neighbours
    assert t.free_extents() == [(128, 384)]
    assert t.fragmentation == 0.0
    assert t.alloc(384, T0, T0 + TTL_MS).offset == 128
    t.free(a.slot, a.generation)
    t.check_invariants()


def test_no_capacity_too_large_full_and_out_of_slot_ids() -> None:
    t = new_table(256, slots_max=2)
    with pytest.raises(NoCapacity):
        t.alloc(257, T0, T0 + TTL_MS)
    a, b = put(t, 64), put(t, 64)
    with pytest.raises(NoCapacity, match="slot id"):  # 128 bytes free but no slot id
        t.alloc(64, T0, T0 + TTL_MS)
    t.free(b.slot, b.generation)
    put(t, 192)  # fills the arena
    t.free(a.slot, a.generation)
    with pytest.raises(NoCapacity, match="no free extent"):  # a slot id but only 64 bytes
        t.alloc(65, T0, T0 + TTL_MS)
    assert t.counters["alloc_too_large_total"] == 1
    assert t.counters["alloc_no_slot_id_total"] == 1
    assert t.counters["alloc_no_extent_total"] == 1
    t.check_invariants()


def test_exact_fit_and_best_fit() -> None:
    t = new_table(1024)
    big, _, small, _ = put(t, 320), put(t, 64), put(t, 128), put(t, 64)  # 448..576 used, rest free
    t.free(big.slot, big.generation)
    t.free(small.slot, small.generation)
    assert t.free_extents() == [(0, 320), (384, 128), (576, 448)]
    assert t.alloc(128, T0, T0 + TTL_MS).offset == 384  # exact fit, not the first or the largest
    assert t.alloc(300, T0, T0 + TTL_MS).offset == 0  # smallest that fits
    assert t.free_extents() == [(576, 448)]
    assert t.alloc(448, T0, T0 + TTL_MS).offset == 576  # exactly the rest
    assert t.free_bytes == 0 and t.free_extents() == []
    t.check_invariants()


def test_alignment_rounds_extents_but_not_object_sizes() -> None:
    t = new_table(1024, alignment=64)
    a, b, c = (put(t, n) for n in (1, 65, 64))
    assert [x.offset for x in (a, b, c)] == [0, 64, 192]
    assert [x.size for x in (a, b, c)] == [1, 65, 64]
    assert t.used_bytes == 64 + 128 + 64
    assert t.acquire(b.slot, b.generation, 65).size == 65
    t1 = new_table(10, alignment=1)
    assert [t1.alloc(n, T0, T0 + 1).offset for n in (3, 3, 4)] == [0, 3, 6]
    with pytest.raises(InvariantViolation):
        SlotTable(1000, alignment=64)  # not a multiple of the alignment
    with pytest.raises(InvariantViolation):
        SlotTable(1024, alignment=48)  # not a power of two


def test_bad_requests() -> None:
    t = new_table()
    with pytest.raises(BadRequest):
        t.alloc(0, T0, T0 + TTL_MS)
    with pytest.raises(BadRequest):
        t.alloc(1, T0, T0)  # deadline already passed
    a = t.alloc(1, T0, T0 + TTL_MS)
    with pytest.raises(BadRequest):
        t.stored(a.slot, a.generation, b"")
    assert (t.used_bytes, t.slots_in_use) == (64, 1)
    t.check_invariants()


def test_caller_bugs_are_invariant_violations_and_change_nothing() -> None:
    t = new_table()
    a = put(t, 64)
    with pytest.raises(InvariantViolation):  # release without a reference
        t.release(a.slot, a.generation)
    with pytest.raises(InvariantViolation):  # stored twice
        t.stored(a.slot, a.generation, SUM)
    with pytest.raises(InvariantViolation):  # abort is for writes, free is for objects
        t.abort(a.slot, a.generation)
    with pytest.raises(InvariantViolation):  # never handed out
        t.stored(5, 1, SUM)
    t.acquire(a.slot, a.generation, 64)
    t.release(a.slot, a.generation)
    with pytest.raises(InvariantViolation):  # released twice
        t.release(a.slot, a.generation)
    assert t.free(a.slot, a.generation) == "freed"
    t.check_invariants()


def test_generations_only_grow_across_reuse() -> None:
    t = new_table(64, slots_max=1)
    seen = []
    for i in range(5):
        a = t.alloc(64, T0, T0 + TTL_MS)
        seen.append((a.slot, a.generation))
        if i % 2:
            t.abort(a.slot, a.generation)
        else:
            t.stored(a.slot, a.generation, SUM)
            t.free(a.slot, a.generation)
    assert seen == [(0, 1), (0, 2), (0, 3), (0, 4), (0, 5)]


def test_deadline_heap_stays_bounded_when_writes_finish_early() -> None:
    t = new_table(1024, slots_max=4)
    slow = [t.alloc(64, T0, T0 + 10 * TTL_MS) for _ in range(2)]  # stay WRITING throughout
    for _ in range(1_000):
        a = put(t, 64)
        t.free(a.slot, a.generation)
    assert len(t._deadlines) <= 2 * t.writing + 64 + 1  # white box: the heap was compacted
    assert t.expire_writes(T0 + TTL_MS) == []
    assert sorted(t.expire_writes(T0 + 10 * TTL_MS)) == sorted(a.slot for a in slow)  # not dropped
