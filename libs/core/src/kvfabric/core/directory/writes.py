"""The write table: two-phase publish of chunk groups (put_begin → confirm → put_commit).

A chunk group is every object of one chunk of one prefix: one per member (TP rank, PP stage,
layer group); `tp_size × pp_size × layer_group_count` members are expected, and the group is
published as a whole (into the published table) when every one is committed.

## States of a building group and its members
    (absent) --put_begin--> BUILDING --every expected member committed--> PUBLISHED (elsewhere)
    BUILDING --abort / write deadline passed / every replica lost--> members reclaimed --> (absent)
A member: PLACED (tickets issued, bytes reserved on the chosen segments) --a segment stored and
checksummed the bytes (confirm)--> replicas CONFIRMED --the writer's put_commit--> COMMITTED.
At commit, unconfirmed tickets die (a late confirm gets `unknown_ticket`); a member with no
confirmed replica answers `missing`. A replica is confirmed by its segment (`confirm`) or by the
segment's write receipt that the writer carries in its put_commit (`WriteReceipt`, verified here
against this table's own record of the ticket: `tickets.receipt_mac`); whichever comes first
names the slot, and a later confirm or receipt of another (slot, generation) for the same ticket
is a `mismatch` (the segment frees that slot: one ticket, one slot). One writer per member: a
second put_begin of a member another writer holds gets `in_flight`, of a published (or
evicting) key `exists`.

## Ownership
Tickets belong to the writer until its deadline (at most `write_ttl_ms_max`); then the directory
reclaims them: confirmed slots are freed (the frees table), other reservations released. A group
whose present members all committed but which never completed is reclaimed once the latest
writer's deadline has passed.

## Invariants (`check_invariants`)
1. Every placement of a building member has its ticket, and every ticket names one.
2. `pending_objects` is the number of building members; the per-tenant pending objects and
   bytes are those of the scoped writers' members (`<tenant>/<writer>`).
3. Every building member's deadline has an entry in the deadline heap.
4. No group is both building and published.

## Bounds
`pending_objects_max` building members (then `busy`), of which one tenant's writers hold at most
`tenant_pending_objects_max` and `tenant_pending_capacity_fraction` of the live capacity;
`PUT_BATCH_OBJECTS_MAX` objects a request, and no more than its reply fits in `reply_bytes_max`.
Retried put_begins are answered from a reply cache of `reply_cache_objects_max` objects. The
deadline heap holds at most twice the building members plus HEAP_SLACK_MIN entries.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from kvfabric.core.directory.base import (
    CHECKSUM_BYTES,
    GENERATION_MAX,
    HEAP_SLACK_MIN,
    SLOT_MAX,
    Context,
    Effect,
    EmitEvent,
    Member,
    Outcome,
    check_batch,
    scope_of,
)
from kvfabric.core.directory.frees import FreeTable
from kvfabric.core.directory.keys import CHAIN_BYTES, GroupInfo, KeyInfo, chain_of, domain_of, parse_key
from kvfabric.core.directory.published import PublishedTable
from kvfabric.core.directory.records import (
    FLAG_DEGRADED,
    MemberRecord,
    PublishedGroup,
    ReplicaRecord,
    unpack_group,
)
from kvfabric.core.directory.replicas import ReplicaTable
from kvfabric.core.directory.replies import ARRAY_HEADER_BYTES, ReplyCache, str_bytes
from kvfabric.core.directory.segments import SegmentTable
from kvfabric.core.placement import choose_segments
from kvfabric.core.quotas import Tenant, request_tokens, tenant_of
from kvfabric.format.errors import BadRequest, BatchTooLarge, Busy
from kvfabric.format.invariant import invariant
from kvfabric.proto import directory as m
from kvfabric.proto.segment import tier_of_slot
from kvfabric.proto.tickets import receipt_mac, sign_ticket, write_receipt_valid

__all__ = ["BuildingGroup", "PendingMember", "Placement", "WriteTable"]


@dataclass(slots=True)
class Placement:
    ticket_id: int
    placement: int  # interned (segment id, incarnation)
    slot: int = -1
    slot_generation: int = -1

    @property
    def confirmed(self) -> bool:
        return self.slot >= 0


@dataclass(slots=True)
class PendingMember:
    key: bytes
    writer_id: str
    size_bytes: int
    checksum: bytes
    deadline_ms: int
    replicas_target: int
    placements: list[Placement]
    # the put_begin that placed it: another request of the same writer (a second save of the
    # same chunk while this one is written) gets `in_flight`, never these tickets (two slots
    # written for one placement, one of them then tracked by nothing)
    request_id: str = ""
    committed: bool = False


@dataclass(slots=True)
class BuildingGroup:
    info: GroupInfo
    members: dict[Member, PendingMember] = field(default_factory=dict)
    parent: bytes = b""  # the previous chunk's chain hash, as the first writer told it


class WriteTable:
    def __init__(
        self,
        ctx: Context,
        segments: SegmentTable,
        published: PublishedTable,
        frees: FreeTable,
        replicas: ReplicaTable,
    ) -> None:
        self.ctx = ctx
        self.segments = segments
        self.published = published
        self.frees = frees
        self.replicas = replicas
        self.building: dict[bytes, BuildingGroup] = {}
        self._tickets: dict[int, tuple[bytes, Member]] = {}
        self._deadlines: list[tuple[int, bytes]] = []  # (deadline_ms, group key), one per member begun
        self.pending_objects = 0
        # tenant scope of the writer id -> its building members / the bytes they hold reserved
        self.scope_pending_objects: dict[str, int] = {}
        self.scope_pending_bytes: dict[str, int] = {}
        self.replies = ReplyCache(ctx.config.reply_cache_objects_max, ctx.count)

    def identity_of(self, gid: bytes) -> GroupInfo | None:
        """The identity of a group being written, if one is."""
        group = self.building.get(gid)
        return None if group is None else group.info

    def _exists(self, gid: bytes) -> bool:
        return gid in self.published.records or gid in self.frees.evicting

    # ---- put_begin -----------------------------------------------------------------------

    def begin(self, req: m.PutBegin, now_ms: int) -> Outcome:
        ctx = self.ctx
        ctx.check_epoch(req.epoch)
        cached = self.replies.get("begin", req.writer_id, req.request_id)
        if cached is not None:
            return Outcome(cached)
        check_batch("put_begin objects", len(req.objects), m.PUT_BATCH_OBJECTS_MAX)
        if not 0 < req.write_ttl_ms <= m.WRITE_TTL_MS_MAX:
            raise BadRequest(f"write_ttl_ms must be in 1..{m.WRITE_TTL_MS_MAX}")
        replicas = req.replicas or ctx.config.replicas_default
        if not 1 <= replicas <= ctx.config.replicas_max:
            raise BadRequest(f"replicas must be in 1..{ctx.config.replicas_max}")
        infos = [self._validate_spec(spec) for spec in req.objects]
        # Identity conflicts refuse the whole request before anything is placed (not half of it).
        seen: dict[bytes, GroupInfo] = {}
        for info in infos:
            building = self.building.get(info.group.group_id)
            known = seen.setdefault(info.group.group_id, building.info if building else info.group)
            if known != info.group:
                raise BadRequest("key conflicts with the identity of its chain hash's chunk group")
        self._check_reply_fits(req, replicas)
        # Before the rate charge: a refused request did not run, and a writer backing off and
        # asking again (kvfabric.client.busy) must not spend the tenant's tokens each time.
        self._check_tenant_pending(req, infos, replicas)
        if self.pending_objects + len(infos) > ctx.config.pending_objects_max:
            ctx.count("busy_pending_total")
            raise Busy("too many objects being written; retry later", limit=ctx.config.pending_objects_max)
        ctx.check_rate((spec.key for spec in req.objects), now_ms, request_tokens(len(req.objects)))
        deadline = now_ms + min(req.write_ttl_ms, ctx.config.write_ttl_ms_max)
        placed_here: set[tuple[bytes, Member]] = set()  # a key twice in one request: placed once
        results = [
            self._begin_one(req.writer_id, req.request_id, spec, info, replicas, deadline, placed_here)
            for spec, info in zip(req.objects, infos, strict=True)
        ]
        reply = m.PutBeginReply(epoch=ctx.epoch, results=results)
        self.replies.remember("begin", req.writer_id, req.request_id, reply, len(results))
        return Outcome(reply)

    def _check_tenant_pending(self, req: m.PutBegin, infos: Sequence[KeyInfo], replicas: int) -> None:
        """A tenant's writes in progress stay within its budgets (`tenant_pending_*`): the
        members this request would newly begin, and their bytes at `replicas` each (an upper
        bound: fewer may fit), or the whole request is `busy` and nothing is placed."""
        scope = scope_of(req.writer_id)
        if scope is None:
            return
        new: dict[tuple[bytes, Member], int] = {}
        for spec, info in zip(req.objects, infos, strict=True):
            gid = info.group.group_id
            if self._exists(gid):
                continue
            group = self.building.get(gid)
            if group is None or info.member not in group.members:
                new[(gid, info.member)] = spec.size_bytes
        if not new:
            return
        objects_max = self.ctx.config.tenant_pending_objects_max
        if self.scope_pending_objects.get(scope, 0) + len(new) > objects_max:
            self.ctx.count("busy_tenant_pending_objects_total")
            raise Busy("this tenant has its share of objects being written; retry later", limit=objects_max)
        bytes_max = int(self.segments.capacity_up_bytes() * self.ctx.config.tenant_pending_capacity_fraction)
        if self.scope_pending_bytes.get(scope, 0) + sum(new.values()) * replicas > bytes_max:
            self.ctx.count("busy_tenant_pending_bytes_total")
            raise Busy("this tenant has its share of bytes being written; retry later")

    def _check_reply_fits(self, req: m.PutBegin, replicas: int) -> None:
        """Refuse (`batch_too_large`, nothing placed) a put_begin whose reply could exceed
        `reply_bytes_max`: every object placed with `replicas` tickets naming the longest segment
        id and data address ever registered here, every integer at its widest (`ReplySizes`)."""
        if not req.objects:
            return
        key_bytes = max(len(spec.key) for spec in req.objects)
        sizes = self.ctx.reply_sizes
        ticket = sizes.ticket + str_bytes(key_bytes) + str_bytes(len(req.writer_id.encode()))
        ticket += str_bytes(self.segments.segment_id_bytes_max) + str_bytes(self.segments.data_addr_bytes_max)
        per_object = sizes.result + str_bytes(key_bytes) + ARRAY_HEADER_BYTES + replicas * ticket
        reply_bytes_max = self.ctx.config.reply_bytes_max
        fits = max(0, (reply_bytes_max - sizes.envelope) // per_object)
        if len(req.objects) > fits:
            self.ctx.count("put_begin_reply_too_large_total")
            raise BatchTooLarge(
                f"put_begin objects: a reply for {len(req.objects)} objects could exceed "
                f"{reply_bytes_max} bytes; send at most {fits} a request",
                n=len(req.objects),
                limit=fits,
            )

    def _validate_spec(self, spec: m.ObjectSpec) -> KeyInfo:
        info = parse_key(spec.key)
        object_bytes_max = self.ctx.config.object_bytes_max
        if not 0 < spec.size_bytes <= object_bytes_max:
            raise BadRequest(f"object size {spec.size_bytes} out of range 1..{object_bytes_max}")
        if len(spec.checksum) != CHECKSUM_BYTES:
            raise BadRequest(f"checksum must be {CHECKSUM_BYTES} bytes (xxh3-128)")
        if len(spec.parent) not in (0, CHAIN_BYTES):
            raise BadRequest("parent must be empty or a 32-byte chain hash")
        return info

    def _begin_one(
        self,
        writer_id: str,
        request_id: str,
        spec: m.ObjectSpec,
        info: KeyInfo,
        replicas: int,
        deadline: int,
        placed_here: set[tuple[bytes, Member]],
    ) -> m.BeginResult:
        gid = info.group.group_id
        if self._exists(gid):
            return m.BeginResult(key=spec.key, status="exists")
        group = self.building.get(gid)
        if group is not None and group.info != info.group:
            raise BadRequest("key conflicts with the identity of its chain hash's chunk group")
        if group is not None and info.member in group.members:
            held = group.members[info.member]
            if (
                held.writer_id != writer_id
                or held.request_id != request_id
                or (gid, info.member) in placed_here
            ):
                return m.BeginResult(key=spec.key, status="in_flight", deadline_ms=held.deadline_ms)
            # the same request again (its reply was lost and has left the reply cache)
            placed_here.add((gid, info.member))
            return m.BeginResult(
                key=spec.key, status="placed", tickets=self._tickets_of(held), deadline_ms=held.deadline_ms
            )
        chosen = choose_segments(self.segments.candidates(), replicas, spec.size_bytes, spec.key)
        if not chosen:
            self.ctx.count("no_capacity_total")
            return m.BeginResult(key=spec.key, status="no_capacity")
        tenant = tenant_of(spec.key)
        if not self.ctx.quotas.admits(tenant, spec.size_bytes * len(chosen), 1):
            self.ctx.count("quota_exceeded_objects_total")
            return m.BeginResult(key=spec.key, status="quota_exceeded")
        self.ctx.quotas.add(tenant, spec.size_bytes * len(chosen), 1)
        if group is None:
            group = self.building[gid] = BuildingGroup(info.group, parent=spec.parent)
        placements = []
        for cand in chosen:
            seg = self.segments.segments[cand.segment_id]
            seg.reserved_bytes += spec.size_bytes
            ticket_id = self.ctx.next_id()
            placements.append(Placement(ticket_id, self.segments.intern(seg.segment_id, seg.incarnation)))
            self._tickets[ticket_id] = (gid, info.member)
        held = PendingMember(
            spec.key, writer_id, spec.size_bytes, spec.checksum, deadline, replicas, placements, request_id
        )
        group.members[info.member] = held
        placed_here.add((gid, info.member))
        self.pending_objects += 1
        self._pending_add(writer_id, 1, spec.size_bytes * len(placements))
        heapq.heappush(self._deadlines, (deadline, gid))
        self._bound_heap()
        return m.BeginResult(
            key=spec.key, status="placed", tickets=self._tickets_of(held), deadline_ms=deadline
        )

    def _tickets_of(self, held: PendingMember) -> list[m.WriteTicket]:
        tickets = []
        for p in held.placements:
            segment_id, incarnation = self.segments.where(p.placement)
            ticket = m.WriteTicket(
                ticket_id=p.ticket_id,
                key=held.key,
                segment_id=segment_id,
                incarnation=incarnation,
                size_bytes=held.size_bytes,
                checksum=held.checksum,
                writer_id=held.writer_id,
                deadline_ms=held.deadline_ms,
                epoch=self.ctx.epoch,
                data_addr=self.segments.segments[segment_id].data_addr,
                shard=self.ctx.shard,
            )
            tickets.append(sign_ticket(ticket, self.ctx.config.ticket_secret))
        return tickets

    # ---- confirm -------------------------------------------------------------------------

    def confirm(self, req: m.ConfirmReplicas, now_ms: int) -> Outcome:
        self.ctx.check_epoch(req.epoch)
        check_batch("confirms", len(req.confirms), m.PUT_BATCH_OBJECTS_MAX)
        self.segments.live_segment(req.segment_id, req.incarnation)
        results = [
            m.ConfirmResult(ticket_id=c.ticket_id, status=self._confirm_one(req, c)) for c in req.confirms
        ]
        return Outcome(m.ConfirmReply(epoch=self.ctx.epoch, results=results))

    def _confirm_one(self, req: m.ConfirmReplicas, c: m.ReplicaConfirm) -> m.ConfirmStatus:
        if not (0 <= c.slot <= SLOT_MAX and 1 <= c.slot_generation <= GENERATION_MAX):
            self.ctx.count("confirm_mismatch_total")  # no segment hands these out: refuse, keep nothing
            return "mismatch"
        where = self._tickets.get(c.ticket_id)
        if where is None and c.ticket_id in self.replicas:
            return self.replicas.confirm(req, c)
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
        if (
            self.segments.where(placement.placement) != (req.segment_id, req.incarnation)
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

    def _apply_receipt(self, writer_id: str, r: m.WriteReceipt) -> None:
        """A writer's receipt confirms its replica when the segment's MAC over this table's own
        record of the ticket (segment, incarnation, key, size, checksum, epoch, shard) and the
        named slot is valid; otherwise it confirms nothing (counted), and a member with no
        confirmed replica commits as `missing`: no bytes nobody stored are ever published."""
        where = self._tickets.get(r.ticket_id)
        if where is None:
            self.ctx.count("receipt_unknown_ticket_total")  # committed, expired or aborted since
            return
        gid, member = where
        held = self.building[gid].members[member]
        placement = next(p for p in held.placements if p.ticket_id == r.ticket_id)
        segment_id, incarnation = self.segments.where(placement.placement)
        if held.writer_id != writer_id or not self.segments.live(placement.placement):
            self.ctx.count("receipt_refused_total")
            return
        if not (0 <= r.slot <= SLOT_MAX and 1 <= r.slot_generation <= GENERATION_MAX) or (
            tier_of_slot(r.slot) != "dram"
        ):
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
            held.checksum,
            held.key,
        )
        if not write_receipt_valid(r.mac, expected):
            self.ctx.count("receipt_invalid_total")
            return
        if not self._settle(placement, r.slot, r.slot_generation):
            self.ctx.count("receipt_mismatch_total")
            return
        self.ctx.count("receipts_applied_total")

    # ---- put_commit ----------------------------------------------------------------------

    def commit(self, req: m.PutCommit, now_ms: int) -> Outcome:
        self.ctx.check_epoch(req.epoch)
        check_batch("put_commit keys", len(req.keys), m.PUT_BATCH_OBJECTS_MAX)
        check_batch("put_commit receipts", len(req.receipts), m.PUT_BATCH_OBJECTS_MAX)
        infos = [parse_key(k) for k in req.keys]
        self.ctx.check_rate(req.keys, now_ms, request_tokens(len(req.keys)))
        for receipt in req.receipts:  # before the commits: they confirm the replicas written
            self._apply_receipt(req.writer_id, receipt)
        effects: list[Effect] = []
        results = [
            self._commit_one(req.writer_id, key, info, effects)
            for key, info in zip(req.keys, infos, strict=True)
        ]
        return Outcome(m.PutCommitReply(epoch=self.ctx.epoch, results=results), effects)

    def _commit_one(self, writer_id: str, key: bytes, info: KeyInfo, effects: list[Effect]) -> m.CommitResult:
        gid = info.group.group_id
        record = self.published.records.get(gid)
        if record is not None:
            status: m.CommitStatus = "degraded" if unpack_group(record).degraded else "published"
            return m.CommitResult(key=key, status=status)
        building = self.building.get(gid)
        held = building.members.get(info.member) if building is not None else None
        if building is None or held is None or held.writer_id != writer_id or held.key != key:
            return m.CommitResult(key=key, status="not_found")
        confirmed = [p for p in held.placements if p.confirmed]
        if not confirmed:
            return m.CommitResult(key=key, status="missing", replicas_target=held.replicas_target)
        for p in held.placements:
            if not p.confirmed:  # an unconfirmed ticket dies: a late confirm will be refused
                self._tickets.pop(p.ticket_id, None)
                self.segments.release(p.placement, held.size_bytes, tenant_of(key))
        self._pending_add(writer_id, 0, -held.size_bytes * (len(held.placements) - len(confirmed)))
        held.placements = confirmed
        held.committed = True
        n = len(confirmed)
        if len(building.members) == info.group.expected_members and all(
            pm.committed for pm in building.members.values()
        ):
            degraded = self._publish(gid, building, effects)
            return m.CommitResult(
                key=key,
                status="degraded" if degraded else "published",
                replicas_confirmed=n,
                replicas_target=held.replicas_target,
            )
        return m.CommitResult(
            key=key, status="waiting_group", replicas_confirmed=n, replicas_target=held.replicas_target
        )

    def _publish(self, gid: bytes, building: BuildingGroup, effects: list[Effect]) -> bool:
        """BUILDING -> PUBLISHED: the group moves to the published table as one record."""
        members = []
        degraded = False
        for member, pm in sorted(building.members.items()):
            degraded |= len(pm.placements) < pm.replicas_target
            replicas = tuple(ReplicaRecord(p.placement, p.slot, p.slot_generation) for p in pm.placements)
            members.append(MemberRecord(*member, pm.size_bytes, pm.checksum, replicas))
            self._pending_add(pm.writer_id, -1, -pm.size_bytes * len(pm.placements))
            for p in pm.placements:
                del self._tickets[p.ticket_id]
        group = PublishedGroup(
            self.published.intern_namespace(building.info.namespace),
            building.info.chunk_index,
            FLAG_DEGRADED if degraded else 0,
            tuple(members),
        )
        self.published.add(gid, group)
        del self.building[gid]
        self.pending_objects -= len(members)
        self.ctx.count("groups_published_total")
        self.ctx.count("objects_published_total", len(members))
        held: dict[str, int] = {}
        for mem in members:
            for r in mem.replicas:
                segment_id = self.segments.where(r.placement)[0]
                held[segment_id] = held.get(segment_id, 0) + mem.size_bytes
        effects.append(
            EmitEvent(
                "published",
                m.GroupPublished(
                    group=chain_of(gid),
                    chunk_index=group.chunk_index,
                    members=len(members),
                    degraded=degraded,
                    namespace=building.info.namespace,
                    parent=building.parent,
                    placements=[m.SegmentBytes(s, b) for s, b in sorted(held.items())],
                ),
            )
        )
        if degraded:
            self.ctx.count("groups_degraded_total")
            effects.append(
                EmitEvent(
                    "under_replicated", m.GroupUnderReplicated(group=chain_of(gid), domain=domain_of(gid))
                )
            )
        return degraded

    # ---- abort, deadlines, lost segments ------------------------------------------------

    def abort(self, req: m.PutAbort, now_ms: int) -> Outcome:
        self.ctx.check_epoch(req.epoch)
        check_batch("put_abort keys", len(req.keys), m.PUT_BATCH_OBJECTS_MAX)
        effects: list[Effect] = []
        aborted = 0
        for key in req.keys:
            info = parse_key(key)
            group = self.building.get(info.group.group_id)
            held = group.members.get(info.member) if group is not None else None
            if group is not None and held is not None and held.writer_id == req.writer_id:
                self._drop_member(info.group.group_id, group, info.member, effects)
                aborted += 1
                continue
            aborted += self.replicas.abort(key, req.writer_id)
        self.ctx.count("objects_aborted_total", aborted)
        return Outcome(m.PutAbortReply(epoch=self.ctx.epoch, aborted=aborted), effects)

    def _drop_member(self, gid: bytes, group: BuildingGroup, member: Member, effects: list[Effect]) -> None:
        """Reclaim one member of a building group: free confirmed slots, release the rest."""
        held = group.members.pop(member)
        self.pending_objects -= 1
        self._pending_add(held.writer_id, -1, -held.size_bytes * len(held.placements))
        tenant = tenant_of(held.key)
        self.ctx.quotas.add(tenant, 0, -1)
        for p in held.placements:
            self._tickets.pop(p.ticket_id, None)
            if p.confirmed:
                replica = ReplicaRecord(p.placement, p.slot, p.slot_generation)
                self.frees.free(replica, held.size_bytes, tenant, effects, key=held.key)
            else:
                self.segments.release(p.placement, held.size_bytes, tenant)
        if not group.members:
            del self.building[gid]

    def expire(self, now_ms: int, effects: list[Effect]) -> None:
        """Members whose write deadline passed uncommitted are reclaimed."""
        while self._deadlines and self._deadlines[0][0] <= now_ms:
            _, gid = heapq.heappop(self._deadlines)
            self._expire_group(gid, now_ms, effects)
        self._bound_heap()

    def _expire_group(self, gid: bytes, now_ms: int, effects: list[Effect]) -> None:
        group = self.building.get(gid)
        if group is None:
            return
        expired = [mem for mem, pm in group.members.items() if not pm.committed and pm.deadline_ms <= now_ms]
        for mem in expired:
            self.ctx.count("write_leases_expired_total")
            self._drop_member(gid, group, mem, effects)
        # A group whose present members all committed but that never completed: reclaim all of it
        # once the latest writer's deadline has passed.
        if gid in self.building and all(
            pm.committed and pm.deadline_ms <= now_ms for pm in group.members.values()
        ):
            self.ctx.count("groups_incomplete_reclaimed_total")
            for mem in list(group.members):
                self._drop_member(gid, group, mem, effects)

    def _bound_heap(self) -> None:
        if len(self._deadlines) > 2 * self.pending_objects + HEAP_SLACK_MIN:  # drop the stale entries
            self._deadlines = [
                (pm.deadline_ms, gid) for gid, g in self.building.items() for pm in g.members.values()
            ]
            heapq.heapify(self._deadlines)

    def segment_lost(self, effects: list[Effect]) -> None:
        """Placements on dead incarnations die; a committed member left with none is reclaimed."""
        for gid, group in list(self.building.items()):
            for member, pm in list(group.members.items()):
                dead = [p for p in pm.placements if not self.segments.live(p.placement)]
                for p in dead:
                    pm.placements.remove(p)
                    self._tickets.pop(p.ticket_id, None)
                self.ctx.quotas.add(tenant_of(group.info.namespace), -pm.size_bytes * len(dead))
                self._pending_add(pm.writer_id, 0, -pm.size_bytes * len(dead))
                if dead and pm.committed and not pm.placements:
                    self._drop_member(gid, group, member, effects)

    def _pending_add(self, writer_id: str, objects: int, nbytes: int) -> None:
        """Adjust what a tenant's writer holds in building members (negative: given back)."""
        scope = scope_of(writer_id)
        if scope is None:
            return
        for table, n in ((self.scope_pending_objects, objects), (self.scope_pending_bytes, nbytes)):
            left = table.get(scope, 0) + n
            invariant(left >= 0, "negative tenant pending count", scope=scope)
            if left:
                table[scope] = left
            else:
                table.pop(scope, None)

    # ---- what this table holds, and checks -----------------------------------------------

    def reservations(self) -> Iterator[tuple[int, int]]:
        for group in self.building.values():
            for pm in group.members.values():
                for p in pm.placements:
                    yield p.placement, pm.size_bytes

    def usage(self) -> Iterator[tuple[Tenant, int, int]]:
        for group in self.building.values():
            tenant = tenant_of(group.info.namespace)
            for pm in group.members.values():
                yield tenant, pm.size_bytes * len(pm.placements), 1

    def check_invariants(self) -> None:
        tickets = set()
        pending_objects: dict[str, int] = {}
        pending_bytes: dict[str, int] = {}
        queued = set(self._deadlines)
        for gid, group in self.building.items():
            # The group's latest deadline is queued: when it passes, every member left has expired
            # or committed, and the group goes (`_expire_group`). An earlier member's entry may be
            # gone already: a member that committed before its deadline waits for the others.
            latest = max(pm.deadline_ms for pm in group.members.values())
            invariant((latest, gid) in queued, "a building group never expires")
            for pm in group.members.values():
                for p in pm.placements:
                    invariant(p.ticket_id in self._tickets, "placement without ticket")
                    tickets.add(p.ticket_id)
                if (scope := scope_of(pm.writer_id)) is not None:
                    pending_objects[scope] = pending_objects.get(scope, 0) + 1
                    if nbytes := pm.size_bytes * len(pm.placements):
                        pending_bytes[scope] = pending_bytes.get(scope, 0) + nbytes
        invariant(tickets == self._tickets.keys(), "ticket without placement")
        invariant(
            self.pending_objects == sum(len(g.members) for g in self.building.values()), "pending drift"
        )
        invariant(pending_objects == self.scope_pending_objects, "per-tenant pending objects drift")
        invariant(pending_bytes == self.scope_pending_bytes, "per-tenant pending bytes drift")
        invariant(
            not (self.published.records.keys() & self.building.keys()), "group both building and published"
        )
        self.replies.check_invariants()
