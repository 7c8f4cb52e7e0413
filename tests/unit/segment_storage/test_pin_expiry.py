"""A local pin lapses with its read tokens (plus the clock skew tolerance), or `PIN_HOLD_MS_MAX`
after it was taken when the segment needs no tokens (review, 2026-12-06). Before, a tenant could
pin objects (PIN_LOCAL, up to 64 grants a connection), release its lease and evict them: the
segment deferred the frees behind the pins and reported them done, so the directory gave the
bytes back to the tenant's quota and the segment's reservation while the arena still held them,
for as long as the connection lived; pin, evict, write again, repeat."""

from __future__ import annotations

from pathlib import Path

import msgspec

from kvfabric.core.segment_slots import SlotTable
from kvfabric.format.checksum import checksum
from kvfabric.format.ids import ObjectKey
from kvfabric.proto.dataplane import ReadRef
from kvfabric.proto.directory import WriteTicket
from kvfabric.proto.tickets import read_token, sign_ticket
from kvfabric.segment_storage.arena import Arena
from kvfabric.segment_storage.backend import ArenaBackend
from kvfabric.segment_storage.backend_reads import PIN_HOLD_MS_MAX, PIN_HOLD_MS_MIN

SECRET = b"unit-pin-secret-0123456789abcd"
SEGMENT = "pinseg"
INCARNATION = 3
ARENA_BYTES = 4 << 20
SKEW_MS = 5_000


def backend(tmp: Path, clock: list[int], *, tokens: bool) -> ArenaBackend:
    return ArenaBackend(
        Arena(tmp, SEGMENT, INCARNATION, ARENA_BYTES),
        SlotTable(ARENA_BYTES),
        segment_id=SEGMENT,
        incarnation=INCARNATION,
        secret=SECRET,
        confirm=lambda *_: "ok",
        clock_ms=lambda: clock[0],
        read_tokens_required=tokens,
        clock_skew_tolerance_ms=SKEW_MS,
    )


def store(b: ArenaBackend, data: bytes, key: bytes, now: int, expires_ms: int) -> ReadRef:
    ticket = WriteTicket(
        ticket_id=int.from_bytes(key[-4:], "big"),
        key=ObjectKey(key),
        segment_id=SEGMENT,
        incarnation=INCARNATION,
        size_bytes=len(data),
        checksum=checksum(data),
        writer_id="w",
        deadline_ms=now + 30_000,
        epoch=1,
    )
    put = b.begin_put(sign_ticket(ticket, SECRET), conn=0)
    put.view[:] = data
    slot, generation = b.finish_put(put, conn=0)
    ref = ReadRef(INCARNATION, slot, generation, len(data))
    token = read_token(SECRET, SEGMENT, INCARNATION, slot, generation, len(data), expires_ms)
    return msgspec.structs.replace(ref, token=token, expires_ms=expires_ms)


def test_a_pin_lapses_with_its_tokens_and_the_deferred_free_completes(tmp_path: Path) -> None:
    clock = [1_000_000]
    b = backend(tmp_path, clock, tokens=True)
    try:
        refs = [store(b, b"x" * 65536, b"key-%04d" % i, clock[0], clock[0] + 30_000) for i in range(8)]
        grants = b.pin_local(refs, conn=9)
        assert [g.status for g in grants.grants] == ["ok"] * 8
        assert b.free_slots([(r.slot, r.slot_generation) for r in refs])  # deferred: pinned
        assert b.slots.used_bytes == 8 * 65536
        clock[0] += 30_000 + SKEW_MS - 1
        assert b.expire_pins() == 0  # not yet
        clock[0] += 1
        assert b.expire_pins() == 1
        assert b.slots.used_bytes == 0  # the arena bytes the directory freed are back
        assert b.unpin_local(grants.grant_id, conn=9) == 0  # a late unpin finds nothing
    finally:
        b.arena.close()


def test_without_tokens_a_pin_lapses_after_the_hold_maximum(tmp_path: Path) -> None:
    clock = [1_000_000]
    b = backend(tmp_path, clock, tokens=False)
    try:
        (ref,) = [store(b, b"y" * 4096, b"key-9999", clock[0], 0)]
        b.pin_local([ref], conn=4)
        clock[0] += PIN_HOLD_MS_MAX - 1
        assert b.expire_pins() == 0
        clock[0] += 1
        assert b.expire_pins() == 1
    finally:
        b.arena.close()


def test_an_unpinned_grant_is_not_expired_again(tmp_path: Path) -> None:
    clock = [1_000_000]
    b = backend(tmp_path, clock, tokens=True)
    try:
        ref = store(b, b"z" * 4096, b"key-0001", clock[0], clock[0] + 1_000)
        grants = b.pin_local([ref], conn=2)
        assert b.unpin_local(grants.grant_id, conn=2) == 1
        clock[0] += 10 * PIN_HOLD_MS_MAX
        assert b.expire_pins() == 0
    finally:
        b.arena.close()


def test_a_pin_outlasts_the_copy_it_protects_whatever_its_tokens_say(tmp_path: Path) -> None:
    """A pin taken with tokens a second from expiry is held `PIN_HOLD_MS_MIN` anyway: it is the
    local reference of a copy in progress, and a timeout never lets memory be reused while a
    transfer runs (DESIGN invariant 3)."""
    clock = [1_000_000]
    b = backend(tmp_path, clock, tokens=True)
    try:
        ref = store(b, b"w" * 4096, b"key-0002", clock[0], clock[0] + 1_000)
        b.pin_local([ref], conn=3)
        clock[0] += PIN_HOLD_MS_MIN - 1
        assert b.expire_pins() == 0
        clock[0] += 1
        assert b.expire_pins() == 1
    finally:
        b.arena.close()
