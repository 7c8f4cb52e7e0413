"""The frees table: slots handed back to their segments, the groups being evicted until their
slots are freed, and the grace period of a new leader.

## States of a slot being freed (one entry per (segment id, incarnation, slot, generation))
    (absent) --free, in grace and adopted--> HELD --grace ends--> QUEUED --tick--> SENT_AT(now)
    HELD (an orphan) --grace ends while orphans are held--> HELD --the core is replaced--> (gone)
    (absent) --free--> SENT (a FreeSlots effect returned now) --next tick--> SENT_AT(now)
    SENT_AT(t) --tick, free_retry_ms after t: FreeSlots again--> SENT_AT(now)
    any --SlotsFreed from that incarnation / the incarnation is lost--> (absent)
A tick sends at most `free_resend_batch_max` QUEUED and due SENT_AT entries (oldest first; the
rest at the next ticks). It walks only those: SENT entries wait in `_fresh`, SENT_AT ones in
`_due` in the order they were stamped (one retry interval for all: that order is their due
order), QUEUED ones in `_queued`. A tick walked every entry (review, stop 67): 200,000 frees
outstanding to a slow segment cost every 100 ms tick a walk of them all.
A slot on an incarnation already lost is not entered: its memory is gone, its reservation is
released at once. Once named in a free, a slot belongs to the segment: the directory never hands
it out again, even if the free is lost (it is retried until acknowledged or the incarnation dies).
Its arena bytes and the tenant's bytes stay counted until then.

## Evicting groups
An evicted group leaves the published table at once and is kept here (`evicting`, its record)
until every free it sent is acknowledged; meanwhile put_begin of its keys answers `exists`. Its
record keeps naming its namespace (`namespaces`, counted per record) until it is forgotten.

## Grace (a new leader, `begin_grace`)
Until `grace_until_ms` (adoption time + `lease_ttl_ms_max`) a free of an adopted slot (one a
reader leased by the old leader may still read) is HELD, not sent; slots written under the new
epoch are not held back. The first tick at or after `grace_until_ms` ends the grace and sends
them.

**Orphans held for a rebuild** (`hold_orphans`). The adopted slots a rebuild freed as orphans
(`adopt`: an incomplete group, say its rank 1 only on a segment that missed the report) stay
HELD past the grace once the host says a rebuild for a missing segment is pending: that rebuild
(a new core, from every segment's report) may find the group whole. Without the hold, a rebuild
backed off past the 30 s grace freed rank 0 and lost a group whose bytes were all in the cluster
(review, stop 65). Other frees of adopted slots still go when the grace ends. The hold ends with
the core (the rebuild replaces it); until then the orphans' bytes stay reserved.

## Invariants (`check_invariants`)
1. `evicting_frees[g]` is the number of entries naming group g; `evicting` holds exactly the
   groups with such entries.
2. An entry is HELD only during the grace, or an orphan while orphans are held; adopted slots
   are remembered only during the grace, orphans only during it or while held.

## Bounds
One entry per slot handed back: at most the slots the segments hold. A retry names each entry
again every `free_retry_ms`. What one call returns goes out batched (`batch_frees`): one
FreeSlots per segment incarnation and `FREE_SLOTS_PER_REQUEST_MAX` slots, not one per slot (an
eviction of 256 slots sent 256 requests at once; the segment's request lane holds 64 and answered
the rest `busy`, their bytes reserved until the retry: a third of the live replay's writes failed).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from typing import Final, Literal, NamedTuple

from kvfabric.core.directory.base import Context, Effect, FreeSlots, Outcome, check_batch
from kvfabric.core.directory.namespaces import NamespaceTable
from kvfabric.core.directory.records import PublishedGroup, ReplicaRecord
from kvfabric.core.directory.segments import Segment, SegmentTable
from kvfabric.core.quotas import Tenant
from kvfabric.format.ids import GroupKey, ObjectKey
from kvfabric.format.invariant import invariant
from kvfabric.proto import directory as m
from kvfabric.proto.segment import tier_of_slot

__all__ = ["FREE_SLOTS_PER_REQUEST_MAX", "FreeTable", "PendingFree", "SlotKey", "batch_frees"]

# Slots one FreeSlots request names: its reply (`SlotsFreed`) stays within `m.FREED_BATCH_MAX`
# and the request within a NATS message (a slot is ~30 bytes encoded).
FREE_SLOTS_PER_REQUEST_MAX: Final = 1_024

SlotKey = tuple[str, int, int, int]  # (segment id, incarnation, slot, slot generation)
FreeState = Literal["held", "queued", "sent", "sent_at"]
NO_GROUP: Final = GroupKey(b"")  # a free of no evicting group
NO_KEY: Final = ObjectKey(b"")  # a free that does not name its key (a retry names only the slot)


class PendingFree(NamedTuple):
    """A tuple of atoms: the cyclic GC does not walk it (docs/directory.md, "Garbage collector")."""

    size_bytes: int
    group: GroupKey  # the evicting group this slot belongs to, empty if none
    tenant: Tenant
    state: FreeState
    sent_ms: int = 0  # when state is "sent_at"


def batch_frees(effects: list[Effect]) -> list[Effect]:
    """`effects` with its FreeSlots merged: one per (segment id, incarnation) per
    `FREE_SLOTS_PER_REQUEST_MAX` slots, at the place of that segment's first; other effects keep
    their order. Pure: what a segment frees and acknowledges is the same slots either way."""
    if sum(isinstance(e, FreeSlots) for e in effects) < 2:
        return effects
    merged: list[Effect] = []
    open_batch: dict[tuple[str, int], int] = {}  # segment incarnation -> index in `merged`
    for effect in effects:
        if not isinstance(effect, FreeSlots):
            merged.append(effect)
            continue
        where = (effect.segment_id, effect.incarnation)
        slots = effect.slots
        index = open_batch.get(where)
        if index is not None:
            batch = merged[index]
            assert isinstance(batch, FreeSlots)
            room = FREE_SLOTS_PER_REQUEST_MAX - len(batch.slots)
            merged[index] = FreeSlots(batch.segment_id, batch.incarnation, batch.slots + slots[:room])
            slots = slots[room:]
        while slots:
            open_batch[where] = len(merged)
            merged.append(
                FreeSlots(effect.segment_id, effect.incarnation, slots[:FREE_SLOTS_PER_REQUEST_MAX])
            )
            slots = slots[FREE_SLOTS_PER_REQUEST_MAX:]
    return merged


class FreeTable:
    def __init__(self, ctx: Context, segments: SegmentTable, namespaces: NamespaceTable) -> None:
        self.ctx = ctx
        self.segments = segments
        self.namespaces = namespaces  # shared with the published table: both records name them
        self.pending: dict[SlotKey, PendingFree] = {}
        self.evicting: dict[GroupKey, PublishedGroup] = {}
        self._evicting_frees: dict[GroupKey, int] = {}  # evicting group -> frees not yet acknowledged
        # After a rebuild (`begin_grace`), frees of adopted slots wait until this time.
        self.grace_until_ms = 0
        self.in_grace = False
        self._adopted: set[SlotKey] = set()  # slots a reader of the old leader may hold
        self._orphans: set[SlotKey] = set()  # adopted slots freed as orphans (`free(orphan=True)`)
        self.orphans_held = False  # `hold_orphans`: a rebuild may adopt them yet
        # What `retry` walks (stale items, of entries gone or re-stamped since, are skipped):
        self._fresh: list[SlotKey] = []  # SENT, to be stamped at the next tick
        self._due: deque[tuple[int, SlotKey]] = deque()  # SENT_AT (stamp, key), oldest first
        self._queued: deque[SlotKey] = deque()  # QUEUED: held past a grace that has ended

    def free(
        self,
        replica: ReplicaRecord,
        size_bytes: int,
        tenant: Tenant,
        effects: list[Effect],
        *,
        key: ObjectKey = NO_KEY,
        group: GroupKey = NO_GROUP,
        orphan: bool = False,
    ) -> None:
        """Hand a confirmed slot back to its segment. The reservation (and the tenant's bytes) is
        released on `SlotsFreed`. `group`: the evicting group it belongs to. `orphan`: an
        adopted slot no complete group names (`hold_orphans` may keep it past the grace)."""
        segment_id, incarnation = self.segments.where(replica.placement)
        if not self.segments.live(replica.placement):
            self.segments.release(replica.placement, size_bytes, tenant)  # dead incarnation: memory gone
            return
        if group:
            self._evicting_frees[group] = self._evicting_frees.get(group, 0) + 1
        slot_key = (segment_id, incarnation, replica.slot, replica.slot_generation)
        if self.in_grace and slot_key in self._adopted:
            # a reader leased by the old leader may still read it: not yet
            self.pending[slot_key] = PendingFree(size_bytes, group, tenant, "held")
            self.ctx.count("frees_deferred_grace_total")
            if orphan:
                self._orphans.add(slot_key)
            return
        self.pending[slot_key] = PendingFree(size_bytes, group, tenant, "sent")
        self._fresh.append(slot_key)
        effects.append(
            FreeSlots(segment_id, incarnation, (m.FreedSlot(key, replica.slot, replica.slot_generation),))
        )

    def freed(self, req: m.SlotsFreed, now_ms: int) -> Outcome:
        """A segment acknowledges frees (unknown ones are ignored: acknowledged already)."""
        self.ctx.check_epoch(req.epoch)
        check_batch("freed slots", len(req.freed), m.FREED_BATCH_MAX)
        self.segments.live_segment(req.segment_id, req.incarnation)
        accepted = 0
        for f in req.freed:
            key = (req.segment_id, req.incarnation, f.slot, f.slot_generation)
            if key in self.pending:
                self._finish(key)
                accepted += 1
        return Outcome(m.FreedAck(epoch=self.ctx.epoch, accepted=accepted))

    def segment_lost(self, seg: Segment) -> None:
        """Frees sent to a lost incarnation are done: its memory is gone."""
        for key in [k for k in self.pending if k[0] == seg.segment_id and k[1] == seg.incarnation]:
            self._finish(key)

    def _finish(self, key: SlotKey) -> None:
        pending = self.pending.pop(key)
        self._orphans.discard(key)
        self.ctx.quotas.add(pending.tenant, -pending.size_bytes)
        self.segments.release_freed(key[0], key[1], key[2], pending.size_bytes)
        if pending.group:
            self._evicting_frees[pending.group] -= 1
            self.forget_if_freed(pending.group)

    # ---- evicting groups -----------------------------------------------------------------

    def start_evicting(self, gid: GroupKey, group: PublishedGroup) -> None:
        """`group` left the published table: its record (and its count of its namespace) is
        kept here until its frees are acknowledged."""
        before = self.evicting.get(gid)
        if before is not None:  # (a group key is never published while evicting: put_begin `exists`)
            self.namespaces.release(before.namespace)
        self.evicting[gid] = group

    def forget_if_freed(self, gid: GroupKey) -> None:
        """An evicting group none of whose frees is outstanding is gone."""
        if not self._evicting_frees.get(gid):
            self._evicting_frees.pop(gid, None)
            group = self.evicting.pop(gid, None)
            if group is not None:
                self.namespaces.release(group.namespace)

    # ---- grace and time ------------------------------------------------------------------

    def begin_grace(self, now_ms: int, adopted: Iterable[SlotKey]) -> None:
        """A new leader: frees of `adopted` slots wait `lease_ttl_ms_max` (the longest lease the
        old leader could have granted). A stepped adoption calls it once per slice of the slots,
        each time with the same `now_ms` (`DirectoryCore.adopt_steps`)."""
        self.grace_until_ms = now_ms + self.ctx.config.lease_ttl_ms_max
        self.in_grace = True
        self._adopted.update(adopted)

    def end_grace(self, now_ms: int) -> None:
        if self.in_grace and now_ms >= self.grace_until_ms:
            self.in_grace = False  # the old leader's leases have all expired: frees may go
            self._adopted = set()
            if self.orphans_held:
                self.ctx.count("orphan_frees_held_total", len(self._orphans))
            else:
                self._orphans = set()
            # once, O(entries held): the held ones that may go now are queued to be sent
            for key, pending in self.pending.items():
                if pending.state == "held" and key not in self._orphans:
                    self.pending[key] = pending._replace(state="queued")
                    self._queued.append(key)

    def hold_orphans(self) -> int:
        """A rebuild for a missing segment is pending: the orphans freed at adoption and still
        held (the grace has not ended) stay held until this core is replaced. Returns how many
        are held (0 once the grace has ended: they were sent, too late to hold)."""
        if self.in_grace:
            self.orphans_held = True
        return len(self._orphans) if self.orphans_held else 0

    def retry(self, now_ms: int, effects: list[Effect]) -> None:
        """Stamp the frees sent since the last tick; send the queued ones (held through a grace
        that has ended), then resend unacknowledged ones `free_retry_ms` after they were sent,
        at most `free_resend_batch_max` in all, oldest first."""
        if now_ms:  # (a stamp at time 0 counts as none: the next tick stamps them again)
            fresh, self._fresh = self._fresh, []
            for key in fresh:
                pending = self.pending.get(key)
                if pending is not None and pending.state == "sent":
                    self._stamp(key, pending, now_ms)
        budget = self.ctx.config.free_resend_batch_max
        retry_ms = self.ctx.config.free_retry_ms
        # The queued first: held through a grace, the oldest of all and never sent yet. After
        # the due resends they starved while more were due each tick than the budget (review
        # of that fix: 0 of 10 sent in 54 s).
        while self._queued and budget > 0:
            key = self._queued.popleft()
            pending = self.pending.get(key)
            if pending is not None and pending.state == "queued":
                self._send(key, pending, now_ms, effects)
                budget -= 1
        while self._due and budget > 0 and now_ms - self._due[0][0] >= retry_ms:
            sent_ms, key = self._due.popleft()
            pending = self.pending.get(key)
            if pending is None or pending.state != "sent_at" or pending.sent_ms != sent_ms:
                continue  # acknowledged, or stamped again since
            self.ctx.count("free_retries_total")
            self._send(key, pending, now_ms, effects)
            budget -= 1
        if len(self._due) > 2 * len(self.pending) + 1_024:  # stale items of acknowledged frees
            self._due = deque(item for item in self._due if self._current(item))

    def _current(self, item: tuple[int, SlotKey]) -> bool:
        pending = self.pending.get(item[1])
        return pending is not None and pending.state == "sent_at" and pending.sent_ms == item[0]

    def _send(self, key: SlotKey, pending: PendingFree, now_ms: int, effects: list[Effect]) -> None:
        segment_id, incarnation, slot, generation = key
        effects.append(FreeSlots(segment_id, incarnation, (m.FreedSlot(NO_KEY, slot, generation),)))
        if now_ms:
            self._stamp(key, pending, now_ms)
        else:
            self.pending[key] = pending._replace(state="sent", sent_ms=0)
            self._fresh.append(key)

    def _stamp(self, key: SlotKey, pending: PendingFree, now_ms: int) -> None:
        """Sent at `now_ms` (> 0): due again `free_retry_ms` later, after those stamped before."""
        self.pending[key] = pending._replace(state="sent_at", sent_ms=now_ms)
        self._due.append((now_ms, key))

    # ---- what this table holds, and checks -----------------------------------------------

    def reservations(self) -> Iterator[tuple[int, int]]:
        """(placement, arena bytes) of every slot not yet acknowledged."""
        for (sid, inc, slot, _), pending in self.pending.items():
            placement = self.segments.find(sid, inc)
            invariant(placement is not None, "a free names a placement never interned")
            if tier_of_slot(slot) == "dram" and placement is not None:
                yield placement, pending.size_bytes

    def usage(self) -> Iterator[tuple[Tenant, int, int]]:
        """(tenant, bytes, objects): a slot being freed holds its bytes, no object."""
        for pending in self.pending.values():
            yield pending.tenant, pending.size_bytes, 0

    def check_invariants(self) -> None:
        outstanding: dict[GroupKey, int] = {}
        for key, pending in self.pending.items():
            if pending.group:
                outstanding[pending.group] = outstanding.get(pending.group, 0) + 1
            held_ok = self.in_grace or key in self._orphans
            invariant(pending.state != "held" or held_ok, "a free held back after the grace")
            invariant(pending.state != "queued" or not self.in_grace, "a free queued during the grace")
        invariant(
            all(k in self.pending and self.pending[k].state == "held" for k in self._orphans),
            "an orphan remembered that is not held",
        )
        invariant(
            self.in_grace or self.orphans_held or not self._orphans, "orphans remembered past the grace"
        )
        invariant(outstanding == self._evicting_frees, "evicting free counts drift")
        invariant(self.evicting.keys() == outstanding.keys(), "evicting group without outstanding frees")
        invariant(self.in_grace or not self._adopted, "adopted slots remembered after the grace")
