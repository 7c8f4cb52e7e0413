"""Hypothesis state machine for the repair core against a simple model of the cluster.

Random segments (restarts, kills, drains, reports), objects (publish, re-sync, corrupt replicas,
evictions), copy results (ok, failed, late, duplicate) and ticks. After every step: the core's
invariants, and against the model: every copy planned is within the in-flight cap, the bandwidth
budget over every window, the replica target and the destination's room, goes to the widest
failure domain with room and reads from a non-draining replica when one exists; a copy result
is accepted exactly when the model still wants that copy, and every copy the model stops
wanting without its result (dropped, or timed out) is cancelled once, by the next tick. Teardown
is a fault-free phase with room everywhere: every object with a replica left converges to its
target (or to every eligible segment) and every drain completes.

`TestDeferredRecountMachine` runs the same machine with one recount per event or tick
(`recounts_per_step=1`, FIFO deduplicated at every chance): a drain flag change or a segment
down leaves most of its objects' counts stale for later ticks, and every check above still
holds (the counts and the below-target set are compared for the objects not waiting for a
recount; an object lost with a segment is counted once recounted; drains complete only once
none is), except that the queues as kept are compared with queues rebuilt from scratch only
while no object a segment down left waits for its recount (its old entry is stale: rebuilt
queues plan it at once, the kept ones once recounted)."""

from __future__ import annotations

import copy
import dataclasses

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvfabric.core.repair import CancelCopy, DrainComplete, Effect, RepairConfig, RepairCore, StartCopy

DOMAINS = {  # segment -> (zone, rack, host): several segments share a zone, a rack or a host
    "s0": ("z0", "r0", "h0"),
    "s1": ("z0", "r0", "h0"),
    "s2": ("z0", "r1", "h1"),
    "s3": ("z1", "r0", "h2"),
    "s4": ("z1", "r0", "h3"),
    "s5": ("z2", "r0", "h4"),
}
SEGMENTS = sorted(DOMAINS)
OBJECTS = range(8)
CONFIG = RepairConfig(
    bandwidth_bytes_per_s=50,
    burst_bytes=40,
    copies_in_flight_max=3,
    copy_timeout_ms=500,
    attempts_max=2,
    retry_backoff_ms=10,
    retry_backoff_max_ms=40,
    stuck_retry_ms=1_000,
)
ROOMY = 10_000


def level(segment: str, others: list[str]) -> int:
    """3: a zone none of `others` is in; 2: a new rack; 1: a new host; 0: only a new segment."""
    zone, rack, host = DOMAINS[segment]
    domains = [DOMAINS[o] for o in others]
    if all(d[0] != zone for d in domains):
        return 3
    if all(d[:2] != (zone, rack) for d in domains):
        return 2
    return 1 if all(d != (zone, rack, host) for d in domains) else 0


class RepairMachine(RuleBasedStateMachine):
    recounts_per_step: int | None = None  # None: the default (every object here at once)

    def __init__(self) -> None:
        super().__init__()
        if self.recounts_per_step is None:
            self.core = RepairCore(CONFIG)
        else:
            self.core = RepairCore(dataclasses.replace(CONFIG, recounts_per_step=self.recounts_per_step))
            self.core.recount_slack = 0
        self.now = 0
        self.incarnation = dict.fromkeys(SEGMENTS, 0)
        self.free: dict[str, int] = {}  # up segments -> free bytes as the core should see them
        self.draining: set[str] = set()
        self.drain_reported: set[str] = set()
        self.objects: dict[int, tuple[int, int]] = {}  # id -> (size, target)
        self.replicas: dict[int, set[str]] = {}
        self.live: dict[int, StartCopy] = {}  # copies the model still wants
        self.dropped: dict[int, StartCopy] = {}  # no longer wanted without a result: to cancel
        self.started_ms: dict[int, int] = {}
        self.unreported: set[int] = set()  # copy ids the shell owes a result for
        self.reported: set[int] = set()
        self.starts: list[tuple[int, int]] = []  # (now, bytes) of every copy started
        self.lost = 0
        # Objects that had a replica on a segment gone, their recount pending: the ready entry
        # each had went stale (its order key changed) and the recount queues it again, where
        # queues rebuilt from scratch plan it at once; the twin comparison waits for them.
        self.down_pending: set[int] = set()

    # ---- the model's view ------------------------------------------------------------------

    def healthy(self, object_id: int) -> list[str]:
        return [s for s in self.replicas[object_id] if s not in self.draining]

    def room(self, segment: str) -> int:
        reserved = sum(c.size_bytes for c in self.live.values() if c.destination == segment)
        return self.free[segment] - reserved

    def prune(self) -> None:
        """Drop objects without a readable replica (lost) and copies the model no longer wants."""
        for object_id in [o for o, r in self.replicas.items() if not r]:
            del self.objects[object_id], self.replicas[object_id]
            self.lost += 1
        for copy_id, c in list(self.live.items()):
            o = c.object_id
            assert isinstance(o, int)
            if (
                o not in self.objects
                or c.source not in self.replicas[o]
                or c.destination not in self.free
                or c.destination in self.draining
                or c.destination in self.replicas[o]
                or len(self.healthy(o)) + 1 > self.objects[o][1]
            ):
                self.dropped[copy_id] = self.live.pop(copy_id)

    def down(self, segment: str) -> None:
        self.down_pending |= {o for o, r in self.replicas.items() if segment in r and segment in self.free}
        self.free.pop(segment, None)
        self.draining.discard(segment)
        self.drain_reported.discard(segment)
        for replicas in self.replicas.values():
            replicas.discard(segment)
        self.prune()

    def check_start(self, c: StartCopy) -> None:
        o = c.object_id
        assert isinstance(o, int) and o in self.objects
        size, target = self.objects[o]
        assert len(self.live) < CONFIG.copies_in_flight_max, "past the in-flight cap"
        assert all(x.object_id != o for x in self.live.values()), "two copies of one object"
        healthy = self.healthy(o)
        assert len(healthy) + 1 <= target, "a copy past the replica target"
        assert c.size_bytes == size and c.source in self.replicas[o]
        assert c.source not in self.draining or not healthy, "read a draining replica needlessly"
        assert c.destination in self.free and c.destination not in self.draining
        assert c.destination not in self.replicas[o] and self.room(c.destination) >= size
        fitting = [
            s
            for s in self.free
            if s not in self.draining and s not in self.replicas[o] and self.room(s) >= size
        ]
        best = max(level(s, healthy) for s in fitting)
        assert level(c.destination, healthy) == best, "not the widest failure domain with room"
        self.live[c.copy_id] = c
        self.started_ms[c.copy_id] = self.now
        self.unreported.add(c.copy_id)
        self.starts.append((self.now, c.size_bytes))

    def check_cancel(self, c: CancelCopy) -> None:
        dropped = self.dropped.pop(c.copy_id, None)
        assert dropped is not None, "cancelled a copy still wanted, or twice"
        assert c.object_id == dropped.object_id

    def check_drain(self, d: DrainComplete) -> None:
        s = d.segment_id
        assert s in self.draining and s not in self.drain_reported, "drain reported twice"
        assert all(s not in (c.source, c.destination) for c in self.live.values())
        for o, replicas in self.replicas.items():
            if s in replicas:
                assert len(self.healthy(o)) >= self.objects[o][1], "drained while still needed"
        self.drain_reported.add(s)

    def check_budget(self) -> None:
        """Bytes started in every window [t_i, t_j] fit the burst plus the refill over it."""
        for i, (t0, _) in enumerate(self.starts):
            total = 0
            for t1, size in self.starts[i:]:
                total += size
                assert total * 1000 <= CONFIG.burst_bytes * 1000 + CONFIG.bandwidth_bytes_per_s * (t1 - t0)

    def apply(self, effects: list[Effect]) -> None:
        for effect in effects:
            if isinstance(effect, StartCopy):
                self.check_start(effect)
            elif isinstance(effect, CancelCopy):
                self.check_cancel(effect)
            else:
                self.check_drain(effect)
        assert not self.dropped, "a copy dropped was never cancelled"
        self.check_budget()

    # ---- rules -----------------------------------------------------------------------------

    @initialize(
        free=st.lists(st.sampled_from([15, 60, ROOMY]), min_size=len(SEGMENTS), max_size=len(SEGMENTS)),
        rebuild_often=st.booleans(),
    )
    def cluster(self, free: list[int], rebuild_often: bool) -> None:
        if rebuild_often:  # the core's own rebuilds too (its slack, 1024, is never reached here)
            self.core.queue_slack = 0
        for segment, segment_free in zip(SEGMENTS, free, strict=True):
            self.segment_up(segment, segment_free, restart=False)

    @rule(
        segment=st.sampled_from(SEGMENTS),
        free=st.sampled_from([0, 15, 60, ROOMY]),
        action=st.sampled_from(["report", "report", "report", "restart", "down"]),
    )
    def segment_event(self, segment: str, free: int, action: str) -> None:
        if action == "down":
            self.core.segment_down(segment)
            self.down(segment)
        else:
            self.segment_up(segment, free, restart=action == "restart")

    def segment_up(self, segment: str, free: int, restart: bool) -> None:
        if restart or segment not in self.free:
            self.incarnation[segment] += 1
            self.down(segment)
        zone, rack, host = DOMAINS[segment]
        self.core.segment_up(
            segment, incarnation=self.incarnation[segment], zone=zone, rack=rack, host=host, free_bytes=free
        )
        self.free[segment] = free
        self.prune()

    @rule()
    def scan_complete(self) -> None:
        """The shell's listing ended: every object this machine told the core of is known."""
        self.core.scan_complete()

    @rule(segment=st.sampled_from(SEGMENTS), draining=st.booleans())
    def segment_draining(self, segment: str, draining: bool) -> None:
        self.core.segment_draining(segment, draining)
        if segment in self.free and draining != (segment in self.draining):
            self.draining ^= {segment}
            self.drain_reported.discard(segment)
        self.prune()

    @rule(
        object_id=st.sampled_from(OBJECTS),
        size=st.integers(1, CONFIG.burst_bytes),
        replica_target=st.integers(1, 3),
        hot=st.integers(0, 2),
        picks=st.sets(st.integers(0, 100), min_size=1, max_size=3),
        anywhere=st.integers(0, 9),
    )
    def object_known(
        self, object_id: int, size: int, replica_target: int, hot: int, picks: set[int], anywhere: int
    ) -> None:
        # Mostly on segments that are up; sometimes on any (a replica on a segment down is ignored).
        pool = sorted(self.free) if self.free and anywhere else SEGMENTS
        segments = {pool[i % len(pool)] for i in picks}
        self.core.object_known(
            object_id, size_bytes=size, replica_target=replica_target, segments=segments, hot=hot
        )
        if object_id not in self.objects and not segments & set(self.free):
            return  # nothing readable and not tracked: not tracked now, no loss (counted once)
        self.objects[object_id] = (size, replica_target)
        self.replicas[object_id] = segments & set(self.free)
        self.prune()

    @precondition(lambda self: bool(self.objects))
    @rule(pick=st.integers(0, 1000))
    def resync_unchanged(self, pick: int) -> None:
        """The scan's re-sync of an object whose view did not change: a comparison only, which
        plans what re-applying the view did (a twin recounting the object; with no recount
        pending, when the old early recount could not differ)."""
        object_id = sorted(self.objects)[pick % len(self.objects)]
        size, target = self.objects[object_id]
        hot = self.core._objects[object_id].hot
        segments = sorted(self.replicas[object_id])
        before = self.core.counters.get("objects_known_unchanged_total", 0)
        # (with entries deferred, the twin's new entry is looked at before the round robin
        # reaches the deferred one: an order, not a plan, that differs)
        twin = copy.deepcopy(self.core) if not self.core._recounts and not self.core._deferred else None
        self.core.object_known(object_id, size_bytes=size, replica_target=target, segments=segments, hot=hot)
        assert self.core.counters["objects_known_unchanged_total"] == before + 1
        if twin is not None:
            twin._refresh(object_id)
            assert twin.tick(self.now) == copy.deepcopy(self.core).tick(self.now)

    @rule(pick=st.integers(0, 1000), corrupt=st.booleans())
    def replica_lost(self, pick: int, corrupt: bool) -> None:
        pairs = sorted((o, s) for o, r in self.replicas.items() for s in r)
        if pairs:
            object_id, segment = pairs[pick % len(pairs)]
            self.core.replica_lost(object_id, segment, corrupt=corrupt)
            self.replicas[object_id].discard(segment)
            self.prune()

    @rule(object_id=st.sampled_from(OBJECTS))
    def object_removed(self, object_id: int) -> None:
        self.core.object_removed(object_id)
        self.objects.pop(object_id, None)
        self.replicas.pop(object_id, None)
        self.prune()

    @precondition(lambda self: bool(self.unreported))
    @rule(pick=st.integers(0, 1000), ok=st.booleans())
    def copy_result(self, pick: int, ok: bool) -> None:
        self.report(sorted(self.unreported)[pick % len(self.unreported)], ok)

    def report(self, copy_id: int, ok: bool) -> None:
        self.unreported.discard(copy_id)
        self.reported.add(copy_id)
        c = self.live.pop(copy_id, None)
        if not ok:
            self.core.copy_failed(copy_id, self.now, source_failed=copy_id % 2 == 0)
            return
        assert self.core.copy_ok(copy_id) == (c is not None), "accepted a stale copy or refused a live one"
        if c is not None:
            assert isinstance(c.object_id, int)
            self.replicas[c.object_id].add(c.destination)
            self.free[c.destination] = max(0, self.free[c.destination] - c.size_bytes)
            self.prune()

    @precondition(lambda self: bool(self.reported))
    @rule(pick=st.integers(0, 1000))
    def duplicate_result(self, pick: int) -> None:
        assert self.core.copy_ok(sorted(self.reported)[pick % len(self.reported)]) is False

    @rule(step_ms=st.sampled_from([0, 1, 50, 400, 2_000]))
    def tick(self, step_ms: int) -> None:
        self.tick_for(step_ms)

    def tick_for(self, step_ms: int) -> list[Effect]:
        self.now += step_ms
        for copy_id in [i for i in self.live if self.now - self.started_ms[i] >= CONFIG.copy_timeout_ms]:
            self.dropped[copy_id] = self.live.pop(copy_id)  # timed out: a failed attempt
        # The queues kept as objects change plan what sorting every object below target plans
        # (a twin with both queues rebuilt from scratch: the order before they were kept).
        self.down_pending &= set(self.core._recounts)
        twin = copy.deepcopy(self.core)
        twin._rebuild_queues()
        expected = twin.tick(self.now)
        # (Objects deferred for want of a destination come back round robin, not in order: the
        # order then differs from sorting, never what may start; `check_start` checks each.)
        deferred = bool(self.core._deferred)
        effects = self.core.tick(self.now)
        if not self.down_pending and not deferred:
            assert effects == expected
            assert self.core.counters == twin.counters and self.core.gauges() == twin.gauges()
        self.apply(effects)
        return effects

    @invariant()
    def consistent(self) -> None:
        self.core.check_invariants()
        # Lost with a segment, waiting for its recount: kept without a replica until then.
        lost_pending = {o for o in OBJECTS if o in self.core and not self.core.replicas(o)}
        assert lost_pending <= set(self.core._recounts)
        assert {o for o in OBJECTS if o in self.core} - lost_pending == set(self.objects)
        for object_id, replicas in self.replicas.items():
            assert self.core.replicas(object_id) == replicas
        gauges = self.core.gauges()
        assert gauges["copies_in_flight"] == len(self.live)
        below = {o for o in self.objects if len(self.healthy(o)) < self.objects[o][1]}
        recounting = set(self.core._recounts)
        assert {o for o in self.objects if o in self.core._below} - recounting == below - recounting
        if not recounting:
            assert gauges["objects_below_target"] == len(below)
        assert gauges["recounts_pending"] <= 2 * len(OBJECTS)  # deduplicated past 2 x the objects
        assert self.core.counters.get("objects_lost_total", 0) + len(lost_pending) == self.lost

    def teardown(self) -> None:
        # Fault-free phase with room everywhere: every copy succeeds, every object converges.
        for segment in list(self.free):
            self.segment_up(segment, ROOMY, restart=False)
        self.core.scan_complete()
        idle = 0
        for _ in range(100):  # each tick is past any backoff: two idle ticks in a row mean settled
            effects = self.tick_for(CONFIG.stuck_retry_ms)
            for copy_id in sorted(self.live):
                self.report(copy_id, ok=True)
            idle = 0 if effects or self.core.gauges()["recounts_pending"] else idle + 1
            if idle == 2:
                break
        assert idle == 2, "repair did not settle"
        eligible = [s for s in self.free if s not in self.draining]
        for object_id, (_, target) in self.objects.items():
            assert len(self.healthy(object_id)) >= min(target, len(eligible)), "did not converge"
        if all(len(eligible) >= target for _, target in self.objects.values()):
            assert self.drain_reported == self.draining, "a drain never completed"
        self.core.check_invariants()


RepairMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
TestRepairMachine = RepairMachine.TestCase


class DeferredRecountMachine(RepairMachine):
    recounts_per_step = 1


DeferredRecountMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
TestDeferredRecountMachine = DeferredRecountMachine.TestCase
