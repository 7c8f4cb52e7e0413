"""The read side: lookups (the fold over published groups, read tokens, a lease for the hit),
and the read-only queries (segments, groups, leases, tenants), which grant nothing and change
nothing but counters.

## Lookups
A lookup answers the longest run of the asked groups, from the first, that is readable: every
wanted member published with a replica on a live incarnation (never a gap: a miss ends the fold;
an unreadable group is a miss). The hit is leased (the lease table) for at most
`lease_ttl_ms_max`, and each replica carries a read token valid until the lease expires. The
fold also stops before the reply could exceed `reply_bytes_max`: a shorter hit is always
correct, a reply NATS drops is not. A lookup is charged `request_tokens` of the groups asked
before any work, and parses its ids only as far as its fold (a miss at the first: one parse).
A long lookup may run in slices (`groups_max`, then `lookup_more`, which adds to the same lease).

## Hits for the eviction policy
The groups hit since the last `accessed` event are counted here and sent in one event once
ACCESS_BATCH_MAX distinct groups are counted, or at the next tick (the only state of this
module; invariant: at most ACCESS_BATCH_MAX groups are held).

## What a query costs (issue 21: the shell runs every call on its one event loop)
Never the size of the store, nor another tenant's data: a listing pages through the index of
the domain asked (at most `list_scan_groups_max` groups examined a call, its reply within
`reply_bytes_max`), `show_group` looks a group up by key (a chain hash alone: under each domain
holding something), lease and tenant listings stop at their `limit` (≤ LIST_LIMIT_MAX).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from kvfabric.core.directory.base import Context, Effect, EmitEvent, Member, Outcome, check_batch
from kvfabric.core.directory.frees import FreeTable
from kvfabric.core.directory.keys import (
    CHAIN_BYTES,
    GROUP_KEY_BYTES,
    GroupInfo,
    chain_of,
    domain_of,
    parse_group,
)
from kvfabric.core.directory.leases import LeaseTable
from kvfabric.core.directory.published import PublishedTable
from kvfabric.core.directory.records import PublishedGroup, unpack_group
from kvfabric.core.directory.replies import LIST_ENVELOPE_BYTES, encode, str_bytes
from kvfabric.core.directory.segments import SegmentTable
from kvfabric.core.directory.writes import WriteTable
from kvfabric.core.quotas import Tenant, TenantUsage, request_tokens
from kvfabric.format.errors import BadRequest, NotFound
from kvfabric.format.ids import ChainHash, GroupKey, pack_group_key
from kvfabric.format.invariant import invariant
from kvfabric.proto import directory as m
from kvfabric.proto.segment import tier_of_slot

__all__ = ["Reads"]


# A lease's share of a `LeaseList` reply beside its holder id (its fields, encoded; generous),
# and the reply's own.
_LEASE_INFO_BYTES = 96
_LEASE_LIST_BYTES = 256


class Reads:
    def __init__(
        self,
        ctx: Context,
        segments: SegmentTable,
        published: PublishedTable,
        frees: FreeTable,
        leases: LeaseTable,
        writes: WriteTable,
    ) -> None:
        self.ctx = ctx
        self.segments = segments
        self.published = published
        self.frees = frees
        self.leases = leases
        self.writes = writes
        # Lookup hits since the last GroupsAccessed event (≤ ACCESS_BATCH_MAX groups).
        self.hits: dict[GroupKey, int] = {}

    # ---- lookups -------------------------------------------------------------------------

    def lookup(
        self, req: m.Lookup, now_ms: int, reply_bytes_max: int | None = None, groups_max: int | None = None
    ) -> Outcome:
        """The longest readable run of the asked groups, leased (see the module docstring). With
        `groups_max`, only the first that many groups are folded (the whole request is charged):
        a shell running a long lookup in slices goes on with `lookup_more` when all of them hit."""
        ctx = self.ctx
        ctx.check_epoch(req.epoch)
        check_batch("lookup groups", len(req.groups), m.LOOKUP_BATCH_GROUPS_MAX)
        check_batch("lookup members", len(req.members), m.LOOKUP_MEMBERS_MAX)
        if not 0 < req.lease_ttl_ms <= m.LEASE_TTL_MS_MAX:
            raise BadRequest(f"lease_ttl_ms must be in 1..{m.LEASE_TTL_MS_MAX}")
        ctx.check_rate(req.groups, now_ms, request_tokens(len(req.groups)))
        ttl_ms = min(req.lease_ttl_ms, ctx.config.lease_ttl_ms_max)
        groups = req.groups if groups_max is None else req.groups[:groups_max]
        objects, hit = self._fold(groups, req.members, now_ms + ttl_ms, reply_bytes_max)
        ctx.count("lookups_total")
        ctx.count("lookup_groups_total", len(req.groups))
        ctx.count("lookup_hit_groups_total", len(hit))
        if not hit:
            return Outcome(m.LookupReply(epoch=ctx.epoch, hit_chunks=0))
        lease_id, expires = self.leases.grant(req.holder_id, tuple(hit), now_ms + ttl_ms, is_pin=False)
        effects: list[Effect] = []
        if req.count_hits:  # (a service's own lookup is no read: `Lookup.count_hits`)
            self._note_hits(hit, effects)
        return Outcome(
            m.LookupReply(
                epoch=ctx.epoch,
                hit_chunks=len(hit),
                lease_id=lease_id,
                lease_expires_ms=expires,
                objects=objects,
            ),
            effects,
        )

    def lookup_more(
        self, req: m.Lookup, lease_id: int, first: int, now_ms: int, *, reply_bytes_max: int, groups_max: int
    ) -> Outcome:
        """Go on with a lookup run in slices: its groups [first, first + groups_max) are folded
        and their hits added to lease `lease_id`, which the earlier slices granted to
        `req.holder_id` (its expiry unchanged: every read token expires with it). The reply holds
        this slice's hits only, within `reply_bytes_max`. Between slices other requests ran: a
        group evicted or lost meanwhile ends the fold there (a shorter hit, as if it had been
        missing at the start); a lease ended meanwhile (expired, or its instance's core
        replaced) ends it at once (hit 0)."""
        lease = self.leases.live_lease(req.holder_id, lease_id, now_ms)
        if lease is None:
            return Outcome(m.LookupReply(epoch=self.ctx.epoch, hit_chunks=0))
        groups = req.groups[first : first + groups_max]
        objects, hit = self._fold(groups, req.members, lease.expires_ms, reply_bytes_max)
        self.ctx.count("lookup_hit_groups_total", len(hit))
        if not hit or not self.leases.may_extend(lease_id, len(hit)):  # (the tenant's groups bound)
            return Outcome(m.LookupReply(epoch=self.ctx.epoch, hit_chunks=0))
        self.leases.extend(lease_id, tuple(hit))
        effects: list[Effect] = []
        if req.count_hits:  # (a service's own lookup is no read: `Lookup.count_hits`)
            self._note_hits(hit, effects)
        return Outcome(
            m.LookupReply(
                epoch=self.ctx.epoch,
                hit_chunks=len(hit),
                lease_id=lease_id,
                lease_expires_ms=lease.expires_ms,
                objects=objects,
            ),
            effects,
        )

    def _fold(
        self,
        groups: Sequence[bytes],
        members: Sequence[m.Member],
        expires_ms: int,
        reply_bytes_max: int | None,
    ) -> tuple[list[m.ObjectLocation], list[GroupKey]]:
        """The readable run of `groups` from the first (their objects, with read tokens until
        `expires_ms`, and group keys), cut where a lookup reply holding them would exceed
        `reply_bytes_max` (at most the configured bound)."""
        wanted = {(x.tp_rank, x.pp_stage, x.layer_group) for x in members}
        room = self.ctx.config.reply_bytes_max
        if reply_bytes_max is not None:
            room = min(room, reply_bytes_max)
        # Reply size: an upper bound per object (integers at their widest, the longest segment id
        # and address) while it fits easily; once it might not, the encoded sizes themselves.
        sizes = self.ctx.reply_sizes
        used = sizes.lookup_envelope
        replica_bytes = (
            sizes.replica
            + str_bytes(self.segments.segment_id_bytes_max)
            + str_bytes(self.segments.data_addr_bytes_max)
        )
        exact = False
        objects: list[m.ObjectLocation] = []
        hit: list[GroupKey] = []
        for raw in groups:
            info = parse_group(raw)
            located = self._locate(info, wanted, expires_ms)
            if located is None:
                break  # fold: never skip a gap
            grow = sum(sizes.location + len(o.replicas) * replica_bytes for o in located)
            if not exact and used + grow > room:
                exact = True
                used = sizes.lookup_envelope + len(encode(objects))
            if exact:
                grow = len(encode(located))
            if used + grow > room:
                self.ctx.count("lookup_hits_cut_to_fit_total")
                break  # the reply would not fit: the hit ends before this group
            used += grow
            objects.extend(located)
            hit.append(info.group_id)
        return objects, hit

    def _locate(self, info: GroupInfo, wanted: set[Member], expires_ms: int) -> list[m.ObjectLocation] | None:
        """The group's wanted members with their live replicas, each with a read token valid until
        `expires_ms` (the lease's expiry); None when the fold must stop here: also for a group
        lost and held until its holds end (`deferred`), whatever members are wanted (a rank whose
        own member survived kept it held for ever with new leases; review, 2026-12-06)."""
        lost = info.group_id in self.published.unreadable or self.published.deferred(info.group_id)
        group = None if lost else self.published.published_as(info)
        if group is None:
            return None
        out = []
        for mem in group.members:
            if wanted and mem.member not in wanted:
                continue
            replicas = [
                self.segments.replica(r, mem.size_bytes, expires_ms)
                for r in mem.replicas
                if self.segments.live(r.placement)
            ]
            if not replicas:
                return None
            replicas.sort(key=lambda r: tier_of_slot(r.slot) == "ssd")  # readers try DRAM first
            out.append(
                m.ObjectLocation(
                    chunk_index=group.chunk_index,
                    member=m.Member(*mem.member),
                    size_bytes=mem.size_bytes,
                    checksum=mem.checksum,
                    replicas=replicas,
                )
            )
        if wanted and len(out) != len(wanted):
            return None  # a required member this group does not have
        return out

    def _note_hits(self, hit: Sequence[GroupKey], effects: list[Effect]) -> None:
        """Count the hits for the eviction policy (`GroupsAccessed`, batched)."""
        for gid in hit:
            if gid not in self.hits and len(self.hits) >= m.ACCESS_BATCH_MAX:
                self.flush_hits(effects)
            self.hits[gid] = self.hits.get(gid, 0) + 1

    def flush_hits(self, effects: list[Effect]) -> None:
        """Tell the eviction policy which groups were read (recency and frequency)."""
        if self.hits:
            hits = [m.GroupHits(chain_of(g), n, domain_of(g)) for g, n in self.hits.items()]
            effects.append(EmitEvent("accessed", m.GroupsAccessed(groups=hits)))
            self.hits = {}

    # ---- read-only queries ---------------------------------------------------------------

    def list_segments(self, req: m.ListSegments, now_ms: int) -> Outcome:
        self.ctx.check_epoch(req.epoch)
        segments = [
            m.SegmentInfo(
                segment_id=s.segment_id,
                incarnation=s.incarnation,
                domain=s.domain,
                up=s.up,
                draining=s.draining,
                capacity_bytes=s.capacity_bytes,
                reserved_bytes=s.reserved_bytes,
                reported_used_bytes=s.reported_used_bytes,
                last_heartbeat_ms=s.last_heartbeat_ms,
                data_addr=s.data_addr,
            )
            for s in sorted(self.segments.segments.values(), key=lambda s: s.segment_id)
        ]
        return Outcome(m.SegmentList(epoch=self.ctx.epoch, segments=segments))

    def _published_summary(
        self, gid: GroupKey, group: PublishedGroup, *, with_objects: bool, evicting: bool = False
    ) -> m.GroupSummary:
        objects = []
        if with_objects:
            for mem in group.members:
                objects.append(
                    m.ObjectLocation(
                        chunk_index=group.chunk_index,
                        member=m.Member(*mem.member),
                        size_bytes=mem.size_bytes,
                        checksum=mem.checksum,
                        replicas=[
                            self.segments.replica(r) for r in mem.replicas if self.segments.live(r.placement)
                        ],
                    )
                )
        return m.GroupSummary(
            group=chain_of(gid),
            namespace=self.published.namespace(group.namespace),
            chunk_index=group.chunk_index,
            state="evicting" if evicting else "published",
            members=len(group.members),
            expected_members=len(group.members),
            degraded=group.degraded,
            leases=self.published.lease_count.get(gid, 0),
            pins=self.published.pin_count.get(gid, 0),
            objects=objects,
        )

    def _summary(self, gid: GroupKey, *, with_objects: bool) -> m.GroupSummary | None:
        record = self.published.records.get(gid)
        group = unpack_group(record) if record is not None else self.frees.evicting.get(gid)
        if group is not None:
            return self._published_summary(gid, group, with_objects=with_objects, evicting=record is None)
        building = self.writes.building.get(gid)
        if building is None:
            return None
        return m.GroupSummary(
            group=chain_of(gid),
            namespace=building.info.namespace,
            chunk_index=building.info.chunk_index,
            state="building",
            members=len(building.members),
            expected_members=building.info.expected_members,
        )

    def _below_target(self, group: PublishedGroup) -> bool:
        """Some member has fewer replicas than the target on segments that are up and not
        draining (a draining segment's replicas are readable but must move)."""
        target = self.ctx.config.replicas_default

        def healthy(placement: int) -> bool:
            seg = self.segments.segment_of(placement)
            return seg is not None and not seg.draining

        # segments, not replicas: an arena and a disk replica on one segment count once
        return any(
            len({r.placement for r in mem.replicas if healthy(r.placement)}) < target for mem in group.members
        )

    def list_groups(self, req: m.ListGroups, now_ms: int) -> Outcome:
        """A page of published groups in group-key order (domain digest, chain hash) after
        `req.after`, from the per-domain index: a domain's page touches only that domain's
        groups, an admin page the domains it crosses. At most `list_scan_groups_max` groups
        are examined (the `below_target` filter may skip them), and the page ends before its
        reply could exceed `reply_bytes_max`; `next_after` is then the last group examined, so
        the caller resumes there. Cost: O(log n + list_scan_groups_max), never the store's size.
        A `below_target` listing walks only the groups short of replicas in their records
        whenever those cover every group below target (`PublishedTable.short_covers_below_target`):
        the repair service asks for one every few seconds, and a healthy store then costs it
        one short page, not a walk through every group. It never lists a deferred group (lost
        and held: nothing to repair; `PublishedTable.deferred`), whichever it walks."""
        self.ctx.check_epoch(req.epoch)
        if not 0 < req.limit <= m.LIST_LIMIT_MAX:
            raise BadRequest(f"limit must be in 1..{m.LIST_LIMIT_MAX}")
        index = self.published.index
        if req.below_target and self.published.short_covers_below_target():
            index = self.published.short
        keys = (
            index.groups(req.domain_digest, req.after) if req.domain_digest else index.all_groups(req.after)
        )
        summaries: list[m.GroupSummary] = []
        room = self.ctx.config.reply_bytes_max - LIST_ENVELOPE_BYTES
        next_after = last = GroupKey(b"")
        for scanned, gid in enumerate(keys):
            if len(summaries) == req.limit or scanned == self.ctx.config.list_scan_groups_max:
                next_after = last  # more remain: the next page resumes after the last one examined
                break
            group = unpack_group(self.published.records[gid])
            if not req.below_target or (not self.published.deferred(gid) and self._below_target(group)):
                summary = self._published_summary(gid, group, with_objects=req.with_objects)
                room -= len(encode(summary))
                if room < 0 and summaries:  # a page holds at least one group, else it could not go on
                    next_after = last
                    break
                summaries.append(summary)
            last = gid
        return Outcome(m.GroupList(epoch=self.ctx.epoch, groups=summaries, next_after=next_after))

    def show_group(self, req: m.ShowGroup, now_ms: int) -> Outcome:
        """One group by chunk group id, group key, or chain hash alone. A chain hash is looked
        up under each share domain holding something here (O(domains), never O(groups)):
        every building, published or evicting group counts towards its domain's usage."""
        self.ctx.check_epoch(req.epoch)
        keys: Sequence[GroupKey]
        records = self.published.records
        if len(req.group) == GROUP_KEY_BYTES:  # domain digest + chain hash: the group key itself
            keys = (GroupKey(req.group),)
        elif len(req.group) == CHAIN_BYTES:  # the published groups with this chain hash, else
            # the building or evicting ones
            domains = self.ctx.quotas.usage.keys() | set(self.published.index.domains())
            candidates = [pack_group_key(d, ChainHash(req.group)) for d in sorted(domains)]
            keys = [k for k in candidates if k in records] or [
                k for k in candidates if k in self.writes.building or k in self.frees.evicting
            ]
        else:
            info = parse_group(req.group)
            if info.group_id in records and self.published.published_as(info) is None:
                raise NotFound("no such chunk group", group=chain_of(info.group_id).hex())  # other identity
            keys = (info.group_id,)
        summaries = [s for s in (self._summary(k, with_objects=True) for k in keys) if s is not None]
        if not summaries:
            raise NotFound("no such chunk group", group=req.group[-CHAIN_BYTES:].hex())
        return Outcome(m.GroupList(epoch=self.ctx.epoch, groups=summaries))

    def list_leases(self, req: m.ListLeases, now_ms: int) -> Outcome:
        self.ctx.check_epoch(req.epoch)
        if not 0 < req.limit <= m.LIST_LIMIT_MAX:
            raise BadRequest(f"limit must be in 1..{m.LIST_LIMIT_MAX}")
        # ids only grow and a lease is inserted once: insertion order is id order. A page ends
        # at `limit`, at `LEASES_EXAMINED_MAX` examined, or before the reply would pass
        # `REPLY_BYTES_MAX` (10,000 leases with long holder ids were 2 MB: the reply was dropped
        # by NATS, the caller timed out; review, 2026-12-05); `next_after` names where the
        # next one starts.
        items = iter(self.leases.leases.items())
        if req.after > 0:
            items = itertools.dropwhile(lambda item: item[0] <= req.after, items)
        leases: list[m.LeaseInfo] = []
        size = _LEASE_LIST_BYTES
        examined = 0
        done = req.after  # the last id this page dealt with
        next_after = 0
        for i, x in items:
            cost = _LEASE_INFO_BYTES + len(x.holder_id.encode())
            full = len(leases) >= req.limit or size + cost > m.REPLY_BYTES_MAX
            if full or examined >= m.LEASES_EXAMINED_MAX:
                next_after = done
                break
            examined += 1
            done = i
            if req.pins_only and not x.is_pin:
                continue
            size += cost
            leases.append(
                m.LeaseInfo(
                    lease_id=i,
                    holder_id=x.holder_id,
                    is_pin=x.is_pin,
                    groups=len(x.groups),
                    expires_ms=x.expires_ms,
                )
            )
        return Outcome(m.LeaseList(epoch=self.ctx.epoch, leases=leases, next_after=next_after))

    def list_tenants(self, req: m.ListTenants, now_ms: int) -> Outcome:
        self.ctx.check_epoch(req.epoch)
        if not 0 < req.limit <= m.LIST_LIMIT_MAX:
            raise BadRequest(f"limit must be in 1..{m.LIST_LIMIT_MAX}")
        tenants = [self._tenant_info(t) for t in itertools.islice(self.ctx.quotas.tenants(), req.limit)]
        default = self._tenant_info(Tenant(b""))
        return Outcome(m.TenantList(epoch=self.ctx.epoch, tenants=tenants, default=default))

    def _tenant_info(self, tenant: Tenant) -> m.TenantInfo:
        quotas = self.ctx.quotas
        quota = quotas.quota(tenant)
        use = quotas.usage.get(tenant) or TenantUsage()
        stats = quotas.stats.get(tenant)
        return m.TenantInfo(
            domain_digest=tenant,
            used_bytes=use.bytes,
            objects=use.objects,
            bytes_max=quota.bytes_max,
            objects_max=quota.objects_max,
            requests_per_s=quota.requests_per_s,
            burst=quota.burst_effective if quota.requests_per_s else 0,
            quota_exceeded=stats.quota_exceeded if stats else 0,
            rate_limited=stats.rate_limited if stats else 0,
        )

    def check_invariants(self) -> None:
        invariant(len(self.hits) <= m.ACCESS_BATCH_MAX, "access batch over its bound")
