"""`DirectoryCore`: one directory shard's state machine, a thin dispatcher over its tables.

It routes each request to the table that owns its verb (`handle`), runs the tables' timers in
order (`tick`), wires the one cascade that crosses every table (a segment incarnation lost), and
checks what no single table can: the conservation sums across them (`check_invariants`). It has
the one entry every core shares, `step(event, now_ms) -> effects` (`kvfabric.core.step`): its
events, each one of the methods below, are in `kvfabric.core.directory.events`.

## Tables (one module each; states and invariants in their docstrings)
| table | owns | verbs |
|---|---|---|
| `segments` | segments up/down, reservations, placements | register, heartbeat |
| `writes` | building groups, write tickets, reply cache | put_begin, confirm, put_commit, put_abort |
| `published` | published records, holds per group, the sweep | evict |
| `leases` | read leases and pins | lease_release, lease_renew, pin, unpin |
| `frees` | slots being freed, evicting groups, grace | slots_freed |
| `replicas` | extra replica tickets | replicate_begin, replica_corrupt (+ `_many`) |
| `reads` | the lookup fold, the access batch | lookup (+ `lookup_more`), list_*, show_group |
Dependencies point one way: segments ← frees ← published ← leases | replicas ← writes ← reads.

## Invariants across tables (checked by `check_invariants()` in tests, after every step)
1. Nothing is readable before publish: `lookup` only returns published groups, and only their
   replicas on live segment incarnations; a folded hit never skips a gap.
2. No leaks: `reserved_bytes` of an up segment equals the sizes of the live placements in its
   arena across the write, published, free and replica tables (a disk-tier replica, slot id from
   `SSD_SLOT_BASE`, reserves no arena bytes: docs/segment.md, "Disk tier"); every tenant's usage
   recomputed from the same tables equals what the quotas hold.
3. A group under a read lease or a pin is never evicting.
4. Stale generations are rejected (`StaleGeneration`) and counted, never applied: an older
   directory epoch, an older segment incarnation, a confirm for a ticket that no longer exists.

## A new leader (`adopt`)
A directory that takes over a shard rebuilds its tables from the segments' reports
(`rebuild`) under a new, higher epoch; frees of adopted slots wait out the grace
period (the frees table), so no slot leased by the old leader is reused under its reader. The
host runs it in bounded steps (`adopt_steps`), its event loop yielded between (review, stop 71).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Sequence
from itertools import chain
from typing import Any

import msgspec

from kvfabric.core.directory import events
from kvfabric.core.directory.base import Context, DirectoryConfig, Effect, Outcome, Steps
from kvfabric.core.directory.events import DirectoryCoreEvent, DirectoryOutput
from kvfabric.core.directory.frees import FreeTable, PendingFree, SlotKey, batch_frees
from kvfabric.core.directory.leases import Lease, LeaseTable
from kvfabric.core.directory.namespaces import NamespaceTable
from kvfabric.core.directory.published import PublishedTable
from kvfabric.core.directory.reads import Reads
from kvfabric.core.directory.rebuild import SegmentHolding, plan_rebuild_steps
from kvfabric.core.directory.records import PublishedGroup, ReplicaRecord
from kvfabric.core.directory.replicas import ReplicaTable
from kvfabric.core.directory.replies import ReplyCache
from kvfabric.core.directory.segments import Segment, SegmentTable, arena_bytes_of
from kvfabric.core.directory.writes import BuildingGroup, WriteTable
from kvfabric.core.eviction_admission import AdmissionGate, AdmissionView
from kvfabric.core.quotas import Quotas, Tenant, TenantUsage, tenant_of
from kvfabric.core.step import not_before
from kvfabric.format.errors import BadRequest, KvfError
from kvfabric.format.ids import GroupKey
from kvfabric.format.invariant import invariant
from kvfabric.proto import directory as m

__all__ = ["AdoptSteps", "DirectoryCore"]

# `DirectoryCore.adopt_steps`: yields between steps, takes each step's time (ms) if sent, and
# returns the effects of the whole adoption.
AdoptSteps = Generator[None, int | None, list[Effect]]


class DirectoryCore:
    """One directory shard's state machine. See the module docstring for its tables."""

    def __init__(self, config: DirectoryConfig, epoch: int = 1, shard: int = 0, first_id: int = 1) -> None:
        invariant(epoch >= 1, "epoch starts at 1")
        invariant(first_id >= 1, "ids start at 1 or later", first_id=first_id)
        self._ctx = Context(config, epoch, shard, first_id)
        self._step_ms = 0  # the latest time given to `step` (the methods keep no time of their own)
        self.segment_table = SegmentTable(self._ctx, self._segment_lost)
        self.free_table = FreeTable(self._ctx, self.segment_table, NamespaceTable())
        self.published_table = PublishedTable(self._ctx, self.segment_table, self.free_table)
        self.lease_table = LeaseTable(self._ctx, self.published_table)
        self.replica_table = ReplicaTable(
            self._ctx, self.segment_table, self.published_table, self.free_table
        )
        self.write_table = WriteTable(
            self._ctx, self.segment_table, self.published_table, self.free_table, self.replica_table
        )
        self.reads = Reads(
            self._ctx,
            self.segment_table,
            self.published_table,
            self.free_table,
            self.lease_table,
            self.write_table,
        )
        segs, writes, published, leases = (
            self.segment_table,
            self.write_table,
            self.published_table,
            self.lease_table,
        )
        self._handlers: dict[type[msgspec.Struct], Callable[[Any, int], Outcome]] = {
            m.RegisterSegment: segs.register,
            m.Heartbeat: segs.heartbeat,
            m.PutBegin: writes.begin,
            m.ConfirmReplicas: writes.confirm,
            m.PutCommit: writes.commit,
            m.PutAbort: writes.abort,
            m.Lookup: self.reads.lookup,
            m.LeaseRelease: leases.release,
            m.LeaseRenew: leases.renew,
            m.Pin: leases.pin,
            m.Unpin: leases.unpin,
            m.Evict: lambda req, now_ms: published.evict(req, writes.identity_of),
            m.SlotsFreed: self.free_table.freed,
            m.ReplicateBegin: self.replica_table.replicate_begin,
            m.ReplicaCorrupt: self.replica_table.corrupt,
            m.ReplicateBeginMany: self.replica_table.replicate_begin_many,
            m.ReplicaCorruptMany: self.replica_table.corrupt_many,
            m.ListSegments: self.reads.list_segments,
            m.ListGroups: self.reads.list_groups,
            m.ShowGroup: self.reads.show_group,
            m.ListLeases: self.reads.list_leases,
            m.ListTenants: self.reads.list_tenants,
        }

    # ---- requests and time ---------------------------------------------------------------

    def step(self, event: DirectoryCoreEvent, now_ms: int) -> list[DirectoryOutput]:
        """The one entry (`kvfabric.core.step`): `event` at `now_ms` as the method of the same
        meaning (`kvfabric.core.directory.events`). Time going backwards is refused first."""
        self._step_ms = not_before(self._step_ms, now_ms)
        return events.dispatch(self, event, now_ms)

    def handle(
        self,
        request: msgspec.Struct,
        now_ms: int,
        *,
        reply_bytes_max: int | None = None,
        groups_max: int | None = None,
    ) -> Outcome:
        """Apply one request. Raises a `KvfError` for a whole-request error (nothing applied).
        For a lookup: `reply_bytes_max` lowers its reply bound (a part of a `lookup_many`, whose
        reply holds every part's), `groups_max` folds only its first groups (the first slice of
        a lookup the shell runs in slices; `lookup_more` goes on)."""
        handler = self._handlers.get(type(request))
        if handler is None:
            raise BadRequest(f"not a directory request: {type(request).__name__}")
        try:
            if isinstance(request, m.Lookup):
                return self.reads.lookup(request, now_ms, reply_bytes_max, groups_max)
            outcome = handler(request, now_ms)
            outcome.effects = batch_frees(outcome.effects)
            return outcome
        except KvfError as err:
            self._ctx.count(f"error_{err.code}_total")
            raise

    def steps(self, request: msgspec.Struct, now_ms: int, ids_max: int) -> Steps:
        """A put_begin, put_commit, put_abort or evict in steps of at most `ids_max` ids each (the shell
        runs each step as its own call, the event loop yielded between; `base.Steps`): what
        `handle` does for it, the same whole-request checks first (a refusal raises at the first
        step, nothing applied), then each slice's work, its effects yielded with it (frees
        batched per step); the generator returns the reply. How each verb's later slices see
        what ran between: `WriteTable.begin_steps`, `commit_steps`, `abort_steps`,
        `PublishedTable.evict_steps`."""
        if isinstance(request, m.PutBegin):
            steps = self.write_table.begin_steps(request, now_ms, ids_max)
        elif isinstance(request, m.PutCommit):
            steps = self.write_table.commit_steps(request, now_ms, ids_max)
        elif isinstance(request, m.PutAbort):
            steps = self.write_table.abort_steps(request, now_ms, ids_max)
        elif isinstance(request, m.Evict):
            steps = self.published_table.evict_steps(request, self.write_table.identity_of, ids_max)
        else:
            raise BadRequest(f"not a request run in steps: {type(request).__name__}")
        try:
            while True:
                try:
                    effects = next(steps)
                except StopIteration as done:
                    reply: msgspec.Struct = done.value
                    return reply
                yield batch_frees(effects)
        except KvfError as err:
            self._ctx.count(f"error_{err.code}_total")
            raise
        finally:  # ended early (the shell closed us): the table's steps give back what they hold
            steps.close()

    def lookup_more(
        self, req: m.Lookup, lease_id: int, first: int, now_ms: int, *, reply_bytes_max: int, groups_max: int
    ) -> Outcome:
        """Go on with a lookup run in slices (see `Reads.lookup_more`)."""
        return self.reads.lookup_more(
            req, lease_id, first, now_ms, reply_bytes_max=reply_bytes_max, groups_max=groups_max
        )

    def charge_domains(self, domain_digests: Iterable[bytes], now_ms: int) -> None:
        """Charge one request to these share domains' rate limits (the shell, for tenant requests
        that name no key); raises `RateLimited` and charges nothing when one is out of tokens."""
        self._ctx.charge_domains(domain_digests, now_ms)

    def set_admission_filter(self, view: AdmissionView, now_ms: int) -> bool:
        """The eviction policy's latest admission filter, received at `now_ms`: put_begin applies
        it while fresh (`kvfabric.core.eviction_admission`). False: older than the one held."""
        return self._ctx.admission.install(view, now_ms)

    @property
    def admission(self) -> AdmissionGate:
        return self._ctx.admission

    def tick(self, now_ms: int, *, deaf: bool = False) -> list[Effect]:
        """Expire leases, pins and write deadlines; mark silent segments down (not while `deaf`:
        the directory's NATS connection is down, `SegmentTable.tick`); retry frees."""
        effects: list[Effect] = []
        self.free_table.end_grace(now_ms)
        self.lease_table.expire(now_ms)
        self.lease_table.flush_unpinned(effects)
        self.write_table.expire(now_ms, effects)
        self.segment_table.tick(now_ms, effects, deaf=deaf)
        self.replica_table.expire(now_ms)
        self.published_table.sweep(effects)
        self.free_table.retry(now_ms, effects)
        self.reads.flush_hits(effects)
        return batch_frees(effects)

    def _segment_lost(self, seg: Segment, reason: str, effects: list[Effect]) -> None:
        """Its placements die with it: published groups are swept lazily, building ones now."""
        self.segment_table.mark_down(seg, reason, effects)
        self.published_table.queue_sweep_all()
        self.free_table.segment_lost(seg)
        self.write_table.segment_lost(effects)

    def adopt(self, holdings: Sequence[SegmentHolding], now_ms: int) -> list[Effect]:
        """Become the index of what `holdings` store (see `rebuild`): their segments are
        up, complete groups are published, orphans are freed once the grace period
        (`lease_ttl_ms_max`, the longest lease the old leader could have granted) has passed.
        One call: `adopt_steps` run to its end."""
        steps = self.adopt_steps(holdings, now_ms, None)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                effects: list[Effect] = done.value
                return effects

    def adopt_steps(
        self, holdings: Sequence[SegmentHolding], now_ms: int, objects_max: int | None
    ) -> AdoptSteps:
        """`adopt` in steps of about `objects_max` objects each (None: one step), yielding
        between them; the effects of them all are returned at the end. At ~25 us an object, one
        call for a shard of 100,000 objects held the host's event loop past its leader lease
        (review, stop 71: the next leader did the same); the host runs each step as its own call.
        The core must not be used by anything else until the adoption has ended (the host builds
        it, then serves it). The driver may send the time of a step (`generator.send`): the
        segments count as heard at the last step's (the core heard no heartbeat while it was
        built; timed from `now_ms`, an adoption longer than the heartbeat timeout had every
        segment declared down by the first tick). The grace runs from `now_ms`: the old
        leader's leases were all granted before."""
        invariant(not self.segments and not self.published and not self.building, "adopt into a used core")
        step = objects_max or max(1, sum(len(h.objects) for h in holdings))
        self.free_table.begin_grace(now_ms, ())  # and each slice's slots below
        for holding in holdings:
            reg = holding.registration
            arena_bytes = 0
            for start in range(0, len(holding.objects), step):
                part = holding.objects[start : start + step]
                self.free_table.begin_grace(
                    now_ms, ((reg.segment_id, reg.incarnation, o.slot, o.slot_generation) for o in part)
                )
                arena_bytes += arena_bytes_of(part)
                yield
            self.segment_table.adopt(reg, arena_bytes, now_ms)
        plan = yield from plan_rebuild_steps(holdings, objects_max)
        effects: list[Effect] = []
        members = weighed = 0
        for gid, group in plan.groups.items():
            weighed += self.published_table.adopt_group(gid, group, effects)
            members += len(group.members)
            if weighed >= step:
                weighed = 0
                yield
        for start in range(0, len(plan.orphans), step):
            for r in plan.orphans[start : start + step]:
                replica = ReplicaRecord(
                    self.segment_table.intern(r.segment_id, r.incarnation), r.slot, r.slot_generation
                )
                tenant = tenant_of(r.key)
                self._ctx.quotas.add(tenant, r.size_bytes)  # held until the segment frees it
                self.free_table.free(replica, r.size_bytes, tenant, effects, key=r.key, orphan=True)
            yield
        self.segment_table.heard_at((yield) or now_ms)  # the last step's time, if sent
        self._ctx.count("adopted_groups_total", len(plan.groups))
        self._ctx.count("adopted_objects_total", members)
        self._ctx.count("adopted_orphans_total", len(plan.orphans))
        return batch_frees(effects)

    def hold_orphans(self) -> int:
        """The host will rebuild this shard for a segment that missed its report: the orphans
        freed at adoption stay held past the grace, until this core is replaced (that rebuild
        may find their groups whole; `FreeTable.hold_orphans`). Returns how many are held."""
        return self.free_table.hold_orphans()

    # ---- checks (tests call this after every step) ---------------------------------------

    def check_invariants(self) -> None:
        tables = (self.write_table, self.published_table, self.free_table, self.replica_table)
        for table in (self.segment_table, *tables, self.lease_table, self.reads):
            table.check_invariants()
        reserved: dict[str, int] = {}
        for placement, size in chain.from_iterable(t.reservations() for t in tables):
            if self.segment_table.live(placement):
                sid = self.segment_table.where(placement)[0]
                reserved[sid] = reserved.get(sid, 0) + size
        self.segment_table.check_reserved(reserved)
        usage: dict[Tenant, TenantUsage] = {}
        for tenant, nbytes, objects in chain.from_iterable(t.usage() for t in tables):
            use = usage.setdefault(tenant, TenantUsage())
            use.bytes += nbytes
            use.objects += objects
        self._ctx.quotas.check(usage)
        self._ctx.admission.check()
        held = self.published_table.lease_count.keys() | self.published_table.pin_count.keys()
        invariant(not (held & self.evicting.keys()), "evicting a leased or pinned group")

    # ---- state the shell's metrics, the host and tests read ------------------------------

    @property
    def config(self) -> DirectoryConfig:
        return self._ctx.config

    @property
    def epoch(self) -> int:
        return self._ctx.epoch

    @epoch.setter
    def epoch(self, epoch: int) -> None:
        self._ctx.epoch = epoch

    @property
    def shard(self) -> int:
        return self._ctx.shard

    @property
    def counters(self) -> dict[str, int]:
        return self._ctx.counters

    @property
    def quotas(self) -> Quotas:
        return self._ctx.quotas

    @property
    def segments(self) -> dict[str, Segment]:
        return self.segment_table.segments

    @property
    def building(self) -> dict[GroupKey, BuildingGroup]:
        return self.write_table.building

    @property
    def pending_objects(self) -> int:
        return self.write_table.pending_objects

    @property
    def published(self) -> dict[GroupKey, bytes]:
        """Group key -> packed record (`records`) of every published group."""
        return self.published_table.records

    @published.setter
    def published(self, records: dict[GroupKey, bytes]) -> None:  # tests swap in an instrumented dict
        self.published_table.records = records

    @property
    def evicting(self) -> dict[GroupKey, PublishedGroup]:
        return self.free_table.evicting

    @property
    def grace_until_ms(self) -> int:
        return self.free_table.grace_until_ms

    @property
    def leases_held(self) -> int:
        """Read leases plus pins held now."""
        return len(self.lease_table.leases)

    @property
    def pins_held(self) -> int:
        return self.lease_table.pins_held

    # Views of the tables' internals that the unit tests read (names as before the split).

    @property
    def _leases(self) -> dict[int, Lease]:
        return self.lease_table.leases

    @property
    def _lease_count(self) -> dict[GroupKey, int]:
        return self.published_table.lease_count

    @property
    def _freeing(self) -> dict[SlotKey, PendingFree]:
        return self.free_table.pending

    @property
    def _hits(self) -> dict[GroupKey, int]:
        return self.reads.hits

    @property
    def _reply_cache(self) -> ReplyCache:
        return self.write_table.replies

    @property
    def _scope_pending_objects(self) -> dict[str, int]:
        return self.write_table.scope_pending_objects

    @property
    def _scope_pending_bytes(self) -> dict[str, int]:
        return self.write_table.scope_pending_bytes
