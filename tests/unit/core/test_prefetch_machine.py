"""The prefetch core against a simple model, over random interleavings (Hypothesis).

Random orders of: new hints (some identical to earlier ones under a fresh id, some retried under
their own id), floods of hints, cancels, ticks, copy results (ok or failed), reads (which make
objects hot), cold extra replicas evicted, replicas removed, segment snapshots.

The model knows where every object has a replica (initial ones, plus each PublishReplica, minus
each removal), which copies are in flight (each StartCopy until its answer) and which hint ids
may still be live: accepted or deduplicated, not cancelled, and the latest deadline sent for
their key not yet passed at the last tick. That is a superset of the core's live hints, so:
- a StartCopy is for an object not already on its target, with no copy of it to that target in
  flight (so identical hints never copy twice), from a segment holding it, and (unless extra)
  wanted by a possibly live hint; in-flight bytes and copies never exceed their bounds;
- each copy_finished is answered by exactly one PublishReplica (only when ok; not extra only if a
  possibly live hint wants it: a copy of a cancelled hint is released) or ReleaseCopy;
- Busy only when the model's upper bounds say the queue could be full (all tenants' or this
  tenant's share); the core's queues never exceed their maxima, whatever the flood; extra
  replicas stay within their budget.
Every example ends fault-free: cancel every hint, answer every copy, tick past every deadline;
then nothing is queued or in flight and every StartCopy got its answer.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvfabric.core.prefetch import (
    Accepted,
    Busy,
    Deduped,
    Hint,
    HintObject,
    PrefetchConfig,
    PrefetchCore,
    PublishReplica,
    Refused,
    ReleaseCopy,
    StartCopy,
)

SIZE = {"o0": 1, "o1": 2, "o2": 3, "o3": 4, "o4": 5, "o5": 3}
TARGETS = ("t0", "t1")
SEGMENTS_FREE = {"s0": 50, "s1": 50, "s2": 50, "t0": 20, "t1": 20}
CONFIG = PrefetchConfig(
    hints_queued_max=4,
    objects_queued_max=8,
    hints_queued_per_tenant_max=3,  # each tenant's share, under the maxima: both can be full
    objects_queued_per_tenant_max=6,
    bytes_in_flight_max=8,
    copies_in_flight_max=3,
    copy_attempts_max=2,
    copy_retry_backoff_ms=10,
    hot_window_ms=100,
    hot_reads_per_s=30.0,  # 3 reads in one window
    cold_reads_per_s=10.0,
    hot_extra_replicas_max=2,
    hot_extra_bytes_max=6,
    hot_tracked_max=3,
)

HintSpec = tuple[str, str, list[str], int]  # tenant, target, objects (head first), deadline offset
hint_specs = st.tuples(
    st.sampled_from(("a", "b")),
    st.sampled_from(TARGETS),
    st.lists(st.sampled_from(sorted(SIZE)), min_size=1, max_size=4, unique=True),
    st.sampled_from((1, 30, 100, 400, 2_000)),
)
HintKey = tuple[str, str, frozenset[str]]


def key_of(hint: Hint) -> HintKey:
    return (hint.tenant, hint.target, frozenset(str(o.object_id) for o in hint.objects))


class PrefetchMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.core = PrefetchCore(CONFIG, SEGMENTS_FREE)
        self.now = 0
        self.last_tick = 0
        self.next_id = 0
        self.replicas: dict[str, set[str]] = {o: {f"s{i % 3}"} for i, o in enumerate(sorted(SIZE))}
        self.replicas["o0"].add("s1")
        self.sent: dict[str, Hint] = {}  # every hint sent, by id (retries resend it as is)
        self.live_ids: set[str] = set()  # accepted or deduplicated, not cancelled
        self.key_deadline: dict[HintKey, int] = {}  # latest deadline accepted for the key
        self.in_flight: dict[int, StartCopy] = {}
        self.extras: dict[str, str] = {}  # stored extra replicas: object -> segment
        self.started = 0
        self.answered = 0

    # ---- the model -------------------------------------------------------------------------

    def possibly_live(self) -> list[str]:
        return [i for i in self.live_ids if self.key_deadline[key_of(self.sent[i])] > self.last_tick]

    def wanted(self, object_id: str, target: str) -> bool:
        return any(
            self.sent[i].target == target and object_id in {o.object_id for o in self.sent[i].objects}
            for i in self.possibly_live()
        )

    def objects_queued_bound(self, tenant: str | None = None) -> int:
        keys = {key_of(self.sent[i]) for i in self.possibly_live()}
        return sum(
            len([o for o in objs if target not in self.replicas[o]])
            for who, target, objs in keys
            if tenant in (None, who)
        )

    def check_start(self, effect: object) -> None:
        assert isinstance(effect, StartCopy)
        o, t = str(effect.object_id), effect.target
        assert t not in self.replicas[o], "copy of an object already on its target"
        assert all((c.object_id, c.target) != (o, t) for c in self.in_flight.values()), "two copies at once"
        assert effect.source in self.replicas[o] and effect.size_bytes == SIZE[o]
        if effect.extra:
            assert o not in self.extras and t in SEGMENTS_FREE
        else:
            assert self.wanted(o, t), "copy for a hint that is no longer live"
        self.in_flight[effect.copy_id] = effect
        self.started += 1
        assert sum(c.size_bytes for c in self.in_flight.values()) <= CONFIG.bytes_in_flight_max
        assert len(self.in_flight) <= CONFIG.copies_in_flight_max
        extras = [c for c in self.in_flight.values() if c.extra]
        assert len(self.extras) + len(extras) <= CONFIG.hot_extra_replicas_max
        assert (
            sum(SIZE[o] for o in self.extras) + sum(c.size_bytes for c in extras)
            <= CONFIG.hot_extra_bytes_max
        )

    def send(self, hint: Hint) -> None:
        todo = [o for o in hint.objects if hint.target not in self.replicas[str(o.object_id)]]
        ids_bound, objects_bound = len(self.possibly_live()), self.objects_queued_bound()
        tenant_ids_bound = len([i for i in self.possibly_live() if self.sent[i].tenant == hint.tenant])
        tenant_objects_bound = self.objects_queued_bound(hint.tenant)
        result = self.core.add_hint(hint, self.now)
        self.sent[hint.hint_id] = hint
        if isinstance(result, Busy):
            if result.reason == "hints_full":
                assert ids_bound >= CONFIG.hints_queued_max, "busy with room for hint ids"
            elif result.reason == "tenant_hints_full":
                assert tenant_ids_bound >= CONFIG.tenant_hints_max, "busy with room for the tenant's ids"
            elif result.reason == "objects_full":
                assert objects_bound + len(todo) > CONFIG.objects_queued_max, "busy with room for objects"
            else:
                assert tenant_objects_bound + len(todo) > CONFIG.tenant_objects_max, "busy with room"
        elif isinstance(result, Refused):
            assert result.reason == "no_source" and any(not o.replicas for o in hint.objects)
        elif isinstance(result, Deduped) or (isinstance(result, Accepted) and result.objects_queued):
            assert isinstance(result, Deduped) or result.objects_queued == len(todo)
            self.live_ids.add(hint.hint_id)
            key = key_of(hint)
            self.key_deadline[key] = max(self.key_deadline.get(key, 0), hint.deadline_ms)
        else:
            assert result == Accepted(hint.hint_id, 0) and not todo

    def make_hint(self, spec: HintSpec) -> Hint:
        tenant, target, objects, offset = spec
        self.next_id += 1
        parts = tuple(HintObject(o, SIZE[o], tuple(sorted(self.replicas[o]))) for o in objects)
        return Hint(f"h{self.next_id}", tenant, target, parts, self.now + offset)

    # ---- rules -----------------------------------------------------------------------------

    @rule(spec=hint_specs)
    def add_hint(self, spec: HintSpec) -> None:
        self.send(self.make_hint(spec))

    def current(self, hint: Hint, hint_id: str, deadline_ms: int) -> Hint:
        """`hint` as its scheduler would send it now: same prefix, today's view of the replicas."""
        parts = tuple(
            HintObject(o.object_id, o.size_bytes, tuple(sorted(self.replicas[str(o.object_id)])))
            for o in hint.objects
        )
        return Hint(hint_id, hint.tenant, hint.target, parts, deadline_ms)

    @precondition(lambda self: bool(self.sent))
    @rule(pick=st.integers(0, 1000), offset=st.sampled_from((0, 50)))
    def duplicate_hint(self, pick: int, offset: int) -> None:
        """The same tenant, target and objects under a fresh id (another request, same prefix)."""
        old = self.sent[sorted(self.sent)[pick % len(self.sent)]]
        self.next_id += 1
        self.send(self.current(old, f"h{self.next_id}", max(old.deadline_ms, self.now + offset + 1)))

    @precondition(lambda self: bool(self.sent))
    @rule(pick=st.integers(0, 1000))
    def retry_hint(self, pick: int) -> None:
        """A hint sent again under its own id (a redelivered or retried message)."""
        hint = self.sent[sorted(self.sent)[pick % len(self.sent)]]
        if hint.deadline_ms > self.now:
            self.send(self.current(hint, hint.hint_id, hint.deadline_ms))

    @rule(specs=st.lists(hint_specs, min_size=4, max_size=10))
    def flood(self, specs: list[HintSpec]) -> None:
        for spec in specs:
            self.send(self.make_hint(spec))
            assert self.core.hint_ids_live <= CONFIG.hints_queued_max
            assert self.core.objects_queued <= CONFIG.objects_queued_max

    @precondition(lambda self: bool(self.sent))
    @rule(pick=st.integers(0, 1000))
    def cancel_hint(self, pick: int) -> None:
        ids = sorted(self.live_ids) if pick % 4 else sorted(self.sent)  # mostly one that may be live
        hint_id = ids[pick % len(ids)] if ids else "unknown"
        # mostly naming the tenant; without it (an older sender) the id is unambiguous here
        tenant = self.sent[hint_id].tenant if hint_id in self.sent and pick % 3 else None
        if self.core.cancel_hint(hint_id, tenant):
            assert hint_id in self.live_ids
        self.live_ids.discard(hint_id)

    @rule(step=st.sampled_from((0, 1, 10, 50, 200)))
    def tick(self, step: int) -> None:
        self.now += step
        self.last_tick = self.now
        for effect in self.core.tick(self.now):
            self.check_start(effect)

    @rule(
        step=st.sampled_from((1, 10, 50)), outcomes=st.lists(st.sampled_from((True, True, False)), max_size=3)
    )
    def tick_and_answer(self, step: int, outcomes: list[bool]) -> None:
        """Copies run: time passes, some of those in flight end (oldest first)."""
        self.tick(step)
        for ok in outcomes:
            if self.in_flight:
                self.copy_finished(0, ok)

    @precondition(lambda self: bool(self.in_flight))
    @rule(pick=st.integers(0, 1000), ok=st.sampled_from((True, True, False)))
    def copy_finished(self, pick: int, ok: bool) -> None:
        copy = self.in_flight.pop(sorted(self.in_flight)[pick % len(self.in_flight)])
        o = str(copy.object_id)
        (answer,) = self.core.copy_finished(copy.copy_id, ok, self.now)
        assert answer.copy_id == copy.copy_id and (answer.object_id, answer.target) == (o, copy.target)
        self.answered += 1
        if isinstance(answer, PublishReplica):
            assert ok, "published a failed copy"
            assert answer.extra or self.wanted(o, copy.target), "published a copy nobody wants"
            assert not answer.extra or copy.extra
            self.replicas[o].add(copy.target)
            if answer.extra:
                self.extras[o] = copy.target
            self.core.replica_added(o, copy.target)  # the directory event that follows: harmless
        else:
            assert isinstance(answer, ReleaseCopy)
            assert ok or answer.reason in ("failed", "unwanted")
            assert answer.reason != "failed" or not ok

    @rule(obj=st.sampled_from(sorted(SIZE)), times=st.integers(1, 4))
    def read(self, obj: str, times: int) -> None:
        holders = sorted(self.replicas[obj])
        if holders:
            for _ in range(times):
                self.core.read(
                    obj, size_bytes=SIZE[obj], served_from=holders[0], replicas=holders, now_ms=self.now
                )

    @rule()
    def evict_cold_extras(self) -> None:
        for cold in self.core.cold_extra_replicas(self.now):
            o = str(cold.object_id)
            assert self.extras.get(o) == cold.segment and cold.reads_per_s < CONFIG.cold_reads_per_s
            del self.extras[o]
            self.replicas[o].discard(cold.segment)
            self.core.replica_removed(o, cold.segment)

    @rule(obj=st.sampled_from(sorted(SIZE)), segment=st.sampled_from(sorted(SEGMENTS_FREE)))
    def remove_replica(self, obj: str, segment: str) -> None:
        if segment in self.replicas[obj] and len(self.replicas[obj]) > 1:  # the last stays: no refusals
            self.replicas[obj].discard(segment)
            if self.extras.get(obj) == segment:
                del self.extras[obj]
            self.core.replica_removed(obj, segment)

    @rule(free=st.lists(st.integers(0, 60), min_size=len(SEGMENTS_FREE), max_size=len(SEGMENTS_FREE)))
    def segments_report(self, free: list[int]) -> None:
        self.core.set_segments(dict(zip(sorted(SEGMENTS_FREE), free, strict=True)))

    @invariant()
    def consistent(self) -> None:
        self.core.check_invariants()
        assert self.core.copies_in_flight == len(self.in_flight)
        assert self.core.bytes_in_flight == sum(c.size_bytes for c in self.in_flight.values())
        assert self.core.hint_ids_live <= len(self.possibly_live())
        assert self.core.objects_queued <= self.objects_queued_bound()
        assert self.core.extra_replicas() == self.extras

    def teardown(self) -> None:
        # Fault-free end: every request finishes, every copy is answered, time passes.
        for hint_id in sorted(self.live_ids):
            self.core.cancel_hint(hint_id, self.sent[hint_id].tenant)
        self.live_ids.clear()
        assert (self.core.hint_ids_live, self.core.objects_queued) == (0, 0)
        for _ in range(20):
            while self.in_flight:
                self.copy_finished(0, True)
            self.now += 1_000
            self.last_tick = self.now
            effects = self.core.tick(self.now)
            for effect in effects:
                assert isinstance(effect, StartCopy) and effect.extra, "a copy for a cancelled hint"
                self.check_start(effect)
            if not effects:
                break
        assert not self.in_flight and self.started == self.answered, "a StartCopy never answered"
        assert (self.core.copies_in_flight, self.core.bytes_in_flight) == (0, 0)
        assert all(self.core.want_state(o, t) is None for o in SIZE for t in SEGMENTS_FREE)
        self.core.check_invariants()


PrefetchMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=60, deadline=None)
TestPrefetchMachine = PrefetchMachine.TestCase
