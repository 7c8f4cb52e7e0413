"""The disk tier's slot table: allocator, slot state machine and the crash-consistent index protocol.

Synchronous and I/O-free: no clock, no threads, no files. The segment's disk tier
(`kvfabric.segment_storage.ssd`) owns the file and does every read, write and sync; it asks this
table where an object goes, which index record to write when, and whether a read naming
(slot, generation) may touch the bytes. The on-disk encodings are `kvfabric.core.disk_records`.
Besides the methods, one entry stands for them all: `step(event, now_ms)` (`kvfabric.core.step`;
the events in `kvfabric.core.disk_slots_events`, each answer a `Reply`).

## Slots
A local slot id is below `slots_max` and has one index record on disk; an object is (slot,
generation, extent of the data region, size, checksum, key). Generations start at 1, only grow,
and are bumped when a free (or an abort) is accepted, so a (slot, generation) pair names at most
one object. A free record carries the slot's next generation, so generations survive a restart
(a slot whose record does not decode starts again at 1: the segment's new incarnation fences
every reference of the old one anyway). Extents are `size` rounded up to `block_bytes`, best-fit
(`kvfabric.core.extents`).

## The write protocol (what makes a crash at any instant safe)
    FREE --alloc--> WRITING             the shell writes the data, then makes it durable (sync)
    WRITING --begin_commit--> COMMITTING   returns the commit record; the shell writes + syncs it
    COMMITTING --end_commit(durable)--> STORED            readable from now on
    COMMITTING --end_commit(failed)--> UNLINKING          the record may be on disk: unlink it
    WRITING --abort--> FREE             nothing on disk names the slot
    STORED --free--> UNLINKING          returns the free record; the shell writes + syncs it
    UNLINKING --unlinked--> FREE        once no reader holds it (else at the last release)
    WRITING/COMMITTING --free--> fenced: the writer finds out at begin_commit (the write is
        dropped, FREE) or end_commit (UNLINKING: the commit record may be on disk)
Two rules, enforced by these states, make every state of the disk recoverable:
1. A commit record is handed out only after the writer says its data is durable
   (`begin_commit`), so a record that decodes names complete bytes.
2. An extent (and its slot id) is handed out again only after the free record that superseded its
   commit record is durable (`unlinked`): a commit record that might still be on disk never names
   bytes that were overwritten. Until then the extent is held (UNLINKING).
A record write torn by a crash does not decode (record checksum): that slot is free after
recovery, which loses only an object whose commit had not been acknowledged, or one being freed.

## Recovery
`recover(records)` rebuilds the table from the index as read at start: every commit record whose
extent lies inside the data region and overlaps no earlier one, whose size is 1..`size_max` and
whose generation is at most `GENERATION_RECOVERED_MAX` is STORED again under its slot and
generation; one that is not is dropped and comes back as UNLINKING (its free record must be
written, and synced, before anything is allocated: `alloc` refuses until then, since the dropped
record's extent may overlap space handed out next). Free records restore generations up to
`GENERATION_RECOVERED_MAX`; a slot whose record names a larger one starts again at 1 (a dropped
commit's free record then carries 1), as one whose record does not decode.

## Invariants (`check_invariants()` in tests, after every step)
1. Read protection: an extent with a reader reference is never handed out again; a free while
   reads run is completed at the last `release`.
2. Generations fence stale actors: only the current generation of a STORED slot is acquired; an
   older one is `StaleGeneration`, counted, never applied.
3. Live extents (WRITING, COMMITTING, STORED, UNLINKING) and free extents tile the data region.
4. No leaks: `used_bytes + free_bytes == data_bytes`; once everything is freed and unlinked,
   `used_bytes == 0`.
5. Nothing is readable before `end_commit(durable=True)`.

## Ownership
- `alloc` -> the writer owns the extent until `begin_commit` returns None (the write was freed
  meanwhile: the extent is reclaimed), `abort`, or `end_commit`. After `end_commit` returns a free
  record, the writer writes it and calls `unlinked`.
- `free` -> a returned record is the caller's to write, then `unlinked`. If that write fails, the
  caller hands it back (`unlink_failed`): the slot stays UNLINKING (its extent held) and
  `take_failed_unlinks()` hands it out once more, to one caller. Each record on its own: of
  records handed out together, those written and synced are `unlinked` and those whose write
  failed handed back (one bad index sector must not hold the others back). Never a record whose write is
  still under way elsewhere: a retry that rewrote such a record after its slot was reused wrote
  a stale free record over the new object's commit record (review, 2026-12-05).
  `pending_unlinks()` lists every record handed out and not yet durable (tests, models).
  `free_durable(slot, generation)` says whether a free of that object may be acknowledged to
  whoever asked for it: not while its record (or a fenced write's) may still not be durable.
- `acquire` -> one reference until `release`.
- Callers track what they hold: `begin_commit`/`end_commit`/`abort` of a slot not in that state
  at that generation, `release` without a reference or `unlinked` of a record not handed out are
  bugs (`InvariantViolation`). Remote requests (`acquire`, `free`) get operating errors.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

from kvfabric.core import disk_slots_events
from kvfabric.core.disk_records import BLOCK_BYTES, KEY_BYTES_MAX, Record
from kvfabric.core.disk_slots_events import DiskSlotEvent, DiskSlotOutput
from kvfabric.core.extents import ExtentAllocator, round_up
from kvfabric.core.step import not_before
from kvfabric.format.errors import BadRequest, NoCapacity, NotFound, StaleGeneration
from kvfabric.format.generations import GENERATION_MAX
from kvfabric.format.invariant import invariant

__all__ = ["GENERATION_RECOVERED_MAX", "DiskAlloc", "DiskFree", "DiskGrant", "DiskHeld", "DiskSlotTable"]

STALE_KIND: Final = "slot_generation"
# The largest generation recovery takes from a record. A table bumps a slot's generation once per
# free, so a record above this is none it wrote (2**63 frees of one slot, a million a second, take
# 290,000 years): a crafted or damaged one with a valid digest. Taken, one just below
# GENERATION_MAX gave the slot's next object GENERATION_MAX, whose free then hit the "generation
# exhausted" invariant, and whose commit record did not decode at the next start (stop 70's list).
GENERATION_RECOVERED_MAX: Final = 2**63
_State = Literal["writing", "committing", "stored", "unlinking"]
FreeResult = Literal["freed", "deferred", "already_freed"]


@dataclass(frozen=True, slots=True)
class DiskAlloc:
    """A slot being written: the writer owns `[offset, offset + extent_bytes)` of the data region."""

    slot: int
    generation: int
    offset: int
    size: int
    extent_bytes: int


@dataclass(frozen=True, slots=True)
class DiskFree:
    """What a free did: `record` (a free record) is the caller's to write, then `unlinked`."""

    result: FreeResult
    record: Record | None


@dataclass(frozen=True, slots=True)
class DiskGrant:
    slot: int
    generation: int
    offset: int
    size: int
    extent_bytes: int
    checksum: bytes


@dataclass(frozen=True, slots=True)
class DiskHeld:
    slot: int
    generation: int
    size: int
    checksum: bytes
    key: bytes


@dataclass(slots=True)
class _DSlot:
    generation: int  # the object's generation (the slot's current one is this + 1 once fenced)
    offset: int
    extent_bytes: int
    size: int
    key: bytes
    state: _State = "writing"
    checksum: bytes = b""
    readers: int = 0
    fenced: bool = False  # a free was accepted while writing or committing
    unlinked: bool = False  # UNLINKING: the free record is durable; waits for the last reader
    retry: bool = False  # UNLINKING: its free record's write failed; `take_failed_unlinks` hands it out


class DiskSlotTable:
    """One disk tier's slot table. See the module docstring for the protocol and invariants."""

    def __init__(self, data_bytes: int, slots_max: int, *, block_bytes: int = BLOCK_BYTES) -> None:
        invariant(slots_max >= 1, "slots_max must be at least 1", slots_max=slots_max)
        self.data_bytes: Final = data_bytes
        self.slots_max: Final = slots_max
        self.block_bytes: Final = block_bytes
        self._extents = ExtentAllocator(data_bytes, block_bytes)
        self._slots: dict[int, _DSlot] = {}
        self._retry_slots: set[int] = set()  # slots whose free record failed (`unlink_failed`)
        self._generations: dict[int, int] = {}  # slot id -> current generation, where not 1
        self._next_id = 0  # ids from here up were never handed out (or restored)
        self._free_ids: list[int] = []  # heap of reclaimed ids below `_next_id`
        self._used_bytes = 0
        self._stored = 0
        self._stored_bytes = 0
        self._recovery_unlinks = 0  # dropped records whose free records are not durable yet
        self.counters: dict[str, int] = {}
        self._step_ms = 0  # the latest time given to `step`

    def step(self, event: DiskSlotEvent, now_ms: int) -> list[DiskSlotOutput]:
        """The one entry (`kvfabric.core.step`): `event` as the method of the same meaning, its
        answer as one `Reply`. Nothing here depends on the time, but time going backwards is
        refused as by every core."""
        self._step_ms = not_before(self._step_ms, now_ms)
        return disk_slots_events.dispatch(self, event)

    # ---- recovery ----------------------------------------------------------------------------

    @classmethod
    def recover(
        cls,
        data_bytes: int,
        records: Sequence[Record | None],
        *,
        block_bytes: int = BLOCK_BYTES,
        size_max: int | None = None,
    ) -> tuple[DiskSlotTable, list[Record]]:
        """A table holding what the index `records` (one per slot id, None where a record did not
        decode) names, and the free records to write for commit records that were dropped
        (outside the data region, overlapping an earlier one, malformed: a size of 0 or above
        `size_max` (None: the data region bounds it), a generation above
        `GENERATION_RECOVERED_MAX`, a key longer than a record holds): those slots are UNLINKING
        until `unlinked`. A record of another slot is a bug of the caller (`InvariantViolation`)."""
        table = cls(data_bytes, len(records), block_bytes=block_bytes)
        unlinks: list[Record] = []
        for slot, record in enumerate(records):
            if record is None:
                continue
            invariant(record.slot == slot, "record of another slot", slot=slot, record_slot=record.slot)
            if record.kind == "free":
                if 1 < record.generation <= GENERATION_RECOVERED_MAX:  # above: the slot starts at 1
                    table._generations[slot] = record.generation
                continue
            extent = round_up(record.size, block_bytes) if record.size > 0 else 0
            ok = (
                extent > 0
                and (size_max is None or record.size <= size_max)
                and len(record.checksum) == 16
                and len(record.key) <= KEY_BYTES_MAX
                and 1 <= record.generation <= GENERATION_RECOVERED_MAX
                and table._extents.take_at(record.offset, extent)
            )
            if not ok:
                table._count("recovery_dropped_total")
                # A generation past the bound is not carried on (its successor would be too): the
                # slot starts again at 1, its free record carrying 1 (stop 70's list).
                generation = record.generation if 1 <= record.generation <= GENERATION_RECOVERED_MAX else 0
                table._generations[slot] = generation + 1
                rec = _DSlot(generation, 0, 0, max(record.size, 0), record.key, "unlinking")
                table._slots[slot] = rec
                unlinks.append(Record("free", slot, generation + 1))
                table._recovery_unlinks += 1
                continue
            table._generations[slot] = record.generation
            table._slots[slot] = _DSlot(
                record.generation, record.offset, extent, record.size, record.key, "stored", record.checksum
            )
            table._used_bytes += extent
            table._stored += 1
            table._stored_bytes += record.size
            table._count("recovered_objects_total")
            table._count("recovered_bytes_total", record.size)
        table._next_id = max(table._slots, default=-1) + 1
        table._free_ids = [s for s in range(table._next_id) if s not in table._slots]
        heapq.heapify(table._free_ids)
        return table, unlinks

    # ---- stats -------------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        """Bytes of extents held by WRITING, COMMITTING, STORED and UNLINKING slots."""
        return self._used_bytes

    @property
    def free_bytes(self) -> int:
        return self.data_bytes - self._used_bytes

    @property
    def largest_free_bytes(self) -> int:
        return self._extents.largest_free_bytes

    @property
    def objects(self) -> int:
        """STORED objects (readable)."""
        return self._stored

    @property
    def stored_bytes(self) -> int:
        """Bytes of the STORED objects (their sizes, not their extents)."""
        return self._stored_bytes

    @property
    def slots_in_use(self) -> int:
        return len(self._slots)

    def free_extents(self) -> list[tuple[int, int]]:
        return self._extents.extents()

    # ---- writes ------------------------------------------------------------------------------

    def alloc(self, size: int, key: bytes) -> DiskAlloc:
        """FREE -> WRITING: where to write an object of `size` bytes. `NoCapacity` when no slot id
        or no extent is free."""
        invariant(self._recovery_unlinks == 0, "alloc before the recovery's free records are durable")
        if size <= 0:
            raise BadRequest("object size must be positive", size=size)
        if len(key) > KEY_BYTES_MAX:
            raise BadRequest("key too long for the disk index", key_bytes=len(key), limit=KEY_BYTES_MAX)
        extent = round_up(size, self.block_bytes)
        if extent > self.data_bytes:
            self._count("alloc_too_large_total")
            raise NoCapacity("object larger than the disk tier", size=size, data_bytes=self.data_bytes)
        if not self._free_ids and self._next_id >= self.slots_max:
            self._count("alloc_no_slot_id_total")
            raise NoCapacity("every disk slot id is in use", slots_max=self.slots_max)
        offset = self._extents.take(extent)
        if offset is None:
            self._count("alloc_no_extent_total")
            raise NoCapacity(
                "no free disk extent fits",
                size=size,
                free_bytes=self.free_bytes,
                largest_free_bytes=self.largest_free_bytes,
            )
        if self._free_ids:
            slot = heapq.heappop(self._free_ids)
        else:
            slot = self._next_id
            self._next_id += 1
        invariant(slot not in self._slots, "allocated a disk slot id in use", slot=slot)
        generation = self._generations.get(slot, 1)
        self._slots[slot] = _DSlot(generation, offset, extent, size, key)
        self._used_bytes += extent
        self._count("allocs_total")
        return DiskAlloc(slot, generation, offset, size, extent)

    def begin_commit(self, slot: int, generation: int, checksum: bytes) -> Record | None:
        """WRITING -> COMMITTING: the data is durable; returns the commit record to write (and sync).
        None when the write was freed meanwhile: nothing was committed, the extent is reclaimed and
        the writer is done."""
        rec = self._writer_slot(slot, generation, "writing", "begin_commit")
        if len(checksum) != 16:
            raise BadRequest("checksum must be 16 bytes", slot=slot)
        if rec.fenced:
            self._count("writes_fenced_total")
            self._reclaim(slot, rec)
            return None
        rec.state = "committing"
        rec.checksum = checksum
        return Record("commit", slot, generation, rec.offset, rec.size, checksum, rec.key)

    def end_commit(self, slot: int, generation: int, durable: bool) -> Record | None:
        """COMMITTING -> STORED when the commit record is durable and no free came meanwhile
        (returns None). Otherwise -> UNLINKING (the record may be on disk): returns the free record
        the writer must write, then `unlinked`."""
        rec = self._writer_slot(slot, generation, "committing", "end_commit")
        if durable and not rec.fenced:
            rec.state = "stored"
            self._stored += 1
            self._stored_bytes += rec.size
            self._count("writes_stored_total")
            self._count("bytes_stored_total", rec.size)
            return None
        if not rec.fenced:
            self._bump(slot, rec)
            self._count("commits_failed_total")
        else:
            self._count("writes_fenced_total")
        rec.state = "unlinking"
        return Record("free", slot, generation + 1)

    def abort(self, slot: int, generation: int) -> None:
        """WRITING -> FREE: the writer gives up before `begin_commit` (nothing on disk names it)."""
        rec = self._writer_slot(slot, generation, "writing", "abort")
        if not rec.fenced:
            self._bump(slot, rec)
        self._count("writes_aborted_total")
        self._reclaim(slot, rec)

    # ---- frees -------------------------------------------------------------------------------

    def free(self, slot: int, generation: int) -> DiskFree:
        """Give an object up. STORED -> UNLINKING with the free record to write ("freed", or
        "deferred" while readers hold it: reclaimed at the last release after `unlinked`). A slot
        still being written or committed is fenced ("deferred", no record: the writer finds out).
        An old generation is "already_freed"; one never handed out is `NotFound`."""
        rec = self._slots.get(slot)
        if rec is not None and rec.generation == generation and not rec.fenced and rec.state != "unlinking":
            self._bump(slot, rec)
            self._count("frees_total")
            if rec.state != "stored":
                rec.fenced = True
                self._count("frees_of_writes_total")
                return DiskFree("deferred", None)
            rec.state = "unlinking"
            self._stored -= 1
            self._stored_bytes -= rec.size
            if rec.readers:
                self._count("frees_deferred_total")
            return DiskFree("deferred" if rec.readers else "freed", Record("free", slot, generation + 1))
        if 1 <= generation < self._current(slot):
            self._count("frees_already_freed_total")
            return DiskFree("already_freed", None)
        self._count("unknown_slot_rejected_total")
        raise NotFound("no such disk slot generation", slot=slot, generation=generation)

    def unlinked(self, slot: int, record_generation: int) -> None:
        """The free record (`Record("free", slot, record_generation)`) is durable: the slot's
        extent and id are free once no reader holds them."""
        rec = self._slots.get(slot)
        invariant(
            rec is not None
            and rec.state == "unlinking"
            and not rec.unlinked
            and rec.generation + 1 == record_generation,
            "unlinked a slot that is not being unlinked",
            slot=slot,
            generation=record_generation,
        )
        assert rec is not None  # for mypy: the invariant above
        rec.unlinked = True
        self._count("unlinks_total")
        if rec.extent_bytes == 0:  # a commit record dropped by `recover`
            self._recovery_unlinks -= 1
        if rec.readers == 0:
            self._reclaim(slot, rec)

    def unlink_failed(self, records: list[Record]) -> None:
        """The writes of these free records (handed out, not durable) failed: each is handed out
        again by `take_failed_unlinks`."""
        for record in records:
            rec = self._slots.get(record.slot)
            invariant(
                rec is not None
                and rec.state == "unlinking"
                and not rec.unlinked
                and not rec.retry
                and rec.generation + 1 == record.generation,
                "a failed unlink of a record not handed out",
                slot=record.slot,
                generation=record.generation,
            )
            assert rec is not None  # for mypy: the invariant above
            rec.retry = True
            self._retry_slots.add(record.slot)

    def take_failed_unlinks(self) -> list[Record]:
        """The free records whose writes failed, handed out again (each to this caller alone,
        until it calls `unlinked` or `unlink_failed` for it)."""
        out = []
        # Only the failed ones: it sorted every slot, under the tier's lock, once a second while a
        # failing index sector kept one record failing (870 ms at 1,000,000 slots; review, stop 68).
        for s in sorted(self._retry_slots):
            r = self._slots.get(s)
            if r is not None and r.state == "unlinking" and r.retry:
                r.retry = False
                out.append(Record("free", s, r.generation + 1))
        self._retry_slots.clear()
        return out

    def pending_unlinks(self) -> list[Record]:
        """Free records handed out and not yet durable (being written, or failed)."""
        return [
            Record("free", s, r.generation + 1)
            for s, r in sorted(self._slots.items())
            if r.state == "unlinking" and not r.unlinked
        ]

    def free_durable(self, slot: int, generation: int) -> bool:
        """Whether (slot, generation) is gone for good: the object is not held, or is UNLINKING with
        its free record durable (`unlinked`, waiting only for its readers). False while it is
        STORED, while a fenced write is being written or committed (its writer may yet write a
        free record), and while its free record is handed out and not durable (being written,
        or its write failed: `unlink_failed`). A slot held at another generation answers True:
        an older one was reused, so its free record was durable; a newer one was never held."""
        rec = self._slots.get(slot)
        return rec is None or rec.generation != generation or rec.unlinked

    # ---- reads -------------------------------------------------------------------------------

    def acquire(self, slot: int, generation: int, size: int) -> DiskGrant:
        """One reader reference on a STORED slot, held until `release`."""
        rec = self._slots.get(slot)
        if rec is not None and rec.generation == generation and rec.state == "stored":
            if size != rec.size:
                self._count("acquire_size_mismatch_total")
                raise BadRequest("size differs from the stored object", slot=slot, size=size)
            rec.readers += 1
            self._count("acquires_total")
            self._count("bytes_granted_total", rec.size)
            return DiskGrant(slot, generation, rec.offset, rec.size, rec.extent_bytes, rec.checksum)
        current = self._current(slot)
        if 1 <= generation < current:
            self._count("stale_generation_rejected_total")
            raise StaleGeneration(STALE_KIND, generation, current)
        if rec is not None and rec.generation == generation and not rec.fenced:
            self._count("acquire_not_stored_total")
            raise NotFound("disk slot is not stored yet", slot=slot, generation=generation)
        self._count("unknown_slot_rejected_total")
        raise NotFound("no such disk slot generation", slot=slot, generation=generation)

    def release(self, slot: int, generation: int) -> None:
        rec = self._slots.get(slot)
        invariant(
            rec is not None and rec.generation == generation and rec.readers > 0,
            "release without a reference",
            slot=slot,
            generation=generation,
        )
        assert rec is not None
        rec.readers -= 1
        self._count("releases_total")
        if rec.readers == 0 and rec.state == "unlinking" and rec.unlinked:
            self._count("deferred_frees_completed_total")
            self._reclaim(slot, rec)

    def held(self, after_slot: int = -1, limit: int = 1 << 30) -> list[DiskHeld]:
        """STORED slots with id > `after_slot`, lowest first, at most `limit`. Walks the ids up
        from `after_slot` (dense: the lowest free id is reused first), not every slot: a page
        filtered and sorted the whole table, 46-123 ms at 1 M slots under the tier's lock,
        every disk GET waiting (review, 2026-12-06)."""
        out = []
        for slot in range(max(0, after_slot + 1), self._next_id):
            r = self._slots.get(slot)
            if r is None or r.state != "stored":
                continue
            out.append(DiskHeld(slot, r.generation, r.size, r.checksum, r.key))
            if len(out) >= limit:
                break
        return out

    def held_one(self, slot: int, generation: int) -> DiskHeld | None:
        r = self._slots.get(slot)
        if r is None or r.generation != generation or r.state != "stored":
            return None
        return DiskHeld(slot, r.generation, r.size, r.checksum, r.key)

    # ---- plumbing ----------------------------------------------------------------------------

    def _count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def _current(self, slot: int) -> int:
        """The slot's generation now (of its live object, or its next one); 0 if never used."""
        if 0 <= slot < self.slots_max and (slot < self._next_id or slot in self._generations):
            return self._generations.get(slot, 1)
        return 0

    def _writer_slot(self, slot: int, generation: int, state: _State, op: str) -> _DSlot:
        rec = self._slots.get(slot)
        invariant(
            rec is not None and rec.generation == generation and rec.state == state,
            f"{op} of a slot that is not {state}",
            slot=slot,
            generation=generation,
        )
        assert rec is not None
        return rec

    def _bump(self, slot: int, rec: _DSlot) -> None:
        invariant(self._generations.get(slot, 1) == rec.generation, "generation drift", slot=slot)
        invariant(rec.generation < GENERATION_MAX, "disk slot generation exhausted", slot=slot)
        self._generations[slot] = rec.generation + 1

    def _reclaim(self, slot: int, rec: _DSlot) -> None:
        invariant(self._current(slot) == rec.generation + 1, "reclaim before the bump", slot=slot)
        del self._slots[slot]
        heapq.heappush(self._free_ids, slot)
        if rec.extent_bytes:
            self._used_bytes -= rec.extent_bytes
            self._extents.give(rec.offset, rec.extent_bytes)

    # ---- checks ------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        self._extents.check()
        extents = [(o, n, -1) for o, n in self._extents.extents()]
        extents += [(r.offset, r.extent_bytes, s) for s, r in self._slots.items() if r.extent_bytes]
        extents.sort()
        pos = 0
        for offset, length, slot in extents:
            invariant(offset == pos, "extents overlap or leave a gap", offset=offset, expected=pos, slot=slot)
            pos = offset + length
        invariant(pos == self.data_bytes, "extents do not cover the data region", end=pos)
        used = stored = stored_bytes = 0
        for slot, r in self._slots.items():
            invariant(0 <= slot < self._next_id <= self.slots_max, "slot id out of range", slot=slot)
            used += r.extent_bytes
            current = self._generations.get(slot, 1)
            invariant(r.readers >= 0, "negative readers", slot=slot)
            if r.state == "stored":
                stored += 1
                stored_bytes += r.size
                invariant(current == r.generation and not r.fenced, "stored slot fenced", slot=slot)
                invariant(len(r.checksum) == 16, "stored slot without checksum", slot=slot)
            elif r.state == "unlinking":
                invariant(current == r.generation + 1, "unlinking slot not fenced", slot=slot)
                invariant(r.readers > 0 or not r.unlinked, "unlinked slot nobody holds", slot=slot)
                invariant(not (r.retry and r.unlinked), "a durable free record to retry", slot=slot)
                invariant(
                    not r.retry or slot in self._retry_slots, "a failed free record not listed", slot=slot
                )
            else:
                invariant(r.readers == 0, "a write with readers", slot=slot)
                invariant(current == r.generation + (1 if r.fenced else 0), "write generation", slot=slot)
        invariant(used == self._used_bytes, "used bytes drift", have=self._used_bytes, want=used)
        invariant(stored == self._stored and stored_bytes == self._stored_bytes, "stored count drift")
        invariant(self.free_bytes == self._extents.free_bytes, "free bytes drift")
        ids = set(self._free_ids)
        invariant(len(ids) == len(self._free_ids), "slot id freed twice")
        invariant(not (ids & self._slots.keys()), "free slot id in use")
        invariant(ids | self._slots.keys() == set(range(self._next_id)), "slot id lost")
