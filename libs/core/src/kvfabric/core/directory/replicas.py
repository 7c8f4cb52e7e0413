"""The replica table: extra replicas of published objects being copied into place (repair,
prefetch, drain, demotion to a segment's disk tier), and replicas dropped (corrupt, cold, demoted).

## States of a replica ticket (one per (group, member, segment, tier) being copied)
    (absent) --replicate_begin--> COPYING(deadline) --replicate_begin again--> the same ticket
    COPYING --confirm, bytes match--> (absent; the replica joins the published record; a
        `keep_source` copy, which no drop follows, publishes its group again once every member
        has a replica of that tier on that segment: `republished`, never for a partial copy)
    COPYING --confirm of other bytes / of an object evicted or lost meanwhile--> (absent; the
        segment frees its copy: `mismatch` / `unknown_ticket`)
    COPYING --put_abort by its writer / deadline passed (tick)--> (absent; reservation released)
A dram ticket reserves the object's size in the target segment's arena; a disk (`ssd`) ticket
reserves none (the segment's tier says when it is full). Both count the tenant's bytes, never
refused (a repair must not fail on a quota).

## Dropping a replica (`replica_corrupt`)
`corrupt`: that replica is freed; a member left without any makes its group unreadable at once
(the sweep invalidates it). `cold` / `demoted`: a healthy replica nobody needs, never a member's
last; a demoted one is kept while its group is leased or pinned (a reader may hold only it).
Events: a group that stays published after any drop is published again (`republished`: its
live placements now, so a consumer counting its bytes per segment, the eviction policy's pools
and the router's index, follows; a `corrupt` drop emits `under_replicated` after it, for
repair), and so is one whose `demoted` drop is refused under a lease while the segment's disk
copy is in the record (its confirm published nothing: the drop was to). Before 2026-12-06 only a
`demoted` drop published: the policy counted a corrupt or drained replica's freed bytes on its
segment for as long as it tracked the group, and never the disk copy a lease kept.

## Many at once (`replicate_begin_many`, `replica_corrupt_many`)
Up to `REPLICA_BATCH_MAX` keys of this shard in one request (a segment demotes a batch): the
whole request's checks (epoch, TTL, batch size, a live segment for a drop, every item's key
valid) first, so a refused request applies nothing, then each item exactly as its single
request, in order, its reply in the same place. (Before (review), keys were parsed as each item
ran: a malformed key refused the request after the items before it were applied.) One round trip and
one request's overhead for a batch instead of one per object (docs/ssd-tier.md).

## Finding a key's tickets
Tickets are indexed by their key (`_by_key`): a retried replicate_begin and a put_abort look at
that key's tickets only (at most the segments times two tiers), never every ticket. Before
(review), both scanned the whole table per key: a tenant's 256-key put_abort cost 343 ms with
10,000 copies in flight, and a batch of copies was quadratic. Only a service holds a ticket
(replicate_begin is a service verb, and services' writer ids have no `/`: one with a `/` is
refused `bad_request`), so a put_abort by a tenant's scoped writer (`<tenant>/<writer>`) does not
look here at all (`writes`).

## Invariants (`check_invariants`)
1. Every ticket's deadline has an entry in the deadline heap.
2. A ticket's tier is `dram` or `ssd` (the tier its confirmed slot must have).
3. `_by_key` holds exactly each ticket's id under its key, and no empty set.

## Bounds
One ticket per (group, member, segment, tier): at most the published replicas' count times the
segments. A member record holds at most MEMBER_REPLICAS_MAX replicas. The deadline heap holds at
most twice the tickets plus HEAP_SLACK_MIN entries.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Final

from kvfabric.core.directory.base import (
    HEAP_SLACK_MIN,
    Context,
    Effect,
    EmitEvent,
    Member,
    Outcome,
    check_batch,
    scope_of,
)
from kvfabric.core.directory.frees import FreeTable
from kvfabric.core.directory.keys import chain_of, domain_of, parse_key
from kvfabric.core.directory.published import PublishedTable
from kvfabric.core.directory.records import MEMBER_REPLICAS_MAX, MemberRecord, ReplicaRecord, unpack_group
from kvfabric.core.directory.segments import Segment, SegmentTable
from kvfabric.core.quotas import Tenant, tenant_of
from kvfabric.format.errors import BadRequest
from kvfabric.format.ids import GroupKey, ObjectKey
from kvfabric.format.invariant import invariant
from kvfabric.proto import directory as m
from kvfabric.proto.segment import tier_of_slot
from kvfabric.proto.tickets import sign_ticket

__all__ = ["ReplicaTable", "ReplicaTicket"]

# A read token lives at most `lease_ttl_ms_max`, and a segment honours it up to its clock-skew
# tolerance past that (at most 10 s: segment_storage's CLOCK_SKEW_TOLERANCE_MS_MAX): how long a
# drained replica's drop waits for its group's readers at most is the two together.
TOKEN_SKEW_MS_MAX: Final = 10_000
DRAIN_WAITS_MAX: Final = 65_536  # drained replicas waiting so at once (past it, refused: no clock)
DRAIN_ORDER_SLACK: Final = 1_024


def check_copy_request(writer_id: str, write_ttl_ms: int) -> None:
    """A copy's request as a whole, before anything is applied: its write TTL, and a service's
    writer id. A tenant's scoped writer (`<tenant>/<writer>`) never holds a copy (replicate_begin
    is a service verb), which is what lets a tenant's put_abort skip the ticket index (`writes`)."""
    if not 0 < write_ttl_ms <= m.WRITE_TTL_MS_MAX:
        raise BadRequest(f"write_ttl_ms must be in 1..{m.WRITE_TTL_MS_MAX}")
    if scope_of(writer_id) is not None:
        raise BadRequest("a copy's writer id is a service's: no '/'")


@dataclass(frozen=True, slots=True)
class ReplicaTicket:
    group: GroupKey
    member: Member
    placement: int
    size_bytes: int
    checksum: bytes
    key: ObjectKey
    deadline_ms: int
    writer_id: str = ""
    tier: str = "dram"  # "ssd": a copy into the segment's own disk tier (demotion), no arena bytes
    keep_source: bool = False  # a copy no drop follows: its confirm publishes the group again


class ReplicaTable:
    def __init__(
        self, ctx: Context, segments: SegmentTable, published: PublishedTable, frees: FreeTable
    ) -> None:
        self.ctx = ctx
        self.segments = segments
        self.published = published
        self.frees = frees
        self.tickets: dict[int, ReplicaTicket] = {}
        self._by_key: dict[ObjectKey, set[int]] = {}  # key -> its tickets' ids
        self._deadlines: list[tuple[int, int]] = []  # (deadline_ms, ticket id)
        # group -> when a drained replica's drop was first refused under a read lease: refused
        # for `lease_ttl_ms_max` + TOKEN_SKEW_MS_MAX from then at most (`corrupt`); at most
        # DRAIN_WAITS_MAX held
        self._drain_waits: dict[tuple[GroupKey, ReplicaRecord], int] = {}
        self._drain_order: deque[tuple[int, tuple[GroupKey, ReplicaRecord]]] = deque()  # by time

    def __contains__(self, ticket_id: int) -> bool:
        return ticket_id in self.tickets

    def replicate_begin(self, req: m.ReplicateBegin, now_ms: int) -> Outcome:
        ctx = self.ctx
        ctx.check_epoch(req.epoch)
        check_copy_request(req.writer_id, req.write_ttl_ms)
        found = self.published.published_member(req.key)
        if found is None:
            return Outcome(m.ReplicateBeginReply(epoch=ctx.epoch, status="not_found"))
        gid, _, mem = found
        seg = self.segments.segments.get(req.segment_id)
        if seg is None or not seg.up or seg.draining:
            return Outcome(m.ReplicateBeginReply(epoch=ctx.epoch, status="segment_down"))
        placement = self.segments.intern(seg.segment_id, seg.incarnation)
        # One replica per (segment, tier): a segment may hold an object in its arena and in its
        # disk tier at once (demotion copies to disk before the arena replica is dropped;
        # promotion copies back before the disk one goes).
        # Readable by the copying segment until the ticket's deadline, at most `lease_ttl_ms_max`
        # as every read token (`TOKEN_SKEW_MS_MAX`: a drained replica's drop waits that long for
        # its readers; a 600 s copy token outlived the wait; review, stop 68).
        read_ms = min(req.write_ttl_ms, ctx.config.lease_ttl_ms_max)
        sources = [
            self.segments.replica(r, mem.size_bytes, now_ms + read_ms)
            for r in mem.replicas
            if self.segments.live(r.placement)
        ]
        if (
            any(r.placement == placement and tier_of_slot(r.slot) == req.tier for r in mem.replicas)
            or len(mem.replicas) >= MEMBER_REPLICAS_MAX
        ):
            # with the live replicas: a demoting segment checks that the disk replica named
            # here is still the one it holds before its arena replica goes
            return Outcome(m.ReplicateBeginReply(epoch=ctx.epoch, status="already_there", sources=sources))
        for ticket_id in self._by_key.get(req.key, ()):
            rt = self.tickets[ticket_id]
            if (rt.group, rt.member, rt.placement, rt.tier) == (gid, mem.member, placement, req.tier):
                # A retry (the first copy failed or its answer was lost): the same ticket again;
                # whichever copy confirms first wins, a later one gets unknown_ticket and is freed.
                if req.keep_source and not rt.keep_source:
                    self.tickets[ticket_id] = rt = replace(rt, keep_source=True)
                ticket = self._ticket(ticket_id, rt, seg, req.writer_id)
                return Outcome(
                    m.ReplicateBeginReply(epoch=ctx.epoch, status="placed", ticket=ticket, sources=sources)
                )
        if req.tier == "dram":  # a disk replica reserves no arena bytes (the segment's tier says full)
            if seg.capacity_bytes - seg.reserved_bytes < mem.size_bytes:
                ctx.count("no_capacity_total")
                return Outcome(m.ReplicateBeginReply(epoch=ctx.epoch, status="no_capacity"))
            seg.reserved_bytes += mem.size_bytes
        ctx.quotas.add(tenant_of(req.key), mem.size_bytes)  # counted, never refused (repair)
        ticket_id = ctx.next_id()
        deadline = now_ms + req.write_ttl_ms
        rt = ReplicaTicket(
            gid,
            mem.member,
            placement,
            mem.size_bytes,
            mem.checksum,
            req.key,
            deadline,
            req.writer_id,
            req.tier,
            req.keep_source,
        )
        self.tickets[ticket_id] = rt
        self._by_key.setdefault(rt.key, set()).add(ticket_id)
        heapq.heappush(self._deadlines, (deadline, ticket_id))
        self._bound_heap()
        ctx.count("replica_tickets_total" if req.tier == "dram" else "replica_tickets_ssd_total")
        ticket = self._ticket(ticket_id, rt, seg, req.writer_id)
        return Outcome(
            m.ReplicateBeginReply(epoch=ctx.epoch, status="placed", ticket=ticket, sources=sources)
        )

    def replicate_begin_many(self, req: m.ReplicateBeginMany, now_ms: int) -> Outcome:
        """`replicate_begin` for each item, in order (the module docstring, "Many at once")."""
        ctx = self.ctx
        check_batch("replicate_begin_many", len(req.items), m.REPLICA_BATCH_MAX)
        ctx.check_epoch(req.epoch)
        check_copy_request(req.writer_id, req.write_ttl_ms)
        for item in req.items:  # every key valid before any item is applied (parses are memoized)
            parse_key(item.key)
        replies: list[m.ReplicateBeginReply] = []
        for item in req.items:
            one = m.ReplicateBegin(
                writer_id=req.writer_id,
                request_id=item.request_id,
                key=item.key,
                segment_id=req.segment_id,
                write_ttl_ms=req.write_ttl_ms,
                epoch=req.epoch,
                tier=req.tier,
                keep_source=item.keep_source,
            )
            reply = self.replicate_begin(one, now_ms).reply
            invariant(isinstance(reply, m.ReplicateBeginReply), "replicate_begin reply type")
            assert isinstance(reply, m.ReplicateBeginReply)
            replies.append(reply)
        return Outcome(m.ReplicateBeginManyReply(epoch=ctx.epoch, replies=replies))

    def _ticket(self, ticket_id: int, rt: ReplicaTicket, seg: Segment, writer_id: str) -> m.WriteTicket:
        ticket = m.WriteTicket(
            ticket_id=ticket_id,
            key=rt.key,
            segment_id=seg.segment_id,
            incarnation=seg.incarnation,
            size_bytes=rt.size_bytes,
            checksum=rt.checksum,
            writer_id=writer_id,
            deadline_ms=rt.deadline_ms,
            epoch=self.ctx.epoch,
            data_addr=seg.data_addr,
            shard=self.ctx.shard,
        )
        return sign_ticket(ticket, self.ctx.config.ticket_secret)

    def confirm(
        self, req: m.ConfirmReplicas, c: m.ReplicaConfirm, republish: dict[GroupKey, int]
    ) -> m.ConfirmStatus:
        """A segment stored an extra replica under ticket `c.ticket_id` (one this table holds). A
        `keep_source` copy's group goes into `republish` with the copy's placement (the caller
        publishes the group once it is whole there: no drop follows such a copy, so nothing
        else tells consumers about the group's new tier)."""
        rt = self._pop(c.ticket_id)
        assert rt is not None  # the caller checked that this table holds it
        if self.segments.where(rt.placement) != (req.segment_id, req.incarnation) or (
            c.key,
            c.size_bytes,
            c.checksum,
            tier_of_slot(c.slot),
        ) != (rt.key, rt.size_bytes, rt.checksum, rt.tier):
            self._end(rt)
            self.ctx.count("confirm_mismatch_total")
            return "mismatch"
        found = self.published.published_member(rt.key)
        # Evicted or lost meanwhile, or evicted and saved again under the same key with other
        # bytes (the copy holds the old ones; review, 2026-12-06: it was added to the new
        # member): the segment frees the copy.
        if found is None or (found[2].size_bytes, found[2].checksum) != (rt.size_bytes, rt.checksum):
            self._end(rt)
            self.ctx.count("replica_confirm_gone_total")
            return "unknown_ticket"
        gid, group, mem = found
        if len(mem.replicas) >= MEMBER_REPLICAS_MAX:
            # tickets granted while it had room, confirmed after it filled: packed, the record
            # raised InvariantViolation half-way through a confirm batch and the directory
            # stopped (review, stop 67). The segment frees the copy.
            self._end(rt)
            self.ctx.count("replica_confirm_full_total")
            return "unknown_ticket"
        replica = ReplicaRecord(rt.placement, c.slot, c.slot_generation)
        self.published.replace_member(
            gid, group, MemberRecord(*mem.member, mem.size_bytes, mem.checksum, (*mem.replicas, replica))
        )
        self.ctx.count("replicas_added_total" if rt.tier == "dram" else "replicas_added_ssd_total")
        if rt.keep_source and rt.tier == "ssd":  # a disk copy (the only kind that keeps its source)
            republish[gid] = rt.placement
        return "ok"

    def abort(self, key: bytes, writer_id: str) -> int:
        """An extra replica's copy that failed: its reservation goes now, not at its deadline.
        O(the key's tickets)."""
        aborted = 0
        for ticket_id in list(self._by_key.get(ObjectKey(key), ())):
            if self.tickets[ticket_id].writer_id == writer_id:
                rt = self._pop(ticket_id)
                assert rt is not None
                self._end(rt)
                aborted += 1
        return aborted

    def _pop(self, ticket_id: int) -> ReplicaTicket | None:
        """Take ticket `ticket_id` out of the table and its key's index, if held."""
        rt = self.tickets.pop(ticket_id, None)
        if rt is not None:
            ids = self._by_key[rt.key]
            ids.discard(ticket_id)
            if not ids:
                del self._by_key[rt.key]
        return rt

    def _end(self, rt: ReplicaTicket) -> None:
        """A replica ticket that added nothing: its tenant bytes (and arena reservation) go back."""
        if rt.tier == "dram":
            self.segments.release(rt.placement, rt.size_bytes, tenant_of(rt.key))
        else:
            self.ctx.quotas.add(tenant_of(rt.key), -rt.size_bytes)

    def expire(self, now_ms: int) -> None:
        while self._deadlines and self._deadlines[0][0] <= now_ms:
            _, ticket_id = heapq.heappop(self._deadlines)
            rt = self._pop(ticket_id)
            if rt is not None:  # never confirmed: a late confirm gets unknown_ticket, the segment frees
                self._end(rt)
                self.ctx.count("replica_tickets_expired_total")
        self._bound_heap()

    def _bound_heap(self) -> None:
        if len(self._deadlines) > 2 * len(self.tickets) + HEAP_SLACK_MIN:  # drop the stale entries
            self._deadlines = [(rt.deadline_ms, i) for i, rt in self.tickets.items()]
            heapq.heapify(self._deadlines)

    # ---- dropping replicas ---------------------------------------------------------------

    def _healthy_segments(self, replicas: tuple[ReplicaRecord, ...]) -> int:
        """Segments up and not draining that hold these replicas: what counts toward the target
        (as `list_groups(below_target)` counts; an arena and a disk replica on one are one)."""
        placements = set()
        for r in replicas:
            seg = self.segments.segment_of(r.placement)
            if seg is not None and not seg.draining:
                placements.add(r.placement)
        return len(placements)

    def corrupt(self, req: m.ReplicaCorrupt, now_ms: int) -> Outcome:
        """A scrubber found bad bytes: that replica goes (freed); a member left without any
        replica makes its group unreadable at once and it is invalidated (swept)."""
        ctx = self.ctx
        ctx.check_epoch(req.epoch)
        self.segments.live_segment(req.segment_id, req.incarnation)
        effects: list[Effect] = []
        placement = self.segments.intern(req.segment_id, req.incarnation)
        found = self.published.published_member(req.key)
        bad = ReplicaRecord(placement, req.slot, req.slot_generation)
        if found is None or bad not in found[2].replicas:
            return Outcome(m.ReplicaCorruptReply(epoch=ctx.epoch, dropped=False))
        gid, group, mem = found
        left = tuple(r for r in mem.replicas if r != bad)
        tenant: Tenant = tenant_of(req.key)
        if req.reason != "corrupt":  # a healthy replica nobody needs (a cold extra): never the last
            # ... live one: a replica of a segment declared down stays in the record until the
            # sweep reaches its group, and counting it dropped the only live copy (review,
            # 2026-12-05: a cold extra dropped right after its original's segment died)
            if not any(self.segments.live(r.placement) for r in left):
                ctx.count("drop_refused_last_live_total")
                return Outcome(m.ReplicaCorruptReply(epoch=ctx.epoch, dropped=False))
            if req.reason == "cold_extra" and self._healthy_segments(left) < ctx.config.replicas_default:
                # the extra is no extra any more: a replica of the object was lost since it was
                # made (review, stop 65: dropped, the object went below target, repair copied it
                # again). It stays, an ordinary replica now: published again with it (the copy's
                # confirm published nothing), so the eviction policy's pools count it.
                ctx.count("drop_refused_below_target_total")
                effects.append(self.published.republished(gid, group))
                return Outcome(m.ReplicaCorruptReply(epoch=ctx.epoch, dropped=False), effects)
            if req.reason == "drained" and self._drain_waits_for_readers(gid, bad, now_ms):
                ctx.count("drop_refused_leased_total")
                return Outcome(m.ReplicaCorruptReply(epoch=ctx.epoch, dropped=False))
            self._drain_waits.pop((gid, bad), None)
            if req.reason == "demoted" and self.published.held(gid):
                # a reader leased it with a lookup that may name only this replica: not under it
                ctx.count("demote_drop_refused_leased_total")
                if any(r.placement == placement and tier_of_slot(r.slot) == "ssd" for r in left):
                    # The disk copy joined the record at its confirm, which published nothing (this
                    # drop was to): published again with it, or consumers never learn it is there.
                    effects.append(self.published.republished(gid, group))
                return Outcome(m.ReplicaCorruptReply(epoch=ctx.epoch, dropped=False), effects)
            self.published.replace_member(
                gid, group, MemberRecord(*mem.member, mem.size_bytes, mem.checksum, left)
            )
            self.frees.free(bad, mem.size_bytes, tenant, effects, key=req.key)
            ctx.count("replicas_dropped_total")
            # its bytes changed tier (demoted) or left that segment (drained, cold_extra; the
            # copies repair or prefetch made, which published nothing, are in it): consumers follow
            effects.append(self.published.republished(gid, unpack_group(self.published.records[gid])))
            return Outcome(m.ReplicaCorruptReply(epoch=ctx.epoch, dropped=True), effects)
        ctx.count("replicas_corrupt_total")
        if not left:  # its only good copy is gone: nobody may read the group any more
            self.published.mark_unreadable(gid)
            return Outcome(m.ReplicaCorruptReply(epoch=ctx.epoch, dropped=True), effects)
        self.published.replace_member(
            gid, group, MemberRecord(*mem.member, mem.size_bytes, mem.checksum, left)
        )
        self.frees.free(bad, mem.size_bytes, tenant, effects, key=req.key)
        self.published.queue_sweep(gid)  # gone entirely if that was the member's last replica
        if any(self.segments.live(r.placement) for r in left):  # (else the sweep invalidates it)
            # published again without the dropped replica, as any drop (module docstring)
            effects.append(self.published.republished(gid, unpack_group(self.published.records[gid])))
        effects.append(
            EmitEvent("under_replicated", m.GroupUnderReplicated(group=chain_of(gid), domain=domain_of(gid)))
        )
        return Outcome(m.ReplicaCorruptReply(epoch=ctx.epoch, dropped=True), effects)

    def _drain_waits_for_readers(self, gid: GroupKey, replica: ReplicaRecord, now_ms: int) -> bool:
        """Whether a drained replica of `gid` stays for now: a read lease holds the group, and
        its reader's lookup may name only this replica (the copy that lets it go came after:
        freed, its load missed, against invariant 3; review, stop 67). Not for longer than
        `lease_ttl_ms_max` + `TOKEN_SKEW_MS_MAX` from the first refusal (after the copy): every
        read token from before the copy has expired by then, whatever leases are renewed or
        taken since (a renewal issues no token; a later lookup names the copy too), so a hot
        group, or a tenant renewing a lease on purpose, cannot hold a drain up for good
        (review of the fix). (Pins do not hold it up at all. A cold extra is dropped under a
        lease: prefetch forgets it whatever the answer, so refused it would stay above target;
        its reader falls back.)"""
        if not self.published.lease_count.get(gid):
            return False
        wait_ms = self.ctx.config.lease_ttl_ms_max + TOKEN_SKEW_MS_MAX
        # Entries go at twice the wait, oldest first (a drop refused and never asked again: the
        # replica dropped otherwise, the drain called off, the group gone): a later drain of the
        # same replica then waits again (reused, its old clock let a drop through at once;
        # review of the fix). Bounded: past DRAIN_WAITS_MAX waiting, a new one is refused without
        # a clock (dropped, it would go under its readers; the oldest age out within 2 x wait).
        while self._drain_order and now_ms - self._drain_order[0][0] >= 2 * wait_ms:
            at, old = self._drain_order.popleft()
            if self._drain_waits.get(old) == at:
                del self._drain_waits[old]
        key = (gid, replica)
        since = self._drain_waits.get(key)
        if since is None:
            if len(self._drain_waits) >= DRAIN_WAITS_MAX:
                return True  # refused, with no clock: asked again once the oldest have aged out
            since = self._drain_waits[key] = now_ms
            self._drain_order.append((now_ms, key))
            if len(self._drain_order) > 2 * len(self._drain_waits) + DRAIN_ORDER_SLACK:
                # entries dropped already (their replicas went): the order keeps only live ones
                waiting = sorted(self._drain_waits.items(), key=lambda item: item[1])
                self._drain_order = deque((t, k) for k, t in waiting)
        return now_ms - since < wait_ms

    def corrupt_many(self, req: m.ReplicaCorruptMany, now_ms: int) -> Outcome:
        """`corrupt` for each item, in order, their effects together (the module docstring)."""
        ctx = self.ctx
        check_batch("replica_corrupt_many", len(req.items), m.REPLICA_BATCH_MAX)
        ctx.check_epoch(req.epoch)
        self.segments.live_segment(req.segment_id, req.incarnation)
        for item in req.items:  # every key valid before any item is applied (parses are memoized)
            parse_key(item.key)
        dropped: list[bool] = []
        effects: list[Effect] = []
        for item in req.items:
            one = m.ReplicaCorrupt(
                segment_id=req.segment_id,
                incarnation=req.incarnation,
                key=item.key,
                slot=item.slot,
                slot_generation=item.slot_generation,
                epoch=req.epoch,
                reason=req.reason,
            )
            outcome = self.corrupt(one, now_ms)
            reply = outcome.reply
            invariant(isinstance(reply, m.ReplicaCorruptReply), "replica_corrupt reply type")
            assert isinstance(reply, m.ReplicaCorruptReply)
            dropped.append(reply.dropped)
            effects.extend(outcome.effects)
        return Outcome(m.ReplicaCorruptManyReply(epoch=ctx.epoch, dropped=dropped), effects)

    # ---- what this table holds, and checks -----------------------------------------------

    def reservations(self) -> Iterator[tuple[int, int]]:
        for rt in self.tickets.values():
            if rt.tier == "dram":
                yield rt.placement, rt.size_bytes

    def usage(self) -> Iterator[tuple[Tenant, int, int]]:
        for rt in self.tickets.values():
            yield tenant_of(rt.key), rt.size_bytes, 0

    def check_invariants(self) -> None:
        queued = set(self._deadlines)
        by_key: dict[ObjectKey, set[int]] = {}
        for ticket_id, rt in self.tickets.items():
            invariant((rt.deadline_ms, ticket_id) in queued, "a replica ticket never expires")
            invariant(rt.tier in ("dram", "ssd"), "replica ticket tier", tier=rt.tier)
            by_key.setdefault(rt.key, set()).add(ticket_id)
        invariant(by_key == self._by_key, "replica tickets' key index differs from the tickets")
