"""The slot table of one segment: the arena allocator and the slot state machine.

Synchronous and I/O-free: no clock, no threads, no memory. The segment shell owns the arena and
the transports; it asks this table *where* an object goes and *whether* a read or write naming
(slot, generation) may touch it. Time is passed in (`now_ms`, `deadline_ms`). Besides the methods,
one entry stands for them all: `step(event, now_ms)` (`kvfabric.core.step`; the events in
`kvfabric.core.segment_slots_events`, each answer a `Reply`).

## Slots
A slot is (slot id, generation, offset, size): one object in one extent of the arena. Every call
names (slot, generation). Slot ids are below `slots_max` and are reused, lowest first, once their
extent is really reclaimed. Each id's generation starts at 1, only grows, and is bumped when a
free of it is *accepted*, so a (slot, generation) pair names at most one object, ever.

Extents are `size` rounded up to `alignment` and start at a multiple of it. The allocator is
best-fit (smallest free extent that fits, lowest offset on a tie) over a free list kept sorted
by offset and by size (bisect: O(log n) search plus a list move); a reclaimed extent is merged
with free neighbours at once.

## States of a slot id
    FREE --alloc--> WRITING --stored--> STORED
    WRITING --abort--> FREE
    WRITING --free / write deadline passed (expire_writes)--> FREEING (the writer still holds it)
    FREEING (writer) --abort, or stored (answered StaleGeneration)--> FREE
    STORED --acquire--> STORED with one more reader --release--> one fewer
    STORED --free, no reader--> FREE
    STORED --free, readers--> FREEING (deferred) --last release--> FREE
The generation is bumped on every arrow out of WRITING/STORED except `stored` and `acquire`, when
the free is accepted, not when the memory is reclaimed: from then on no `acquire`, `stored` or
`free` naming the old generation is applied, but the holders of the old generation can still let
go of it (readers `release`, the writer `abort`s).

## Invariants (checked by `check_invariants()` in tests, after every step)
1. Read protection (docs/design.md 3.3): an extent with a reader reference, or whose writer may still
   be writing into it, is never handed out again, and neither is its slot id. A timeout
   (`expire_writes`) fences a write but never lets its memory be reused while the transport may
   still write into it: the extent is reclaimed when the transport lets go (`abort`/`stored`).
2. Generations fence stale actors (3.4): only the current generation of a STORED slot can be
   acquired; an older one is answered `StaleGeneration` and counted, never applied.
3. Live extents (WRITING, STORED, FREEING) and free extents tile the arena exactly: none overlap,
   none leave it, each starts at a multiple of `alignment`; no two free extents touch.
4. No leaks (3.7): `used_bytes + free_bytes == arena_bytes`; once every slot is freed and every
   reference released, `used_bytes == 0` and one free extent covers the whole arena.
5. Nothing is readable before `stored`.

## Ownership
- `alloc` → the transport owns the slot's bytes (writes into them) until it calls `stored` or
  `abort`; after `stored` returns the table owns them. If `stored` raises, the write is void and
  `abort` is always safe to call (an old generation makes it a counted no-op).
- `acquire` → the reader owns one reference until `release`: until then the extent is neither
  reused nor rewritten, even if the slot is freed meanwhile.
- `free` → the caller (the directory, through the shell) gives the object up. The table reclaims
  the extent once its last holder lets go.
- Callers track what they hold. Releasing a reference that is not held, or `stored`/`abort` of a
  slot that is not being written at that generation, is a bug in the caller: `InvariantViolation`.
  Requests that arrive from remote peers (`acquire`, `free`) get operating errors instead:
  `StaleGeneration` (old generation), `NotFound` (a generation never handed out, or a slot still
  being written), `BadRequest` (size differs), all counted in `counters`.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from dataclasses import dataclass
from typing import Final, Literal

from kvfabric.core import segment_slots_events
from kvfabric.core.segment_slots_events import SlotEvent, SlotOutput
from kvfabric.core.step import not_before
from kvfabric.format.errors import BadRequest, NoCapacity, NotFound, StaleGeneration
from kvfabric.format.generations import GENERATION_MAX
from kvfabric.format.invariant import invariant

__all__ = ["ALIGNMENT_DEFAULT", "Alloc", "FreeResult", "HeldSlot", "ReadGrant", "SlotTable"]

FreeResult = Literal["freed", "deferred", "already_freed"]
_State = Literal["writing", "stored", "freeing"]

STALE_KIND: Final = "slot_generation"
ALIGNMENT_DEFAULT: Final = 64  # every extent starts at a multiple of it; the arena is one too
_DEADLINE_HEAP_SLACK: Final = 64  # stale write deadlines kept before the heap is compacted


@dataclass(frozen=True, slots=True)
class Alloc:
    """A slot being written: the transport owns `[offset, offset + size)` until stored/abort."""

    slot: int
    generation: int
    offset: int
    size: int


@dataclass(frozen=True, slots=True)
class ReadGrant:
    """One reader reference on a stored slot, held until `release(slot, generation)`."""

    slot: int
    generation: int
    offset: int
    size: int
    checksum: bytes


@dataclass(frozen=True, slots=True)
class HeldSlot:
    slot: int
    generation: int
    size: int
    checksum: bytes
    key: bytes


@dataclass(slots=True)
class _Slot:
    generation: int  # the generation this object was allocated with
    offset: int
    extent_bytes: int  # size rounded up to the alignment
    size: int
    deadline_ms: int
    state: _State = "writing"
    checksum: bytes = b""
    readers: int = 0
    writer: bool = True  # the transport may still write into the extent (WRITING, fenced FREEING)
    key: bytes = b""  # the object's key, as its write ticket named it (reported to a new directory)


def _round_up(size: int, alignment: int) -> int:
    return -(-size // alignment) * alignment


class SlotTable:
    """One segment's slot table. See the module docstring for states and invariants."""

    def __init__(
        self, arena_bytes: int, *, alignment: int = ALIGNMENT_DEFAULT, slots_max: int = 1 << 20
    ) -> None:
        invariant(
            alignment >= 1 and alignment & (alignment - 1) == 0,
            "alignment must be a power of two",
            alignment=alignment,
        )
        invariant(
            arena_bytes > 0 and arena_bytes % alignment == 0,
            "arena size must be a positive multiple of the alignment",
            arena_bytes=arena_bytes,
            alignment=alignment,
        )
        invariant(slots_max >= 1, "slots_max must be at least 1", slots_max=slots_max)
        self.arena_bytes: Final = arena_bytes
        self.alignment: Final = alignment
        self.slots_max: Final = slots_max
        self._slots: dict[int, _Slot] = {}  # slot id -> its WRITING, STORED or FREEING object
        self._generations: list[int] = []  # slot id -> current generation (every id ever used)
        self._free_ids: list[int] = []  # heap of reclaimed slot ids
        # The free list, twice: offsets sorted (+ length by offset) and (length, offset) sorted.
        self._free_offsets: list[int] = [0]
        self._free_length: dict[int, int] = {0: arena_bytes}
        self._free_by_length: list[tuple[int, int]] = [(arena_bytes, 0)]
        self._deadlines: list[tuple[int, int, int]] = []  # heap of (deadline_ms, slot, generation)
        self._writing = 0
        self._used_bytes = 0
        self._deferred_frees = 0
        self._step_ms = 0  # the latest time given to `step`
        self.counters: dict[str, int] = {}

    def step(self, event: SlotEvent, now_ms: int) -> list[SlotOutput]:
        """The one entry (`kvfabric.core.step`): `event` at `now_ms` as the method of the same
        meaning, its answer as one `Reply` (`Tick`: `expire_writes`). Time going backwards is
        refused first."""
        self._step_ms = not_before(self._step_ms, now_ms)
        return segment_slots_events.dispatch(self, event, now_ms)

    # ---- stats ---------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        """Bytes of extents held by WRITING, STORED and FREEING slots (rounded to alignment)."""
        return self._used_bytes

    @property
    def free_bytes(self) -> int:
        return self.arena_bytes - self._used_bytes

    @property
    def largest_free_bytes(self) -> int:
        return self._free_by_length[-1][0] if self._free_by_length else 0

    @property
    def fragmentation(self) -> float:
        """1 - largest free extent / free bytes: 0 when the free space is one extent (or none)."""
        free = self.free_bytes
        return 0.0 if free == 0 else 1.0 - self.largest_free_bytes / free

    @property
    def slots_in_use(self) -> int:
        return len(self._slots)

    @property
    def deferred_frees(self) -> int:
        """Slots whose free was accepted but whose extent is still held (readers or writer)."""
        return self._deferred_frees

    @property
    def writing(self) -> int:
        return self._writing

    def free_extents(self) -> list[tuple[int, int]]:
        """The free list as (offset, length), by offset."""
        return [(o, self._free_length[o]) for o in self._free_offsets]

    # ---- operations ------------------------------------------------------------------------

    def alloc(self, size: int, now_ms: int, deadline_ms: int, key: bytes = b"") -> Alloc:
        """FREE -> WRITING. The transport owns the extent until `stored` or `abort`."""
        if size <= 0:
            raise BadRequest("object size must be positive", size=size)
        if deadline_ms <= now_ms:
            raise BadRequest("write deadline already passed", deadline_ms=deadline_ms, now_ms=now_ms)
        extent_bytes = _round_up(size, self.alignment)
        if extent_bytes > self.arena_bytes:
            self._count("alloc_too_large_total")
            raise NoCapacity("object larger than the arena", size=size, arena_bytes=self.arena_bytes)
        if not self._free_ids and len(self._generations) >= self.slots_max:
            self._count("alloc_no_slot_id_total")
            raise NoCapacity("every slot id is in use", slots_max=self.slots_max)
        i = bisect_left(self._free_by_length, (extent_bytes, -1))
        if i == len(self._free_by_length):
            self._count("alloc_no_extent_total")
            raise NoCapacity(
                "no free extent fits",
                size=size,
                free_bytes=self.free_bytes,
                largest_free_bytes=self.largest_free_bytes,
            )
        length, offset = self._free_by_length[i]
        self._take_extent(i, offset, length, extent_bytes)
        if self._free_ids:
            slot = heapq.heappop(self._free_ids)
        else:
            slot = len(self._generations)
            self._generations.append(1)
        generation = self._generations[slot]
        invariant(slot not in self._slots, "allocated a slot id in use", slot=slot)
        self._slots[slot] = _Slot(generation, offset, extent_bytes, size, deadline_ms, key=key)
        self._writing += 1
        self._used_bytes += extent_bytes
        heapq.heappush(self._deadlines, (deadline_ms, slot, generation))
        self._compact_deadlines()
        self._count("allocs_total")
        return Alloc(slot, generation, offset, size)

    def held(self, after_slot: int = -1, limit: int = 1 << 30) -> list[HeldSlot]:
        """STORED slots with id > `after_slot`, lowest first, at most `limit`: what this segment
        holds, for a directory rebuilding its index (a FREEING slot is already given up). Walks
        the ids up from `after_slot` (dense: the lowest free id is reused first), not every slot
        sorted (review, 2026-12-06: O(table) a page)."""
        out = []
        for slot in range(max(0, after_slot + 1), len(self._generations)):
            rec = self._slots.get(slot)
            if rec is None or rec.state != "stored":
                continue
            out.append(HeldSlot(slot, rec.generation, rec.size, rec.checksum, rec.key))
            if len(out) >= limit:
                break
        return out

    def held_one(self, slot: int, generation: int) -> HeldSlot | None:
        """`slot` as `held` lists it, if it is STORED under `generation` (else None): O(1)."""
        rec = self._slots.get(slot)
        if rec is None or rec.generation != generation or rec.state != "stored":
            return None
        return HeldSlot(slot, rec.generation, rec.size, rec.checksum, rec.key)

    def holds(self, slot: int, generation: int) -> bool:
        """Whether `slot` is WRITING or STORED under `generation` (its extent in use for it)."""
        rec = self._slots.get(slot)
        return rec is not None and rec.generation == generation and rec.state in ("writing", "stored")

    def stored(self, slot: int, generation: int, checksum: bytes) -> None:
        """WRITING -> STORED: the transport is done writing; the object is readable from now on.

        A write fenced meanwhile (freed, or past its deadline) is void: the transport's hold ends
        (the extent may be reclaimed) and `StaleGeneration` is raised. Calling `abort` after any
        error from here is safe.
        """
        if not checksum:
            raise BadRequest("empty checksum", slot=slot)
        rec = self._slots.get(slot)
        if rec is not None and rec.generation == generation and rec.writer:
            if rec.state == "writing":
                rec.state = "stored"
                rec.writer = False
                rec.checksum = checksum
                self._writing -= 1
                self._count("writes_stored_total")
                self._count("bytes_stored_total", rec.size)
                return
            rec.writer = False  # fenced while writing: the transport lets go now
            self._maybe_reclaim(slot, rec)
        self._stale_or_bug(slot, generation, "stored")

    def abort(self, slot: int, generation: int) -> None:
        """WRITING -> FREE (client gone, bad checksum), or the end of a fenced write's hold.

        An old generation (the write was already given up) is a counted no-op.
        """
        rec = self._slots.get(slot)
        if rec is not None and rec.generation == generation and rec.writer:
            rec.writer = False
            if rec.state == "writing":
                self._writing -= 1
                self._bump_generation(slot, rec)
                self._reclaim(slot, rec)
                self._count("writes_aborted_total")
            else:
                self._maybe_reclaim(slot, rec)
                self._count("fenced_writes_released_total")
            return
        current = self._current_generation(slot)
        invariant(
            not (rec is not None and rec.generation == generation),
            "abort of a slot that is not being written",
            slot=slot,
            generation=generation,
        )
        invariant(1 <= generation < current, "abort of a generation never handed out", slot=slot)
        self._count("abort_already_freed_total")

    def acquire(self, slot: int, generation: int, size: int) -> ReadGrant:
        """One reader reference on a STORED slot, held until `release`."""
        rec = self._slots.get(slot)
        if rec is not None and rec.generation == generation and rec.state == "stored":
            if size != rec.size:
                self._count("acquire_size_mismatch_total")
                raise BadRequest(
                    "size differs from the stored object", slot=slot, size=size, stored_size=rec.size
                )
            rec.readers += 1
            self._count("acquires_total")
            self._count("bytes_granted_total", rec.size)  # read bandwidth (GB/s on the dashboard)
            return ReadGrant(slot, generation, rec.offset, rec.size, rec.checksum)
        current = self._current_generation(slot)
        if 1 <= generation < current:
            self._count("stale_generation_rejected_total")
            raise StaleGeneration(STALE_KIND, generation, current)
        if rec is not None and rec.generation == generation:  # still being written
            self._count("acquire_not_stored_total")
            raise NotFound("slot is not stored yet", slot=slot, generation=generation)
        self._count("unknown_slot_rejected_total")
        raise NotFound("no such slot generation", slot=slot, generation=generation)

    def release(self, slot: int, generation: int) -> None:
        """Drop a reader reference; the last one of a deferred free reclaims the extent."""
        rec = self._slots.get(slot)
        invariant(
            rec is not None and rec.generation == generation and rec.readers > 0,
            "release without a reference",
            slot=slot,
            generation=generation,
        )
        assert rec is not None  # for mypy: the invariant above
        rec.readers -= 1
        self._count("releases_total")
        self._maybe_reclaim(slot, rec)

    def free(self, slot: int, generation: int) -> FreeResult:
        """Give an object up. Idempotent: a generation already freed answers "already_freed".

        "deferred": readers (or a writer) still hold it; no new `acquire` succeeds from now on and
        the extent is reclaimed when the last holder lets go. A generation never handed out is
        `NotFound`.
        """
        rec = self._slots.get(slot)
        if rec is not None and rec.generation == generation and rec.state != "freeing":
            self._bump_generation(slot, rec)
            self._count("frees_total")
            if rec.state == "writing":
                self._writing -= 1
                self._count("writes_fenced_total")
            if rec.readers == 0 and not rec.writer:
                self._reclaim(slot, rec)
                return "freed"
            rec.state = "freeing"
            self._deferred_frees += 1
            self._count("frees_deferred_total")
            return "deferred"
        if 1 <= generation < self._current_generation(slot):
            self._count("frees_already_freed_total")
            return "already_freed"
        self._count("unknown_slot_rejected_total")
        raise NotFound("no such slot generation", slot=slot, generation=generation)

    def expire_writes(self, now_ms: int) -> list[int]:
        """Fence every WRITING slot whose deadline is at or before `now_ms`; return their ids.

        Each is freed as by `free`: its generation is bumped (a late `stored` is rejected) and its
        extent is reclaimed when the transport lets go (`abort`, or the rejected `stored`), never
        while it may still be writing.
        """
        expired: list[int] = []
        while self._deadlines and self._deadlines[0][0] <= now_ms:
            _, slot, generation = heapq.heappop(self._deadlines)
            rec = self._slots.get(slot)
            if rec is None or rec.generation != generation or rec.state != "writing":
                continue  # stored, aborted or freed before its deadline
            self._writing -= 1
            self._bump_generation(slot, rec)
            rec.state = "freeing"
            self._deferred_frees += 1
            self._count("writes_expired_total")
            expired.append(slot)
        return expired

    # ---- plumbing --------------------------------------------------------------------------

    def _count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def _current_generation(self, slot: int) -> int:
        """The generation of `slot` now: of its live object, or the next one; 0 if never used."""
        return self._generations[slot] if 0 <= slot < len(self._generations) else 0

    def _stale_or_bug(self, slot: int, generation: int, op: str) -> None:
        current = self._current_generation(slot)
        invariant(1 <= generation < current, f"{op} of a slot that is not being written", slot=slot)
        self._count("stale_generation_rejected_total")
        raise StaleGeneration(STALE_KIND, generation, current)

    def _bump_generation(self, slot: int, rec: _Slot) -> None:
        invariant(self._generations[slot] == rec.generation, "generation drift", slot=slot)
        invariant(rec.generation < GENERATION_MAX, "slot generation exhausted", slot=slot)
        self._generations[slot] = rec.generation + 1

    def _maybe_reclaim(self, slot: int, rec: _Slot) -> None:
        """Reclaim a FREEING slot once nobody (reader or writer) holds it any more."""
        if rec.state == "freeing" and rec.readers == 0 and not rec.writer:
            self._deferred_frees -= 1
            self._count("deferred_frees_completed_total")
            self._reclaim(slot, rec)

    def _reclaim(self, slot: int, rec: _Slot) -> None:
        invariant(self._generations[slot] == rec.generation + 1, "reclaim before the bump", slot=slot)
        del self._slots[slot]
        heapq.heappush(self._free_ids, slot)
        self._used_bytes -= rec.extent_bytes
        self._give_extent(rec.offset, rec.extent_bytes)

    def _take_extent(self, i: int, offset: int, length: int, extent_bytes: int) -> None:
        """Carve `extent_bytes` from the start of the free extent at `_free_by_length[i]`."""
        del self._free_by_length[i]
        j = bisect_left(self._free_offsets, offset)
        del self._free_offsets[j]
        del self._free_length[offset]
        rest = length - extent_bytes
        if rest:
            self._free_offsets.insert(j, offset + extent_bytes)
            self._free_length[offset + extent_bytes] = rest
            insort(self._free_by_length, (rest, offset + extent_bytes))

    def _give_extent(self, offset: int, length: int) -> None:
        """Return an extent to the free list, merged with the free neighbours it touches."""
        i = bisect_left(self._free_offsets, offset)
        if i > 0:
            left = self._free_offsets[i - 1]
            left_end = left + self._free_length[left]
            invariant(left_end <= offset, "freed extent overlaps a free one", offset=offset)
            if left_end == offset:
                self._drop_free(i - 1, left)
                offset, length, i = left, length + (left_end - left), i - 1
        if i < len(self._free_offsets):
            right = self._free_offsets[i]
            invariant(offset + length <= right, "freed extent overlaps a free one", offset=offset)
            if offset + length == right:
                length += self._free_length[right]
                self._drop_free(i, right)
        self._free_offsets.insert(i, offset)
        self._free_length[offset] = length
        insort(self._free_by_length, (length, offset))

    def _drop_free(self, i: int, offset: int) -> None:
        length = self._free_length.pop(offset)
        del self._free_offsets[i]
        j = bisect_left(self._free_by_length, (length, offset))
        invariant(self._free_by_length[j] == (length, offset), "free list drift", offset=offset)
        del self._free_by_length[j]

    def _compact_deadlines(self) -> None:
        """Drop deadlines of writes already stored/aborted/freed so the heap stays O(slots)."""
        if len(self._deadlines) > 2 * self._writing + _DEADLINE_HEAP_SLACK:
            self._deadlines = [
                (d, s, g)
                for d, s, g in self._deadlines
                if (rec := self._slots.get(s)) is not None and rec.generation == g and rec.state == "writing"
            ]
            heapq.heapify(self._deadlines)

    # ---- checks (tests call this after every step) -----------------------------------------

    def check_invariants(self) -> None:
        # The free list: both orders hold the same extents.
        invariant(self._free_offsets == sorted(self._free_length), "free offsets unsorted or drifted")
        invariant(
            self._free_by_length == sorted((n, o) for o, n in self._free_length.items()),
            "free lengths drifted",
        )
        # Live and free extents tile the arena; free ones never touch.
        extents = [(o, n, -1) for o, n in self._free_length.items()]
        extents += [(r.offset, r.extent_bytes, s) for s, r in self._slots.items()]
        extents.sort()
        pos = 0
        prev_free = False
        for offset, length, slot in extents:
            invariant(offset == pos, "extents overlap or leave a gap", offset=offset, expected=pos)
            invariant(length > 0 and offset % self.alignment == 0, "bad extent", offset=offset)
            invariant(not (prev_free and slot < 0), "free extents not coalesced", offset=offset)
            prev_free = slot < 0
            pos = offset + length
        invariant(pos == self.arena_bytes, "extents do not cover the arena", end=pos)
        # Slots.
        invariant(len(self._generations) <= self.slots_max, "too many slot ids")
        invariant(all(g >= 1 for g in self._generations), "generation below 1")
        ids = set(self._free_ids)
        invariant(len(ids) == len(self._free_ids), "slot id freed twice")
        invariant(not (ids & self._slots.keys()), "free slot id in use")
        invariant(ids | self._slots.keys() == set(range(len(self._generations))), "slot id lost")
        used = writing = freeing = 0
        for slot, rec in self._slots.items():
            used += rec.extent_bytes
            current = self._generations[slot]
            invariant(
                rec.size > 0 and rec.extent_bytes == _round_up(rec.size, self.alignment),
                "extent size drift",
                slot=slot,
            )
            invariant(rec.readers >= 0, "negative readers", slot=slot)
            if rec.state == "writing":
                writing += 1
                invariant(rec.writer and rec.readers == 0, "writing slot with readers", slot=slot)
                invariant(current == rec.generation, "writing slot fenced", slot=slot)
            elif rec.state == "stored":
                invariant(not rec.writer and rec.checksum, "stored slot without checksum", slot=slot)
                invariant(current == rec.generation, "stored slot fenced", slot=slot)
            else:
                freeing += 1
                invariant(rec.writer or rec.readers > 0, "freeing slot nobody holds", slot=slot)
                invariant(not (rec.writer and rec.readers), "a write with readers", slot=slot)
                invariant(current == rec.generation + 1, "freeing slot not fenced", slot=slot)
        invariant(used == self._used_bytes, "used bytes drift", have=self._used_bytes, want=used)
        invariant(writing == self._writing, "writing count drift")
        invariant(freeing == self._deferred_frees, "deferred free count drift")
        invariant(
            self.free_bytes == sum(self._free_length.values()), "free bytes drift", free=self.free_bytes
        )
