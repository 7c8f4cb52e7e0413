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
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, Literal

from kvfabric.core.segment_slots import HeldSlot, SlotTable
from kvfabric.dataplane.backend import GetGrant, PutSlot
from kvfabric.format.checksum import checksum
from kvfabric.format.clock import now_ms
from kvfabric.format.errors import (
    BadRequest,
    Busy,
    ChecksumMismatch,
    Conflict,
    KvfError,
    NotFound,
    StaleGeneration,
    Unauthorized,
)
from kvfabric.format.invariant import invariant
from kvfabric.proto.dataplane import (
    GetRequest,
    LocalGrant,
    LocalGrants,
    MapReply,
    MapRequest,
    ObjectResult,
    ObjectStatus,
    PutRequest,
    ReadRef,
)
from kvfabric.proto.directory import WriteTicket
from kvfabric.proto.segment import SSD_SLOT_BASE
from kvfabric.proto.tickets import read_token_valid, ticket_signature_valid, write_receipt
from kvfabric.segment_storage.arena import Arena
from kvfabric.segment_storage.ssd import SsdRead, SsdStream, SsdTier

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

# Transfer-reference grants (GET in progress, PIN_LOCAL not yet unpinned) one connection may hold:
# a client holds one or two (a pin, and the pipelined unpin of the previous one).
LOCAL_GRANTS_PER_CONNECTION_MAX: Final = 64
# Read references of a connection's first request whose tokens are checked to admit it.
AUTH_REFS_CHECKED_MAX: Final = 4
# How far past a directory-issued expiry (read token, write ticket) this segment's wall clock may
# be and still honour it (see the module doc): covers clocks this far apart.
CLOCK_SKEW_TOLERANCE_MS_DEFAULT: Final = 5_000
CLOCK_SKEW_TOLERANCE_MS_MAX: Final = 10_000
# `demote` waits at most this long, before each of its CPU steps (re-hash, disk write), while a
# GET is being served (KVF_SEGMENT_DEMOTE_YIELD_MS): reads first, demotion in the gaps.
DEMOTE_YIELD_MS_DEFAULT: Final = 20

# (ticket, slot, generation) -> the directory's verdict: "ok", "unknown_ticket" or "mismatch".
# Blocks the calling transport thread; raises KvfError when the directory cannot be reached.
# (ticket, slot, generation, trace id, the save's writes for this segment and shard) -> verdict
ConfirmFn = Callable[[WriteTicket, int, int, str, int], str]
# (ticket, slot, generation, trace id) of a write answered with a receipt: confirm it in the background and
# call `ArenaBackend.unconfirmed` if the directory refuses it (or never answers). Never blocks;
# raises KvfError when it cannot take the confirm (then the write fails as a refused confirm does).
ConfirmLaterFn = Callable[[WriteTicket, int, int, str], None]
# Fills the writable slot view with the object's bytes (a copy from another segment); raises a
# KvfError when it cannot. Runs on the thread that called `copy_in`.
FetchFn = Callable[[memoryview], None]
# verify_stored: "ok" (bytes match), "corrupt" (mismatch: the slot was freed here), "skipped"
# (freed, rewritten or resized since it was listed; or freed by the directory while being hashed).
ScrubVerdict = Literal["ok", "corrupt", "skipped"]
# (key, slot, generation, size) of a disk replica a read found corrupt (already freed here): the
# shell tells the directory. Called from a transport thread.
CorruptFn = Callable[[bytes, int, int, int], None]


@dataclass(slots=True)
class _Conn:
    puts: dict[int, tuple[int, int]] = field(default_factory=dict)  # slot -> (slot, generation)
    grants: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # grant id -> refs
    gets: set[int] = field(default_factory=set)  # GET grants being served (begin_get .. end_get)
    disk_reads: dict[int, list[SsdRead | SsdStream]] = field(default_factory=dict)  # grant id -> disk buffers


class ArenaBackend:
    def __init__(
        self,
        arena: Arena,
        slots: SlotTable,
        *,
        segment_id: str,
        incarnation: int,
        secret: bytes,
        confirm: ConfirmFn,
        confirm_later: ConfirmLaterFn | None = None,
        clock_ms: Callable[[], int] | None = None,
        read_tokens_required: bool = False,
        ssd: SsdTier | None = None,
        report_corrupt: CorruptFn | None = None,
        clock_skew_tolerance_ms: int = CLOCK_SKEW_TOLERANCE_MS_DEFAULT,
        demote_yield_ms: int = DEMOTE_YIELD_MS_DEFAULT,
    ) -> None:
        invariant(
            0 <= clock_skew_tolerance_ms <= CLOCK_SKEW_TOLERANCE_MS_MAX,
            "clock skew tolerance out of range",
            tolerance_ms=clock_skew_tolerance_ms,
        )
        self.arena = arena
        self.ssd = ssd
        self.report_corrupt = report_corrupt
        # Serve a read only with the directory's unexpired token for it (no lease, no bytes).
        self.read_tokens_required = read_tokens_required
        self.slots = slots
        self.segment_id = segment_id
        self.incarnation = incarnation
        self.secret = secret
        self.confirm = confirm
        # None: every write is confirmed before its reply (no receipts signed)
        self.confirm_later = confirm_later
        self.clock_ms = clock_ms or now_ms
        self.clock_skew_tolerance_ms = clock_skew_tolerance_ms
        self.draining = False
        # The newest directory epoch this segment has heard of, per shard: tickets of older
        # epochs were issued by a fenced leader of that shard and store nothing.
        self.min_epochs: dict[int, int] = {}
        self.lock = threading.Lock()
        self._conns: dict[int, _Conn] = {}
        self._grant_ids = itertools.count(1)
        self._copy_conns = itertools.count(-1, -1)  # negative: never a transport's connection id
        self.counters: dict[str, int] = {}
        self.demote_yield_ms = demote_yield_ms
        self._gets_served = 0  # GETs between begin_get and end_get (or their connection's close)
        self._gets_idle = threading.Condition(self.lock)

    def _count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def count(self, name: str, n: int = 1) -> None:
        """Count an event of the shell's (exported with the backend's counters)."""
        with self.lock:
            self._count(name, n)

    def _conn(self, conn: int) -> _Conn:
        return self._conns.setdefault(conn, _Conn())

    # ---- writes ------------------------------------------------------------------------------

    def begin_put(self, ticket: WriteTicket, conn: int) -> PutSlot:
        if not ticket_signature_valid(ticket, self.secret):
            self._count("bad_ticket_signature_total")
            raise Unauthorized("write ticket signature is not valid")
        if ticket.segment_id != self.segment_id:
            raise BadRequest(f"ticket is for segment {ticket.segment_id!r}, this is {self.segment_id!r}")
        if ticket.incarnation != self.incarnation:
            self._count("stale_incarnation_rejected_total")
            raise StaleGeneration("segment_incarnation", ticket.incarnation, self.incarnation)
        fence = self.min_epochs.get(ticket.shard, 0)
        if ticket.epoch < fence:
            self._count("stale_epoch_rejected_total")
            raise StaleGeneration("directory_epoch", ticket.epoch, fence)
        now = self.clock_ms()
        deadline_ms = self.ticket_deadline_ms(ticket)
        if now >= deadline_ms:
            self._count("expired_ticket_total")
            raise Conflict("write ticket deadline has passed", deadline_ms=ticket.deadline_ms)
        if self.draining:
            raise Conflict("segment is draining: no new writes")
        with self.lock:
            alloc = self.slots.alloc(ticket.size_bytes, now, deadline_ms, ticket.key)
            self._conn(conn).puts[alloc.slot] = (alloc.slot, alloc.generation)
        view = self.arena.slice(alloc.offset, alloc.size)
        return PutSlot(alloc.slot, alloc.generation, view, ticket, alloc.offset)

    def finish_put(self, put: PutSlot, conn: int) -> tuple[int, int]:
        # Hashed on arrival by the transport, or now (nobody else can see a WRITING slot: no lock).
        stored = put.checksum if put.checksum is not None else checksum(put.view)
        put.view.release()
        if stored != put.ticket.checksum:
            self._count("checksum_mismatch_total")
            self.abort_put(put, conn)
            raise ChecksumMismatch("bytes received do not match the ticket's checksum")
        with self.lock:
            self.slots.stored(put.slot, put.slot_generation, stored)
            self._conns[conn].puts.pop(put.slot, None)
            self.arena.board.publish(put.slot, put.slot_generation, put.offset, put.ticket.size_bytes, stored)
        if put.receipt_wanted and self.confirm_later is not None:
            # The writer carries the receipt in its put_commit (the directory checks our MAC): the
            # confirm leaves the write's path. It still goes, in the background: a receipt the
            # writer never commits (it died, aborted) is refused there and the slot freed here.
            try:
                self.confirm_later(put.ticket, put.slot, put.slot_generation, put.trace_id)
            except KvfError:
                self._free(put.slot, put.slot_generation)
                raise
            put.receipt = write_receipt(self.secret, put.ticket, put.slot, put.slot_generation)
            self._count("puts_total")
            self._count("puts_receipted_total")
            return put.slot, put.slot_generation
        try:
            verdict = self.confirm(put.ticket, put.slot, put.slot_generation, put.trace_id, put.save_writes)
        except KvfError:
            self._free(put.slot, put.slot_generation)  # not confirmed: never readable via the directory
            raise
        if verdict != "ok":
            self._count(f"confirm_{verdict}_total")
            self._free(put.slot, put.slot_generation)
            raise Conflict(f"the directory refused the replica: {verdict}", verdict=verdict)
        self._count("puts_total")
        return put.slot, put.slot_generation

    def unconfirmed(self, slot: int, generation: int, verdict: str) -> None:
        """The background confirm of a receipted write was refused (`unknown_ticket`,
        `mismatch`) or got no verdict: the directory will not publish it from this confirm;
        free it (a free of a slot published meanwhile through its receipt counts as already
        freed once the directory freed it; docs/segment.md "Write")."""
        self.count(f"confirm_later_{verdict}_total")
        self._free(slot, generation)

    def abort_put(self, put: PutSlot, conn: int) -> None:
        with self.lock:
            c = self._conns.get(conn)
            if c is not None and c.puts.pop(put.slot, None) is not None:
                self.slots.abort(put.slot, put.slot_generation)
                self._count("puts_aborted_total")

    def copy_in(self, ticket: WriteTicket, fetch: FetchFn, trace_id: str = "") -> tuple[int, int]:
        """Store `ticket`'s object by letting `fetch` fill the slot (a copy from another segment).

        The same path as a PUT: `begin_put` checks the ticket (signature, segment, incarnation,
        epoch, deadline, drain, size) and allocates; `fetch` writes straight into the slot;
        `finish_put` verifies the ticket's checksum, stores and confirms to the directory. Any
        failure (fetch error, mismatch, refusal) leaves nothing stored and nothing held, and is
        raised. Blocks: call it from a worker thread (the confirm waits on the event loop).
        """
        conn = next(self._copy_conns)
        try:
            put = self.begin_put(ticket, conn)
            put.trace_id = trace_id
            try:
                fetch(put.view)
            except BaseException:
                put.view.release()
                self.abort_put(put, conn)
                raise
            slot, generation = self.finish_put(put, conn)
        except BaseException:
            self.count("copies_failed_total")
            raise
        finally:
            self.close_connection(conn)  # whatever this copy still held (nothing, normally)
        with self.lock:
            self._count("copies_total")
            self._count("bytes_copied_total", ticket.size_bytes)
        return slot, generation

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

    # ---- reads -------------------------------------------------------------------------------

    def _acquire(self, ref: ReadRef) -> tuple[ObjectStatus, int, bytes]:
        """Under the lock: take a transfer reference. Returns (status, offset, checksum)."""
        if ref.incarnation != self.incarnation:
            self._count("stale_incarnation_read_total")
            return "stale_incarnation", 0, b""
        if self.read_tokens_required and not self._token_ok(ref):
            self._count("read_token_rejected_total")
            return "unauthorized", 0, b""
        try:
            grant = self.slots.acquire(ref.slot, ref.slot_generation, ref.size_bytes)
        except StaleGeneration:
            return "stale_generation", 0, b""
        except BadRequest:
            return "wrong_size", 0, b""
        except KvfError:
            return "not_found", 0, b""
        return "ok", grant.offset, grant.checksum

    def ticket_deadline_ms(self, ticket: WriteTicket) -> int:
        """The ticket's deadline on this segment's clock: the directory's plus the skew tolerance."""
        return ticket.deadline_ms + self.clock_skew_tolerance_ms

    def _token_ok(self, ref: ReadRef) -> bool:
        if ref.expires_ms + self.clock_skew_tolerance_ms <= self.clock_ms():
            return False
        return read_token_valid(
            ref.token,
            self.secret,
            self.segment_id,
            ref.incarnation,
            ref.slot,
            ref.slot_generation,
            ref.size_bytes,
            ref.expires_ms,
        )

    def admits(self, meta: object) -> bool:
        """The data plane's `Authenticator`: does this first request of a connection carry a
        credential for this segment, valid now? A write ticket signed for this segment and
        incarnation, before its deadline; or a read reference of this incarnation with a valid,
        unexpired token (only the first `AUTH_REFS_CHECKED_MAX` are checked: a MAC each). Keeps
        no state: a connection that fails is closed by its transport with nothing held here."""
        reads: list[ReadRef]
        if isinstance(meta, PutRequest):
            return self._ticket_admits(meta.ticket)
        if isinstance(meta, MapRequest):
            if meta.ticket is not None and self._ticket_admits(meta.ticket):
                return True
            reads = meta.reads
        elif isinstance(meta, GetRequest):
            reads = meta.reads
        else:
            return False
        return any(
            ref.incarnation == self.incarnation and self._token_ok(ref)
            for ref in reads[:AUTH_REFS_CHECKED_MAX]
        )

    def _ticket_admits(self, ticket: WriteTicket) -> bool:
        return (
            ticket.segment_id == self.segment_id
            and ticket.incarnation == self.incarnation
            and self.clock_ms() < self.ticket_deadline_ms(ticket)
            and ticket_signature_valid(ticket, self.secret)
        )

    def _pin(self, reads: list[ReadRef], conn: int) -> tuple[int, list[tuple[ObjectStatus, int, bytes]]]:
        """Take a transfer reference per readable ref, held as one grant of the connection. A
        grant that holds nothing (every ref refused: no token, stale, missing) is not kept, so
        a flood of refused pins leaves no state; a connection holds at most
        `LOCAL_GRANTS_PER_CONNECTION_MAX` grants (more is `Busy`: unpin first)."""
        with self.lock:
            held = self._conns.get(conn)
            if held is not None and len(held.grants) >= LOCAL_GRANTS_PER_CONNECTION_MAX:
                self._count("grants_busy_total")
                raise Busy(
                    "too many pinned grants on this connection: unpin first",
                    limit=LOCAL_GRANTS_PER_CONNECTION_MAX,
                )
            acquired = [self._acquire(ref) for ref in reads]
            refs = [
                (ref.slot, ref.slot_generation)
                for ref, a in zip(reads, acquired, strict=True)
                if a[0] == "ok"
            ]
            grant_id = next(self._grant_ids)
            if refs:
                self._conn(conn).grants[grant_id] = refs
        return grant_id, acquired

    def _unpin(self, grant_id: int, conn: int) -> int:
        with self.lock:
            c = self._conns.get(conn)
            refs = c.grants.pop(grant_id, []) if c is not None else []
            for slot, generation in refs:
                self.slots.release(slot, generation)
            return len(refs)

    def begin_get(self, reads: list[ReadRef], conn: int) -> GetGrant:
        return self._begin_get(reads, conn, stream=False)

    def begin_get_streamed(self, reads: list[ReadRef], conn: int) -> GetGrant:
        """`begin_get` for a client that takes verdicts after the bytes: a disk replica's read is
        started, not finished — the transport sends each piece as it lands (`GetGrant.filling`)
        while the rest is read, so reading the disk and sending overlap; then `verdicts()`: a
        replica whose bytes failed their checksum (or the device) is freed and reported as with
        `begin_get`, and answered `stale_generation` after its bytes (the client drops them)."""
        return self._begin_get(reads, conn, stream=True)

    def _begin_get(self, reads: list[ReadRef], conn: int, *, stream: bool) -> GetGrant:
        disk = [i for i, ref in enumerate(reads) if ref.slot >= SSD_SLOT_BASE] if self.ssd is not None else []
        disk_reads = self._read_disk([reads[i] for i in disk], stream) if disk else []
        try:
            grant_id, acquired = self._pin(reads, conn)  # disk refs answer not_found here; replaced below
        except BaseException:
            for _, done in disk_reads:
                if done is not None:
                    done.release()
            raise
        views: list[memoryview | None] = [
            self.arena.slice(offset, ref.size_bytes).toreadonly() if status == "ok" else None
            for ref, (status, offset, _) in zip(reads, acquired, strict=True)
        ]
        statuses = [a[0] for a in acquired]
        checksums = [a[2] for a in acquired]
        for i, (status, read) in zip(disk, disk_reads, strict=True):
            statuses[i], checksums[i] = status, read.checksum if read is not None else b""
            views[i] = read.view.toreadonly() if read is not None and read.view is not None else None
        held = [read for _, read in disk_reads if read is not None]
        with self.lock:
            c = self._conn(conn)
            if held:
                c.disk_reads[grant_id] = held
            c.gets.add(grant_id)
            self._gets_served += 1
        streams = {
            i: read for i, (_, read) in zip(disk, disk_reads, strict=True) if isinstance(read, SsdStream)
        }
        if not streams:
            return GetGrant(grant_id, statuses, checksums, views)
        filling: list[Callable[[int], int] | None] = [None] * len(reads)
        for i, read in streams.items():
            filling[i] = read.wait
        first = [ObjectResult(s, c) for s, c in zip(statuses, checksums, strict=True)]

        def verdicts() -> list[ObjectResult]:
            out = list(first)
            for i, read in streams.items():
                if not read.verdict():  # freed by the tier: reported like a corrupt replica
                    ref = reads[i]
                    if self.report_corrupt is not None:
                        self.report_corrupt(read.key, ref.slot, read.generation, ref.size_bytes)
                    self.count("disk_get_failed_after_bytes_total")
                    out[i] = ObjectResult("stale_generation", b"")
            return out

        return GetGrant(grant_id, statuses, checksums, views, filling, verdicts)

    def _read_disk(
        self, reads: list[ReadRef], stream: bool = False
    ) -> list[tuple[ObjectStatus, SsdRead | SsdStream | None]]:
        """Read disk replicas into private buffers (blocks on the disk), or with `stream` start
        reading them (`SsdTier.read_stream`: checked after the bytes). A replica found corrupt
        (or unreadable) is freed by the tier and reported; the reader sees `stale_generation`
        (its generation moved on). `Busy` (I/O bounds) gives back whatever was read already."""
        assert self.ssd is not None
        out: list[tuple[ObjectStatus, SsdRead | SsdStream | None]] = []
        try:
            for ref in reads:
                if ref.incarnation != self.incarnation:
                    self.count("stale_incarnation_read_total")
                    out.append(("stale_incarnation", None))
                    continue
                if self.read_tokens_required and not self._token_ok(ref):
                    self.count("read_token_rejected_total")
                    out.append(("unauthorized", None))
                    continue
                if stream:  # the first disk object read now, later ones while it is sent
                    first = not any(done is not None for _, done in out)
                    read: SsdRead | SsdStream = self.ssd.read_stream(
                        ref.slot, ref.slot_generation, ref.size_bytes, inline_first=first
                    )
                else:
                    read = self.ssd.read(ref.slot, ref.slot_generation, ref.size_bytes)
                if read.status == "ok":
                    out.append(("ok", read))
                    continue
                if read.status == "corrupt":
                    if self.report_corrupt is not None:
                        self.report_corrupt(read.key, ref.slot, read.generation, ref.size_bytes)
                    out.append(("stale_generation", None))
                else:
                    out.append((read.status, None))
        except BaseException:
            for _, done in out:
                if done is not None:
                    done.release()
            raise
        return out

    def end_get(self, grant: GetGrant, conn: int) -> None:
        for view in grant.views:
            if view is not None:
                view.release()
        self._unpin(grant.grant_id, conn)
        with self.lock:
            c = self._conns.get(conn)
            buffers = c.disk_reads.pop(grant.grant_id, []) if c is not None else []
            if c is not None and grant.grant_id in c.gets:
                c.gets.discard(grant.grant_id)
                self._gets_ended(1)
        for buffer in buffers:
            buffer.release()

    def map_info(self) -> MapReply:
        return MapReply(
            arena_path=str(self.arena.path),
            arena_bytes=self.arena.size_bytes,
            incarnation=self.incarnation,
            board_path=str(self.arena.board.path),
        )

    def pin_local(self, reads: list[ReadRef], conn: int) -> LocalGrants:
        grant_id, acquired = self._pin(reads, conn)
        return LocalGrants(grant_id=grant_id, grants=[LocalGrant(s, o, c) for s, o, c in acquired])

    def unpin_local(self, grant_id: int, conn: int) -> int:
        return self._unpin(grant_id, conn)

    def close_connection(self, conn: int) -> None:
        """Everything a dead connection held goes back: unfinished writes, transfer references."""
        with self.lock:
            c = self._conns.pop(conn, None)
            if c is None:
                return
            for slot, generation in c.puts.values():
                self.slots.abort(slot, generation)
                self._count("puts_aborted_total")
            for refs in c.grants.values():
                for slot, generation in refs:
                    self.slots.release(slot, generation)
            self._gets_ended(len(c.gets))
        for buffers in c.disk_reads.values():
            for buffer in buffers:
                buffer.release()

    def _gets_ended(self, n: int) -> None:
        """Under the lock: `n` GETs are no longer served."""
        if n:
            self._gets_served -= n
            if self._gets_served == 0:
                self._gets_idle.notify_all()

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

    # ---- frees and housekeeping --------------------------------------------------------------

    def _free(self, slot: int, generation: int) -> str:
        with self.lock:
            return self._free_locked(slot, generation)

    def _free_locked(self, slot: int, generation: int) -> str:
        """Accept a free (caller holds the lock). The slot leaves the board before the lock is
        released, so before its extent can be allocated again: a local reader copying it sees
        the change (kvfabric.dataplane.slotboard)."""
        result = self.slots.free(slot, generation)
        if result != "already_freed":
            self.arena.board.withdraw(slot, generation)
        return result

    def free_slots(self, slots: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The directory's frees, one by one (one bad pair never blocks the rest). Deferred ones are
        freed when the last transfer ends. Returns every pair: each is freed now, deferred, was freed
        already, or was never held here — in all cases the directory may stop retrying it."""
        done = []
        disk = []
        for slot, generation in slots:
            if slot >= SSD_SLOT_BASE and self.ssd is not None:
                disk.append((slot, generation))
                continue
            try:
                self._free(slot, generation)
            except NotFound:  # never handed out by this incarnation: nothing held, so it counts as freed
                self.count("free_unknown_slot_total")
            done.append((slot, generation))
        if disk:  # their free records are durable when this returns (one sync for all)
            done.extend(self.ssd.free_many(disk) if self.ssd is not None else disk)
        return done

    # ---- the disk tier ---------------------------------------------------------------------

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
        if self.ssd is None:
            raise Conflict("this segment has no disk tier")
        self.yield_to_gets()
        with self.lock:
            grant = self.slots.acquire(slot, generation, size)
            held = self.slots.held_one(slot, generation)
        key = held.key if held is not None else b""
        view = self.arena.slice(grant.offset, grant.size)
        try:
            if checksum(view) != grant.checksum:
                with self.lock:
                    self._count("demote_corrupt_total")
                    self.slots.release(slot, generation)
                    self._free_locked(slot, generation)
                raise ChecksumMismatch("the arena copy no longer matches its checksum: freed", slot=slot)
            try:
                self.yield_to_gets()
                placed = self.ssd.write(view, key, grant.checksum)
            finally:
                with self.lock:
                    self.slots.release(slot, generation)
        finally:
            view.release()
        self.count("demotions_total")
        self.count("demoted_bytes_total", size)
        return placed
