"""Each queue policy (SIEVE, S3-FIFO, W-TinyLFU) and LRU-2 against a plain model of its paper's
algorithm: with every victim accepted (no prefixes, leases or pools), random inserts, hits and
evictions give the same victims in the same order. The rules the core adds (tails before heads,
refusals, quotas) are checked by the machines in test_eviction_machine.py, over every policy."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric.core.eviction import EvictBatch, EvictionConfig, EvictionCore
from kvfabric.core.eviction_order import ObjectId, VictimOrder
from kvfabric.core.eviction_ranking import LRU2_SINGLE_ACCESS_MS
from kvfabric.core.eviction_s3fifo import GHOST_FLOOR, GHOST_SHARE, PROMOTE_HITS, SMALL_SHARE, S3Fifo
from kvfabric.core.eviction_sieve import Sieve
from kvfabric.core.eviction_sketch import SKETCH_WIDTH, FrequencySketch
from kvfabric.core.eviction_wtinylfu import (
    PROTECTED_SHARE,
    SAMPLE_FLOOR,
    SAMPLE_PER_OBJECT,
    WINDOW_SHARE,
    WTinyLfu,
)

# ("insert", new id), ("hit", pick among resident), ("evict", -): evict exactly one object.
OPS = st.lists(
    st.tuples(st.sampled_from(["insert", "insert", "hit", "hit", "evict"]), st.integers(0, 10_000)),
    max_size=300,
)


class SieveModel:
    """NSDI'24 SIEVE, as in the paper's pseudocode: a list, oldest first, and a hand index."""

    def __init__(self) -> None:
        self.queue: list[int] = []
        self.visited: dict[int, bool] = {}
        self.hand: int | None = None

    def insert(self, object_id: int) -> None:
        self.queue.append(object_id)
        self.visited[object_id] = False

    def hit(self, object_id: int) -> None:
        self.visited[object_id] = True

    def evict(self) -> int:
        i = self.hand if self.hand is not None else 0
        while self.visited[self.queue[i]]:
            self.visited[self.queue[i]] = False
            i = i + 1 if i + 1 < len(self.queue) else 0
        victim = self.queue.pop(i)
        del self.visited[victim]
        self.hand = i if i < len(self.queue) else None
        return victim


class S3FifoModel:
    """SOSP'23 S3-FIFO with libCacheSim's parameters, on plain lists (oldest first)."""

    def __init__(self) -> None:
        self.small: list[int] = []
        self.main: list[int] = []
        self.ghost: list[int] = []
        self.freq: dict[int, int] = {}

    def insert(self, object_id: int) -> None:
        self.freq[object_id] = 0
        if object_id in self.ghost:
            self.ghost.remove(object_id)
            self.main.append(object_id)
        else:
            self.small.append(object_id)

    def hit(self, object_id: int) -> None:
        self.freq[object_id] = min(self.freq[object_id] + 1, 3)

    def evict(self) -> int:
        while True:
            total = len(self.small) + len(self.main)
            if self.small and (not self.main or len(self.small) >= SMALL_SHARE * total):
                victim = self.small.pop(0)
                if self.freq[victim] >= PROMOTE_HITS:
                    self.freq[victim] = 0
                    self.main.append(victim)
                    continue
                del self.freq[victim]
                self.ghost.append(victim)
                while len(self.ghost) > int(GHOST_SHARE * len(self.freq)) + GHOST_FLOOR:
                    self.ghost.pop(0)
                return victim
            victim = self.main.pop(0)
            if self.freq[victim] > 0:
                self.freq[victim] -= 1
                self.main.append(victim)
                continue
            del self.freq[victim]
            return victim


class WTinyLfuModel:
    """W-TinyLFU as Caffeine shapes it, on plain lists (least recent first), with its own sketch."""

    def __init__(self) -> None:
        self.window: list[int] = []
        self.probation: list[int] = []
        self.protected: list[int] = []
        self.sketch = FrequencySketch()

    def count(self, object_id: int) -> None:
        resident = len(self.window) + len(self.probation) + len(self.protected)
        self.sketch.add(object_id, max(SAMPLE_FLOOR, SAMPLE_PER_OBJECT * resident))

    def insert(self, object_id: int) -> None:
        self.count(object_id)
        self.window.append(object_id)

    def hit(self, object_id: int) -> None:
        self.count(object_id)
        for segment in (self.window, self.protected):
            if object_id in segment:
                segment.remove(object_id)
                segment.append(object_id)
                return
        self.probation.remove(object_id)
        self.protected.append(object_id)
        main = len(self.probation) + len(self.protected)
        while len(self.protected) > PROTECTED_SHARE * main and len(self.protected) > 1:
            self.probation.append(self.protected.pop(0))

    def evict(self) -> int:
        while True:
            total = len(self.window) + len(self.probation) + len(self.protected)
            main = self.probation or self.protected
            if self.window and (len(self.window) > WINDOW_SHARE * total or not main):
                candidate = self.window.pop(0)
                if not main:
                    self.probation.append(candidate)
                    continue
                if self.sketch.estimate(candidate) <= self.sketch.estimate(main[0]):
                    return candidate
                self.probation.append(candidate)
            return main.pop(0)


def _replay(
    order: VictimOrder, model: SieveModel | S3FifoModel | WTinyLfuModel, ops: list[tuple[str, int]]
) -> None:
    resident: list[ObjectId] = []
    next_id = 0
    for op, pick in ops:
        if op == "insert":
            order.inserted(next_id, 1)
            model.insert(next_id)
            resident.append(next_id)
            next_id += 1
        elif op == "hit" and resident:
            object_id = resident[pick % len(resident)]
            order.accessed(object_id)
            model.hit(int(str(object_id)))
        elif op == "evict" and resident:
            chosen: list[ObjectId] = []

            def take(object_id: ObjectId, chosen: list[ObjectId] = chosen) -> tuple[int, None]:
                chosen.append(object_id)
                return 1, None

            order.choose(take, 1, 1)
            assert chosen == [model.evict()]
            resident.remove(chosen[0])
        order.check(dict.fromkeys(resident, 1))


@settings(max_examples=150, deadline=None)
@given(ops=OPS)
def test_sieve_evicts_as_the_paper_does(ops: list[tuple[str, int]]) -> None:
    _replay(Sieve(), SieveModel(), ops)


@settings(max_examples=150, deadline=None)
@given(ops=OPS)
def test_s3fifo_evicts_as_the_paper_does(ops: list[tuple[str, int]]) -> None:
    _replay(S3Fifo(), S3FifoModel(), ops)


@settings(max_examples=150, deadline=None)
@given(ops=OPS)
def test_wtinylfu_evicts_as_the_paper_does(ops: list[tuple[str, int]]) -> None:
    _replay(WTinyLfu(), WTinyLfuModel(), ops)


@settings(max_examples=100, deadline=None)
@given(ops=OPS, capacity=st.integers(1, 12))
def test_lru2_evicts_the_oldest_second_to_last_access(ops: list[tuple[str, int]], capacity: int) -> None:
    """LRU-K, K = 2, through the core (one pool, no prefixes): the victim is the object whose
    second-to-last access is oldest, objects seen once first; a removed object's last access is
    remembered when it comes back."""
    core = EvictionCore(EvictionConfig(policy="lru2", high_watermark=1.0, low_watermark=1.0, batch_max=100))
    core.set_capacity("p", capacity)
    last: dict[int, int] = {}
    previous: dict[int, int | None] = {}
    history: dict[int, int] = {}
    for now, (op, pick) in enumerate(ops):
        if op == "insert":
            object_id = pick % 40  # ids come back after eviction
            if object_id in last:
                continue
            core.insert(object_id, tenant="t", pool="p", size=1, parent=None, chunk_index=0, now_ms=now)
            previous[object_id] = history.pop(object_id, None)
            last[object_id] = now
        elif op == "hit" and last:
            object_id = sorted(last)[pick % len(last)]
            core.access(object_id, now)
            previous[object_id], last[object_id] = last[object_id], now
        expected: list[int] = []
        while len(last) - len(expected) > capacity:
            rank: dict[int, int] = {}
            for o in last:
                if o not in expected:
                    before = previous[o]
                    rank[o] = before if before is not None else last[o] - LRU2_SINGLE_ACCESS_MS
            expected.append(min(rank, key=lambda o: rank[o]))
        effects = core.tick(now)
        victims = [v for e in effects if isinstance(e, EvictBatch) for v in e.victims]
        assert victims == expected
        for victim in expected:
            core.removed(victim)
            history[victim] = last.pop(victim)
            del previous[victim]
        core.check_invariants()


def test_the_sketch_rows_index_independently() -> None:
    """Regression: row 0 used `h ^ h` (always cell 0) and the others multiples of `h`, so ids
    65536 apart shared every counter."""
    sketch = FrequencySketch()
    assert len({sketch.cells(i)[0] for i in range(1000)}) > 900  # row 0 spreads the keys
    for key in range(0, 50):
        twin = key + SKETCH_WIDTH
        assert sketch.cells(key) != sketch.cells(twin)
    for _ in range(5):
        sketch.add(7, halve_every=1 << 20)
    assert sketch.estimate(7) == 5 and sketch.estimate(7 + SKETCH_WIDTH) == 0


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["insert", "insert", "hit", "remove"]), st.integers(0, 10_000)),
        max_size=200,
    ),
    capacity=st.integers(1, 12),
)
def test_lru_ranks_an_id_that_came_back_by_its_new_life(ops: list[tuple[str, int]], capacity: int) -> None:
    """LRU through the core with objects also removed outside eviction (invalidated, or moved:
    the policy shell removes and inserts a group again when its tier changes) and ids coming
    back: the victim is always the least recently used resident. An id inserted again once
    carried its previous life's heap entries as live (a per-record version restarting at 1)."""
    core = EvictionCore(EvictionConfig(policy="lru", high_watermark=1.0, low_watermark=1.0, batch_max=100))
    core.set_capacity("p", capacity)
    last: dict[int, int] = {}
    for now, (op, pick) in enumerate(ops):
        if op == "insert":
            object_id = pick % 20  # ids come back
            if object_id in last:
                continue
            core.insert(object_id, tenant="t", pool="p", size=1, parent=None, chunk_index=0, now_ms=now)
            last[object_id] = now
        elif op == "hit" and last:
            object_id = sorted(last)[pick % len(last)]
            core.access(object_id, now)
            last[object_id] = now
        elif op == "remove" and last:
            object_id = sorted(last)[pick % len(last)]
            core.removed(object_id)
            del last[object_id]
        expected = sorted(last, key=lambda o: last[o])[: max(0, len(last) - capacity)]
        effects = core.tick(now)
        victims = [v for e in effects if isinstance(e, EvictBatch) for v in e.victims]
        assert victims == expected
        for victim in expected:
            core.removed(victim)
            del last[victim]
        core.check_invariants()
