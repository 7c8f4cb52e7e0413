"""The segment backend's shared core: its state (slot table, arena, connections, counters, the
lock), the credentials every transport request is checked against, a dead connection's cleanup
and the directory's frees. `BackendWrites` and `BackendReads` extend it; `ArenaBackend`
(`kvfabric.segment_storage.backend`, where who owns what is told) is their union.
"""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from kvfabric.core.segment_slots import SlotTable
from kvfabric.format.clock import now_ms
from kvfabric.format.errors import NotFound
from kvfabric.format.invariant import invariant
from kvfabric.proto.dataplane import GetRequest, MapRequest, PutRequest, ReadRef
from kvfabric.proto.directory import WriteTicket
from kvfabric.proto.segment import SSD_SLOT_BASE
from kvfabric.proto.tickets import read_token_valid, ticket_signature_valid
from kvfabric.segment_storage.arena import Arena
from kvfabric.segment_storage.gate import SegmentGate
from kvfabric.segment_storage.ssd import SsdRead, SsdStream, SsdTier, release_reads

__all__ = [
    "AUTH_REFS_CHECKED_MAX",
    "CLOCK_SKEW_TOLERANCE_MS_DEFAULT",
    "CLOCK_SKEW_TOLERANCE_MS_MAX",
    "DEMOTE_YIELD_MS_DEFAULT",
    "BackendCore",
    "ConfirmFn",
    "ConfirmLaterFn",
    "CorruptFn",
    "FetchFn",
]

# Read references of a connection's first request whose tokens are checked to admit it.
AUTH_REFS_CHECKED_MAX: Final = 4
# How far past a directory-issued expiry (read token, write ticket) this segment's wall clock may
# be and still honour it (see the module doc): covers clocks this far apart.
CLOCK_SKEW_TOLERANCE_MS_DEFAULT: Final = 5_000
CLOCK_SKEW_TOLERANCE_MS_MAX: Final = 10_000
# `demote` waits at most this long, before each of its CPU steps (re-hash, disk write), while a
# GET is being served (KVF_SEGMENT_DEMOTE_YIELD_MS): reads first, demotion in the gaps.
DEMOTE_YIELD_MS_DEFAULT: Final = 20

# (ticket, slot, generation) -> the directory's verdict: "ok", "unknown_ticket", "mismatch" or
# "pending" (a ticket without a checksum whose writer has not committed its receipt).
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
# (key, slot, generation, size) of a disk replica a read found corrupt (already freed here): the
# shell tells the directory. Called from a transport thread.
CorruptFn = Callable[[bytes, int, int, int], None]


@dataclass(slots=True)
class _Conn:
    puts: dict[int, tuple[int, int]] = field(default_factory=dict)  # slot -> (slot, generation)
    grants: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # grant id -> refs
    # A local pin's grant id -> when it lapses (ms; `BackendReads.expire_pins`): its read
    # tokens' expiry plus the clock skew tolerance, or `PIN_HOLD_MS_MAX` from now without tokens.
    pin_expiry_ms: dict[int, int] = field(default_factory=dict)
    gets: set[int] = field(default_factory=set)  # GET grants being served (begin_get .. end_get)
    disk_reads: dict[int, list[SsdRead | SsdStream]] = field(default_factory=dict)  # grant id -> disk buffers


class BackendCore:
    """State and checks shared by the backend's writes and reads (`ArenaBackend`)."""

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
        # Epoch fences per directory shard and the drain flag: tickets, frees and reports of a
        # replaced leader's epoch store and free nothing; a draining segment takes no writes.
        self.gate = SegmentGate()
        self.lock = threading.Lock()
        self._conns: dict[int, _Conn] = {}
        # Write tickets used here, until their deadline: (shard, epoch, ticket id, key) -> (slot,
        # generation, deadline ms), and the same in deadline order for pruning (`begin_put`:
        # one slot per ticket).
        self._ticket_slots: dict[tuple[int, int, int, bytes], tuple[int, int, int]] = {}
        self._ticket_deadlines: collections.deque[tuple[int, tuple[int, int, int, bytes]]] = (
            collections.deque()
        )
        self._grant_ids = itertools.count(1)
        self._copy_conns = itertools.count(-1, -1)  # negative: never a transport's connection id
        self.counters: dict[str, int] = {}
        self.demote_yield_ms = demote_yield_ms
        self._gets_served = 0  # GETs between begin_get and end_get (or their connection's close)
        self._gets_idle = threading.Condition(self.lock)

    def _count(self, name: str, n: int = 1) -> None:
        # The caller holds self.lock: a read then a write, from many threads (else `count`;
        # tests/unit/segment_storage/test_counters_under_lock.py checks every call site).
        self.counters[name] = self.counters.get(name, 0) + n

    def count(self, name: str, n: int = 1) -> None:
        """Count an event of the shell's (exported with the backend's counters)."""
        with self.lock:
            self._count(name, n)

    def _conn(self, conn: int) -> _Conn:
        return self._conns.setdefault(conn, _Conn())

    @property
    def draining(self) -> bool:
        return self.gate.draining

    @draining.setter
    def draining(self, draining: bool) -> None:
        with self.lock:
            self.gate.draining = draining

    def admit_directory(self, shard: int, epoch: int) -> bool:
        """A free or report from the leader of `shard` at `epoch`: `StaleGeneration` if a newer
        leader has been heard of, else the shard's fence rises to `epoch` (returns whether it rose)."""
        with self.lock:
            return self.gate.admit(shard, epoch)

    def saw_epoch(self, shard: int, epoch: int) -> bool:
        """A leader of `shard` with `epoch` exists (a reply, a heartbeat's shard epochs): tickets,
        frees and reports of older epochs are fenced from now on. Returns whether the fence rose."""
        with self.lock:
            return self.gate.saw(shard, epoch)

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
        release_reads([buffer for buffers in c.disk_reads.values() for buffer in buffers])

    def connection_leaked(self, conn: int) -> None:
        """A connection whose transport may still use its buffers (a stuck UCX link): its
        references and slots stay held (leaked on purpose: `close_connection` is never called
        for it), but its GETs end: demotion yields to GETs being served, and one never ended
        made every demotion step wait `demote_yield_ms`, for good (review, stop 67)."""
        with self.lock:
            c = self._conns.get(conn)
            if c is not None:
                self._gets_ended(len(c.gets))
                c.gets.clear()

    def _gets_ended(self, n: int) -> None:
        """Under the lock: `n` GETs are no longer served."""
        if n:
            self._gets_served -= n
            if self._gets_served == 0:
                self._gets_idle.notify_all()

    # ---- frees ---------------------------------------------------------------------------------

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
        freed when the last transfer ends. Returns the pairs the directory may stop retrying: every
        DRAM pair (freed now, deferred, freed already, or never held here) and the disk pairs
        `SsdTier.free_many` returns (not those whose free record is not durable yet)."""
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
        if disk:  # those returned have their free records durable (one sync for all)
            done.extend(self.ssd.free_many(disk) if self.ssd is not None else disk)
        return done
