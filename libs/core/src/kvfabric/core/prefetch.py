"""The prefetch planning core: scheduler hints become bounded copies toward the engine's host;
hot objects get one extra replica.

Synchronous and I/O-free: the prefetch service decodes hints, reads and copy results, calls the
core with the time (`now_ms`) and performs the effects it returns. Sizes are bytes.
Events: `add_hint`, `cancel_hint`, `tick`, `copy_finished`, `read`, `set_segments`,
`replica_added`, `replica_removed`, all through one entry too: `step(event, now_ms) -> effects`
(`kvfabric.core.step`; the events in `kvfabric.core.prefetch_events`). Effects (`tick`,
`copy_finished`): StartCopy, PublishReplica, ReleaseCopy. Queries: `cold_extra_replicas`,
gauges (`bytes_in_flight`, ...), `counters`.

## Hints
A `Hint` says: request `hint_id` of `tenant` will soon load the prefix `objects` (head first,
each with its size and the segments holding a replica) through an engine whose local segment is
`target`; the copies are useless after `deadline_ms`, which the core cuts to at most
`hint_hold_ms_max` (5 min) after the hint arrives (`hints_deadline_capped_total`): the service
renews the read leases on a hint's sources until its deadline (`kvfabric.core.prefetch_leases`),
so a deadline days ahead would hold them, and the tenant's queue share, for days. A hint id is
the tenant's: (tenant, hint id) names a hint, and two tenants' `req-1` are two hints (they
were one, and one cancel ended both; review, 2026-12-06). Its *key* is (tenant, target,
fingerprint of the set of object ids: its size and hash, not the set): hints with one key are
one hint with several ids. A
fingerprint collision (vanishingly rare, and only within one tenant and target) joins a hint to
another: its own objects are then not copied (best effort, nothing else is wrong). `add_hint`
answers
    Accepted (kept, or nothing to copy) | Deduped (joined a live hint; its deadline becomes the
    later one) | Busy (full: retryable, nothing kept) | Refused (malformed or can never fit)
Busy: `hints_full` / `objects_full` (all tenants' live hint ids / queued objects at their
maximum) or `tenant_hints_full` / `tenant_objects_full` (this tenant's at its share,
`hints_queued_per_tenant_max` / `objects_queued_per_tenant_max`; by default all but a quarter
of each, left to the others: one tenant's four hints answered every other tenant busy, and a
lone tenant keeps most of the queues). A hint with more objects to copy than
a tenant's share is Refused (`too_many_objects`): it could never fit. A live hint ends when:
    every object is on the target --> completed
    `cancel_hint` of its last id (the request finished) --> cancelled
    `tick` at or after its deadline --> expired
    one of its objects is dropped after failed copies --> failed (the tail is useless without it)
Ending releases its objects at once: none stays queued for it. A live hint keeps only its objects
still to copy (ids, head first; they were the whole prefix: 1,024 hints of 8,192 objects with one
to copy held 1.7 GiB, and each tick walked all of them).
`cancel_hint(hint_id, tenant)`: without a tenant (an older sender) it cancels the one live hint
with that id, and none when two tenants hold it.

## Wants: one per (object, target), shared by every hint that needs it (refcount = its hints)
    (none) --a live hint needs it, or a hot object gets an extra replica--> QUEUED
    QUEUED --tick, within the budget--> COPYING (StartCopy)
    QUEUED --last wanter ended / replica appeared on the target / no source left--> (none)
    COPYING --last wanter ended--> COPYING, marked release --a new hint wants it--> COPYING
    COPYING --copy_finished(ok)--> (none): PublishReplica, or ReleaseCopy("unwanted") if marked
    COPYING --copy_finished(failed)--> QUEUED after `copy_retry_backoff_ms` (ReleaseCopy("failed")),
        or dropped after `copy_attempts_max` attempts or when no source is left (its hints fail)
    COPYING --copy_finished(busy: the target had no copy slot)--> QUEUED after a doubling backoff
        (at most `COPY_BUSY_BACKOFF_MAX_MS`), no attempt counted, its source not blamed
An extra-replica want is its own wanter: it is never marked release.

## Planning (`tick`)
Each tenant's live hints in order of deadline (earliest first, then arrival), each prefix head
first; the tenants take turns: the next copy is the tenant's with fewest copies in flight (of
those that have one to start), ties to the tenant with the earliest deadline. So a tenant alone
uses every slot, and one whose hints are all more urgent no longer holds every slot while
another waits (review, 2026-12-06). Then the queued extra replicas. A want starts when
`copies_in_flight_max` and `bytes_in_flight_max` allow; the first one that does not fit stops the
tick (no smaller copy overtakes it). A want waiting out its retry backoff holds back the rest of
that prefix. A copy counts for the tenant whose turn started it. The source is the replica that
has not failed for this want, then the one with fewest copies reading from it, then the first
listed. A tick costs O(live hints x log + queued objects + copies started x log tenants), all
bounded.

## Hot objects
`read` feeds a per-object rate over a sliding window of `hot_window_ms` (two buckets; at most
`hot_tracked_max` objects, the least recently read forgotten). At `hot_reads_per_s` an object
without an extra replica gets one queued on the known segment (`set_segments`) with most free
bytes that does not hold it, within `hot_extra_replicas_max` / `hot_extra_bytes_max` (counting
queued, copying and stored extras), and of those at most `hot_extra_replicas_per_domain_max` /
`hot_extra_bytes_per_domain_max` (a quarter of each by default) for one share domain (the
`domain` a read names: one tenant's hot prefixes held the whole budget and no other tenant's got
an extra; review, 2026-12-06). The eviction policy does not know which replicas are extras:
the prefetch service drops them itself once cold. `cold_extra_replicas(now_ms)` lists those below
`cold_reads_per_s`; once one is removed, `replica_removed` gives its budget back.
An extra want dropped (its copies failed `copy_attempts_max` times, or no source left) puts the
object's rate entry off: no new extra is queued for it for `hot_window_ms`, doubled on each drop
in a row (at most `EXTRA_RETRY_WINDOWS_MAX` windows), cleared when an extra is made. A hot
object whose copies always failed was queued again on its next read with fresh attempts: 180
copies started in 30 s (review, 2026-12-06). Forgotten with the rate entry (bounded as it is).

## Ownership
- StartCopy: the shell reserves a slot on the target, copies, enforces its own transfer timeout
  and reports `copy_finished(copy_id, ok)` exactly once. Until then it owns the reservation.
- The answer to `copy_finished` is exactly one of PublishReplica (commit the reservation and
  publish the replica in the directory) or ReleaseCopy (abort or free the reservation). So every
  StartCopy ends in one of them: no slot or lease is left behind, whatever was cancelled.
- Unknown or repeated completions and cancels come from the network: counted, no-ops. Copy ids
  are unique in one core; the shell fences a previous incarnation's late completions itself.

## Invariants (`check_invariants()`, after every step in tests)
1. Bounded: bytes and copies in flight within their maxima; live hint ids <= `hints_queued_max`;
   objects of live hints not yet on their target <= `objects_queued_max`; one tenant's of each
   within its share; rate table bounded. A hint keeps only the ids of its objects to copy. No
   live hint's deadline is more than `hint_hold_ms_max` ahead.
2. No object has two concurrent copies to one target (one want per (object, target)).
3. Every want is wanted: each of its hints is live and still needs it, or it is an extra; a
   COPYING want without either is marked release; a marked want has no wanter.
4. An ended hint leaves nothing: none of its ids remains, no want names it.
5. Accounting: in-flight bytes, queued objects and the extra budget equal what they count, and
   so do the per-tenant counts (hint ids, queued objects, copies in flight), none held at zero.

Not split (over 600 lines): one core; hint copies and hot-object extras draw on the same copy and
byte budgets and the same `StartCopy` ownership, checked together by `check_invariants`.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Final, Literal, TypeAlias

from kvfabric.core import prefetch_events
from kvfabric.core.prefetch_events import PrefetchEvent, PrefetchOutput
from kvfabric.core.step import not_before
from kvfabric.format.invariant import invariant

__all__ = [
    "COUNTERS",
    "EXTRA_RETRY_WINDOWS_MAX",
    "Accepted",
    "AddResult",
    "Busy",
    "Deduped",
    "Effect",
    "ExtraReplica",
    "Hint",
    "HintObject",
    "PrefetchConfig",
    "PrefetchCore",
    "PublishReplica",
    "Refused",
    "ReleaseCopy",
    "StartCopy",
]

ObjectId: TypeAlias = Hashable
SegmentId: TypeAlias = str
HintId: TypeAlias = str
_TenantHintId: TypeAlias = tuple[str, HintId]  # (tenant, hint id): a hint id is its tenant's
# (tenant, target, (number, hash) of the set of object ids): a fingerprint, never the prefix itself
_HintKey: TypeAlias = tuple[str, SegmentId, tuple[int, int]]
_WantKey: TypeAlias = tuple[ObjectId, SegmentId]  # (object, target)
WantState = Literal["queued", "copying", "releasing"]

# Plain counters, all present from the start; the shell exports them as kvfabric_prefetch_<name>.
COUNTERS: Final = (
    "hints_accepted_total",
    "hints_deduped_total",
    "hints_busy_total",
    "hints_refused_total",
    "hints_cancelled_total",
    "hints_expired_total",
    "hints_completed_total",
    "hints_failed_total",
    "hints_deadline_capped_total",
    "hint_cancel_unknown_total",
    "copies_started_total",
    "copies_ok_total",
    "copies_failed_total",
    "copies_retried_total",
    "copies_busy_total",
    "copies_already_there_total",
    "copies_dropped_total",
    "copies_released_total",
    "copy_finished_unknown_total",
    "bytes_copied_total",
    "hot_replicas_queued_total",
    "hot_replicas_created_total",
    "hot_over_budget_total",
    "hot_no_segment_total",
    "extra_replicas_removed_total",
)

# A hot object's extra dropped n times in a row waits 2**(n-1) hot windows, at most this many.
EXTRA_RETRY_WINDOWS_MAX: Final = 64
# A copy its target answered `busy` n times in a row waits copy_retry_backoff_ms x 2**n, at most;
# past COPY_BUSY_RETRIES_MAX in a row it counts as a failed attempt (a target busy for hours, as
# one repair fills, held an extra's budget for as long; review of stop 68's fix).
COPY_BUSY_BACKOFF_MAX_MS: Final = 5_000
COPY_BUSY_RETRIES_MAX: Final = 12


def _leaving_a_quarter(total: int) -> int:
    """A tenant's default share of `total`: all but a quarter, left to the other tenants (a
    quarter *at most* would have held a lone tenant, tenants off, to a quarter of the queues)."""
    return max(1, total - total // 4)


@dataclass(frozen=True, slots=True)
class PrefetchConfig:
    hints_queued_max: int = 1024  # live hint ids (an id deduplicated into another hint counts)
    objects_queued_max: int = 16_384  # objects of live hints not yet on their target
    # Of those, one tenant's (0: all but a quarter, left to the others; at least one).
    hints_queued_per_tenant_max: int = 0
    objects_queued_per_tenant_max: int = 0
    bytes_in_flight_max: int = 1 << 30  # sizes of copies started and not yet finished
    copies_in_flight_max: int = 64
    copy_attempts_max: int = 3  # per (object, target); then dropped
    copy_retry_backoff_ms: int = 100
    hot_window_ms: int = 10_000
    hot_reads_per_s: float = 50.0  # at or above it an object gets an extra replica
    cold_reads_per_s: float = 5.0  # below it an extra replica is listed as cold
    hot_extra_replicas_max: int = 256  # extra replicas queued, copying or stored, all objects
    hot_extra_bytes_max: int = 8 << 30
    # Of those, one share domain's (0: a quarter of the budget, at least one replica).
    hot_extra_replicas_per_domain_max: int = 0
    hot_extra_bytes_per_domain_max: int = 0
    hot_tracked_max: int = 65_536  # objects whose read rate is tracked
    # A hint's deadline is at most this long after it arrives (a later one is cut to it): how
    # long its copies may wait and its sources' read leases are renewed (`prefetch_leases`)
    hint_hold_ms_max: int = 300_000

    def __post_init__(self) -> None:
        invariant(self.hints_queued_max >= 1 and self.objects_queued_max >= 1, "queues need room")
        invariant(self.bytes_in_flight_max >= 1 and self.copies_in_flight_max >= 1, "need a copy budget")
        invariant(self.copy_attempts_max >= 1 and self.copy_retry_backoff_ms >= 0, "bad retry policy")
        invariant(self.hot_window_ms >= 1 and self.hot_tracked_max >= 1, "bad hot window")
        invariant(self.hint_hold_ms_max >= 1, "a hint needs time to be held")
        invariant(0 <= self.cold_reads_per_s <= self.hot_reads_per_s, "need 0 <= cold <= hot")
        invariant(
            self.hot_extra_replicas_per_domain_max >= 0 and self.hot_extra_bytes_per_domain_max >= 0,
            "a domain's share of the hot budget is a count",
        )
        invariant(
            self.hints_queued_per_tenant_max >= 0 and self.objects_queued_per_tenant_max >= 0,
            "a tenant's share of the queues is a count",
        )

    @property
    def tenant_hints_max(self) -> int:
        return self.hints_queued_per_tenant_max or _leaving_a_quarter(self.hints_queued_max)

    @property
    def tenant_objects_max(self) -> int:
        return self.objects_queued_per_tenant_max or _leaving_a_quarter(self.objects_queued_max)

    @property
    def domain_extras_max(self) -> int:
        return self.hot_extra_replicas_per_domain_max or max(1, self.hot_extra_replicas_max // 4)

    @property
    def domain_extra_bytes_max(self) -> int:
        return self.hot_extra_bytes_per_domain_max or max(1, self.hot_extra_bytes_max // 4)


@dataclass(frozen=True, slots=True)
class HintObject:
    object_id: ObjectId
    size_bytes: int
    replicas: tuple[SegmentId, ...]  # segments holding it now


@dataclass(frozen=True, slots=True)
class Hint:
    hint_id: HintId
    tenant: str
    target: SegmentId  # the segment local to the engine host
    objects: tuple[HintObject, ...]  # the prefix, head first
    deadline_ms: int


@dataclass(frozen=True, slots=True)
class Accepted:
    hint_id: HintId
    objects_queued: int  # of its objects not on the target yet; 0: nothing to do, not kept


@dataclass(frozen=True, slots=True)
class Deduped:
    hint_id: HintId
    same_as: HintId  # the first id of the live hint it joined


BusyReason: TypeAlias = Literal["hints_full", "objects_full", "tenant_hints_full", "tenant_objects_full"]


@dataclass(frozen=True, slots=True)
class Busy:
    """Full: retry later (or not at all: prefetch is best effort). Nothing was kept."""

    hint_id: HintId
    reason: BusyReason


RefuseReason = Literal[
    "empty",
    "deadline_passed",
    "duplicate_object",
    "too_many_objects",
    "bad_size",
    "object_too_large",
    "size_mismatch",
    "no_source",
]


@dataclass(frozen=True, slots=True)
class Refused:
    """Malformed, or can never fit: retrying the same hint gets the same answer."""

    hint_id: HintId
    reason: RefuseReason


AddResult: TypeAlias = Accepted | Deduped | Busy | Refused


@dataclass(frozen=True, slots=True)
class StartCopy:
    """Reserve `size_bytes` on `target`, copy the object from `source`, then `copy_finished`."""

    copy_id: int
    object_id: ObjectId
    source: SegmentId
    target: SegmentId
    size_bytes: int
    extra: bool  # for a hot object's extra replica


@dataclass(frozen=True, slots=True)
class PublishReplica:
    """Commit the reservation of `copy_id`: publish the replica on `target` (extra: a hot
    object's extra replica, which the prefetch service drops itself once cold)."""

    copy_id: int
    object_id: ObjectId
    target: SegmentId
    size_bytes: int
    extra: bool


@dataclass(frozen=True, slots=True)
class ReleaseCopy:
    """Abort or free the reservation of `copy_id`: nothing is published."""

    copy_id: int
    object_id: ObjectId
    target: SegmentId
    reason: Literal["unwanted", "failed"]


Effect: TypeAlias = StartCopy | PublishReplica | ReleaseCopy


@dataclass(frozen=True, slots=True)
class ExtraReplica:
    object_id: ObjectId
    segment: SegmentId
    size_bytes: int
    reads_per_s: float


@dataclass(slots=True)
class _Hint:
    key: _HintKey
    target: SegmentId
    ids: list[HintId]  # first one first (all of the key's tenant)
    undone: dict[ObjectId, None]  # not on the target yet, head first: all it keeps of its prefix
    deadline_ms: int
    seq: int

    @property
    def tenant(self) -> str:
        return self.key[0]


@dataclass(slots=True)
class _Want:
    object_id: ObjectId
    target: SegmentId
    size: int
    sources: list[SegmentId]
    extra: bool
    hints: set[_HintKey] = field(default_factory=set)
    domain: bytes = b""  # an extra's share domain (its budget share)
    copy_id: int | None = None  # set while COPYING
    copy_tenant: str | None = None  # while COPYING: the tenant whose turn started it (None: an extra)
    source: SegmentId = ""
    release: bool = False
    attempts: int = 0
    busy_in_row: int = 0  # copies answered `busy` in a row (`copy_finished`)
    not_before_ms: int = 0
    failed_sources: set[SegmentId] = field(default_factory=set)


@dataclass(slots=True)
class _Rate:
    bucket: int  # now_ms // hot_window_ms of the current bucket
    current: int = 0
    previous: int = 0
    extra_drops: int = 0  # its extra wants dropped in a row (failed copies, no source)
    extra_not_before_ms: int = 0  # no extra is queued for it before


class PrefetchCore:
    """See the module docstring."""

    def __init__(self, config: PrefetchConfig, segments_free: Mapping[SegmentId, int] | None = None) -> None:
        self.config = config
        self._ids: dict[_TenantHintId, _HintKey] = {}
        self._hints: dict[_HintKey, _Hint] = {}
        self._wants: dict[_WantKey, _Want] = {}
        self._copies: dict[int, _WantKey] = {}
        self._extra_wants: dict[ObjectId, SegmentId] = {}  # object -> target of its extra want
        # stored extras: (segment, size, share domain)
        self._extras: dict[ObjectId, tuple[SegmentId, int, bytes]] = {}
        self._extra_count = 0  # extra wants + stored extras
        self._extra_bytes = 0
        self._domain_extras: dict[bytes, list[int]] = {}  # share domain -> [extras, bytes]
        self._objects_queued = 0
        # per tenant, entries dropped at zero: live hint ids, queued objects, copies in flight
        self._tenant_ids: dict[str, int] = {}
        self._tenant_objects: dict[str, int] = {}
        self._tenant_copies: dict[str, int] = {}
        self._bytes_in_flight = 0
        self._source_load: dict[SegmentId, int] = {}
        self._rates: OrderedDict[ObjectId, _Rate] = OrderedDict()
        self._segments_free: dict[SegmentId, int] = dict(segments_free or {})
        self._seq = 0
        self._next_copy_id = 1
        self._now_ms = 0
        self._step_ms = 0  # the latest time given to `step` (events without a time included)
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)

    def step(self, event: PrefetchEvent, now_ms: int) -> list[PrefetchOutput]:
        """The one entry (`kvfabric.core.step`): `event` at `now_ms` as the method of the same
        meaning (`kvfabric.core.prefetch_events`). Time going backwards is refused first."""
        self._step_ms = not_before(max(self._step_ms, self._now_ms), now_ms)
        return prefetch_events.dispatch(self, event, now_ms)

    # ---- queries ---------------------------------------------------------------------------

    @property
    def bytes_in_flight(self) -> int:
        return self._bytes_in_flight

    @property
    def copies_in_flight(self) -> int:
        return len(self._copies)

    @property
    def objects_queued(self) -> int:
        return self._objects_queued

    @property
    def hint_ids_live(self) -> int:
        return len(self._ids)

    def has_hint(self, hint_id: HintId, tenant: str | None = None) -> bool:
        """Whether `tenant`'s hint `hint_id` is live (no tenant: any tenant's; O(live ids))."""
        if tenant is not None:
            return (tenant, hint_id) in self._ids
        return any(i == hint_id for _, i in self._ids)

    def hint_deadline(self, hint_id: HintId, tenant: str) -> int | None:
        """The deadline of the live hint `tenant`'s `hint_id` names (the latest of its ids', each
        cut to `hint_hold_ms_max` after it arrived); None when none is live. The service renews
        the hint's read leases up to it."""
        key = self._ids.get((tenant, hint_id))
        return None if key is None else self._hints[key].deadline_ms

    def busy_for(self, tenant: str) -> BusyReason | None:
        """Why a new hint of `tenant` would be answered busy whatever it names (the queues its
        `add_hint` checks full), so the shell answers before resolving it: each such hint cost
        a lookup on every shard, leases and their release, and the tenant's directory rate
        (review, stop 70). None: it may fit. (A hint whose objects are all on its target would
        have been accepted with nothing to do: busy too.)"""
        cfg = self.config
        if len(self._ids) >= cfg.hints_queued_max:
            return "hints_full"
        if self._tenant_ids.get(tenant, 0) >= cfg.tenant_hints_max:
            return "tenant_hints_full"
        if self._objects_queued >= cfg.objects_queued_max:
            return "objects_full"
        if self._tenant_objects.get(tenant, 0) >= cfg.tenant_objects_max:
            return "tenant_objects_full"
        return None

    def want_state(self, object_id: ObjectId, target: SegmentId) -> WantState | None:
        want = self._wants.get((object_id, target))
        if want is None:
            return None
        if want.copy_id is None:
            return "queued"
        return "releasing" if want.release else "copying"

    def extra_replicas(self) -> dict[ObjectId, SegmentId]:
        return {o: seg for o, (seg, _, _) in self._extras.items()}

    def reads_per_s(self, object_id: ObjectId, now_ms: int) -> float:
        rate = self._rates.get(object_id)
        if rate is None:
            return 0.0
        window = self.config.hot_window_ms
        bucket = now_ms // window
        current = rate.current if rate.bucket == bucket else 0
        previous = (
            rate.previous if rate.bucket == bucket else rate.current if rate.bucket == bucket - 1 else 0
        )
        weight = 1.0 - (now_ms % window) / window  # how much of the previous window still overlaps
        return (previous * weight + current) * 1000.0 / window

    def cold_extra_replicas(self, now_ms: int) -> list[ExtraReplica]:
        """Stored extra replicas read less than `cold_reads_per_s`, coldest first."""
        self._advance(now_ms)
        extras = [
            ExtraReplica(o, seg, size, self.reads_per_s(o, now_ms))
            for o, (seg, size, _) in self._extras.items()
        ]
        return sorted(
            (e for e in extras if e.reads_per_s < self.config.cold_reads_per_s), key=lambda e: e.reads_per_s
        )

    # ---- events ----------------------------------------------------------------------------

    def add_hint(self, hint: Hint, now_ms: int) -> AddResult:
        """A scheduler's hint. Never raises for what the network sends; copies start on `tick`."""
        self._advance(now_ms)
        cfg, tenant = self.config, hint.tenant
        named = (tenant, hint.hint_id)
        if named in self._ids:  # a retried message
            self.counters["hints_deduped_total"] += 1
            return Deduped(hint.hint_id, self._hints[self._ids[named]].ids[0])
        reason = self._refusal(hint, now_ms)
        if reason is not None:
            self.counters["hints_refused_total"] += 1
            return Refused(hint.hint_id, reason)
        busy: BusyReason | None = None
        if len(self._ids) >= cfg.hints_queued_max:
            busy = "hints_full"
        elif self._tenant_ids.get(tenant, 0) >= cfg.tenant_hints_max:
            busy = "tenant_hints_full"
        if busy is not None:
            self.counters["hints_busy_total"] += 1
            return Busy(hint.hint_id, busy)
        # held (its copies queued, its sources' leases renewed) this long at most
        deadline_ms = min(hint.deadline_ms, now_ms + cfg.hint_hold_ms_max)
        capped = int(deadline_ms < hint.deadline_ms)
        ids = frozenset(o.object_id for o in hint.objects)
        key = (tenant, hint.target, (len(ids), hash(ids)))
        live = self._hints.get(key)
        if live is not None:
            for obj in hint.objects:
                self._add_sources(self._wants.get((obj.object_id, hint.target)), obj.replicas)
            live.ids.append(hint.hint_id)
            live.deadline_ms = max(live.deadline_ms, deadline_ms)
            self._name(named, key)
            self.counters["hints_deadline_capped_total"] += capped
            self.counters["hints_deduped_total"] += 1
            return Deduped(hint.hint_id, live.ids[0])
        todo = [o for o in hint.objects if hint.target not in o.replicas]
        if len(todo) > cfg.tenant_objects_max:  # never fits its tenant's share
            self.counters["hints_refused_total"] += 1
            return Refused(hint.hint_id, "too_many_objects")
        if self._objects_queued + len(todo) > cfg.objects_queued_max:
            busy = "objects_full"
        elif self._tenant_objects.get(tenant, 0) + len(todo) > cfg.tenant_objects_max:
            busy = "tenant_objects_full"
        if busy is not None:
            self.counters["hints_busy_total"] += 1
            return Busy(hint.hint_id, busy)
        self.counters["hints_accepted_total"] += 1
        if not todo:
            self.counters["hints_completed_total"] += 1
            return Accepted(hint.hint_id, 0)
        self._seq += 1
        self.counters["hints_deadline_capped_total"] += capped
        undone = dict.fromkeys(o.object_id for o in todo)
        self._hints[key] = _Hint(key, hint.target, [hint.hint_id], undone, deadline_ms, self._seq)
        self._name(named, key)
        self._queue(tenant, len(todo))
        for obj in todo:
            want = self._wants.get((obj.object_id, hint.target))
            if want is None:
                want = _Want(obj.object_id, hint.target, obj.size_bytes, [], extra=False)
                self._wants[(obj.object_id, hint.target)] = want
            self._add_sources(want, obj.replicas)
            want.release = False  # a copy in flight for a cancelled hint is wanted again
            want.hints.add(key)
        return Accepted(hint.hint_id, len(todo))

    def cancel_hint(self, hint_id: HintId, tenant: str | None = None) -> bool:
        """The request behind `tenant`'s `hint_id` finished (or gave up). False if no live hint
        has that id. Without a tenant (an older sender): the one live hint with that id, none
        when two tenants hold it (O(live ids))."""
        if tenant is None:
            holders = [named for named in self._ids if named[1] == hint_id]
            tenant = holders[0][0] if len(holders) == 1 else None
        key = None if tenant is None else self._ids.get((tenant, hint_id))
        if tenant is None or key is None:
            self.counters["hint_cancel_unknown_total"] += 1
            return False
        self._unname((tenant, hint_id))
        hint = self._hints[key]
        hint.ids.remove(hint_id)
        if not hint.ids:
            self._end_hint(hint, "hints_cancelled_total")
        return True

    def tick(self, now_ms: int) -> list[Effect]:
        """Expire hints past their deadline, then start the copies that fit: each tenant's most
        urgent first, the tenants in turn (fewest copies in flight first); then queued extras."""
        self._advance(now_ms)
        for hint in [h for h in self._hints.values() if h.deadline_ms <= now_ms]:
            self._end_hint(hint, "hints_expired_total")
        effects: list[Effect] = []
        by_tenant: dict[str, list[_Hint]] = {}  # in order of each tenant's most urgent hint
        for hint in sorted(self._hints.values(), key=lambda h: (h.deadline_ms, h.seq)):
            by_tenant.setdefault(hint.tenant, []).append(hint)
        # (copies in flight, urgency rank, tenant, its startable wants): fewest in flight first
        turns = [
            (self._tenant_copies.get(tenant, 0), rank, tenant, self._startable(hints, now_ms))
            for rank, (tenant, hints) in enumerate(by_tenant.items())
        ]
        heapq.heapify(turns)
        while turns:
            copies, rank, tenant, wants = heapq.heappop(turns)
            want = next(wants, None)
            if want is None:
                continue  # nothing more to start for this tenant
            if not self._fits(want.size):
                return effects
            effects.append(self._start(want, tenant))
            heapq.heappush(turns, (copies + 1, rank, tenant, wants))
        for want in [w for w in self._wants.values() if w.extra and w.copy_id is None]:
            if want.not_before_ms <= now_ms:
                if not self._fits(want.size):
                    break
                effects.append(self._start(want))
        return effects

    def _startable(self, hints: list[_Hint], now_ms: int) -> Iterator[_Want]:
        """The queued wants of `hints` (one tenant's, most urgent first), each prefix head first;
        a want waiting out its retry backoff holds back the rest of its prefix. Lazy: a want
        started meanwhile (another hint's, another tenant's) is skipped."""
        for hint in hints:
            for object_id in hint.undone:
                want = self._wants[(object_id, hint.target)]
                if want.copy_id is not None:
                    continue
                if want.not_before_ms > now_ms:
                    break  # the tail waits for its head's retry
                yield want

    def copy_finished(
        self, copy_id: int, ok: bool, now_ms: int, *, made: bool = True, busy: bool = False
    ) -> list[Effect]:
        """The copy `copy_id` ended. Returns exactly one of PublishReplica or ReleaseCopy.
        `made` False: the replica was on the target already (not this copy's): never an extra.
        `busy`: the target had no copy slot free, nothing was tried: queued again after a
        backoff that doubles per busy answer in a row (up to `COPY_BUSY_BACKOFF_MAX_MS`), its
        attempt given back and its source not blamed, `COPY_BUSY_RETRIES_MAX` times in a row
        (about 40 s), then as a failed attempt, which starts a new row: a want meets a busy
        target for about 40 s an attempt, `copy_attempts_max` attempts. A target busy with
        repair's copies failed the want in 0.3 s, every hint needing it with it (review, stop
        68). Counted once each: `copies_ok_total` (and `copies_already_there_total` when not
        `made`: no bytes copied), `copies_busy_total` or `copies_failed_total`."""
        self._advance(now_ms)
        key = self._copies.pop(copy_id, None)
        if key is None:
            self.counters["copy_finished_unknown_total"] += 1
            return []
        want = self._wants[key]
        want.copy_id = None
        if want.copy_tenant is not None:
            self._count(self._tenant_copies, want.copy_tenant, -1)
            want.copy_tenant = None
        self._bytes_in_flight -= want.size
        self._source_load[want.source] -= 1
        if not self._source_load[want.source]:
            del self._source_load[want.source]
        # busy is no failed copy (it was counted both; review, stop 70)
        self.counters[
            "copies_ok_total" if ok else "copies_busy_total" if busy else "copies_failed_total"
        ] += 1
        if want.release:
            del self._wants[key]
            self.counters["copies_released_total"] += 1
            return [ReleaseCopy(copy_id, want.object_id, want.target, "unwanted")]
        if ok:
            if made:
                self.counters["bytes_copied_total"] += want.size
            else:  # on the target already: nothing copied
                self.counters["copies_already_there_total"] += 1
            extra = want.extra and not want.hints and made
            if made and not extra and self._extras.get(want.object_id, (None, 0, b""))[0] == want.target:
                # A copy made it anew where its extra was: that one had gone unnoticed (evicted,
                # demoted) and this replica is a hint's. Kept as the extra, the object's cooling
                # dropped the replica the hint just made (review, stop 70).
                _, size, domain = self._extras.pop(want.object_id)
                self._extra_budget(domain, -1, size)
                self.counters["extra_replicas_removed_total"] += 1
            if extra:
                self.counters["hot_replicas_created_total"] += 1
                self._extras[want.object_id] = (want.target, want.size, want.domain)
                rate = self._rates.get(want.object_id)
                if rate is not None:  # made: its next extra (once this one is gone) waits for nothing
                    rate.extra_drops, rate.extra_not_before_ms = 0, 0
            self._satisfied(want, keep_extra=extra)
            return [PublishReplica(copy_id, want.object_id, want.target, want.size, extra)]
        if busy and want.busy_in_row < COPY_BUSY_RETRIES_MAX:
            want.attempts -= 1
            want.busy_in_row += 1
            backoff = self.config.copy_retry_backoff_ms << min(want.busy_in_row, 16)
            want.not_before_ms = now_ms + min(max(backoff, 1), COPY_BUSY_BACKOFF_MAX_MS)
            return [ReleaseCopy(copy_id, want.object_id, want.target, "failed")]
        want.busy_in_row = 0
        want.failed_sources.add(want.source)
        if want.attempts >= self.config.copy_attempts_max or not want.sources:
            self._drop_want(want)
        else:
            self.counters["copies_retried_total"] += 1
            want.not_before_ms = now_ms + self.config.copy_retry_backoff_ms
        return [ReleaseCopy(copy_id, want.object_id, want.target, "failed")]

    def read(
        self,
        object_id: ObjectId,
        *,
        size_bytes: int,
        served_from: SegmentId,
        replicas: Iterable[SegmentId] = (),
        now_ms: int,
        reads: int = 1,
        domain: bytes = b"",
    ) -> None:
        """An engine read `object_id` `reads` times from `served_from`; `replicas`: other segments
        holding it. Feeds its read rate; a newly hot object's extra replica is queued (it starts
        on `tick`). One call with `reads` n is n calls of one at the same time."""
        invariant(reads >= 1, "a read counts at least once")
        self._advance(now_ms)
        rate = self._rates.pop(object_id, None) or _Rate(now_ms // self.config.hot_window_ms)
        self._rates[object_id] = rate  # most recently read last
        if len(self._rates) > self.config.hot_tracked_max:
            self._rates.popitem(last=False)
        bucket = now_ms // self.config.hot_window_ms
        if rate.bucket != bucket:
            rate.previous = rate.current if rate.bucket == bucket - 1 else 0
            rate.bucket, rate.current = bucket, 0
        rate.current += reads
        if self.reads_per_s(object_id, now_ms) < self.config.hot_reads_per_s:
            return
        if object_id in self._extras or object_id in self._extra_wants:
            return
        if now_ms < rate.extra_not_before_ms:  # its last extra was dropped: backing off
            return
        cfg = self.config
        held, held_bytes = self._domain_extras.get(domain, (0, 0))
        if (
            self._extra_count >= cfg.hot_extra_replicas_max
            or self._extra_bytes + size_bytes > cfg.hot_extra_bytes_max
            or held >= cfg.domain_extras_max
            or held_bytes + size_bytes > cfg.domain_extra_bytes_max
            or size_bytes > cfg.bytes_in_flight_max
        ):
            self.counters["hot_over_budget_total"] += 1
            return
        holders = list(dict.fromkeys((served_from, *replicas)))
        free = [
            (-free, seg)
            for seg, free in self._segments_free.items()
            if seg not in holders and (object_id, seg) not in self._wants and free >= size_bytes
        ]
        if not free:
            self.counters["hot_no_segment_total"] += 1
            return
        _, target = min(free)  # most free bytes, then lowest id
        self._segments_free[target] -= size_bytes  # our estimate until the next set_segments
        self._wants[(object_id, target)] = _Want(
            object_id, target, size_bytes, holders, extra=True, domain=domain
        )
        self._extra_wants[object_id] = target
        self._extra_budget(domain, +1, size_bytes)
        self.counters["hot_replicas_queued_total"] += 1

    def _extra_budget(self, domain: bytes, count: int, size: int) -> None:
        """An extra replica (queued, copying or stored) taken (+1) or given back (-1)."""
        self._extra_count += count
        self._extra_bytes += count * size
        entry = self._domain_extras.setdefault(domain, [0, 0])
        entry[0] += count
        entry[1] += count * size
        if entry[0] == 0:
            del self._domain_extras[domain]

    def set_segments(self, segments_free: Mapping[SegmentId, int]) -> None:
        """The segments that may take extra replicas, with their free bytes (a fresh snapshot)."""
        self._segments_free = dict(segments_free)

    def replica_added(self, object_id: ObjectId, segment: SegmentId) -> None:
        """The directory published `object_id` on `segment` (not through us): a new source, and a
        queued want to that segment is satisfied."""
        for want in [w for w in self._wants.values() if w.object_id == object_id]:
            if want.target == segment and want.copy_id is None:
                self._satisfied(want, keep_extra=False)
            elif want.target != segment and segment not in want.sources:
                want.sources.append(segment)

    def replica_removed(self, object_id: ObjectId, segment: SegmentId) -> None:
        """`object_id` is gone from `segment` (evicted, freed, segment down)."""
        if self._extras.get(object_id, (None, 0, b""))[0] == segment:
            _, size, domain = self._extras.pop(object_id)
            self._extra_budget(domain, -1, size)
            self.counters["extra_replicas_removed_total"] += 1
        for want in [w for w in self._wants.values() if w.object_id == object_id]:
            if segment in want.sources:
                want.sources.remove(segment)
                if not want.sources and want.copy_id is None:
                    self._drop_want(want)

    # ---- internals -------------------------------------------------------------------------

    def _refusal(self, hint: Hint, now_ms: int) -> RefuseReason | None:
        cfg = self.config
        ids = [o.object_id for o in hint.objects]
        checks: list[tuple[bool, RefuseReason]] = [
            (not ids, "empty"),
            (hint.deadline_ms <= now_ms, "deadline_passed"),
            (len(set(ids)) != len(ids), "duplicate_object"),
            (len(ids) > cfg.objects_queued_max, "too_many_objects"),
            (any(o.size_bytes <= 0 for o in hint.objects), "bad_size"),
            (any(o.size_bytes > cfg.bytes_in_flight_max for o in hint.objects), "object_too_large"),
            (any(self._size_differs(o, hint.target) for o in hint.objects), "size_mismatch"),
            (any(not o.replicas for o in hint.objects), "no_source"),
        ]
        return next((reason for failed, reason in checks if failed), None)

    def _size_differs(self, obj: HintObject, target: SegmentId) -> bool:
        want = self._wants.get((obj.object_id, target))
        return want is not None and want.size != obj.size_bytes

    @staticmethod
    def _add_sources(want: _Want | None, replicas: Iterable[SegmentId]) -> None:
        if want is not None:
            want.sources += [s for s in replicas if s not in want.sources and s != want.target]

    def _fits(self, size: int) -> bool:
        return (
            len(self._copies) < self.config.copies_in_flight_max
            and self._bytes_in_flight + size <= self.config.bytes_in_flight_max
        )

    def _start(self, want: _Want, tenant: str | None = None) -> StartCopy:
        """Start `want`'s copy, counted for `tenant` (None: an extra)."""
        order = {s: i for i, s in enumerate(want.sources)}
        want.source = min(
            want.sources, key=lambda s: (s in want.failed_sources, self._source_load.get(s, 0), order[s])
        )
        want.copy_id, self._next_copy_id = self._next_copy_id, self._next_copy_id + 1
        want.attempts += 1
        want.copy_tenant = tenant
        if tenant is not None:
            self._count(self._tenant_copies, tenant, +1)
        self._copies[want.copy_id] = (want.object_id, want.target)
        self._bytes_in_flight += want.size
        self._source_load[want.source] = self._source_load.get(want.source, 0) + 1
        self.counters["copies_started_total"] += 1
        return StartCopy(want.copy_id, want.object_id, want.source, want.target, want.size, want.extra)

    def _satisfied(self, want: _Want, *, keep_extra: bool) -> None:
        """The object is on the want's target: done for every hint that wanted it."""
        del self._wants[(want.object_id, want.target)]
        if want.extra:
            del self._extra_wants[want.object_id]
            if not keep_extra:
                self._extra_budget(want.domain, -1, want.size)
        for key in want.hints:
            hint = self._hints[key]
            del hint.undone[want.object_id]
            self._queue(hint.tenant, -1)
            if not hint.undone:
                self._end_hint(hint, "hints_completed_total")

    def _drop_want(self, want: _Want) -> None:
        """No copy can be made: give up on the object; the hints that need it fail."""
        del self._wants[(want.object_id, want.target)]
        self.counters["copies_dropped_total"] += 1
        if want.extra:
            del self._extra_wants[want.object_id]
            self._extra_budget(want.domain, -1, want.size)
            rate = self._rates.get(want.object_id)
            if rate is not None:  # no new extra for it until this passes (the last time seen)
                rate.extra_drops = min(rate.extra_drops + 1, EXTRA_RETRY_WINDOWS_MAX.bit_length())
                windows = min(1 << (rate.extra_drops - 1), EXTRA_RETRY_WINDOWS_MAX)
                rate.extra_not_before_ms = self._now_ms + windows * self.config.hot_window_ms
        hints = [self._hints[key] for key in want.hints]
        want.hints.clear()
        for hint in hints:
            del hint.undone[want.object_id]
            self._queue(hint.tenant, -1)
            self._end_hint(hint, "hints_failed_total")

    def _end_hint(self, hint: _Hint, counter: str) -> None:
        """Completed, cancelled, expired or failed: release everything it still wanted."""
        del self._hints[hint.key]
        for hint_id in hint.ids:
            self._unname((hint.tenant, hint_id))
        self._queue(hint.tenant, -len(hint.undone))
        for object_id in hint.undone:
            want = self._wants[(object_id, hint.target)]
            want.hints.discard(hint.key)
            if not want.hints and not want.extra:
                if want.copy_id is None:
                    del self._wants[(want.object_id, want.target)]
                else:
                    want.release = True  # answered ReleaseCopy when it finishes
        hint.undone.clear()
        self.counters[counter] += 1

    def _name(self, named: _TenantHintId, key: _HintKey) -> None:
        self._ids[named] = key
        self._count(self._tenant_ids, named[0], +1)

    def _unname(self, named: _TenantHintId) -> None:
        del self._ids[named]
        self._count(self._tenant_ids, named[0], -1)

    def _queue(self, tenant: str, count: int) -> None:
        """`count` objects of `tenant`'s hints queued (+) or no longer (-)."""
        self._objects_queued += count
        self._count(self._tenant_objects, tenant, count)

    @staticmethod
    def _count(counts: dict[str, int], tenant: str, delta: int) -> None:
        value = counts.get(tenant, 0) + delta
        if value:
            counts[tenant] = value
        else:
            counts.pop(tenant, None)

    def _advance(self, now_ms: int) -> None:
        invariant(now_ms >= self._now_ms, "time went backwards", now_ms=now_ms, last_ms=self._now_ms)
        self._now_ms = now_ms

    def check_invariants(self) -> None:
        cfg = self.config
        invariant(self._bytes_in_flight <= cfg.bytes_in_flight_max, "too many bytes in flight")
        invariant(len(self._copies) <= cfg.copies_in_flight_max, "too many copies in flight")
        invariant(len(self._ids) <= cfg.hints_queued_max, "too many hint ids")
        invariant(self._objects_queued <= cfg.objects_queued_max, "too many queued objects")
        invariant(len(self._rates) <= cfg.hot_tracked_max, "rate table unbounded")
        copying = [w for w in self._wants.values() if w.copy_id is not None]
        invariant(self._bytes_in_flight == sum(w.size for w in copying), "in-flight bytes drifted")
        invariant(set(self._copies) == {w.copy_id for w in copying}, "copy index drifted")
        for copy_id, key in self._copies.items():
            invariant(self._wants[key].copy_id == copy_id, "copy names another want", copy_id=copy_id)
        invariant(self._objects_queued == sum(len(h.undone) for h in self._hints.values()), "queue drifted")
        for key, want in self._wants.items():
            invariant(key == (want.object_id, want.target), "want filed under another key")
            for hint_key in want.hints:
                hint = self._hints.get(hint_key)
                invariant(hint is not None and want.object_id in hint.undone, "want names an ended hint")
            invariant(not want.release or (want.copy_id is not None and not want.hints), "bad release mark")
            invariant(want.hints or want.extra or want.release, "unwanted want", object_id=want.object_id)
        for hint in self._hints.values():
            invariant(bool(hint.ids) and bool(hint.undone), "hint should have ended", key=hint.key)
            invariant(hint.deadline_ms <= self._now_ms + cfg.hint_hold_ms_max, "a hint held too long")
            invariant(
                all(self._ids.get((hint.tenant, i)) == hint.key for i in hint.ids), "hint id index drifted"
            )
            for object_id in hint.undone:
                wanted = self._wants.get((object_id, hint.target))
                invariant(wanted is not None and hint.key in wanted.hints, "hint object not wanted")
        invariant(sum(len(h.ids) for h in self._hints.values()) == len(self._ids), "stray hint ids")
        tenant_ids: dict[str, int] = {}
        tenant_objects: dict[str, int] = {}
        for hint in self._hints.values():
            tenant_ids[hint.tenant] = tenant_ids.get(hint.tenant, 0) + len(hint.ids)
            tenant_objects[hint.tenant] = tenant_objects.get(hint.tenant, 0) + len(hint.undone)
        invariant(self._tenant_ids == tenant_ids, "a tenant's hint ids drifted")
        invariant(self._tenant_objects == tenant_objects, "a tenant's queued objects drifted")
        invariant(
            all(n <= cfg.tenant_hints_max for n in tenant_ids.values())
            and all(n <= cfg.tenant_objects_max for n in tenant_objects.values()),
            "a tenant over its share of the queues",
        )
        tenant_copies: dict[str, int] = {}
        for want in copying:
            invariant(want.extra or want.copy_tenant is not None, "a hint's copy counted for no tenant")
            if want.copy_tenant is not None:
                tenant_copies[want.copy_tenant] = tenant_copies.get(want.copy_tenant, 0) + 1
        invariant(self._tenant_copies == tenant_copies, "a tenant's copies drifted")
        extra_wants = [w for w in self._wants.values() if w.extra]
        invariant({w.object_id: w.target for w in extra_wants} == self._extra_wants, "extra index drifted")
        invariant(not self._extra_wants.keys() & self._extras.keys(), "two extras for one object")
        invariant(self._extra_count == len(extra_wants) + len(self._extras), "extra count drifted")
        extra_bytes = sum(w.size for w in extra_wants) + sum(s for _, s, _ in self._extras.values())
        invariant(self._extra_bytes == extra_bytes, "extra bytes drifted")
        by_domain: dict[bytes, list[int]] = {}
        for domain, size in [(w.domain, w.size) for w in extra_wants] + [
            (d, s) for _, s, d in self._extras.values()
        ]:
            entry = by_domain.setdefault(domain, [0, 0])
            entry[0] += 1
            entry[1] += size
        invariant(self._domain_extras == by_domain, "a domain's extras drifted")
        for held, held_bytes in by_domain.values():
            invariant(
                held <= cfg.domain_extras_max and held_bytes <= cfg.domain_extra_bytes_max,
                "a domain's extras over its share",
            )
        invariant(self._extra_count <= cfg.hot_extra_replicas_max, "extra replicas over budget")
        invariant(self._extra_bytes <= cfg.hot_extra_bytes_max, "extra bytes over budget")
