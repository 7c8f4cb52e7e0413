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
is a `mismatch` (the segment frees that slot: one ticket, one slot). A member whose writer named
no checksum takes it, and its first slot, only from a receipt the writer commits: a confirm
before that is `pending` (`writes_confirm`). One writer per member: a
second put_begin of a member another writer holds gets `in_flight`, of a published (or
evicting) key `exists`.

## Ownership
Tickets belong to the writer until its deadline (at most `write_ttl_ms_max`); then the directory
reclaims them: confirmed slots are freed (the frees table), other reservations released. A group
whose present members all committed but which never completed is reclaimed once the latest
writer's deadline has passed (if that writer aborted, at its deadline all the same).

## Invariants (`check_invariants`)
1. Every placement of a building member has its ticket, and every ticket names one.
2. `pending_objects` is the number of building members; the per-tenant pending objects and
   bytes are those of the scoped writers' members (`<tenant>/<writer>`).
3. Every building group has an entry in the deadline heap at or after its members' latest
   deadline (so it is examined once they all passed; an aborted member's later entry counts).
4. No group is both building and published.

## Bounds
`pending_objects_max` building members (then `busy`), of which one tenant's writers hold at most
`tenant_pending_objects_max` and `tenant_pending_capacity_fraction` of the live capacity;
`PUT_BATCH_OBJECTS_MAX` objects a request, and no more than its reply fits in `reply_bytes_max`.
Retried put_begins are answered from a reply cache of `reply_cache_objects_max` objects. The
deadline heap holds at most twice the building members plus HEAP_SLACK_MIN entries.

## Events
A commit that publishes groups emits them as one `GroupsPublished` event, not a `GroupPublished`
each (`one_event_per_commit`; over `PUBLISHED_BATCH_MAX` groups, several in order), then an
`under_replicated` for each degraded one. A commit run in steps (`commit_steps`; the directory
shell steps only requests larger than the client's 256-key batch) emits that a step.

## Modules
The state and its count/heap helpers are `writes_state`; put_begin `writes_begin`; confirms and
receipts `writes_confirm`; this one holds `WriteTable` (their union) with put_commit, publish,
abort, expiry, lost segments and the invariant check.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from kvfabric.core.directory.base import (
    Effect,
    EmitEvent,
    Member,
    Outcome,
    Steps,
    check_batch,
    run_whole,
    scope_of,
)
from kvfabric.core.directory.keys import KeyInfo, chain_of, domain_of, parse_key
from kvfabric.core.directory.records import (
    FLAG_DEGRADED,
    MemberRecord,
    PublishedGroup,
    ReplicaRecord,
    unpack_group,
)
from kvfabric.core.directory.writes_begin import WriteBegin
from kvfabric.core.directory.writes_confirm import WriteConfirm
from kvfabric.core.directory.writes_state import BuildingGroup, PendingMember, Placement
from kvfabric.core.quotas import Tenant, request_tokens, tenant_of
from kvfabric.format.ids import GroupKey, ObjectKey
from kvfabric.format.invariant import invariant
from kvfabric.proto import directory as m
from kvfabric.proto.codec import encode

__all__ = ["BuildingGroup", "PendingMember", "Placement", "WriteTable", "one_event_per_commit"]


def one_event_per_commit(effects: list[Effect]) -> list[Effect]:
    """A commit's effects with its `published` events as one `GroupsPublished` (a JetStream
    publish, and a delivery to every follower, per commit rather than per group; issue 20): the
    groups in the order published, at most `PUBLISHED_BATCH_MAX` groups and about
    `PUBLISHED_BATCH_BYTES_MAX` encoded bytes an event (a group over it goes alone), where the
    first was; every other effect (an `under_replicated` of a degraded group among them) after,
    in order."""
    groups = [e.event for e in effects if isinstance(e, EmitEvent) and isinstance(e.event, m.GroupPublished)]
    if not groups:
        return effects
    batches: list[Effect] = [
        EmitEvent("published", m.GroupsPublished(groups=batch)) for batch in _published_batches(groups)
    ]
    first = next(i for i, e in enumerate(effects) if isinstance(e, EmitEvent) and e.event is groups[0])
    rest = [e for e in effects if not (isinstance(e, EmitEvent) and isinstance(e.event, m.GroupPublished))]
    return [*rest[:first], *batches, *rest[first:]]


def _published_batches(groups: list[m.GroupPublished]) -> Iterator[list[m.GroupPublished]]:
    """`groups` cut in order into runs of at most `PUBLISHED_BATCH_MAX` groups whose encoded
    sizes add up to at most `PUBLISHED_BATCH_BYTES_MAX` (a single larger group makes a run of
    its own). Encoding a group to size it costs ~1 us, a few per commit."""
    batch: list[m.GroupPublished] = []
    batch_bytes = 0
    for group in groups:
        size = len(encode(group))
        full = len(batch) >= m.PUBLISHED_BATCH_MAX or batch_bytes + size > m.PUBLISHED_BATCH_BYTES_MAX
        if batch and full:
            yield batch
            batch, batch_bytes = [], 0
        batch.append(group)
        batch_bytes += size
    if batch:
        yield batch


class WriteTable(WriteBegin, WriteConfirm):
    """Two-phase publish of chunk groups (see the module doc)."""

    # ---- put_commit ----------------------------------------------------------------------

    def commit(self, req: m.PutCommit, now_ms: int) -> Outcome:
        return run_whole(self.commit_steps(req, now_ms, None))

    def commit_steps(self, req: m.PutCommit, now_ms: int, ids_max: int | None) -> Steps:
        """put_commit as steps of at most `ids_max` keys or receipts each (None: one of each
        kind; `Steps`): the keys parsed a slice a step (a malformed one refuses the request
        whole, nothing applied) and the rate charged for all, then the receipts applied a slice
        a step, all before the first commit (as whole), then the keys committed a slice a step,
        each slice's published groups as its own `GroupsPublished` (in order with whatever ran
        between). Each key's result is its own: what ran between two steps is seen by the later
        keys as if it had run first (a member aborted or expired meanwhile is `not_found`)."""
        self.ctx.check_epoch(req.epoch)
        check_batch("put_commit keys", len(req.keys), m.PUT_BATCH_OBJECTS_MAX)
        # At most one receipt a replica of the keys committed: what a request is charged (by its
        # keys, here and in fair admission) bounds the receipts it makes this table check (a
        # commit of no key with 4,096 receipts cost the directory 12-54 ms uncharged: review).
        check_batch(
            "put_commit receipts",
            len(req.receipts),
            min(m.PUT_BATCH_OBJECTS_MAX, len(req.keys) * self.ctx.config.replicas_max),
        )
        self.ctx.check_rate_ahead(req.keys, now_ms, request_tokens(len(req.keys)))  # before parsing
        keys_step = ids_max or max(1, len(req.keys))
        infos: list[KeyInfo] = []
        for start in range(0, len(req.keys), keys_step):
            infos += [parse_key(k) for k in req.keys[start : start + keys_step]]
            yield []
        self.ctx.check_rate(req.keys, now_ms, request_tokens(len(req.keys)))
        committed = set(req.keys) if req.receipts else set()
        receipts_step = ids_max or max(1, len(req.receipts))
        for start in range(0, len(req.receipts), receipts_step):
            for receipt in req.receipts[start : start + receipts_step]:  # before the commits
                self._apply_receipt(req.writer_id, receipt, committed)
            yield []
        results: list[m.CommitResult] = []
        for start in range(0, len(req.keys), keys_step):
            effects: list[Effect] = []
            results += [
                self._commit_one(req.writer_id, key, info, effects)
                for key, info in zip(
                    req.keys[start : start + keys_step], infos[start : start + keys_step], strict=True
                )
            ]
            yield one_event_per_commit(effects)
        return m.PutCommitReply(epoch=self.ctx.epoch, results=results)

    def _commit_one(
        self, writer_id: str, key: ObjectKey, info: KeyInfo, effects: list[Effect]
    ) -> m.CommitResult:
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

    def _publish(self, gid: GroupKey, building: BuildingGroup, effects: list[Effect]) -> bool:
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
                    group_bytes=sum(mem.size_bytes for mem in members),
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
        return run_whole(self.abort_steps(req, now_ms, None))

    def abort_steps(self, req: m.PutAbort, now_ms: int, ids_max: int | None) -> Steps:
        """put_abort in steps of at most `ids_max` keys (None: one; `Steps`): every key parsed
        first, a slice a step (a malformed one refuses the request whole, nothing aborted), then
        a slice aborted a step. A key the writer does not hold here may name its replica copy
        (`replicas.abort`): a service's only, so a tenant's abort does not look there."""
        self.ctx.check_epoch(req.epoch)
        check_batch("put_abort keys", len(req.keys), m.PUT_BATCH_OBJECTS_MAX)
        step = ids_max or max(1, len(req.keys))
        infos: list[KeyInfo] = []
        for start in range(0, len(req.keys), step):
            infos += [parse_key(k) for k in req.keys[start : start + step]]
            yield []
        aborted = 0
        # A replica copy is only ever a service's (replicate_begin is a service verb; services'
        # writer ids have no "/"): a tenant's scoped writer holds none to abort.
        copies = scope_of(req.writer_id) is None
        for start in range(0, len(req.keys), step):
            effects: list[Effect] = []
            for key, info in zip(req.keys[start : start + step], infos[start : start + step], strict=True):
                group = self.building.get(info.group.group_id)
                held = group.members.get(info.member) if group is not None else None
                if group is not None and held is not None and held.writer_id == req.writer_id:
                    self._drop_member(info.group.group_id, group, info.member, effects)
                    aborted += 1
                    continue
                if copies:  # O(this key's copies: `replicas`)
                    aborted += self.replicas.abort(key, req.writer_id)
            yield effects
        self.ctx.count("objects_aborted_total", aborted)
        return m.PutAbortReply(epoch=self.ctx.epoch, aborted=aborted)

    def _drop_member(
        self, gid: GroupKey, group: BuildingGroup, member: Member, effects: list[Effect]
    ) -> None:
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
        """Members whose write deadline passed uncommitted are reclaimed, at most about
        `expire_batch_max` a tick (a group's members together; the rest stay queued: invariant
        3 holds, and the next tick goes on)."""
        reclaimed, budget = 0, self.ctx.config.expire_batch_max
        while self._deadlines and self._deadlines[0][0] <= now_ms and reclaimed < budget:
            _, gid = heapq.heappop(self._deadlines)
            reclaimed += max(1, self._expire_group(gid, now_ms, effects))  # a stale entry costs one
        if reclaimed >= budget:
            self.ctx.count("expiry_deferred_ticks_total")
        self._bound_heap()

    def _expire_group(self, gid: GroupKey, now_ms: int, effects: list[Effect]) -> int:
        """Members reclaimed."""
        group = self.building.get(gid)
        if group is None:
            return 0
        expired = [mem for mem, pm in group.members.items() if not pm.committed and pm.deadline_ms <= now_ms]
        for mem in expired:
            self.ctx.count("write_leases_expired_total")
            self._drop_member(gid, group, mem, effects)
        reclaimed = len(expired)
        # A group whose present members all committed but that never completed: reclaim all of it
        # once the latest writer's deadline has passed.
        if gid in self.building and all(
            pm.committed and pm.deadline_ms <= now_ms for pm in group.members.values()
        ):
            self.ctx.count("groups_incomplete_reclaimed_total")
            reclaimed += len(group.members)
            for mem in list(group.members):
                self._drop_member(gid, group, mem, effects)
        return reclaimed

    def segment_lost(self, effects: list[Effect]) -> None:
        """Placements on dead incarnations die; a member left with none is reclaimed, committed
        or not (an uncommitted one kept the key `in_flight` for every other writer until its
        deadline, and a retry of its put_begin was answered placed with no ticket; review,
        2026-12-05)."""
        for gid, group in list(self.building.items()):
            for member, pm in list(group.members.items()):
                dead = [p for p in pm.placements if not self.segments.live(p.placement)]
                for p in dead:
                    pm.placements.remove(p)
                    self._tickets.pop(p.ticket_id, None)
                self.ctx.quotas.add(tenant_of(group.info.namespace), -pm.size_bytes * len(dead))
                self._pending_add(pm.writer_id, 0, -pm.size_bytes * len(dead))
                if dead and not pm.placements:
                    self._drop_member(gid, group, member, effects)

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
        queued_until: dict[GroupKey, int] = {}  # group -> its latest queued deadline
        for deadline, queued_gid in self._deadlines:
            queued_until[queued_gid] = max(deadline, queued_until.get(queued_gid, deadline))
        for gid, group in self.building.items():
            # An entry at or after the group's latest deadline is queued: when it pops, every
            # member left has expired or committed, and the group goes (`_expire_group`). An
            # earlier member's entry may be gone already: a member that committed before its
            # deadline waits for the others. The entry may be later than the latest deadline of
            # the members left: one that held it aborted (the group then goes at that deadline,
            # at most a write lease after its own; found by the directory machine, 2026-12-02).
            latest = max(pm.deadline_ms for pm in group.members.values())
            invariant(queued_until.get(gid, latest - 1) >= latest, "a building group never expires")
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
        # Reservations exist only while a put_begin in steps is suspended between them.
        invariant(self.begins_in_steps >= 0, "negative begins in steps")
        invariant(
            self.begins_in_steps > 0
            or (
                self.reserved_objects == 0
                and not self.scope_reserved_objects
                and not self.scope_reserved_bytes
            ),
            "a reservation outlived its put_begin",
        )
        invariant(
            self.reserved_objects >= sum(self.scope_reserved_objects.values()),
            "tenant reservations exceed the total",
        )
        invariant(
            not (self.published.records.keys() & self.building.keys()), "group both building and published"
        )
        self.replies.check_invariants()
