"""How each policy of the eviction core ranks leaves (`kvfabric.core.eviction`): the heap
policies' priorities, density's per-class heaps, the frontier that predicted admission compares
against, the reason code of a victim, and `explain`.

`LeafRanking` is a mixin of `EvictionCore`: it reads the core's objects and writes only the
ranking state (the heap, the class heaps, an object's entry version); the core keeps the
accounting and the rules (leaves only, cooldowns, guaranteed shares, watermarks, lru2's history,
the GDSF clock's rise) and calls `_push` whenever an object's rank may have changed or it
became a leaf again. To choose victims the core asks `_offer` for leaves in the policy's order
and decides itself which to pass over and what taking one means (`EvictionCore._evict`).

## Policies
Heap policies (a priority per leaf; lower goes first):
- `lru`: last access time.
- `gdsf`: GreedyDual-Size-Frequency: `clock + frequency x cost / size`, where `cost` is the
  recompute cost of the chunk, growing with its position in the prompt (attention over a longer
  prefix costs more): `tokens x (1 + position_weight x chunk_index)`. `clock` rises to the
  priority of each victim, so old popularity ages out.
- `lru2`: LRU-K with K = 2 (O'Neil, O'Neil, Weikum, "The LRU-K Page Replacement Algorithm for
  Database Disk Buffering", SIGMOD 1993): the time of the second-to-last access; an object seen
  once ranks `LRU2_SINGLE_ACCESS_MS` before its only access, so one-off objects go first, least
  recent first. Retained information: the last access of removed objects, at most as many as
  resident objects (`LRU2_HISTORY_FLOOR` at least), so an object asked for again remembers it.
  No correlated-reference period: the caller reports one access per request.
Queue policies (`kvfabric.core.eviction_order`: the order offers victims, the core keeps every
rule): `sieve` (`eviction_sieve`), `s3fifo` (`eviction_s3fifo`), `wtinylfu`
(`eviction_wtinylfu`), each with its paper and adaptations in its module.
- `reuse`: a reuse predictor learned online (`kvfabric.core.eviction_reuse`: classes, learning,
  bounds): last access + `reuse_horizon_ms` x ln(the chunk's class reuse rate).
- `density`: hit density learned from reuse gaps (`kvfabric.core.eviction_density`: classes,
  learning, bounds; after LHD, NSDI 2018): per class a heap of leaves by last access, the victim
  is the class head with the lowest density per byte at its age. Not a single-heap priority:
  a chunk's density depends on its age, so classes are compared at eviction time.

## Entries (one per object, re-keyed lazily)
An object has at most one current heap entry (`Tracked.version` names it; 0: none). A rank
change keeps it when the rank rises (a hit under lru, lru2, gdsf, density: the usual case), only
recording the new key `(priority, rank_seq)` on the object; the entry is re-keyed when it reaches
a heap's head (`_settle`). A rank that falls (reuse's learned rate, a size growing under gdsf)
or a density class that changes pushes a new entry, and the old one goes stale. So a heap's
settled head is the least key of all, as if every change had pushed (an entry's key is never
above its object's), and hits push nothing: every hit used to push, and compaction (an O(n)
scan) ran inside one call every ~3n hits (143 ms at 100,000 objects; review, stop 69). Stale
entries (removed objects', fallen ranks', changed classes') still count towards the bound that
compacts. What a hit no longer does is left to the next settle of its entry: a pass (`tick`) or
a frontier (predicted admission) after many hits re-keys the entries that reach the head, one
heap step each (as the eager heap popped as many stale entries there); counted
`entries_settled_total`, not bounded per call.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any, Final

from kvfabric.core.eviction_density import DensityClass, DensityPredictor
from kvfabric.core.eviction_model import EvictionConfig, ObjectId, Tracked
from kvfabric.core.eviction_order import VictimOrder
from kvfabric.core.eviction_reuse import (
    REUSE_PRIOR_NAMED,
    REUSE_PRIOR_REUSED,
    ReuseClass,
    ReusePredictor,
    reuse_class,
)

__all__ = [
    "HEAP_ENTRIES_PER_OBJECT",
    "HEAP_ENTRIES_SLACK",
    "LRU2_HISTORY_FLOOR",
    "LRU2_SINGLE_ACCESS_MS",
    "LeafRanking",
]

LRU2_SINGLE_ACCESS_MS: Final = 1 << 50  # an object seen once ranks this long before its access
LRU2_HISTORY_FLOOR: Final = 1024  # removed objects' last accesses kept, at least
# The heap (density's class heaps together) is compacted past this many entries an object, plus
# the slack: stale entries (a removed object's, a fallen rank's) go, so it stays within a multiple
# of them.
HEAP_ENTRIES_PER_OBJECT: Final = 4
HEAP_ENTRIES_SLACK: Final = 1024

# A heap entry: (priority, or last access for density's class heaps; rank seq; version; id): its
# key is the first two, the object's key when pushed or last re-keyed (`_settle`)
HeapEntry = tuple[float, int, int, ObjectId]


class LeafRanking:
    """The ranking half of `EvictionCore` (see the module docstring)."""

    # The core's, read here
    config: EvictionConfig
    _objects: dict[ObjectId, Tracked]
    _now_ms: int
    _order: VictimOrder | None
    _predictor: ReusePredictor | None
    _density: DensityPredictor | None
    # The ranking's own
    _heap: list[HeapEntry]  # leaves by priority (heap policies), stale entries skipped
    _seq: int  # push and rank-change sequence: ties of priority go in rank-change order
    _clock: float  # GDSF inflation
    _class_heaps: dict[DensityClass, list[HeapEntry]]
    _class_entries: int
    counters: dict[str, int]

    def reuse_classes(self) -> dict[ReuseClass, tuple[float, float]]:
        """The reuse predictor's learned (reused, named) counts per class; empty for other policies."""
        return self._predictor.classes() if self._predictor is not None else {}

    def explain(self, object_id: ObjectId) -> dict[str, Any] | None:
        """Why `object_id` ranks where it does (what `kvctl` can show): None if not resident."""
        obj = self._objects.get(object_id)
        if obj is None:
            return None
        out: dict[str, Any] = {
            "policy": self.config.policy,
            "tenant": obj.tenant,
            "bytes": obj.size,
            "last_access_ms": obj.last_access_ms,
            "accesses": obj.frequency,
            "chunk_index": obj.chunk_index,
            "leaf": obj.children == obj.children_evicting,
            "evicting": obj.evicting,
        }
        if self._density is not None:
            out.update(
                prompt_chunks=obj.prompt_chunks,
                density_class=obj.density_class,
                hit_density_per_byte_ms=self._density_score(obj, self._now_ms),
            )
        elif self._order is None:
            out["priority"] = obj.priority  # as ranked (its entry is re-keyed to it when it heads the heap)
        if self._predictor is not None:
            cls = self._reuse_class(obj)
            out.update(
                turn=obj.turn,
                prompt_chunks=obj.prompt_chunks,
                reuse_class=cls,
                reuse_probability=self._predictor.probability(cls),
            )
        return out

    def _evictable(self, obj: Tracked) -> bool:
        """`obj` may be taken now: not already chosen, and (prefix order) no child stays."""
        return not obj.evicting and not (self.config.prefix_order and obj.children > obj.children_evicting)

    def _settle(self, heap: list[HeapEntry]) -> Tracked | None:
        """The evictable leaf whose entry heads `heap` once the head is settled, None when the
        heap runs out: stale entries are dropped, an entry behind its object's key is re-keyed
        (replaced at the key), and an object that may not go now (a child stays, or chosen
        already) loses its entry (version 0: `_push` queues it again when it may go). Each entry
        settled so is counted (`entries_settled_total`): the work hits and removals left to it."""
        settled = 0
        try:
            while heap:
                entry = heap[0]
                obj = self._objects.get(entry[3])
                settled += 1
                if obj is None or obj.version != entry[2]:
                    heapq.heappop(heap)  # stale: its object gone, or a newer entry of it pushed
                elif entry[0] != obj.priority or entry[1] != obj.rank_seq:
                    heapq.heapreplace(heap, (obj.priority, obj.rank_seq, entry[2], entry[3]))
                elif not self._evictable(obj):
                    heapq.heappop(heap)
                    obj.version = 0
                else:
                    settled -= 1  # (the head itself: current)
                    return obj
            return None
        finally:
            if settled:
                self.counters["entries_settled_total"] = (
                    self.counters.get("entries_settled_total", 0) + settled
                )

    def _frontier(self) -> float | None:
        """The lowest priority of an evictable leaf (any pool), settling the heap's head on the
        way (as `_evict` would); None when there is none."""
        return None if self._settle(self._heap) is None else self._heap[0][0]

    def _density_score(self, obj: Tracked, now_ms: int) -> float:
        """density: expected hits per byte-ms of `obj` at its age (lower goes first)."""
        assert self._density is not None
        return self._density.density(obj.density_class, now_ms - obj.last_access_ms) / obj.size

    def _density_lowest(self, now_ms: int) -> tuple[float, DensityClass] | None:
        """density: the evictable leaf with the lowest density per byte, as (density, class)
        (its entry heads that class's heap; ties: least recent first, then the lower class: the
        heaps' dict order followed their compaction history), settling each head on the way;
        None when there is none. O(classes) plus the entries settled."""
        best: tuple[float, float, DensityClass] | None = None
        for cls, heap in self._class_heaps.items():
            obj = self._settle(heap)
            if obj is None:
                continue
            candidate = (self._density_score(obj, now_ms), heap[0][0], cls)
            if best is None or candidate < best:
                best = candidate
        return None if best is None else (best[0], best[2])

    def _density_frontier(self, now_ms: int) -> float | None:
        lowest = self._density_lowest(now_ms)
        return None if lowest is None else lowest[0]

    def _reuse_class(self, obj: Tracked) -> ReuseClass:
        return reuse_class(
            obj.frequency, obj.turn, obj.prompt_chunks, obj.chunk_index == obj.prompt_chunks - 1
        )

    def _victim_reason(self, obj: Tracked) -> str:
        policy = self.config.policy
        if policy == "lru":
            return "least_recent"
        if policy == "lru2":
            return "seen_once" if obj.previous_access_ms is None else "least_recent_second_access"
        if policy == "gdsf":
            return "lowest_gdsf"
        if policy == "density":
            return "lowest_hit_density"
        if self._predictor is not None:
            p = self._predictor.probability(self._reuse_class(obj))
            return "low_predicted_reuse" if p < REUSE_PRIOR_REUSED / REUSE_PRIOR_NAMED else "idle_longest"
        return "queue_order"

    def _priority(self, obj: Tracked) -> float:
        if self.config.policy == "lru":
            return float(obj.last_access_ms)
        if self._predictor is not None:
            log_p = self._predictor.log_probability(self._reuse_class(obj))
            return obj.last_access_ms + self.config.reuse_horizon_ms * log_p
        if self.config.policy == "lru2":
            if obj.previous_access_ms is None:
                return float(obj.last_access_ms - LRU2_SINGLE_ACCESS_MS)
            return float(obj.previous_access_ms)
        cost = self.config.tokens_per_chunk * (1.0 + self.config.position_weight * obj.chunk_index)
        return self._clock + obj.frequency * cost / obj.size

    def _push(self, object_id: ObjectId, obj: Tracked) -> None:
        """`obj`'s rank may have changed, or it may be a leaf again: its key is recorded, and a
        new entry pushed unless its current one is at or below the key (module docstring). A
        density class change must zero `version` first (the entry is in the old class's heap)."""
        if self._order is not None:
            return  # a queue policy keeps its own order
        priority = float(obj.last_access_ms) if self._density is not None else self._priority(obj)
        # Sequence numbers are unique over the core's life, and a version is one: an id removed
        # and inserted again (a republish, a demoted group's move) starts a new record, and its
        # old entries, still in the heap, must never match it (a per-record count restarting at
        # 1 did: the record was then ranked by its previous life's priority).
        self._seq += 1
        risen = obj.version != 0 and priority >= obj.priority
        obj.priority, obj.rank_seq = priority, self._seq
        if risen:
            return  # its entry, below the new key, is re-keyed when it heads the heap
        obj.version = self._seq
        entry = (priority, self._seq, self._seq, object_id)
        if self._density is not None:
            heapq.heappush(self._class_heaps.setdefault(obj.density_class, []), entry)
            self._class_entries += 1  # pops are not counted: an upper bound, reset by _compact
            if self._class_entries > HEAP_ENTRIES_PER_OBJECT * len(self._objects) + HEAP_ENTRIES_SLACK:
                self._compact()
            return
        heapq.heappush(self._heap, entry)
        if len(self._heap) > HEAP_ENTRIES_PER_OBJECT * len(self._objects) + HEAP_ENTRIES_SLACK:
            # compacted on a push, not only in a pass: with no pool pressed, stale entries (of
            # removed objects) grew the heap without bound, and the next pass popped them all
            # (1.6 s at 850,000 entries when every hit pushed; review, stop 67)
            self._compact()

    def _offer(
        self,
        excess: int,
        now_ms: int,
        victims: list[ObjectId],
        *,
        skipped: Callable[[Tracked], bool],
        take: Callable[[ObjectId, Tracked], tuple[int, ObjectId | None]],
    ) -> tuple[int, int]:
        """Offer evictable leaves in the policy's order to `take` (which appends to `victims` and
        returns the bytes freed and a parent that became a leaf), passing over those `skipped`,
        until `excess` bytes are taken or `victims` holds `batch_max`: a heap policy pops its heap
        (skipped entries are pushed back), density its class heaps, a queue policy its order.
        Returns the bytes freed and the entries examined (popped or offered). For a heap policy,
        stopping short of both bounds means every leaf was offered: none left that may go
        (`EvictionCore._park`); a queue policy's scan also stops at its step bound."""
        freed = examined = 0
        if self._order is not None:
            tally = [0, 0]  # bytes freed, objects offered

            def offered(object_id: ObjectId) -> tuple[int, ObjectId | None] | None:
                tally[1] += 1
                obj = self._objects.get(object_id)
                if obj is None or not self._evictable(obj) or skipped(obj):
                    return None
                got = take(object_id, obj)
                tally[0] += got[0]
                return got

            self._order.choose(offered, excess, self.config.batch_max)
            freed, examined = tally
        elif self._density is not None:
            set_aside: list[tuple[DensityClass, HeapEntry]] = []
            while freed < excess and len(victims) < self.config.batch_max:
                lowest = self._density_lowest(now_ms)
                if lowest is None:
                    break
                cls = lowest[1]
                examined += 1
                entry = heapq.heappop(self._class_heaps[cls])  # settled by `_density_lowest`
                candidate = self._objects[entry[3]]
                if skipped(candidate):
                    set_aside.append((cls, entry))
                    continue
                candidate.version = 0  # its entry is gone: `_push` queues it again if it stays
                freed += take(entry[3], candidate)[0]
            for cls, entry in set_aside:  # a `take` may have compacted the heaps: its class gone
                heapq.heappush(self._class_heaps.setdefault(cls, []), entry)
                self._class_entries += 1
        else:
            passed: list[HeapEntry] = []
            while freed < excess and len(victims) < self.config.batch_max:
                obj = self._settle(self._heap)
                if obj is None:
                    break
                examined += 1
                entry = heapq.heappop(self._heap)
                if skipped(obj):
                    passed.append(entry)
                    continue
                obj.version = 0  # its entry is gone: `_push` queues it again if it stays
                freed += take(entry[3], obj)[0]
            for entry in passed:
                heapq.heappush(self._heap, entry)
            if len(self._heap) > HEAP_ENTRIES_PER_OBJECT * len(self._objects) + HEAP_ENTRIES_SLACK:
                self._compact()
        return freed, examined

    def _compact(self) -> None:
        """Drop stale heap entries (bounded memory: the heap stays within a multiple of objects)."""
        live = [e for e in self._heap if (o := self._objects.get(e[3])) is not None and o.version == e[2]]
        heapq.heapify(live)
        self._heap = live
        for cls, heap in list(self._class_heaps.items()):
            kept = [e for e in heap if (o := self._objects.get(e[3])) is not None and o.version == e[2]]
            heapq.heapify(kept)
            if kept:
                self._class_heaps[cls] = kept
            else:
                del self._class_heaps[cls]
        self._class_entries = sum(map(len, self._class_heaps.values()))
