"""The published table: the readable chunk groups, who holds them (leases and pins), and how a
group stops being published (evicted, or invalidated by the sweep).

A published group is one packed `bytes` record (`records`) under its group key, its
namespace interned (`namespaces`: counted by the published and evicting records naming it,
dropped with the last); the per-domain index (`index`) orders the keys for listings.

## States of a published group
    (absent) --publish (writes) / adopt--> PUBLISHED
    PUBLISHED --replica added or dropped (replicas)--> PUBLISHED (record replaced, degraded flag
        follows the replica target)
    PUBLISHED --evict, no lease and no pin--> (absent here; EVICTING in the frees table)
    PUBLISHED --a member's last good replica corrupt (replicas)--> UNREADABLE (still here: lookups
        and pins skip it) --sweep--> (absent)
    PUBLISHED --sweep: replicas on dead incarnations dropped--> PUBLISHED degraded, or, when a
        member has none left: (absent, its live slots freed; `invalidated` event)
    a sweep that would remove a held group defers it (DEFERRED) while it is read-leased, or
        pinned with replicas left on live incarnations (a member of several that survived:
        removing the group frees them, and a pinned slot is never freed); then queues it again.
        A pinned group with nothing left to free is removed at once: a pin gives nobody read
        tokens, and while the lost group stayed published its keys answered `exists` to every
        re-save, so a pinned hot prefix was recomputed by every request until the pin ended (up
        to a day for an operator's pin; review, stop 68). The pin outlives the record and holds
        the key's next record, as a pin of a key does.
A group is lost (`lost`) when it is unreadable or a member has no replica on a live incarnation,
for good (an incarnation never comes back). No hold on a lost group outlasts the holds it had
when lost: a pin skips lost groups and a renew does not extend a lease holding a deferred one
(`leases`). A below-target listing does not list a deferred group (nothing can repair it), so
`short_covers_below_target` ignores them. Before (review), re-pinning a lost group every 15 s kept
it deferred for ever, and while it was, each of the repair service's below-target passes walked
every group.

## Invariants (`check_invariants`)
1. The per-domain index holds exactly the published group keys.
2. Unreadable, queued and deferred groups are published; a deferred group is leased or pinned.
3. Lease and pin counts are positive (the lease table checks they match its leases).
4. `short` (the repair listing's index) holds exactly the groups with a member short of the
   default replica target in its record; a group with a replica on a dead incarnation is queued
   for the sweep or deferred (so `short` covers every group below target, but the deferred ones,
   which a below-target listing skips, when none is queued and no segment drains).
5. Each interned namespace is counted once per published or evicting record naming its index
   (`namespaces`), and only those are interned.

## Bounds
The sweep queue holds each group key at most once (an ordered set; a key leaves it when its group
leaves the table), so it never exceeds the published table; a tick examines at most
`sweep_batch_max` of it. Lease and pin counts: one entry per held group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from kvfabric.core.directory.base import (
    Context,
    Effect,
    EmitEvent,
    Outcome,
    Steps,
    check_batch,
    run_whole,
)
from kvfabric.core.directory.frees import FreeTable
from kvfabric.core.directory.index import DomainIndex
from kvfabric.core.directory.keys import GroupInfo, chain_of, domain_of, parse_group, parse_key
from kvfabric.core.directory.rebuild import RebuiltGroup
from kvfabric.core.directory.records import (
    FLAG_DEGRADED,
    MemberRecord,
    PublishedGroup,
    ReplicaRecord,
    pack_group,
    replica_segments,
    unpack_group,
)
from kvfabric.core.directory.segments import SegmentTable
from kvfabric.core.quotas import Tenant, tenant_of
from kvfabric.format.errors import BadRequest
from kvfabric.format.ids import GroupKey, Namespace
from kvfabric.format.invariant import invariant
from kvfabric.proto import directory as m
from kvfabric.proto.segment import tier_of_slot

__all__ = ["PublishedTable"]


class PublishedTable:
    def __init__(self, ctx: Context, segments: SegmentTable, frees: FreeTable) -> None:
        self.ctx = ctx
        self.segments = segments
        self.frees = frees
        self.records: dict[GroupKey, bytes] = {}  # group key -> packed record
        self.namespaces = frees.namespaces  # one table: evicting records name them too
        # The published group keys per share domain, in order: listings page through one
        # domain's keys only (the same key objects as `records`').
        self.index = DomainIndex()
        # The published groups a member of which has fewer replicas in its record than the
        # default target, in the same order: the repair service's below-target listing pages
        # through these only (`short_covers_below_target`), not every group every few seconds
        # (at 20,000 groups that scan was a fifth of the directory's loop during a save loop,
        # 2026-12-02). Not the degraded flag: a publish sets that against the writer's own target.
        self.short = DomainIndex()
        # Published groups a member of which has no good replica left (its last one was corrupt):
        # unreadable at once, invalidated by the sweep once no lease or pin holds them.
        self.unreadable: set[GroupKey] = set()
        self.lease_count: dict[GroupKey, int] = {}
        self.pin_count: dict[GroupKey, int] = {}
        self._sweep_queue: dict[GroupKey, None] = {}  # an ordered set, taken from its end
        # Groups that lost a member's last replica while leased/pinned: unreadable now, their
        # remaining slots are freed only once the last lease or pin on them ends.
        self._sweep_deferred: set[GroupKey] = set()

    # ---- records -------------------------------------------------------------------------

    def intern_namespace(self, namespace: Namespace) -> int:
        """The index of `namespace` for a record about to be added (`add`): counted once more,
        given back when the record is gone (invalidated, or evicted and its frees acknowledged)."""
        return self.namespaces.acquire(namespace)

    def namespace(self, idx: int) -> Namespace:
        return self.namespaces.get(idx)

    def add(self, gid: GroupKey, group: PublishedGroup) -> None:
        self.records[gid] = pack_group(group)
        self.index.add(gid)
        if self._short(group):
            self.short.add(gid)

    def replace(self, gid: GroupKey, group: PublishedGroup) -> None:
        self.records[gid] = pack_group(group)
        was, now = gid in self.short, self._short(group)
        if now and not was:
            self.short.add(gid)
        elif was and not now:
            self.short.remove(gid)

    def _remove(self, gid: GroupKey) -> None:
        del self.records[gid]
        self.index.remove(gid)
        if gid in self.short:
            self.short.remove(gid)
        self.unreadable.discard(gid)
        self._sweep_queue.pop(gid, None)

    def published_as(self, info: GroupInfo) -> PublishedGroup | None:
        """The published group under `info`'s group key if it has `info`'s identity. A known
        group key paired with other identity fields (model, layout) is treated as absent by every
        verb, so such ids answer exactly like missing groups."""
        record = self.records.get(info.group_id)
        if record is None:
            return None
        group = unpack_group(record)
        if self.namespaces.find(info.namespace) != group.namespace or group.chunk_index != info.chunk_index:
            self.ctx.count("lookup_identity_mismatch_total")
            return None
        return group

    def published_member(self, key: bytes) -> tuple[GroupKey, PublishedGroup, MemberRecord] | None:
        info = parse_key(key)
        record = self.records.get(info.group.group_id)
        if record is None:
            return None
        group = unpack_group(record)
        if self.namespaces.get(group.namespace) != info.group.namespace:
            return None
        mem = next((x for x in group.members if x.member == info.member), None)
        return None if mem is None else (info.group.group_id, group, mem)

    def replace_member(self, gid: GroupKey, group: PublishedGroup, new: MemberRecord) -> None:
        """The member's replicas changed: the degraded flag follows the replica target."""
        members = tuple(new if x.member == new.member else x for x in group.members)
        target = self.ctx.config.replicas_default
        degraded = any(replica_segments(x.replicas) < target for x in members)
        flags = (group.flags | FLAG_DEGRADED) if degraded else (group.flags & ~FLAG_DEGRADED)
        self.replace(gid, PublishedGroup(group.namespace, group.chunk_index, flags, members))

    def is_published_replica(self, placement: int | None, c: m.ReplicaConfirm) -> bool:
        """Whether this confirm names exactly a replica of a published member (same bytes, slot)."""
        try:
            info = parse_key(c.key)
        except BadRequest:
            return False
        record = self.records.get(info.group.group_id)
        if placement is None or record is None:
            return False
        return any(
            mem.member == info.member
            and (mem.size_bytes, mem.checksum) == (c.size_bytes, c.checksum)
            and ReplicaRecord(placement, c.slot, c.slot_generation) in mem.replicas
            for mem in unpack_group(record).members
        )

    def republished(self, gid: GroupKey, group: PublishedGroup) -> EmitEvent:
        """A `published` event for a group already published, with its live placements now and
        the disk share of them (after a demotion, or adopted with disk replicas)."""
        held: dict[str, int] = {}
        disk: dict[str, int] = {}
        for mem in group.members:
            for r in mem.replicas:
                if not self.segments.live(r.placement):
                    continue
                segment_id = self.segments.where(r.placement)[0]
                held[segment_id] = held.get(segment_id, 0) + mem.size_bytes
                if tier_of_slot(r.slot) == "ssd":
                    disk[segment_id] = disk.get(segment_id, 0) + mem.size_bytes
        self.ctx.count("groups_republished_total")
        return EmitEvent(
            "published",
            m.GroupPublished(
                group=chain_of(gid),
                chunk_index=group.chunk_index,
                members=len(group.members),
                degraded=bool(group.flags & FLAG_DEGRADED),
                namespace=self.namespaces.get(group.namespace),
                placements=[m.SegmentBytes(s, b) for s, b in sorted(held.items())],
                disk_placements=[m.SegmentBytes(s, b) for s, b in sorted(disk.items())],
                group_bytes=sum(mem.size_bytes for mem in group.members),
            ),
        )

    def adopt_group(self, gid: GroupKey, rebuilt: RebuiltGroup, effects: list[Effect]) -> int:
        """Publish one complete group a rebuild found (`rebuild`); returns how many replicas it
        holds (what `DirectoryCore.adopt_steps` bounds a step by)."""
        records = []
        degraded = False
        for _, mem in sorted(rebuilt.members.items()):  # by `member_code`: in member order
            replicas = tuple(
                ReplicaRecord(self.segments.intern(r.segment_id, r.incarnation), r.slot, r.slot_generation)
                for r in mem.replicas
            )
            degraded |= replica_segments(replicas) < self.ctx.config.replicas_default
            records.append(
                MemberRecord(
                    mem.tp_rank, mem.pp_stage, mem.layer_group, mem.size_bytes, mem.checksum, replicas
                )
            )
        group = PublishedGroup(
            self.intern_namespace(rebuilt.namespace),
            rebuilt.chunk_index,
            FLAG_DEGRADED if degraded else 0,
            tuple(records),
        )
        self.add(gid, group)
        if any(tier_of_slot(r.slot) == "ssd" for x in records for r in x.replicas):
            effects.append(self.republished(gid, group))  # the policy learns its disk bytes
        self.ctx.quotas.add(
            tenant_of(rebuilt.namespace), sum(x.size_bytes * len(x.replicas) for x in records), len(records)
        )
        return sum(len(x.replicas) for x in records)

    # ---- holds (read leases and pins, counted per group by the lease table) ---------------

    def hold(self, gid: GroupKey, is_pin: bool) -> None:
        counts = self.pin_count if is_pin else self.lease_count
        counts[gid] = counts.get(gid, 0) + 1

    def unhold(self, gid: GroupKey, is_pin: bool) -> None:
        counts = self.pin_count if is_pin else self.lease_count
        left = counts[gid] - 1
        invariant(left >= 0, "negative lease count")
        if left:
            counts[gid] = left
            return
        del counts[gid]
        if gid in self._sweep_deferred and not self._defers(gid, self._replicas_left(gid)):
            self._sweep_deferred.discard(gid)
            self.queue_sweep(gid)

    def held(self, gid: GroupKey) -> bool:
        return bool(self.lease_count.get(gid) or self.pin_count.get(gid))

    def _defers(self, gid: GroupKey, replicas_left: bool) -> bool:
        """Whether lost group `gid`'s removal waits (module docstring): a read lease, or a pin
        on a group with replicas left on live incarnations (`replicas_left`: they would be freed)."""
        return bool(self.lease_count.get(gid) or (self.pin_count.get(gid) and replicas_left))

    def _replicas_left(self, gid: GroupKey) -> bool:
        record = self.records.get(gid)
        return record is not None and any(
            self.segments.live(r.placement) for x in unpack_group(record).members for r in x.replicas
        )

    # ---- eviction (published -> evicting, in the frees table) ------------------------------

    def evict(self, req: m.Evict, building_identity: Callable[[GroupKey], GroupInfo | None]) -> Outcome:
        return run_whole(self.evict_steps(req, building_identity, None))

    def evict_steps(
        self, req: m.Evict, building_identity: Callable[[GroupKey], GroupInfo | None], ids_max: int | None
    ) -> Steps:
        """Evict groups no lease or pin holds, in steps of at most `ids_max` groups (None: one;
        `Steps`): every id parsed first, a slice a step (a malformed one refuses the request
        whole, nothing evicted), then a slice evicted a step, each group's result its own.
        `building_identity`: the identity of a group being written (the write table's), for the
        statuses of groups not published."""
        self.ctx.check_epoch(req.epoch)
        check_batch("evict groups", len(req.groups), m.EVICT_BATCH_GROUPS_MAX)
        if req.tails and (
            len(req.tails) != len(req.groups)
            or sum(map(len, req.tails)) > len(req.groups)
            or any(not 0 <= j < i for i, tails in enumerate(req.tails) for j in tails)
        ):
            raise BadRequest(
                "evict tails: one list per group, of earlier groups' indexes, as many in all as groups"
            )
        step = ids_max or max(1, len(req.groups))
        infos: list[GroupInfo] = []
        for start in range(0, len(req.groups), step):
            infos += [parse_group(raw) for raw in req.groups[start : start + step]]
            yield []
        results = []
        for start in range(0, len(req.groups), step):
            effects: list[Effect] = []
            for raw, info in zip(req.groups[start : start + step], infos[start : start + step], strict=True):
                building = building_identity(info.group_id)
                if (info.group_id in self.records and self.published_as(info) is None) or (
                    building is not None and building != info
                ):
                    results.append(m.EvictResult(group=raw, status="not_found"))  # forged identity
                    continue
                tails = req.tails[len(results)] if req.tails else ()
                if any(results[j].status in m.EVICT_STAYS for j in tails):
                    self.ctx.count("evict_refused_tail_stays_total")
                    results.append(m.EvictResult(group=raw, status="tail_stays"))
                    continue
                status = self._evict_one(info.group_id, req.reason, building is not None, effects, req.tier)
                results.append(m.EvictResult(group=raw, status=status))
            yield effects
        return m.EvictReply(epoch=self.ctx.epoch, results=results)

    def _evict_one(
        self, gid: GroupKey, reason: str, building: bool, effects: list[Effect], tier: str = "all"
    ) -> m.EvictStatus:
        record = self.records.get(gid)
        if record is None:
            return "not_published" if building or gid in self.frees.evicting else "not_found"
        # A pin first: the eviction policy backs off only from pinned refusals (a pin lasts, a
        # lease ends in seconds), and a hot pinned group is leased at almost every attempt.
        if self.pin_count.get(gid):
            self.ctx.count("evict_refused_pinned_total")
            return "pinned"
        if self.lease_count.get(gid):
            self.ctx.count("evict_refused_leased_total")
            return "leased"
        group = unpack_group(record)
        if tier == "ssd" and self._drop_disk_replicas(gid, group, effects):
            return "disk_dropped"
        self._remove(gid)
        self.frees.start_evicting(gid, group)
        tenant = tenant_of(self.namespaces.get(group.namespace))
        self.ctx.quotas.add(tenant, 0, -len(group.members))
        for mem in group.members:
            for r in mem.replicas:
                self.frees.free(r, mem.size_bytes, tenant, effects, group=gid)
        self.ctx.count("groups_evicted_total")
        effects.append(
            EmitEvent("evicted", m.GroupEvicted(group=chain_of(gid), reason=reason, domain=domain_of(gid)))
        )
        self.frees.forget_if_freed(gid)
        return "evicting"

    def _drop_disk_replicas(self, gid: GroupKey, group: PublishedGroup, effects: list[Effect]) -> bool:
        """A disk tier's victim that every member also holds in a live arena (a head copied to
        disk): its disk replicas are freed, the group stays published with the others and is
        published again with its tiers now — also when it has no disk replica left (one found
        corrupt since: the policy still counts it on disk and learns otherwise from the event;
        evicting it would drop the arena replica this verb keeps). False (nothing changed) when a
        member has no live arena replica: then the group is evicted as a whole."""
        kept = [tuple(r for r in mem.replicas if tier_of_slot(r.slot) != "ssd") for mem in group.members]
        if gid in self.unreadable or not all(any(self.segments.live(r.placement) for r in k) for k in kept):
            return False  # (an unreadable group's corrupt last replica is still in its record)
        tenant = tenant_of(self.namespaces.get(group.namespace))
        for mem, replicas in zip(group.members, kept, strict=True):
            for r in mem.replicas:
                if r not in replicas:
                    self.frees.free(r, mem.size_bytes, tenant, effects)
            self.replace_member(
                gid,
                unpack_group(self.records[gid]),
                MemberRecord(*mem.member, mem.size_bytes, mem.checksum, replicas),
            )
        self.ctx.count("disk_replicas_evicted_total")
        effects.append(self.republished(gid, unpack_group(self.records[gid])))
        return True

    # ---- the sweep (invalidation) ----------------------------------------------------------

    def _short(self, group: PublishedGroup) -> bool:
        """A member has replicas on fewer segments in the record than the default target."""
        target = self.ctx.config.replicas_default
        return any(replica_segments(x.replicas) < target for x in group.members)

    def short_covers_below_target(self) -> bool:
        """Whether `short` holds every group below its replica target as the repair service
        counts it (replicas on segments up and not draining), but the deferred ones (lost: a
        below-target listing skips them, `deferred`). `short` counts the replicas in a record,
        each of which is on a live incarnation once the sweep has dropped those on dead ones
        (every loss queues every group: `queue_sweep_all`), so: when no group is queued for the
        sweep and no segment drains. (A deferred group made this False until its last hold
        ended: while a lost group was held, each below-target pass walked every group.)"""
        return not self._sweep_queue and not self.segments.any_draining()

    def deferred(self, gid: GroupKey) -> bool:
        """Whether `gid` is lost and held (`_defers`): the sweep removes it once that ends."""
        return gid in self._sweep_deferred

    def holds_deferred(self, gids: tuple[GroupKey, ...]) -> bool:
        """Whether any of `gids` (a lease's) is deferred; O(1) while none is."""
        deferred = self._sweep_deferred
        return bool(deferred) and any(g in deferred for g in gids)

    def lost(self, gid: GroupKey, group: PublishedGroup) -> bool:
        """Whether published group `gid` (`group`, its record) is lost: unreadable, or a member
        has no replica on a live incarnation (the module docstring)."""
        return gid in self.unreadable or not all(
            any(self.segments.live(r.placement) for r in mem.replicas) for mem in group.members
        )

    def queue_sweep(self, gid: GroupKey) -> None:
        self._sweep_queue.pop(gid, None)  # once, at the end: the next one the sweep examines
        self._sweep_queue[gid] = None

    def queue_sweep_all(self) -> None:
        """A segment incarnation died: every group may have lost replicas. The queue becomes
        every record in their order, built in one C call (the loop of `queue_sweep`s held the
        directory's loop 36 ms at 200,000 groups; review, 2026-12-06), with the groups still
        queued from before kept at its end, the next ones examined: rebuilt in record order,
        each loss sent the sweep back to the newest records, and under losses more often than a
        whole pass the oldest were never examined (their lost groups published for good, every
        re-save `exists`; review, stop 68). Every queued group is a record (`check_invariants`)."""
        waiting = self._sweep_queue
        queue = dict.fromkeys(self.records)
        for gid in waiting:  # (O(still queued): nothing when the last pass had ended)
            del queue[gid]
        queue.update(waiting)
        self._sweep_queue = queue

    def mark_unreadable(self, gid: GroupKey) -> None:
        """A member has no good replica left: nobody may read the group any more."""
        self.unreadable.add(gid)
        self.queue_sweep(gid)

    def sweep(self, effects: list[Effect]) -> None:
        """Drop replicas on dead incarnations; a group whose member lost every replica is gone."""
        for _ in range(min(len(self._sweep_queue), self.ctx.config.sweep_batch_max)):
            gid, _ = self._sweep_queue.popitem()
            record = self.records.get(gid)
            if record is None:
                continue
            group = unpack_group(record)
            forced = gid in self.unreadable
            if not forced and all(
                self.segments.live(r.placement) for mem in group.members for r in mem.replicas
            ):
                continue
            members = []
            lost = forced
            dead_bytes = 0
            for mem in group.members:
                live = tuple(r for r in mem.replicas if self.segments.live(r.placement))
                lost |= not live
                dead_bytes += mem.size_bytes * (len(mem.replicas) - len(live))
                members.append(MemberRecord(*mem.member, mem.size_bytes, mem.checksum, live))
            tenant = tenant_of(self.namespaces.get(group.namespace))
            if lost and self._defers(gid, any(x.replicas for x in members)):
                self._sweep_deferred.add(gid)  # pins skip it, and lookups of its lost members
                continue
            self.ctx.quotas.add(tenant, -dead_bytes)  # replicas on dead incarnations leave the record
            if lost:
                self._invalidate(gid, group.namespace, members, tenant, effects)
                continue
            # Degraded (and repair told) only below the replica target, as `replace_member`
            # judges: a group that lost a surplus replica still meets it (review, 2026-12-05).
            target = self.ctx.config.replicas_default
            degraded = any(replica_segments(x.replicas) < target for x in members)
            flags = group.flags | FLAG_DEGRADED if degraded else group.flags
            self.replace(gid, PublishedGroup(group.namespace, group.chunk_index, flags, tuple(members)))
            if degraded:
                effects.append(
                    EmitEvent(
                        "under_replicated", m.GroupUnderReplicated(group=chain_of(gid), domain=domain_of(gid))
                    )
                )

    def _invalidate(
        self,
        gid: GroupKey,
        namespace: int,
        members: list[MemberRecord],
        tenant: Tenant,
        effects: list[Effect],
    ) -> None:
        self._remove(gid)
        # (deferred under a pin while replicas were left, and their segments died since)
        self._sweep_deferred.discard(gid)
        self.namespaces.release(namespace)  # its record is gone (an evicted one's goes with its frees)
        self.ctx.quotas.add(tenant, 0, -len(members))
        for mem in members:
            for r in mem.replicas:
                self.frees.free(r, mem.size_bytes, tenant, effects)
        self.ctx.count("groups_invalidated_total")
        effects.append(
            EmitEvent(
                "invalidated",
                m.GroupInvalidated(group=chain_of(gid), reason="replica_lost", domain=domain_of(gid)),
            )
        )

    # ---- what this table holds, and checks -----------------------------------------------

    def reservations(self) -> Iterator[tuple[int, int]]:
        """(placement, arena bytes) of every replica in the arena (a disk replica reserves none)."""
        for record in self.records.values():
            for mem in unpack_group(record).members:
                for r in mem.replicas:
                    if tier_of_slot(r.slot) == "dram":
                        yield r.placement, mem.size_bytes

    def usage(self) -> Iterator[tuple[Tenant, int, int]]:
        """(tenant, bytes, objects) of every member: its replicas' bytes (dead ones until swept)."""
        for record in self.records.values():
            group = unpack_group(record)
            tenant = tenant_of(self.namespaces.get(group.namespace))
            for mem in group.members:
                yield tenant, mem.size_bytes * len(mem.replicas), 1

    def check_invariants(self) -> None:
        self.index.check(set(self.records))
        self.short.check({g for g, r in self.records.items() if self._short(unpack_group(r))})
        waiting = self._sweep_queue.keys() | self._sweep_deferred
        for gid, record in self.records.items():  # what `short_covers_below_target` relies on
            invariant(
                gid in waiting
                or all(
                    self.segments.live(r.placement) for x in unpack_group(record).members for r in x.replicas
                ),
                "a replica on a dead incarnation in a group the sweep will not examine",
            )
        for name, keys in (
            ("unreadable", self.unreadable),
            ("sweep queue", self._sweep_queue.keys()),
            ("sweep deferred", self._sweep_deferred),
        ):
            invariant(all(g in self.records for g in keys), f"{name} group not published")
        invariant(all(self.held(g) for g in self._sweep_deferred), "a deferred group no longer held")
        named: dict[int, int] = {}  # namespace index -> records naming it, published and evicting
        for idx in (
            *(unpack_group(r).namespace for r in self.records.values()),
            *(g.namespace for g in self.frees.evicting.values()),
        ):
            named[idx] = named.get(idx, 0) + 1
        self.namespaces.check(named)
        invariant(all(n > 0 for n in (*self.lease_count.values(), *self.pin_count.values())), "lease count")
