"""Confirms and write receipts: a segment's confirm of a stored replica, or the receipt a writer
carries in its put_commit, names the slot of a ticket (first one wins; another is a `mismatch`).
An object whose writer named no checksum gets it, and its first slot, only from the writer's
receipt (the segment's MAC over what it stored); a confirm before that is `pending`.
A mixin of `WriteTable` (`kvfabric.core.directory.writes`) over `WriteState`.
"""

from __future__ import annotations

from kvfabric.core.directory.base import GENERATION_MAX, SLOT_MAX, Effect, Outcome, check_batch
from kvfabric.core.directory.records import unpack_group
from kvfabric.core.directory.writes_state import Placement, WriteState
from kvfabric.format.checksum import CHECKSUM_BYTES
from kvfabric.format.ids import GroupKey, ObjectKey
from kvfabric.proto import directory as m
from kvfabric.proto.segment import tier_of_slot
from kvfabric.proto.tickets import receipt_mac, write_receipt_valid

__all__ = ["WriteConfirm"]


class WriteConfirm(WriteState):
    """The confirm phase of `WriteTable`."""

    # ---- confirm -------------------------------------------------------------------------

    def confirm(self, req: m.ConfirmReplicas, now_ms: int) -> Outcome:
        self.ctx.check_epoch(req.epoch)
        check_batch("confirms", len(req.confirms), m.CONFIRM_BATCH_MAX)
        self.segments.live_segment(req.segment_id, req.incarnation)
        republish: dict[GroupKey, int] = {}  # group -> placement a kept-source copy added to
        results = [
            m.ConfirmResult(ticket_id=c.ticket_id, status=self._confirm_one(req, c, republish))
            for c in req.confirms
        ]
        effects: list[Effect] = []
        for gid, placement in republish.items():
            record = self.published.records.get(gid)
            if record is None:
                continue
            group = unpack_group(record)
            # Published again only once the copy is whole on that segment's disk: a consumer
            # (the eviction policy) then counts the group there, and a partial copy is not a
            # head a tail may be demoted under (its confirms may also come in several requests).
            if all(
                any(r.placement == placement and tier_of_slot(r.slot) == "ssd" for r in mem.replicas)
                for mem in group.members
            ):
                effects.append(self.published.republished(gid, group))
        return Outcome(m.ConfirmReply(epoch=self.ctx.epoch, results=results), effects)

    def _confirm_one(
        self, req: m.ConfirmReplicas, c: m.ReplicaConfirm, republish: dict[GroupKey, int]
    ) -> m.ConfirmStatus:
        if not (0 <= c.slot <= SLOT_MAX and 1 <= c.slot_generation <= GENERATION_MAX):
            self.ctx.count("confirm_mismatch_total")  # no segment hands these out: refuse, keep nothing
            return "mismatch"
        where = self._tickets.get(c.ticket_id)
        if where is None and c.ticket_id in self.replicas:
            return self.replicas.confirm(req, c, republish)
        if where is None:
            if self.published.is_published_replica(self.segments.find(req.segment_id, req.incarnation), c):
                # A retried confirm (its first reply was lost) of a replica published since: its
                # ticket is gone, but "unknown_ticket" would tell the segment to free a readable slot.
                self.ctx.count("confirm_retried_published_total")
                return "ok"
            self.ctx.count("confirm_unknown_ticket_total")
            return "unknown_ticket"
        gid, member = where
        held = self.building[gid].members[member]
        placement = next(p for p in held.placements if p.ticket_id == c.ticket_id)
        addressed = self.segments.where(placement.placement) == (req.segment_id, req.incarnation)
        if addressed and (c.key, c.size_bytes) == (held.key, held.size_bytes) and not held.checksum:
            # No checksum named and no receipt committed yet: a segment's confirm cannot give
            # the object its bytes (whoever saw the ticket on the wire may have written it);
            # the writer's receipt will, and this confirm is asked again after it.
            self.ctx.count("confirm_pending_total")
            return "pending"
        if (
            not addressed
            or c.key != held.key
            or c.size_bytes != held.size_bytes
            or c.checksum != held.checksum
            # a write lands in the arena: a slot in the disk range would publish a replica that
            # reserves nothing (the tier follows the slot) while its bytes hold arena space
            or tier_of_slot(c.slot) != "dram"
            or not self._settle(placement, c.slot, c.slot_generation)
        ):
            self.ctx.count("confirm_mismatch_total")
            return "mismatch"
        return "ok"

    @staticmethod
    def _settle(placement: Placement, slot: int, generation: int) -> bool:
        """Confirm `placement` in (slot, generation): the first confirm or receipt names its slot;
        the same again is fine, another slot for the same ticket is refused (False)."""
        if placement.confirmed:
            return (placement.slot, placement.slot_generation) == (slot, generation)
        placement.slot, placement.slot_generation = slot, generation
        return True

    def _apply_receipt(self, writer_id: str, r: m.WriteReceipt, committed: set[ObjectKey]) -> None:
        """A writer's receipt confirms its replica when the segment's MAC over this table's own
        record of the ticket (segment, incarnation, key, size, checksum, epoch, shard) and the
        named slot is valid and the ticket's key is one of `committed` (the keys of the same
        put_commit); otherwise it confirms nothing (counted), and a member with no confirmed
        replica commits as `missing`: no bytes nobody stored are ever published."""
        where = self._tickets.get(r.ticket_id)
        if where is None:
            self.ctx.count("receipt_unknown_ticket_total")  # committed, expired or aborted since
            return
        gid, member = where
        held = self.building[gid].members[member]
        placement = next(p for p in held.placements if p.ticket_id == r.ticket_id)
        segment_id, incarnation = self.segments.where(placement.placement)
        if (
            held.writer_id != writer_id
            or held.key not in committed
            or not self.segments.live(placement.placement)
        ):
            self.ctx.count("receipt_refused_total")
            return
        if not (0 <= r.slot <= SLOT_MAX and 1 <= r.slot_generation <= GENERATION_MAX) or (
            tier_of_slot(r.slot) != "dram"
        ):
            self.ctx.count("receipt_refused_total")
            return
        # The checksum the writer named at put_begin, else the one the receipt's segment stored
        # (the MAC covers it: a writer cannot name another); once one replica gave it, every
        # other must have stored the same bytes.
        stored = held.checksum or r.checksum
        if len(stored) != CHECKSUM_BYTES:
            self.ctx.count("receipt_refused_total")
            return
        expected = receipt_mac(
            self.ctx.config.ticket_secret,
            r.ticket_id,
            self.ctx.epoch,
            self.ctx.shard,
            segment_id,
            incarnation,
            r.slot,
            r.slot_generation,
            held.size_bytes,
            stored,
            held.key,
        )
        if not write_receipt_valid(r.mac, expected):
            self.ctx.count("receipt_invalid_total")
            return
        if not self._settle(placement, r.slot, r.slot_generation):
            self.ctx.count("receipt_mismatch_total")
            return
        held.checksum = stored
        self.ctx.count("receipts_applied_total")
