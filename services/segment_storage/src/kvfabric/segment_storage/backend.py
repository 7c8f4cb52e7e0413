"""`ArenaBackend`: the segment's side of the data plane (`kvfabric.dataplane.backend.SegmentBackend`).

Transports call it from their own threads; one lock serialises every change of the slot table
(a pure `SlotTable` core). Bytes are never touched under the lock except to checksum a freshly
written slot that nobody else can see yet.

Who owns what:
- A WRITING slot belongs to the connection that began the put, until `finish_put`/`abort_put`
  or the connection closes (then it is aborted). It is never expired by time while its
  connection lives (the transport may still be receiving into it); a stalled client is cut off
  by the transport's idle timeout, which closes the connection and so aborts the slot.
- A transfer reference (GET or local pin) belongs to its connection until `end_get`/`unpin_local`
  or the connection closes. While any reference is held, a free from the directory is deferred:
  the memory is not reused under a reader (docs/design.md invariant 3). A connection holds at most
  `LOCAL_GRANTS_PER_CONNECTION_MAX` grants, and a request that pins nothing keeps no grant (no
  state per refused frame).
- `admits` is the transports' authenticator (`kvfabric.dataplane.admission`): a connection's
  first request must carry a valid credential for this segment; it reads, never writes, state.
- The stored checksum is computed here from the bytes that arrived (xxh3-128) and compared with
  the one the directory signed into the ticket; a mismatch stores nothing.
- A segment-to-segment copy (`copy_in`) is a put whose "transport" is a fetch function run on the
  caller's thread: it owns the slot's view only while `fetch` runs; whatever happens, nothing is
  left held by the copy when `copy_in` returns or raises.
- The scrubber (`verify_stored`) holds one read reference while it hashes a stored object, so a
  free meanwhile is deferred; a mismatch frees the slot at once (its generation is bumped: no read
  of it succeeds from then on).
- The gate (`gate`: `kvfabric.segment_storage.gate`, pure) holds the epoch fence per directory
  shard and the drain flag; it changes only under the lock (`admit_directory`, `saw_epoch`, the
  `draining` setter, called by the shell); `begin_put` checks a ticket against it, and
  `finish_put` and `demote_many` again in the step that stores the slot (a fenced one is not;
  `demote_many` holds this lock around the disk tier's, never the other way round).
- The disk tier (`ssd`, optional: `kvfabric.segment_storage.ssd`) holds the objects whose slot ids
  are `SSD_SLOT_BASE` and up. A GET of one reads it from disk into a private buffer (verified
  there: a mismatch or an I/O error frees it and goes to `report_corrupt`) that the grant owns
  until `end_get`; a local pin of one answers `not_found` (disk replicas are read with GET).
  Frees, reports and verifies name disk slots like arena slots. `demote` copies a stored arena
  object into the disk tier (under a read reference on the arena slot; checksum verified first).

Clocks: read tokens and write tickets carry absolute expiries on the issuing directory's wall
clock, checked here against this segment's (`clock_ms`). Each check honours an expiry up to
`clock_skew_tolerance_ms` past it (`KVF_CLOCK_SKEW_TOLERANCE_MS`), so clocks that far apart
refuse nothing that is still valid by the directory's (a repair copy's source token lives only
the copy timeout: a source ahead of the directory by that much refused every copy). Safe: a
token names (slot, generation) and a free bumps the generation when the slot table accepts it,
so a token honoured late never reads a slot the directory freed, let alone one reused (it gets
`stale_generation`); a ticket honoured late stores a replica whose confirm the directory
refuses (`unknown_ticket`), and the slot is freed. Tolerance is bounded by
`CLOCK_SKEW_TOLERANCE_MS_MAX`, below the directory's default lease grace (30 s).

Modules: the state, credentials, connection cleanup and frees are `backend_core`; PUTs and copies
in `backend_writes`; GETs and local pins `backend_reads`; this one holds `ArenaBackend` (their
union) with the scrubber's re-hash and demotion into the disk tier, and re-exports the rest.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Literal

from kvfabric.core.segment_slots import HeldSlot
from kvfabric.format.checksum import checksum
from kvfabric.format.errors import ChecksumMismatch, Conflict, KvfError, StaleGeneration
from kvfabric.proto.directory import WriteTicket
from kvfabric.proto.segment import SSD_SLOT_BASE
from kvfabric.segment_storage.backend_core import (
    AUTH_REFS_CHECKED_MAX,
    CLOCK_SKEW_TOLERANCE_MS_DEFAULT,
    CLOCK_SKEW_TOLERANCE_MS_MAX,
    DEMOTE_YIELD_MS_DEFAULT,
    ConfirmFn,
    ConfirmLaterFn,
    CorruptFn,
    FetchFn,
)
from kvfabric.segment_storage.backend_reads import LOCAL_GRANTS_PER_CONNECTION_MAX, BackendReads
from kvfabric.segment_storage.backend_writes import BackendWrites

__all__ = [
    "AUTH_REFS_CHECKED_MAX",
    "CLOCK_SKEW_TOLERANCE_MS_DEFAULT",
    "CLOCK_SKEW_TOLERANCE_MS_MAX",
    "DEMOTE_YIELD_MS_DEFAULT",
    "LOCAL_GRANTS_PER_CONNECTION_MAX",
    "ArenaBackend",
    "ConfirmFn",
    "ConfirmLaterFn",
    "CorruptFn",
    "FetchFn",
    "ScrubVerdict",
]

# verify_stored: "ok" (bytes match), "corrupt" (mismatch: the slot was freed here), "skipped"
# (freed, rewritten or resized since it was listed; or freed by the directory while being hashed).
ScrubVerdict = Literal["ok", "corrupt", "skipped"]


class ArenaBackend(BackendWrites, BackendReads):
    """The segment's `SegmentBackend`: writes, reads, frees, scrub and demotion over one slot table."""

    # ---- scrub -------------------------------------------------------------------------------

    def verify_stored(self, slot: int, generation: int, size: int) -> ScrubVerdict:
        """Re-hash one stored object under a read reference and compare with its stored checksum.

        On a mismatch the slot is freed here and now (generation bumped: every later read of
        (slot, generation) is refused, the extent is reclaimed once other readers let go) and
        "corrupt" is returned; the caller tells the directory. Blocks while hashing. A disk slot is
        read back from the disk tier and checked the same way.
        """
        if slot >= SSD_SLOT_BASE:
            status = self.ssd.verify(slot, generation, size) if self.ssd is not None else "not_found"
            verdict: ScrubVerdict = (
                "ok" if status == "ok" else "corrupt" if status == "corrupt" else "skipped"
            )
            self.count(
                {"ok": "scrub_objects_total", "corrupt": "scrub_corrupt_total"}.get(
                    verdict, "scrub_skipped_total"
                )
            )
            return verdict
        with self.lock:
            try:
                grant = self.slots.acquire(slot, generation, size)
            except KvfError:  # freed, reused or never stored: nothing to check
                self._count("scrub_skipped_total")
                return "skipped"
        view = self.arena.slice(grant.offset, grant.size)
        try:
            digest = checksum(view)
        finally:
            view.release()
        with self.lock:
            self._count("scrub_objects_total")
            self._count("scrub_bytes_total", grant.size)
            self.slots.release(slot, generation)
            if digest == grant.checksum:
                return "ok"
            self._count("scrub_corrupt_total")
            if self._free_locked(slot, generation) == "already_freed":  # the directory freed it meanwhile
                return "skipped"
        return "corrupt"

    # ---- the disk tier ---------------------------------------------------------------------

    def yield_to_gets(self) -> float:
        """Wait while a GET is being served, at most `demote_yield_ms`: demotion's CPU work (the
        re-hash, the bounce copy, the syscalls of its write) then runs between reads instead of
        beside them, on a host whose cores the transports need (docs/ssd-tier.md). Returns the
        seconds waited."""
        with self.lock:
            if self._gets_served == 0 or self.demote_yield_ms <= 0:
                return 0.0
            started = time.monotonic()
            self._gets_idle.wait_for(lambda: self._gets_served == 0, self.demote_yield_ms / 1000)
            waited = time.monotonic() - started
            self._count("demote_yields_total")
            self._count("demote_yield_us_total", int(waited * 1e6))
            return float(waited)

    def held_one(self, slot: int, generation: int) -> HeldSlot | None:
        """A stored object of either tier, as `SlotTable.held_one` lists it (else None)."""
        if slot >= SSD_SLOT_BASE:
            h = self.ssd.held_one(slot, generation) if self.ssd is not None else None
            return None if h is None else HeldSlot(h.slot, h.generation, h.size, h.checksum, h.key)
        with self.lock:
            return self.slots.held_one(slot, generation)

    def demote(self, slot: int, generation: int, size: int) -> tuple[int, int]:
        """Copy a stored arena object into the disk tier; returns its disk (slot, generation). The
        arena slot is untouched (the caller frees it once the directory points at the disk
        replica). Its bytes are verified first: a mismatch frees it (as the scrubber does) and
        raises `ChecksumMismatch`. `NoCapacity`, `Busy`, `Unavailable` from the disk tier."""
        (done,) = self.demote_many([(slot, generation, size)])
        if isinstance(done, BaseException):
            raise done
        return done

    def demote_many(
        self, objects: list[tuple[int, int, int]], tickets: Sequence[WriteTicket] | None = None
    ) -> list[tuple[int, int] | KvfError]:
        """`demote` for several arena objects (slot, generation, size), their disk writes sharing
        syncs and commit-record writes (`SsdTier.write_many`); per object, in order, its disk
        (slot, generation) or the error `demote` would raise (an unexpected one is raised once
        every object's read reference is let go). Each object is verified just before it is
        written (waiting first while a GET is served, as `demote` does).

        `tickets` (the demotion's, one per object): an object whose ticket's epoch a newer leader
        of its shard has fenced by the time its disk slot would become readable is not stored
        (`StaleGeneration`, its slot freed), checked under the lock the fence rises under, in the
        step that stores it, as `finish_put` checks a PUT. That leader's report (taken after its
        fence rose) did not list the slot and it refuses the confirm at the old epoch: stored,
        the slot had no owner and held its disk bytes until a restart (review, 2026-12-06)."""
        ssd = self.ssd
        if ssd is None:
            raise Conflict("this segment has no disk tier")
        out: list[tuple[int, int] | KvfError | None] = [None] * len(objects)
        held: list[tuple[int, memoryview, bytes, bytes]] = []  # (index, arena view, key, checksum)
        try:
            for i, (slot, generation, size) in enumerate(objects):
                self.yield_to_gets()
                try:
                    with self.lock:
                        grant = self.slots.acquire(slot, generation, size)
                        one = self.slots.held_one(slot, generation)
                except KvfError as exc:
                    out[i] = exc
                    continue
                view = self.arena.slice(grant.offset, grant.size)
                if checksum(view) != grant.checksum:
                    view.release()
                    with self.lock:
                        self._count("demote_corrupt_total")
                        self.slots.release(slot, generation)
                        self._free_locked(slot, generation)
                    if self.report_corrupt is not None and one is not None:  # as the scrubber does
                        self.report_corrupt(one.key, slot, generation, size)
                    out[i] = ChecksumMismatch(
                        "the arena copy no longer matches its checksum: freed", slot=slot
                    )
                    continue
                held.append((i, view, one.key if one is not None else b"", grant.checksum))
            if held:
                refuse = None
                if tickets is not None:
                    held_tickets = [tickets[i] for i, *_ in held]

                    def check(j: int) -> KvfError | None:  # under self.lock: the gate changes under it
                        ticket = held_tickets[j]
                        fence = self.gate.fence(ticket.shard)
                        if ticket.epoch < fence:
                            return StaleGeneration("directory_epoch", ticket.epoch, fence)
                        return None

                    refuse = (self.lock, check)
                placed = ssd.write_many(
                    [(v, k, c) for _, v, k, c in held], before_each=self.yield_to_gets, refuse=refuse
                )
                for (i, *_), done in zip(held, placed, strict=True):
                    out[i] = done
        finally:
            for i, view, _, _ in held:
                view.release()
                with self.lock:
                    self.slots.release(objects[i][0], objects[i][1])
        demoted = [o for o in out if isinstance(o, tuple)]
        self.count("demotions_total", len(demoted))
        self.count(
            "demoted_bytes_total",
            sum(size for (_, _, size), o in zip(objects, out, strict=True) if isinstance(o, tuple)),
        )
        return [o if o is not None else Conflict("not demoted") for o in out]
