"""The repair core: which copies bring every object back to its replica target, and when.

Synchronous and I/O-free: time is passed in (`now_ms`), sizes are bytes. The repair service
feeds in what the directory and the segments report, calls `tick(now_ms)` periodically and
performs the effects it returns. One entry takes them all: `step(event, now_ms) -> effects`
(`kvfabric.core.step`; the events, one per method below, in `kvfabric.core.repair_events`):

    events   segment_up(id, incarnation, zone, rack, host, free_bytes, draining=None)
             segment_draining(id, draining=True)    segment_down(id)
             object_known(id, size_bytes, replica_target, segments, hot=0)
             replica_lost(id, segment_id, corrupt=False)    object_removed(id)
             copy_ok(copy_id) -> bool    copy_failed(copy_id, now_ms, source_failed=False)
             scan_complete()
    tick     tick(now_ms) -> [CancelCopy | StartCopy | DrainComplete]
    read     counters (plain, monotonic: the shell exports them), gauges(), replicas(id),
             drain_pending(id), tokens_bytes, check_invariants()

## Model
A *segment* has a failure domain (zone > rack > host > segment), an incarnation and the free
bytes it last reported. An *object* has a size, a replica target (the shell resolves it from
the namespace), a hotness hint (active readers; higher goes first), a tenant (its share domain:
tenants' objects take turns, below) and replicas on segments.
A replica on an UP segment is *healthy*: it counts toward the target. A replica on a DRAINING
segment is only *readable*: a copy source that no longer counts.

## States of a segment
    (unknown) --segment_up--> UP <--segment_draining(True / False)--> DRAINING
    UP | DRAINING --segment_down, or segment_up with a newer incarnation--> (gone: its replicas
        are lost at once, copies from or to it aborted, its objects recounted as below)
    DRAINING --tick: a listing of the objects below target ended since the drain began
        (`scan_complete`), every object on it has its target elsewhere (so no copy touches it)
        and no recount is pending--> DrainComplete (once per drain); the shell retires the
        segment, then sends segment_down.
A drain waits while an object cannot reach its target elsewhere (`drain_pending` counts them).

## Recounts (a drain flag that changes, or a segment lost, under many objects)
A segment starting or stopping a drain, or going down, changes the healthy count of every
object on it. A segment down drops its replicas from its objects at once, in one pass (the
event: 0.12-0.28 s at 1,000,000 objects, 0.66-2.45 s when it recounted each too;
docs/repair.md), so no replica on a segment gone is ever read or counted and a segment id
that comes back starts empty. The objects with a copy in flight are recounted at once
(O(copies in flight): a copy stays within its target); the others join a FIFO of *recounts*
(after a segment down, in buckets of the planning order's key: hotter first, then fewer
readable replicas left; those left with none last). The event recounts at most
`recounts_per_step` of them, and each tick as many in all: first from the FIFO, then whatever
planning finds stale among the objects it pops (while recounts are pending it recounts each
before use, so a copy is never started on a stale count; once the tick's allowance is spent
it stops planning until the next tick, keeping the order). Until an object is recounted its
healthy count and its place below target are those before the flag changed: a drain's objects
are planned up to `objects / recounts_per_step` ticks later (a hot one after colder ones
already recounted), `gauges()` counts below target what has been recounted, and a drain
completes only once no recount is pending. (Before: the event recounted every object on the
segment at once: 1.0-2.4 s of the repair service's loop at 1,000,000 objects, docs/repair.md.)
An object whose last replica was on a segment that went down is LOST when recounted (or
when an `object_known` or `object_removed` for it comes first: counted then); until then it is
kept without a replica (`in` the core, `replicas()` empty, counted in the `objects` gauge and,
by its old count, maybe below target) and never planned (popped, it is recounted first). An
object of a segment down has a stale ready entry (its order key, the readable replicas,
changed): the recount queues it again.
A flag that flaps adds an object again; when entries are added past twice the objects (plus
`recount_slack`) the FIFO is rebuilt without duplicates and objects gone, so it holds at most
twice the objects known at its last addition, plus that slack.
The core never removes single replicas: one DrainComplete lets the shell retire the segment
whole (the directory then drops its replicas like a segment down), so a replica is never freed
before its replacement is confirmed and registered.

## States of an object
    (absent) --object_known with >= 1 readable replica--> OK (healthy >= target) | BELOW
    BELOW --tick picks it--> COPYING (exactly one copy in flight)
    COPYING --copy_ok--> OK | BELOW
    COPYING --source or destination gone or draining, or target met elsewhere--> aborted, no backoff
        (CancelCopy at the next tick: "Ownership")
    COPYING --copy_failed (source_failed: the next copy reads another replica if it has one),
        or no result within copy_timeout_ms (CancelCopy)--> BACKOFF (retry_backoff_ms x 2^k,
        capped) --> BELOW; after attempts_max failures in a row: STUCK (counted) for
        stuck_retry_ms, then BELOW with a fresh set of attempts
    any --its last readable replica gone--> LOST: counted and forgotten (no copy can help);
        gone with a segment: when recounted ("Recounts")
    any --object_removed (deleted or evicted)--> (absent): its copy is forgotten
An object larger than `burst_bytes` can never start: it stays BELOW (gauge objects_oversize).

## Planning (`tick`)
Objects BELOW go in order: hotter first, then fewest readable replicas, then first known. The
order is kept as objects change (a ready queue of candidates, and one of objects in backoff by
retry time), so a tick costs the objects it looks at, not every object below target.
Destination: an UP segment without a replica of the object whose free bytes minus the bytes
reserved for copies in flight to it fit the object, in the widest failure domain the object's
healthy replicas do not use yet (placement's `_spread`: new zone, else rack, host, segment),
then most room. Source: a non-draining replica if any, then not the replica whose read failed
the object's last copy (the source refused or could not serve it: `copy_failed(...,
source_failed=True)`; e.g. a source token expired by a skewed source clock), then the one
nearest the destination, then the one with fewest copies reading from it. Starting a copy takes
`size_bytes` tokens from a bucket refilled at `bandwidth_bytes_per_s` and capped at
`burst_bytes` (the project's one `kvfabric.core.quotas.TokenBucket`, kept in milli-bytes with
time in ms: its rate, bytes/s, is then milli-bytes/ms and every level an integer-valued float, so
refill is exact; it refills from the last tick whatever events came between); when the next
object in order does not fit the tokens left, planning stops for this tick (strict priority: a
large hot object is not starved by small cold ones). At most `copies_in_flight_max` copies run
at once.

## Invariants (`check_invariants()`, after every step in tests)
1. Bounded: copies in flight <= copies_in_flight_max; one copy per object at most.
2. Budget: 0 <= tokens <= burst_bytes, so the bytes started in any window of w ms are at most
   burst_bytes + bandwidth_bytes_per_s x w / 1000.
3. Target: an object has a copy in flight only while healthy replicas + 1 <= target (a copy
   made redundant by a replica appearing elsewhere is aborted).
4. Domains: a copy goes to the widest unused failure domain with room at plan time (checked
   against an independent model in the state-machine test).
5. Room: per segment, reserved bytes = the sum of copies in flight to it, and reserved <= free
   unless a later report lowered free (then nothing more is planned there until it fits).
6. Every copy reads from a readable replica of its object and writes to an UP segment without
   one; every object the core keeps has at least one readable replica, or waits for a
   recount (its last one went with a segment).
   An object waiting for a recount (in the FIFO) may hold a stale healthy count; its place
   below target always follows the count it holds. An object with a copy never holds a stale
   count (invariant 3 is on the true count).
7. Planning misses no object: every object below target without a copy (and not oversize) has
   a current entry in the ready queue, or one in the waiting queue at its retry time, or waits
   for a recount (which queues it).
8. Cancels: every copy the core dropped without the shell's result (aborted, timed out) is
   reported once, as a CancelCopy at the next tick: the copies in flight and those waiting for
   their CancelCopy are distinct, and together at most copies_in_flight_max.

## Ownership
The directory is the source of truth for replicas; `object_known` replaces the core's view of
one object (the shell re-syncs with it at start and after gaps). Segment reports must come
before objects naming them: replicas on unknown segments are ignored (counted). A StartCopy's
copy id belongs to the shell until it reports exactly one `copy_ok` or `copy_failed`, or the
core drops the copy (aborted: no longer wanted; or timed out) and says so with a
`CancelCopy(copy_id)` at its next tick. The shell then stops that copy and gives its ticket
back, so the destination's confirm, if still on its way, is refused and the segment frees what
it wrote: a copy the core no longer wants does not land as a replica past the target (before
2026-12-06 it ran on and landed, kept until eviction: review). It must not start a copy of the
same object until the cancelled one has ended (the directory aborts a writer's tickets of an
object by key). A confirm that reached the directory before the cancel stays a replica; the
shell's later result for it is stale (`copy_ok` returns False), as is any result for a copy
the core no longer tracks (aborted, timed out, duplicate). Copy ids are unique within one core
instance. Tokens spent on a copy that fails are not refunded. Scrub reports a corrupt replica
with `replica_lost(..., corrupt=True)`.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Final, TypeAlias

from kvfabric.core import repair_events
from kvfabric.core.placement import Candidate
from kvfabric.core.placement import _spread as spread
from kvfabric.core.quotas import TokenBucket
from kvfabric.core.repair_events import RepairEvent, RepairOutput
from kvfabric.core.step import not_before
from kvfabric.format.invariant import invariant, unreachable

__all__ = ["CancelCopy", "DrainComplete", "Effect", "RepairConfig", "RepairCore", "StartCopy"]

ObjectId: TypeAlias = Hashable


@dataclass(frozen=True, slots=True)
class RepairConfig:
    bandwidth_bytes_per_s: int = 200 << 20  # token refill rate for copies started
    burst_bytes: int = 256 << 20  # bucket size; also the largest object repair can copy
    copies_in_flight_max: int = 32
    # copies in flight to one segment: a segment takes `KVF_SEGMENT_COPIES_MAX` (4) at once and
    # answers `busy` past it (review, stop 65: 8 at once to one segment, half of them busy)
    copies_per_destination_max: int = 4
    copy_timeout_ms: int = 60_000  # no result by then: a failed attempt (indeterminate)
    attempts_max: int = 3  # failed copies in a row before the object is STUCK
    retry_backoff_ms: int = 1_000  # after the k-th failure in a row: this x 2^(k-1) ...
    retry_backoff_max_ms: int = 30_000  # ... capped here
    stuck_retry_ms: int = 600_000  # a STUCK object gets a fresh set of attempts after this
    recounts_per_step: int = 5_000  # objects a drain flag change recounts per event or tick

    def __post_init__(self) -> None:
        invariant(self.bandwidth_bytes_per_s > 0 and self.burst_bytes > 0, "budget must be positive")
        invariant(
            min(self.copies_in_flight_max, self.copies_per_destination_max, self.attempts_max) >= 1,
            "bounds must be >= 1",
        )
        invariant(self.copy_timeout_ms > 0, "copy_timeout_ms must be positive")
        invariant(0 <= self.retry_backoff_ms <= self.retry_backoff_max_ms, "need 0 <= backoff <= max")
        invariant(self.recounts_per_step >= 1, "recounts_per_step must be >= 1")


# Objects below target with no destination that one tick's planning looks at, at most (`_plan`).
PLAN_NO_DESTINATION_MAX: Final = 256


@dataclass(frozen=True, slots=True)
class StartCopy:
    """Copy `object_id` (`size_bytes`) from segment `source` to segment `destination`; report
    the outcome with `copy_ok(copy_id)` or `copy_failed(copy_id, now_ms)`."""

    copy_id: int
    object_id: ObjectId
    source: str
    destination: str
    size_bytes: int


@dataclass(frozen=True, slots=True)
class DrainComplete:
    """Nothing on draining `segment_id` is needed any more: the shell may retire it."""

    segment_id: str


@dataclass(frozen=True, slots=True)
class CancelCopy:
    """The core dropped copy `copy_id` of `object_id` without its result (no longer wanted, or
    timed out): stop it and give its ticket back, then copy that object again only once it
    ended (module docstring, "Ownership")."""

    copy_id: int
    object_id: ObjectId


Effect: TypeAlias = CancelCopy | StartCopy | DrainComplete


@dataclass(slots=True)
class _Segment:
    incarnation: int
    zone: str
    rack: str
    host: str
    free_bytes: int
    draining: bool = False
    drain_reported: bool = False
    # A listing of the objects below target finished since the drain began (`scan_complete`):
    # until then the core may not know the segment's objects at all (review, stop 68: the tick
    # between the flag and the listing reported a drain complete with every object still there).
    drain_listed: bool = False
    reserved_bytes: int = 0  # copies in flight to it
    reads: int = 0  # copies in flight from it
    writes: int = 0  # copies in flight to it (at most `copies_per_destination_max`)
    short: bool = False  # a report put free below reserved: plan nothing here until it fits

    def candidate(self, segment_id: str) -> Candidate:
        """Placement's view, with the room left after copies in flight as its free bytes."""
        room = self.free_bytes - self.reserved_bytes
        return Candidate(segment_id, self.zone, self.rack, self.host, room)


@dataclass(slots=True)
class _Copy:
    copy_id: int
    object_id: ObjectId
    source: str
    destination: str
    size_bytes: int
    started_ms: int


@dataclass(slots=True)
class _Object:
    object_id: ObjectId
    # planning tie-break, unique: (its tenant's turn << SEQ_TURN_SHIFT) | the order first known.
    # Tenants' objects of one hotness and replica count take turns: each tenant's k-th object
    # known goes with the others' k-th (a tenant first known later starts at the turn being
    # served). In order first known alone, a segment loss repaired tenants whole one after
    # another, in the listing's order (by domain digest; review, stop 70).
    seq: int
    tenant: Hashable
    size_bytes: int
    target: int
    hot: int
    replicas: set[str]  # on UP or DRAINING segments
    healthy: int = 0  # of those, on UP segments
    copy: _Copy | None = None
    failures: int = 0  # failed copies in a row
    retry_at_ms: int = 0
    stuck: bool = False
    failed_source: str = ""  # the source whose read failed the last copy: tried last next time
    gauged_stuck: bool = False  # what this object adds to the core's gauges now (`_gauge`)
    gauged_oversize: bool = False


# (-hot, readable replicas, seq, push number, object id): the planning order of `_plan`.
_ReadyEntry: TypeAlias = tuple[int, int, int, int, ObjectId]
# (retry_at_ms, seq, push number, object id): an object in backoff, ready again at retry_at_ms.
_WaitingEntry: TypeAlias = tuple[int, int, int, ObjectId]
QUEUE_SLACK = 1024  # entries past 2 x the objects below target before a queue is rebuilt
SEQ_TURN_SHIFT: Final = 40  # an object's seq: its tenant's turn above, the order known below


class RepairCore:
    """See the module docstring."""

    def __init__(self, config: RepairConfig, now_ms: int = 0) -> None:
        self.config = config
        self._segments: dict[str, _Segment] = {}
        self._objects: dict[ObjectId, _Object] = {}
        self._on_segment: dict[str, set[ObjectId]] = {}  # segment id -> objects with a replica there
        self._below: set[ObjectId] = set()  # objects with healthy < target
        # Planning queues, kept as objects change (a tick pops what it starts, not every object
        # below target: 1.3-2.2 s a tick with 1 M below before). Lazy: an entry is checked when
        # popped and dropped when stale; `_queue` is called wherever an object's order key or
        # its eligibility can change (`_refresh`, `_end`), `_failed` adds its retry time.
        self._ready: list[_ReadyEntry] = []
        # Popped with no destination: back in `_ready` once it is empty, round robin within the
        # tick's bound (`_plan`).
        self._deferred: list[_ReadyEntry] = []
        self._waiting: list[_WaitingEntry] = []
        self._pushes = 0  # unique per entry: ties never compare object ids
        self.queue_slack = QUEUE_SLACK  # (tests set 0: rebuilds at every chance)
        # Objects whose healthy count a drain flag change left stale (module docstring,
        # "Recounts"); an id may repeat, or name an object gone since (skipped).
        self._recounts: deque[ObjectId] = deque()
        self.recount_slack = QUEUE_SLACK  # (tests set 0: deduplicated at every chance)
        # Kept as objects change (`_gauge`): `gauges()` is read from the metrics thread, which
        # must not iterate sets the event loop changes (nor walk every object below target).
        self._stuck_below = 0
        self._oversize_below = 0
        self._copies: dict[int, _Copy] = {}
        self._cancels: list[CancelCopy] = []  # copies dropped since the last tick (invariant 8)
        # Milli-bytes, time in ms (rate: bytes/s = milli-bytes/ms): integer-valued floats, exact.
        self._budget = TokenBucket.full(config.bandwidth_bytes_per_s, config.burst_bytes * 1000, now_ms)
        self._now_ms = now_ms
        self._step_ms = now_ms  # the latest time given to `step` (events without a time included)
        self._seq = 0
        # per tenant with objects here: its next turn, its objects (dropped with its last)
        self._tenant_turn: dict[Hashable, int] = {}
        self._tenant_objects: dict[Hashable, int] = {}
        self._turn_served = 0  # the turn of the object last started (a new tenant starts there)
        self._next_copy_id = 1
        self.counters: dict[str, int] = {}

    def step(self, event: RepairEvent, now_ms: int) -> list[RepairOutput]:
        """The one entry (`kvfabric.core.step`): `event` at `now_ms` as the method of the same
        meaning; `CopyOk` answers `[Reply(wanted)]`. Time going backwards is refused first."""
        self._step_ms = not_before(max(self._step_ms, self._now_ms), now_ms)
        return repair_events.dispatch(self, event, now_ms)

    # ---- queries ---------------------------------------------------------------------------

    def __contains__(self, object_id: ObjectId) -> bool:
        return object_id in self._objects

    def replicas(self, object_id: ObjectId) -> frozenset[str]:
        """Segments (UP or DRAINING) holding a readable replica of `object_id`."""
        obj = self._objects.get(object_id)
        return frozenset(obj.replicas) if obj else frozenset()

    def drain_pending(self, segment_id: str) -> int:
        """Objects on draining `segment_id` still short of their target elsewhere (counted
        now, recounts pending or not)."""
        objects = (self._objects[o] for o in self._on_segment.get(segment_id, ()))
        return sum(1 for obj in objects if self._healthy_now(obj) < obj.target)

    @property
    def tokens_bytes(self) -> int:
        return int(self._budget.tokens) // 1000

    def gauges(self) -> dict[str, int]:
        """Current levels, for the shell to export next to `counters`. Safe to call from another
        thread (the metrics server's): counts kept as objects change, and copies of the two
        small tables (copies in flight, segments) taken whole under the GIL."""
        copies = list(self._copies.values())
        segments = list(self._segments.values())
        return {
            "objects": len(self._objects),
            "objects_below_target": len(self._below),
            "objects_stuck": self._stuck_below,
            "objects_oversize": self._oversize_below,
            "copies_in_flight": len(copies),
            "copy_bytes_in_flight": sum(c.size_bytes for c in copies),
            "segments_draining": sum(1 for seg in segments if seg.draining),
            "recounts_pending": len(self._recounts),
        }

    # ---- events: segments ------------------------------------------------------------------

    def segment_up(
        self,
        segment_id: str,
        *,
        incarnation: int,
        zone: str,
        rack: str,
        host: str,
        free_bytes: int,
        draining: bool | None = None,
    ) -> None:
        """A segment registered or reported (heartbeat). A newer incarnation lost every replica.
        `draining` is the segment's own report; None leaves it as it was (UP when new)."""
        invariant(free_bytes >= 0, "negative free bytes", segment_id=segment_id)
        seg = self._segments.get(segment_id)
        if seg is not None and incarnation < seg.incarnation:
            self._count("stale_segment_reports_total")
            return
        if seg is not None and incarnation > seg.incarnation:
            self.segment_down(segment_id)
            seg = None
        if seg is None:
            seg = _Segment(incarnation, zone, rack, host, free_bytes)
            self._segments[segment_id] = seg
            self._on_segment[segment_id] = set()
        seg.zone, seg.rack, seg.host, seg.free_bytes = zone, rack, host, free_bytes
        if seg.reserved_bytes > free_bytes and not seg.short:
            self._count("reports_below_reserved_total")
        seg.short = seg.reserved_bytes > free_bytes
        if draining is not None:
            self.segment_draining(segment_id, draining)

    def segment_draining(self, segment_id: str, draining: bool = True) -> None:
        """Move everything off `segment_id` (its replicas stay readable sources), or stop that.
        Its objects are recounted `recounts_per_step` at a time (module docstring, "Recounts")."""
        seg = self._segments.get(segment_id)
        if seg is None or seg.draining == draining:
            return
        seg.draining, seg.drain_reported, seg.drain_listed = draining, False, False
        if draining:
            for copy in [c for c in self._copies.values() if c.destination == segment_id]:
                self._abort(copy)  # a replica landing there would not count
        on_segment = self._on_segment[segment_id]
        self._defer_recounts(on_segment, [on_segment])

    def scan_complete(self) -> None:
        """The shell's listing of every object below target ended (after the segments' report
        that began it): a draining segment's objects are known from here, so its drain may be
        reported complete."""
        for seg in self._segments.values():
            seg.drain_listed = seg.drain_listed or seg.draining

    def segment_down(self, segment_id: str) -> None:
        """The segment (this incarnation) is gone: its replicas are lost at once, its copies
        aborted, and its objects recounted `recounts_per_step` at a time in planning order
        (module docstring, "Recounts"): one whose last replica was there is LOST when recounted."""
        if self._segments.pop(segment_id, None) is None:
            return
        self._count("segments_down_total")
        for copy in [c for c in self._copies.values() if segment_id in (c.source, c.destination)]:
            self._abort(copy)
        on_segment = self._on_segment.pop(segment_id)
        objects = self._objects
        # One pass over its objects, no more per object: the replica dropped, and each object
        # put in a bucket of the planning order's key (hotter, then fewer readable replicas
        # left), those left with none last (they are LOST: no copy can help). Cold objects,
        # most of them, keyed by their replicas left alone (no key tuple made: 0.1 s a million).
        hot: dict[tuple[int, int], list[ObjectId]] = {}
        cold: dict[int, list[ObjectId]] = {}
        lost: list[ObjectId] = []
        for object_id in on_segment:
            obj = objects[object_id]
            replicas = obj.replicas
            replicas.discard(segment_id)
            left = len(replicas)
            if not left:
                lost.append(object_id)
            elif obj.hot:
                hot.setdefault((-obj.hot, left), []).append(object_id)
            else:
                try:
                    cold[left].append(object_id)
                except KeyError:
                    cold[left] = [object_id]
        order = [hot[key] for key in sorted(hot)] + [cold[left] for left in sorted(cold)] + [lost]
        self._defer_recounts(on_segment, order)

    def _defer_recounts(self, object_ids: set[ObjectId], order: Iterable[Iterable[ObjectId]]) -> None:
        """`object_ids` join the recounts, in `order` (runs of them, each in its own order), the
        objects with a copy in flight among them recounted now (a copy stays within its target on
        the true count), then the event's `recounts_per_step` are taken from the front."""
        for copy in list(self._copies.values()):
            if copy.object_id in object_ids and copy.copy_id in self._copies:
                self._refresh(copy.object_id)
        for ids in order:
            self._recounts.extend(ids)
        if len(self._recounts) > 2 * len(self._objects) + self.recount_slack:
            self._recounts = deque(o for o in dict.fromkeys(self._recounts) if o in self._objects)
        self._recount(self.config.recounts_per_step)

    # ---- events: objects -------------------------------------------------------------------

    def object_known(
        self,
        object_id: ObjectId,
        *,
        size_bytes: int,
        replica_target: int,
        segments: Iterable[str],
        hot: int = 0,
        tenant: Hashable = None,
    ) -> None:
        """The directory's view of one object (published, or re-synced): replaces the core's.
        `tenant`: whose it is (its share domain), for the turns tenants take (`_Object.seq`);
        one known already keeps its first.
        A view equal to the core's changes nothing and costs a comparison (the scan re-syncs
        every object below target each pass: 3.0-3.2 s of this method per pass at 1,000,000 when
        each view was applied again, 0.48 s now; docs/repair.md)."""
        invariant(size_bytes > 0 and replica_target >= 1, "bad object", object_id=object_id)
        segments = tuple(segments)
        obj = self._objects.get(object_id)
        if (
            obj is not None
            and obj.size_bytes == size_bytes
            and obj.target == replica_target
            and obj.hot == hot
            and obj.replicas == set(segments)  # (replicas are all on known segments)
            and obj.replicas
        ):
            self._count("objects_known_unchanged_total")
            return
        if obj is not None and not obj.replicas:  # LOST, its recount pending: counted now
            self._lost(obj)
            obj = None
        if obj is None and not any(s in self._segments for s in segments):
            # Nothing readable on a segment known here: no copy can help, and a loss is counted
            # once, when a tracked object loses its last replica. A lost object stays listed
            # until the directory's sweep reaches it, and each pass counted it lost again (and
            # one with its recount pending twice; review, stop 70).
            self._count("objects_known_unreadable_total")
            return
        if obj is None:
            self._seq += 1
            turn = self._tenant_turn.get(tenant, self._turn_served)
            self._tenant_turn[tenant] = turn + 1
            self._tenant_objects[tenant] = self._tenant_objects.get(tenant, 0) + 1
            seq = (turn << SEQ_TURN_SHIFT) | (self._seq & ((1 << SEQ_TURN_SHIFT) - 1))
            obj = self._objects[object_id] = _Object(
                object_id, seq, tenant, size_bytes, replica_target, hot, set()
            )
        obj.size_bytes, obj.target, obj.hot = size_bytes, replica_target, hot
        for segment_id in obj.replicas:
            self._on_segment[segment_id].discard(object_id)
        obj.replicas = set()
        for segment_id in segments:
            if segment_id in self._segments:
                obj.replicas.add(segment_id)
                self._on_segment[segment_id].add(object_id)
            else:
                self._count("replicas_on_unknown_segment_total")
        copy = obj.copy
        if copy is not None and (copy.source not in obj.replicas or copy.destination in obj.replicas):
            self._abort(copy)
        self._refresh(object_id)

    def replica_lost(self, object_id: ObjectId, segment_id: str, *, corrupt: bool = False) -> None:
        """One replica is gone: removed, or invalidated by scrub (`corrupt`)."""
        obj = self._objects.get(object_id)
        if obj is None or segment_id not in obj.replicas:
            return
        self._count("replicas_corrupt_total" if corrupt else "replicas_removed_total")
        obj.replicas.discard(segment_id)
        self._on_segment[segment_id].discard(object_id)
        if obj.copy is not None and obj.copy.source == segment_id:
            self._abort(obj.copy)
        self._refresh(object_id)

    def object_removed(self, object_id: ObjectId) -> None:
        """Deleted or evicted: forget it and any copy of it."""
        obj = self._objects.get(object_id)
        if obj is not None and not obj.replicas:  # LOST before it was removed
            self._lost(obj)
        elif obj is not None:
            del self._objects[object_id]
            self._forget(object_id, obj)

    # ---- events: copies --------------------------------------------------------------------

    def copy_ok(self, copy_id: int) -> bool:
        """The copy is stored and checksummed. True: register the replica with the directory;
        False: the core no longer wanted it (stale): free the copied bytes."""
        copy = self._copies.get(copy_id)
        if copy is None:
            self._count("stale_copy_results_total")
            return False
        seg = self._segments[copy.destination]
        seg.free_bytes = max(0, seg.free_bytes - copy.size_bytes)  # until its next report
        self._end(copy)
        obj = self._objects[copy.object_id]
        obj.failures, obj.retry_at_ms = 0, 0
        obj.replicas.add(copy.destination)
        self._on_segment[copy.destination].add(copy.object_id)
        self._count("copies_ok_total")
        self._count("bytes_copied_total", copy.size_bytes)
        self._refresh(copy.object_id)
        return True

    def copy_failed(self, copy_id: int, now_ms: int, source_failed: bool = False, busy: bool = False) -> None:
        """The copy failed (the destination keeps nothing): back off, then retry, bounded.
        `source_failed`: reading the source failed (refused, unreachable, gone): the retry reads
        another replica of the object if it has one, instead of the same one again. `busy`: the
        destination had no copy slot free (nothing was tried): retried after the base backoff,
        never counted towards STUCK (review, stop 65: three busy answers made an object stuck
        for 10 minutes)."""
        self._advance(now_ms)
        copy = self._copies.get(copy_id)
        if copy is None:
            self._count("stale_copy_results_total")
            return
        self._end(copy)
        obj = self._objects[copy.object_id]
        if busy:
            self._count("copies_busy_total")
            obj.retry_at_ms = now_ms + self.config.retry_backoff_ms
            self._gauge(obj)
            self._wait(obj)
            return
        self._count("copies_failed_total")
        if source_failed:
            self._count("copies_source_failed_total")
            obj.failed_source = copy.source
        self._failed(obj, now_ms)

    # ---- tick ------------------------------------------------------------------------------

    def tick(self, now_ms: int) -> list[Effect]:
        """Time out copies, refill the budget, start copies in priority order, report drains;
        the copies dropped since the last tick (aborted or timed out) come first, cancelled."""
        self._advance(now_ms)
        self._budget.refill(now_ms)
        for copy in [
            c for c in self._copies.values() if now_ms - c.started_ms >= self.config.copy_timeout_ms
        ]:
            self._count("copies_timed_out_total")
            self._cancels.append(CancelCopy(copy.copy_id, copy.object_id))
            self._end(copy)
            self._failed(self._objects[copy.object_id], now_ms)
        allowance = self.config.recounts_per_step - self._recount(self.config.recounts_per_step)
        started = self._plan(now_ms, allowance)
        effects: list[Effect] = [*self._cancels, *started]
        self._cancels = []
        for segment_id, seg in self._segments.items():
            if (
                seg.draining
                and seg.drain_listed
                and not seg.drain_reported
                and not self._recounts
                and self._drained(segment_id)
            ):
                seg.drain_reported = True
                self._count("drains_complete_total")
                effects.append(DrainComplete(segment_id))
        return effects

    def _plan(self, now_ms: int, recounts_left: int) -> list[StartCopy]:
        """Objects below target in priority order, from the ready queue: those in backoff whose
        retry time came are queued first; each popped entry is checked (stale ones dropped);
        those past the budget go back for the next tick, those without a destination once the
        others have been looked at (`_deferred`). The same
        order and choices as sorting every eligible object each tick, at the cost of the
        entries looked at (and of a rebuild, O(objects below), once stale entries outnumber
        them: the objects queued reached their target)."""
        self._rebuild_queues_if_stale()
        while self._waiting and self._waiting[0][0] <= now_ms:
            retry_at, seq, _, object_id = heapq.heappop(self._waiting)
            obj = self._objects.get(object_id)
            if obj is not None and obj.seq == seq and obj.retry_at_ms == retry_at and obj.copy is None:
                obj.stuck = False
                self._gauge(obj)
                self._queue(obj)
        started: list[StartCopy] = []
        looked_at: set[ObjectId] = set()  # a duplicate entry of one already looked at is dropped
        put_back: list[_ReadyEntry] = []
        # An object with no destination is deferred: looked at again once every ready entry has
        # been (round robin), at most `PLAN_NO_DESTINATION_MAX` of them a tick; so each deferred
        # one is looked at again within ceil(deferred / that) ticks, and one that can go behind
        # thousands that cannot is reached. A cluster with no room, or every destination at its
        # cap, cost a tick one look per object below target (50,000: 0.5 s a tick; review, stop
        # 68). (Merged back in order at any segment change, a scan's reports every 2 s and each
        # copy started or ended restarted the walk at the top: review of that fix.)
        no_destination: list[_ReadyEntry] = []
        cycled = False  # the deferred entries came back once this tick
        while (
            len(self._copies) < self.config.copies_in_flight_max
            and len(no_destination) < PLAN_NO_DESTINATION_MAX
        ):
            if not self._ready:
                if cycled or not self._deferred:
                    break
                self._ready, self._deferred, cycled = self._deferred, [], True
                heapq.heapify(self._ready)
            entry = heapq.heappop(self._ready)
            obj = self._objects.get(entry[4])
            if obj is None or not self._current(obj, entry) or obj.object_id in looked_at:
                continue  # stale: the object changed (and was queued again), or is gone
            if obj.retry_at_ms > now_ms:
                continue  # in backoff: its waiting entry queues it again
            if self._recounts and (obj.healthy != self._healthy_now(obj) or not obj.replicas):
                if recounts_left <= 0:  # the tick's recounts are spent: the rest next tick
                    put_back.append(entry)
                    break
                recounts_left -= 1
                self._count("recounts_total")
                self._refresh(obj.object_id)  # queued again if still below: popped in this loop
                continue
            looked_at.add(obj.object_id)
            if obj.size_bytes > self.config.burst_bytes:
                continue  # can never start (gauge objects_oversize): not queued again
            destination = self._destination(obj)
            if destination is None:  # no room in any domain (or at its caps): looked at again later
                no_destination.append(entry)
                continue
            if not self._budget.take(obj.size_bytes * 1000, now_ms):
                self._count("budget_waits_total")
                put_back.append(entry)
                break
            started.append(self._start(obj, destination, now_ms))
        for entry in put_back:
            heapq.heappush(self._ready, entry)
        self._deferred += no_destination
        return started

    def _current(self, obj: _Object, entry: _ReadyEntry) -> bool:
        """`entry` is `obj`'s entry as it stands: below target, no copy, the same order key."""
        return (
            obj.seq == entry[2]
            and obj.copy is None
            and obj.object_id in self._below
            and (-obj.hot, len(obj.replicas)) == entry[:2]
        )

    def _queue(self, obj: _Object) -> None:
        """Offer `obj` to planning when it is below target without a copy (a duplicate of an
        entry already queued is harmless: the second one popped is dropped)."""
        if obj.copy is not None or obj.object_id not in self._below:
            return
        heapq.heappush(self._ready, (-obj.hot, len(obj.replicas), obj.seq, self._push(), obj.object_id))
        self._rebuild_queues_if_stale()

    def _push(self) -> int:
        self._pushes += 1
        return self._pushes

    def _wait(self, obj: _Object) -> None:
        """`obj` failed a copy: planning takes it up again at its retry time."""
        heapq.heappush(self._waiting, (obj.retry_at_ms, obj.seq, self._push(), obj.object_id))
        self._rebuild_queues_if_stale()

    def _rebuild_queues_if_stale(self) -> None:
        if (
            max(len(self._ready) + len(self._deferred), len(self._waiting))
            > 2 * len(self._below) + self.queue_slack
        ):
            self._rebuild_queues()

    def _rebuild_queues(self) -> None:
        """Both queues from the objects below target, stale entries gone: O(objects below),
        when a queue has grown past twice their number (and in tests: the reference order)."""
        below = [self._objects[i] for i in self._below]
        self._ready = [
            (-o.hot, len(o.replicas), o.seq, self._push(), o.object_id) for o in below if o.copy is None
        ]
        # (a stuck object's retry time can be 0: a failure at time 0 with stuck_retry_ms 0)
        self._waiting = [
            (o.retry_at_ms, o.seq, self._push(), o.object_id) for o in below if o.retry_at_ms or o.stuck
        ]
        self._deferred = []
        heapq.heapify(self._ready)
        heapq.heapify(self._waiting)

    def _destination(self, obj: _Object) -> Candidate | None:
        """The widest failure domain the healthy replicas do not use, then the most room."""
        chosen = [self._segments[s].candidate(s) for s in obj.replicas if not self._segments[s].draining]
        fitting = [
            seg.candidate(segment_id)
            for segment_id, seg in self._segments.items()
            if not seg.draining and segment_id not in obj.replicas
        ]
        fitting = [c for c in fitting if c.free_bytes >= obj.size_bytes]
        if not fitting:
            return None
        widest = max(spread(c, chosen) for c in fitting)
        # The one with the most room of those as wide and not at its copies' cap. All of them at
        # it: the copy waits a tick rather than a narrower domain taking it (a replica placed
        # there stays there; review of the cap, stop 65). Only the roomiest of them was looked
        # at: a new, empty segment at its cap left the others idle, 4 copies in flight of 32
        # (review, stop 68).
        cap = self.config.copies_per_destination_max
        open_ = [
            c for c in fitting if spread(c, chosen) == widest and self._segments[c.segment_id].writes < cap
        ]
        return max(open_, key=lambda c: (c.free_bytes, c.segment_id), default=None)

    def _start(self, obj: _Object, destination: Candidate, now_ms: int) -> StartCopy:
        invariant(self._healthy_now(obj) + 1 <= obj.target, "copy past the replica target", target=obj.target)
        self._turn_served = max(self._turn_served, obj.seq >> SEQ_TURN_SHIFT)

        def source_order(segment_id: str) -> tuple[bool, bool, int, int, str]:
            seg = self._segments[segment_id]
            return (
                seg.draining,
                segment_id == obj.failed_source,
                spread(seg.candidate(segment_id), [destination]),
                seg.reads,
                segment_id,
            )

        source = min(obj.replicas, key=source_order)
        object_id = obj.object_id
        copy = _Copy(self._next_copy_id, object_id, source, destination.segment_id, obj.size_bytes, now_ms)
        self._next_copy_id += 1
        self._copies[copy.copy_id] = obj.copy = copy
        self._segments[source].reads += 1
        self._segments[destination.segment_id].reserved_bytes += obj.size_bytes
        self._segments[destination.segment_id].writes += 1
        self._count("copies_started_total")
        self._count("bytes_started_total", obj.size_bytes)
        return StartCopy(copy.copy_id, object_id, source, copy.destination, copy.size_bytes)

    # ---- internals -------------------------------------------------------------------------

    def _recount(self, limit: int) -> int:
        """Recount up to `limit` objects from the front of the recounts (module docstring);
        returns how many it took from the FIFO."""
        recounts = self._recounts
        taken = min(limit, len(recounts))
        for _ in range(taken):
            object_id = recounts.popleft()
            if object_id in self._objects:
                self._refresh(object_id)
        if taken:
            self._count("recounts_total", taken)
        return taken

    def _healthy_now(self, obj: _Object) -> int:
        return sum(1 for s in obj.replicas if not self._segments[s].draining)

    def _refresh(self, object_id: ObjectId) -> None:
        """Recount one object's healthy replicas; LOST if none is readable; abort a redundant copy."""
        obj = self._objects[object_id]
        if not obj.replicas:
            self._lost(obj)
            return
        obj.healthy = self._healthy_now(obj)
        if obj.copy is not None and obj.healthy + 1 > obj.target:
            self._abort(obj.copy)
        if obj.healthy < obj.target:
            self._below.add(object_id)
            self._queue(obj)
        else:
            self._below.discard(object_id)
            obj.failures, obj.retry_at_ms, obj.stuck, obj.failed_source = 0, 0, False, ""
        self._gauge(obj)

    def _lost(self, obj: _Object) -> None:
        """`obj` has no readable replica left: counted and forgotten (no copy can help)."""
        del self._objects[obj.object_id]
        self._forget(obj.object_id, obj)
        self._count("objects_lost_total")

    def _gauge(self, obj: _Object) -> None:
        """Bring what `obj` adds to the stuck and oversize gauges in line with its state (an
        object counts while it is below target; one forgotten counts for nothing)."""
        below = obj.object_id in self._below and self._objects.get(obj.object_id) is obj
        stuck, oversize = below and obj.stuck, below and obj.size_bytes > self.config.burst_bytes
        self._stuck_below += stuck - obj.gauged_stuck
        self._oversize_below += oversize - obj.gauged_oversize
        obj.gauged_stuck, obj.gauged_oversize = stuck, oversize

    def _forget(self, object_id: ObjectId, obj: _Object) -> None:
        left = self._tenant_objects[obj.tenant] - 1
        if left:
            self._tenant_objects[obj.tenant] = left
        else:  # (no entry per tenant ever seen)
            del self._tenant_objects[obj.tenant]
            del self._tenant_turn[obj.tenant]
        if obj.copy is not None:
            self._abort(obj.copy)
        for segment_id in obj.replicas:
            self._on_segment[segment_id].discard(object_id)
        self._below.discard(object_id)
        self._gauge(obj)

    def _failed(self, obj: _Object, now_ms: int) -> None:
        obj.failures += 1
        if obj.failures >= self.config.attempts_max:
            self._count("objects_stuck_total")
            obj.failures, obj.stuck = 0, True
            obj.retry_at_ms = now_ms + self.config.stuck_retry_ms
        else:
            backoff = self.config.retry_backoff_ms << (obj.failures - 1)
            obj.retry_at_ms = now_ms + min(backoff, self.config.retry_backoff_max_ms)
        self._gauge(obj)
        self._wait(obj)

    def _abort(self, copy: _Copy) -> None:
        """Forget a copy that is no longer wanted (not the object's fault: no backoff); the next
        tick cancels it."""
        self._count("copies_aborted_total")
        self._cancels.append(CancelCopy(copy.copy_id, copy.object_id))
        self._end(copy)

    def _end(self, copy: _Copy) -> None:
        del self._copies[copy.copy_id]
        obj = self._objects.get(copy.object_id)
        if obj is not None and obj.copy is copy:
            obj.copy = None
            self._queue(obj)  # still below target after an abort or a failure
        source = self._segments.get(copy.source)
        if source is not None:
            source.reads -= 1
        destination = self._segments.get(copy.destination)
        if destination is not None:
            destination.reserved_bytes -= copy.size_bytes
            destination.writes -= 1
            destination.short = destination.short and destination.reserved_bytes > destination.free_bytes

    def _drained(self, segment_id: str) -> bool:
        # No copy touches it then: copies to a draining segment are aborted, and a copy from it
        # is of an object on it that is still below its target.
        # Over the smaller set (an object is below target exactly when healthy < target): a
        # drain's last ticks have few below and up to every object on the segment.
        on_segment = self._on_segment[segment_id]
        if len(self._below) < len(on_segment):
            return not any(segment_id in self._objects[o].replicas for o in self._below)
        return all(self._objects[o].healthy >= self._objects[o].target for o in on_segment)

    def _advance(self, now_ms: int) -> None:
        invariant(now_ms >= self._now_ms, "time went backwards", now_ms=now_ms, last_ms=self._now_ms)
        self._now_ms = now_ms

    def _count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def check_invariants(self) -> None:
        cfg = self.config
        tenants: dict[Hashable, int] = {}
        for known in self._objects.values():
            tenants[known.tenant] = tenants.get(known.tenant, 0) + 1
        invariant(tenants == self._tenant_objects, "a tenant's object count drifted")
        invariant(self._tenant_turn.keys() == tenants.keys(), "a turn kept for a tenant with no object")
        invariant(len(self._copies) <= cfg.copies_in_flight_max, "too many copies in flight")
        cancels = {c.copy_id for c in self._cancels}
        invariant(len(cancels) == len(self._cancels), "a copy cancelled twice")
        invariant(not cancels & self._copies.keys(), "a copy both in flight and cancelled")
        invariant(len(self._copies) + len(cancels) <= cfg.copies_in_flight_max, "too many cancels")
        invariant(self._budget.capacity == cfg.burst_bytes * 1000, "token bucket out of bounds")
        self._budget.check()
        reserved: dict[str, int] = {}
        reads: dict[str, int] = {}
        writes: dict[str, int] = {}
        for copy in self._copies.values():
            obj = self._objects.get(copy.object_id)
            if obj is None or obj.copy is not copy:
                unreachable("copy of an unknown object", copy=copy)
            invariant(copy.source in obj.replicas, "copy from a non-replica", copy=copy)
            dest = self._segments.get(copy.destination)
            invariant(dest is not None and not dest.draining, "copy to a segment not UP", copy=copy)
            invariant(copy.destination not in obj.replicas, "copy to a segment holding a replica", copy=copy)
            reserved[copy.destination] = reserved.get(copy.destination, 0) + copy.size_bytes
            reads[copy.source] = reads.get(copy.source, 0) + 1
            writes[copy.destination] = writes.get(copy.destination, 0) + 1
        for segment_id, seg in self._segments.items():
            invariant(
                seg.reserved_bytes == reserved.get(segment_id, 0), "reservations drifted", seg=segment_id
            )
            invariant(seg.reads == reads.get(segment_id, 0), "read count drifted", seg=segment_id)
            invariant(seg.writes == writes.get(segment_id, 0), "write count drifted", seg=segment_id)
            invariant(seg.writes <= self.config.copies_per_destination_max, "too many copies to one segment")
            invariant(seg.short or seg.reserved_bytes <= seg.free_bytes, "reserved past free", seg=segment_id)
            on = {o for o, obj in self._objects.items() if segment_id in obj.replicas}
            invariant(self._on_segment[segment_id] == on, "segment index drifted", seg=segment_id)
        invariant(set(self._on_segment) == set(self._segments), "segment index has stale segments")
        recounting = set(self._recounts)
        for object_id, obj in self._objects.items():
            # None readable only while waiting for a recount (its last segment went down): LOST then.
            invariant(obj.replicas or object_id in recounting, "an object without replicas", obj=object_id)
            invariant(obj.replicas <= set(self._segments), "replicas drifted", obj=object_id)
            healthy = self._healthy_now(obj)
            invariant(obj.copy is None or healthy < obj.target, "copy past the target", object_id=object_id)
            invariant(obj.copy is None or obj.healthy == healthy, "a copy's object recount", obj=object_id)
            # Stale only while waiting for a recount (a drain flag changed under it).
            invariant(
                obj.healthy == healthy or object_id in recounting, "healthy count drifted", obj=object_id
            )
            invariant(
                (object_id in self._below) == (obj.healthy < obj.target), "below set drifted", obj=object_id
            )
        stuck = sum(1 for o in self._below if self._objects[o].stuck)
        oversize = sum(1 for o in self._below if self._objects[o].size_bytes > cfg.burst_bytes)
        invariant((self._stuck_below, self._oversize_below) == (stuck, oversize), "gauges drifted")
        # Planning sees every object below target that can start: a current ready entry, or a
        # waiting one at its retry time (it backs off).
        ready = {
            e[4]
            for e in (*self._ready, *self._deferred)
            if e[4] in self._objects and self._current(self._objects[e[4]], e)
        }
        waiting = {(e[3], e[0]) for e in self._waiting}
        # (An object waiting for a recount is queued again by it: a segment down changed the
        # order key of its entry, its readable replicas.)
        for object_id in self._below - recounting:
            obj = self._objects[object_id]
            if obj.copy is None and obj.size_bytes <= cfg.burst_bytes and object_id not in ready:
                invariant(
                    (object_id, obj.retry_at_ms) in waiting,
                    "an object below target is in no planning queue",
                    object_id=object_id,
                )
