"""The segment backend's writes: a PUT's slot from its ticket to its confirm (or receipt), its
abort, and a copy from another segment as a PUT whose transport is a fetch. A mixin over
`BackendCore`; who owns a WRITING slot is told in `kvfabric.segment_storage.backend`.
"""

from __future__ import annotations

import contextlib

import msgspec

from kvfabric.dataplane.backend import PutClaim, PutSlot
from kvfabric.format.checksum import checksum
from kvfabric.format.errors import (
    BadRequest,
    ChecksumMismatch,
    Conflict,
    Indeterminate,
    KvfError,
    StaleGeneration,
    Unauthorized,
)
from kvfabric.proto.directory import WriteTicket
from kvfabric.proto.tickets import claim_proof_valid, ticket_signature_valid, write_receipt
from kvfabric.segment_storage.backend_core import BackendCore, FetchFn

__all__ = ["BackendWrites"]


class BackendWrites(BackendCore):
    """PUTs and copies in (`ArenaBackend`)."""

    def begin_put(self, ticket: WriteTicket, conn: int, claim: PutClaim | None = None) -> PutSlot:
        if not ticket_signature_valid(ticket, self.secret):
            self.count("bad_ticket_signature_total")
            raise Unauthorized("write ticket signature is not valid")
        if not ticket.checksum and (claim is None or not claim_proof_valid(ticket, self.secret, *claim)):
            # Not the writer: whoever read the sealed ticket off the wire cannot prove what it
            # names (the ticket's signature is the key, and it never crosses the data plane).
            # Refused before a slot is taken or a byte received.
            self.count("bad_claim_proof_total")
            raise Unauthorized("the PUT's proof of what it names is not the ticket's writer's")
        if ticket.segment_id != self.segment_id:
            raise BadRequest(f"ticket is for segment {ticket.segment_id!r}, this is {self.segment_id!r}")
        if ticket.incarnation != self.incarnation:
            self.count("stale_incarnation_rejected_total")
            raise StaleGeneration("segment_incarnation", ticket.incarnation, self.incarnation)
        try:
            self.gate.check(ticket.shard, ticket.epoch)
        except StaleGeneration:
            self.count("stale_epoch_rejected_total")
            raise
        now = self.clock_ms()
        deadline_ms = self.ticket_deadline_ms(ticket)
        if now >= deadline_ms:
            self.count("expired_ticket_total")
            raise Conflict("write ticket deadline has passed", deadline_ms=ticket.deadline_ms)
        self.gate.check_writes()
        with self.lock:
            # One slot per ticket (review, 2026-12-05): a writer could PUT one ticket again and
            # again, each time a new slot, N times the bytes its tenant was charged for once,
            # held until the ticket's deadline (its confirms `pending`). A ticket whose slot is
            # gone (aborted, freed: a repair's copy asked again) may be used once more.
            self._prune_tickets(now)
            # ids are per shard leader (a new one counts from 1 again): the ticket is all of these
            which = (ticket.shard, ticket.epoch, ticket.ticket_id, bytes(ticket.key))
            used = self._ticket_slots.get(which)
            if used is not None and self.slots.holds(used[0], used[1]):
                self._count("ticket_reused_total")
                raise Conflict("this write ticket already holds a slot here", ticket_id=ticket.ticket_id)
            alloc = self.slots.alloc(ticket.size_bytes, now, deadline_ms, ticket.key)
            self._conn(conn).puts[alloc.slot] = (alloc.slot, alloc.generation)
            self._ticket_slots[which] = (alloc.slot, alloc.generation, deadline_ms)
            if used is None or used[2] != deadline_ms:  # once per ticket: a ticket used again
                # after an abort appended again each time (review, 2026-12-06)
                self._ticket_deadlines.append((deadline_ms, which))
        view = self.arena.slice(alloc.offset, alloc.size)
        return PutSlot(alloc.slot, alloc.generation, view, ticket, alloc.offset)

    def _prune_tickets(self, now: int) -> None:
        """Forget tickets past their deadline (caller holds the lock): none can be used again.
        Deadlines come in about the order tickets were used; one that is not waits its turn."""
        while self._ticket_deadlines and self._ticket_deadlines[0][0] <= now:
            _, which = self._ticket_deadlines.popleft()
            used = self._ticket_slots.get(which)
            if used is not None and used[2] <= now:
                del self._ticket_slots[which]

    def finish_put(self, put: PutSlot, conn: int) -> tuple[int, int]:
        # Hashed on arrival by the transport, or now (nobody else can see a WRITING slot: no lock).
        stored = put.checksum if put.checksum is not None else checksum(put.view)
        put.view.release()
        # The ticket's checksum; for a ticket that carries none, the writer's of the bytes it
        # sent (a staged put names none: the bytes were read from the writer's own pages).
        expected = put.ticket.checksum or put.claimed
        if expected and stored != expected:
            self.count("checksum_mismatch_total")
            self.abort_put(put, conn)
            raise ChecksumMismatch("bytes received do not match the ticket's checksum")
        ticket = put.ticket
        if not ticket.checksum:
            # What this segment stored: its receipt and its confirm name it, and the writer's
            # commit of the receipt makes it the object's checksum (ObjectSpec.checksum).
            put.stored = stored
            ticket = msgspec.structs.replace(ticket, checksum=stored)
        with self.lock:
            # The ticket's epoch again, now: a successor leader of its shard may have asked for
            # this segment's report while the bytes were landing. Its report (taken after its
            # fence rose) did not list this WRITING slot, so it will never adopt it, and it
            # refuses the writer's commit at the old epoch: stored now, the slot would have no
            # owner (a receipted write's background confirm leaves a `stale_generation` slot to
            # the successor). Fenced here, under the lock the report's fence takes, the slot is
            # either in the report or never stored (review of 2026-12-02).
            fenced = ticket.epoch < self.gate.fence(ticket.shard)
            if not fenced:
                self.slots.stored(put.slot, put.slot_generation, stored)
                self._conns[conn].puts.pop(put.slot, None)
                self.arena.board.publish(put.slot, put.slot_generation, put.offset, ticket.size_bytes, stored)
        if fenced:
            self.count("stale_epoch_rejected_total")
            self.abort_put(put, conn)
            raise StaleGeneration("directory_epoch", ticket.epoch, self.gate.fence(ticket.shard))
        if put.receipt_wanted and self.confirm_later is not None:
            # The writer carries the receipt in its put_commit (the directory checks our MAC): the
            # confirm leaves the write's path. It still goes, in the background: a receipt the
            # writer never commits (it died, aborted) is refused there and the slot freed here.
            try:
                self.confirm_later(ticket, put.slot, put.slot_generation, put.trace_id)
            except KvfError:
                self._free(put.slot, put.slot_generation)
                raise
            put.receipt = write_receipt(self.secret, ticket, put.slot, put.slot_generation)
            with self.lock:  # both counters in one hold (the transports' threads count too)
                self._count("puts_total")
                self._count("puts_receipted_total")
            return put.slot, put.slot_generation
        try:
            verdict = self.confirm(ticket, put.slot, put.slot_generation, put.trace_id, put.save_writes)
        except StaleGeneration as err:
            if err.details.get("kind") != "directory_epoch":  # (this incarnation is not the live one)
                self._free(put.slot, put.slot_generation)
                raise
            # The ticket's leader was replaced after the slot was stored (fenced above
            # otherwise): its successor's report lists the slot, and the successor publishes or
            # frees it, as a background confirm's `stale_generation` leaves it (shell_confirms).
            # Freed here, a rebuild that published the group from the report served a replica
            # that was gone (review, stop 67).
            self.count("confirm_superseded_total")
            raise
        except Indeterminate:
            # No verdict in time: the directory may have applied the confirm (slow, its answer
            # late). For a copy that made the slot a replica of a published group, and freed
            # here the record named a slot that was gone (review, stop 68). Kept, and confirmed
            # again in the background as a receipted write's is: `ok` keeps it, a refusal (the
            # writer's or copier's abort came first) or no verdict past the deadline frees it.
            self._confirm_again_or_free(ticket, put)
            raise
        except KvfError:
            self._free(put.slot, put.slot_generation)  # not confirmed: never readable via the directory
            raise
        if verdict != "ok":
            self.count(f"confirm_{verdict}_total")
            self._free(put.slot, put.slot_generation)
            raise Conflict(f"the directory refused the replica: {verdict}", verdict=verdict)
        self.count("puts_total")
        return put.slot, put.slot_generation

    def _confirm_again_or_free(self, ticket: WriteTicket, put: PutSlot) -> None:
        """A stored slot whose confirm (under `ticket`, with the stored checksum) got no verdict:
        to the background confirms, or freed when there are none (a backend without a shell)
        or they stopped."""
        kept = False
        if self.confirm_later is not None:
            with contextlib.suppress(KvfError):  # (they stopped: freed below, as without them)
                self.confirm_later(ticket, put.slot, put.slot_generation, put.trace_id)
                kept = True
        if kept:
            self.count("confirm_indeterminate_kept_total")
        else:
            self._free(put.slot, put.slot_generation)

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
