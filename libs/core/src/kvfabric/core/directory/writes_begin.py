"""put_begin: a request's objects checked (batch, identity, reply size, tenant budgets, rate),
then each member placed on segments with signed tickets, or answered `exists` / `in_flight` /
`no_capacity` / `not_admitted` (the eviction policy's admission filter, while fresh, refuses it
on every placement it could have: `kvfabric.core.eviction_admission`; nothing reserved) /
`quota_exceeded`.
A mixin of `WriteTable` (`kvfabric.core.directory.writes`) over `WriteState`.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from kvfabric.core.directory.base import (
    CHECKSUM_BYTES,
    Member,
    Outcome,
    Steps,
    check_batch,
    run_whole,
    scope_of,
)
from kvfabric.core.directory.keys import CHAIN_BYTES, GroupInfo, KeyInfo, parse_key
from kvfabric.core.directory.replies import ARRAY_HEADER_BYTES, str_bytes
from kvfabric.core.directory.writes_state import BuildingGroup, PendingMember, Placement, WriteState
from kvfabric.core.placement import Candidate, choose_segments
from kvfabric.core.quotas import request_tokens, tenant_of
from kvfabric.format.errors import BadRequest, BatchTooLarge, Busy
from kvfabric.format.ids import GroupKey
from kvfabric.proto import directory as m
from kvfabric.proto.tickets import sign_ticket

__all__ = ["WriteBegin"]


class WriteBegin(WriteState):
    """The put_begin phase of `WriteTable`."""

    # ---- put_begin -----------------------------------------------------------------------

    def begin(self, req: m.PutBegin, now_ms: int) -> Outcome:
        return run_whole(self.begin_steps(req, now_ms, None))

    def begin_steps(self, req: m.PutBegin, now_ms: int, ids_max: int | None) -> Steps:
        """put_begin as steps of at most `ids_max` objects each (None: one step; `Steps`). Every
        whole-request check runs before anything is placed — the reply's size, the objects
        validated a slice a step, then identity conflicts, the tenant's budgets, the pending table
        and the rate charged for all of it — so a refused request places nothing, as whole. Then
        each step places a slice. What ran between two steps is seen by the later ones as if it
        had run first: a member another writer began meanwhile is `in_flight`, and so is one whose
        chain hash another writer began under another identity (refused whole before the first
        step); the budgets and the pending bound were checked for the whole request at its start,
        and what they admitted stays reserved (`reserved_objects`, the scope's reserved objects and
        bytes, counted by every later check) until its slice is placed or the steps end early.
        The reply is remembered (retries answered from it) once the last object is placed."""
        ctx = self.ctx
        ctx.check_epoch(req.epoch)
        cached = self.replies.get("begin", req.writer_id, req.request_id)
        if cached is not None:
            return cached
        check_batch("put_begin objects", len(req.objects), m.PUT_BATCH_OBJECTS_MAX)
        if not 0 < req.write_ttl_ms <= m.WRITE_TTL_MS_MAX:
            raise BadRequest(f"write_ttl_ms must be in 1..{m.WRITE_TTL_MS_MAX}")
        replicas = req.replicas or ctx.config.replicas_default
        if not 1 <= replicas <= ctx.config.replicas_max:
            raise BadRequest(f"replicas must be in 1..{ctx.config.replicas_max}")
        self._check_reply_fits(req, replicas)  # by the keys' lengths: before parsing any
        ctx.check_rate_ahead((spec.key for spec in req.objects), now_ms, request_tokens(len(req.objects)))
        step = ids_max or max(1, len(req.objects))
        infos: list[KeyInfo] = []
        for start in range(
            0, len(req.objects), step
        ):  # nothing applied yet: a malformed one refuses it whole
            infos += [self._validate_spec(spec) for spec in req.objects[start : start + step]]
            yield []
        # Identity conflicts refuse the whole request before anything is placed (not half of it).
        seen: dict[GroupKey, GroupInfo] = {}
        for info in infos:
            building = self.building.get(info.group.group_id)
            known = seen.setdefault(info.group.group_id, building.info if building else info.group)
            if known != info.group:
                raise BadRequest("key conflicts with the identity of its chain hash's chunk group")
        # Before the rate charge: a refused request did not run, and a writer backing off and
        # asking again (kvfabric.client.busy) must not spend the tenant's tokens each time.
        new = self._check_tenant_pending(req, infos, replicas)
        if self.pending_objects + self.reserved_objects + len(infos) > ctx.config.pending_objects_max:
            ctx.count("busy_pending_total")
            raise Busy("too many objects being written; retry later", limit=ctx.config.pending_objects_max)
        ctx.check_rate((spec.key for spec in req.objects), now_ms, request_tokens(len(req.objects)))
        deadline = now_ms + min(req.write_ttl_ms, ctx.config.write_ttl_ms_max)
        placed_here: set[tuple[GroupKey, Member]] = set()  # a key twice in one request: placed once
        results: list[m.BeginResult] = []
        # What the checks above admitted stays reserved until its slice is placed (or the request
        # ends early: wrong_shard, a closed generator), so requests stepping at once share the
        # bounds. Run whole (one slice), nothing runs between the checks and the placements.
        held = step < len(req.objects)
        scope = scope_of(req.writer_id)
        reserved = [len(infos), len(new), sum(new.values()) * replicas] if held else [0, 0, 0]
        self._reserve_add(scope, reserved[0], reserved[1], reserved[2])
        self.begins_in_steps += held
        try:
            for start in range(0, len(req.objects), step):  # later slices see what ran between
                chunk = list(zip(req.objects[start : start + step], infos[start : start + step], strict=True))
                if held:
                    mine = [
                        new.pop((i.group.group_id, i.member))
                        for _, i in chunk
                        if (i.group.group_id, i.member) in new
                    ]
                    release = [len(chunk), len(mine), sum(mine) * replicas]
                    self._reserve_add(scope, -release[0], -release[1], -release[2])
                    reserved = [a - b for a, b in zip(reserved, release, strict=True)]
                results += [
                    self._begin_one(
                        req.writer_id,
                        req.request_id,
                        spec,
                        info,
                        replicas,
                        deadline,
                        placed_here,
                        now_ms,
                        resumed=start > 0,
                    )
                    for spec, info in chunk
                ]
                yield []
        finally:
            self._reserve_add(scope, -reserved[0], -reserved[1], -reserved[2])
            self.begins_in_steps -= held
        reply = m.PutBeginReply(epoch=ctx.epoch, results=results)
        self.replies.remember("begin", req.writer_id, req.request_id, reply, len(results))
        return reply

    def _check_tenant_pending(
        self, req: m.PutBegin, infos: Sequence[KeyInfo], replicas: int
    ) -> dict[tuple[GroupKey, Member], int]:
        """A tenant's writes in progress (placed, and admitted to a put_begin still in steps) stay
        within its budgets (`tenant_pending_*`): the members this request would newly begin, and
        their bytes at `replicas` each (an upper bound: fewer may fit), or the whole request is
        `busy` and nothing is placed. Returns those members and their sizes (none without a scope)."""
        new: dict[tuple[GroupKey, Member], int] = {}
        scope = scope_of(req.writer_id)
        if scope is None:
            return new
        for spec, info in zip(req.objects, infos, strict=True):
            gid = info.group.group_id
            if self._exists(gid):
                continue
            group = self.building.get(gid)
            if group is None or info.member not in group.members:
                new[(gid, info.member)] = spec.size_bytes
        if not new:
            return new
        objects_max = self.ctx.config.tenant_pending_objects_max
        objects = self.scope_pending_objects.get(scope, 0) + self.scope_reserved_objects.get(scope, 0)
        if objects + len(new) > objects_max:
            self.ctx.count("busy_tenant_pending_objects_total")
            share = "this tenant has its share of objects being written; retry later"
            raise Busy(share, limit=objects_max)
        bytes_max = int(self.segments.capacity_up_bytes() * self.ctx.config.tenant_pending_capacity_fraction)
        nbytes = self.scope_pending_bytes.get(scope, 0) + self.scope_reserved_bytes.get(scope, 0)
        if nbytes + sum(new.values()) * replicas > bytes_max:
            self.ctx.count("busy_tenant_pending_bytes_total")
            raise Busy("this tenant has its share of bytes being written; retry later")
        return new

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
        if len(spec.checksum) not in (0, CHECKSUM_BYTES):
            # empty: the segment's hash of what it stored, from the writer's committed receipt
            raise BadRequest(f"checksum must be {CHECKSUM_BYTES} bytes (xxh3-128) or empty")
        if len(spec.parent) not in (0, CHAIN_BYTES):
            raise BadRequest("parent must be empty or a 32-byte chain hash")
        if spec.parent and bytes(info.group.group_id).endswith(spec.parent):
            # its own chain hash: the eviction policy never found such a group a leaf (review)
            raise BadRequest("a group cannot be its own parent")
        return info

    def _begin_one(
        self,
        writer_id: str,
        request_id: str,
        spec: m.ObjectSpec,
        info: KeyInfo,
        replicas: int,
        deadline: int,
        placed_here: set[tuple[GroupKey, Member]],
        now_ms: int,
        *,
        resumed: bool = False,
    ) -> m.BeginResult:
        """One object placed (or why not). `resumed`: a later step of a request run in steps,
        where another writer may have begun the chain hash's group under another identity since
        the request was checked: that object is `in_flight` (the whole request was refused when
        the conflict was there before the first step)."""
        gid = info.group.group_id
        if self._exists(gid):
            return m.BeginResult(key=spec.key, status="exists")
        group = self.building.get(gid)
        if group is not None and group.info != info.group:
            if resumed:
                held_until = max((pm.deadline_ms for pm in group.members.values()), default=deadline)
                return m.BeginResult(key=spec.key, status="in_flight", deadline_ms=held_until)
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
        candidates = self.segments.candidates()
        chosen = choose_segments(candidates, replicas, spec.size_bytes, spec.key)
        if group is not None and group.refused_on:  # a later rank: not where its group was refused
            admitting = [c for c in candidates if c.segment_id not in group.refused_on]
            elsewhere = choose_segments(admitting, replicas, spec.size_bytes, spec.key)
            # ... when that gives as many replicas: a placed rank is never stranded, nor placed
            # with fewer replicas than there is room for, by its group's filter
            if len(elsewhere) == len(chosen):
                chosen = elsewhere
        if not chosen:
            self.ctx.count("no_capacity_total")
            return m.BeginResult(key=spec.key, status="no_capacity")
        tenant = tenant_of(spec.key)
        # The eviction policy's filter, while fresh: refused = nothing reserved, nothing charged.
        # Decided once per chunk group, by its first member: a later member (another TP rank) of
        # a group already building is admitted, so a newer filter cannot strand the placed ranks
        # of a group that could then never publish.
        refused_on: frozenset[str] = frozenset()
        if group is None:
            chosen, refused_on = self._admitted(chosen, candidates, spec, info, replicas, now_ms)
            if not chosen:
                return m.BeginResult(key=spec.key, status="not_admitted")
        if not self.ctx.quotas.admits(tenant, spec.size_bytes * len(chosen), 1):
            self.ctx.count("quota_exceeded_objects_total")
            return m.BeginResult(key=spec.key, status="quota_exceeded")
        self.ctx.quotas.add(tenant, spec.size_bytes * len(chosen), 1)
        if group is None:
            group = self.building[gid] = BuildingGroup(info.group, parent=spec.parent, refused_on=refused_on)
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

    def _admitted(
        self,
        chosen: list[Candidate],
        candidates: list[Candidate],
        spec: m.ObjectSpec,
        info: KeyInfo,
        replicas: int,
        now_ms: int,
    ) -> tuple[list[Candidate], frozenset[str]]:
        """(`chosen`, no segments refused) when the admission filter admits the object's group
        there. Refused, the object is placed once more among the `candidates` whose limits admit
        the group (a large segment past its low watermark beside a small one with room: the
        small one takes it, where placement by free bytes alone would give every put to the
        large one and have it refused), as many replicas as first chosen or none (a filter that
        refuses everywhere is not passed by placing fewer replicas); returns that placement and
        the segments refused on (the group's later members are placed without them), or
        ([], ...) for `not_admitted`. One pass over the candidates. The verdict is counted once,
        on the placement answered (`admission_replaced`: admitted on other segments than
        placement chose first). The same replica count, not the same spread: replicas placed
        again may share a failure domain the first choice did not (a cache object: a lost one
        is recomputed)."""
        gate, gid, chunk_index = self.ctx.admission, info.group.group_id, info.group.chunk_index
        group_bytes = spec.size_bytes * info.group.expected_members * len(chosen)
        verdict = gate.verdict([c.segment_id for c in chosen], gid, chunk_index, group_bytes, now_ms)
        if verdict[0]:
            gate.counted(verdict)
            return chosen, frozenset()
        # refused for a segment's limit (nothing else refuses): every segment over its limit out
        ids = [c.segment_id for c in candidates]
        refused_on = frozenset(gate.refusing(ids, gid, chunk_index, group_bytes, now_ms, exempt=False))
        again = choose_segments(
            [c for c in candidates if c.segment_id not in refused_on], replicas, spec.size_bytes, spec.key
        )
        if len(again) == len(chosen):  # none of them over its limit: admitted there
            gate.counted((True, "filter"))
            self.ctx.count("admission_replaced_total")
            # Kept for the group's later members (TP ranks) only: a set of up to every segment
            # per building group (~33 KB at 1,024) is not held for groups of one member.
            return again, refused_on if info.group.expected_members > 1 else frozenset()
        gate.counted(verdict)  # refused: counted with its reason
        return [], frozenset()

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
