"""W-TinyLFU as a victim order (`kvfabric.core.eviction_order`): Einziger, Friedman, Manes,
"TinyLFU: A Highly Efficient Cache Admission Policy", ACM Transactions on Storage 13(4), 2017;
the shape Caffeine ships (1 % window, segmented-LRU main with 80 % protected).

Three LRU segments: the *window* (new objects), and the main cache split into *probation* and
*protected*; a count-min sketch (`eviction_sketch.FrequencySketch`) counts every insert and
every hit of a resident object, and halves every `SAMPLE_PER_OBJECT` x resident objects
increments. Not the paper's every request: the core tells an order nothing of a miss
(`EvictionCore.seen` feeds only its admission filter and predictors), so a block asked for often
while not resident has no count when it is written again (found by a review, stop 68; the
figures in docs/eviction-policy.md are this variant's).
- A new object enters the window's most recent end; a hit moves it to its segment's most recent
  end, and from probation up to protected (protected over `PROTECTED_SHARE` of the main bytes
  demotes its least recent object to probation).
- To evict: while the window holds more than `WINDOW_SHARE` of the bytes, its least recent
  object (the *candidate*) leaves it and meets the main cache's *victim* (probation's least
  recent, else protected's): the one the sketch counts less often goes (a tie keeps the victim),
  the other stays in probation. With the window within its share, the victim goes.

Adaptations to `EvictionCore` (module docstring of `eviction_order`):
- Sizes are bytes: the shares are of bytes (the simulator's size is 1 a block).
- An object `take` refuses stays: a candidate moves to probation, a victim to its segment's
  most recent end.
- A victim's parent that just became a leaf goes at once if it is not protected and the sketch
  counts it no more often than the victim (prefix chains).
- A chosen object the directory refused comes back to probation's most recent end.
- No doorkeeper bloom filter and no random admission of warm candidates (Caffeine's defence
  against hash flooding): ids are digests the directory issues, not attacker-chosen keys.

Bounds: per object its size and segment (one dict entry in one segment); the sketch is fixed
(`SKETCH_DEPTH` x `SKETCH_WIDTH` counters); `choose` takes at most `SCAN_STEPS_PER_OBJECT` x the
resident objects (+1) steps, then stops.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Final

from kvfabric.core.eviction_order import ObjectId, Take
from kvfabric.core.eviction_sketch import FrequencySketch
from kvfabric.format.invariant import invariant

__all__ = ["WTinyLfu"]

WINDOW_SHARE: Final = 0.01  # of the resident bytes, in the window
PROTECTED_SHARE: Final = 0.80  # of the main cache's bytes, protected
SAMPLE_PER_OBJECT: Final = 10  # sketch increments between halvings, per resident object
SAMPLE_FLOOR: Final = 1 << 12  # ... and at least this many
SCAN_STEPS_PER_OBJECT: Final = 3  # window drain, then one rotation of every main object


class WTinyLfu:
    """See the module docstring."""

    def __init__(self) -> None:
        self._window: OrderedDict[ObjectId, int] = OrderedDict()  # id -> size, least recent first
        self._probation: OrderedDict[ObjectId, int] = OrderedDict()
        self._protected: OrderedDict[ObjectId, int] = OrderedDict()
        self._bytes = {"window": 0, "probation": 0, "protected": 0}
        self.sketch = FrequencySketch()

    def __len__(self) -> int:
        return len(self._window) + len(self._probation) + len(self._protected)

    # ---- events ----------------------------------------------------------------------------

    def inserted(self, object_id: ObjectId, size: int) -> None:
        invariant(self._segment(object_id) is None, "wtinylfu: object already queued", object_id=object_id)
        self._count(object_id)
        self._put("window", object_id, size)

    def accessed(self, object_id: ObjectId) -> None:
        segment = self._segment(object_id)
        if segment is None:
            return
        self._count(object_id)
        if segment == "probation":
            size = self._remove("probation", object_id)
            self._put("protected", object_id, size)
            main = self._bytes["probation"] + self._bytes["protected"]
            while self._bytes["protected"] > PROTECTED_SHARE * main and len(self._protected) > 1:
                demoted, demoted_size = next(iter(self._protected.items()))
                self._remove("protected", demoted)
                self._put("probation", demoted, demoted_size)
        else:
            self._queue(segment).move_to_end(object_id)

    def forgotten(self, object_id: ObjectId) -> None:
        segment = self._segment(object_id)
        if segment is not None:
            self._remove(segment, object_id)

    def returned(self, object_id: ObjectId, size: int) -> None:
        invariant(
            self._segment(object_id) is None, "wtinylfu: returned object still queued", object_id=object_id
        )
        self._put("probation", object_id, size)

    def resized(self, object_id: ObjectId, size: int) -> None:
        segment = self._segment(object_id)
        if segment is not None:
            queue = self._queue(segment)
            self._bytes[segment] += size - queue[object_id]
            queue[object_id] = size  # keeps its place

    def choose(self, take: Take, needed: int, max_victims: int) -> None:
        freed = taken = 0
        steps_left = SCAN_STEPS_PER_OBJECT * len(self) + 1
        # Objects `take` refused in this call, per main segment: a segment whose every object
        # was refused is skipped, then the window's candidates go without a duel.
        refused: dict[str, set[ObjectId]] = {"probation": set(), "protected": set()}
        while len(self) and freed < needed and taken < max_victims and steps_left > 0:
            steps_left -= 1
            total = sum(self._bytes.values())
            victim, victim_segment = self._main_victim(refused)
            candidate_size = 0
            if self._window and (self._bytes["window"] > WINDOW_SHARE * total or victim is None):
                candidate, candidate_size = next(iter(self._window.items()))
                self._remove("window", candidate)
                if victim is None and not (self._probation or self._protected):
                    self._put("probation", candidate, candidate_size)  # an empty main cache fills
                    continue
                if victim is not None and self.sketch.estimate(candidate) > self.sketch.estimate(victim):
                    self._put("probation", candidate, candidate_size)  # admitted to the main cache
                else:
                    victim, victim_segment = candidate, "window"  # the candidate loses
            if victim is None or victim_segment is None:
                break  # nothing left that may go
            got = take(victim)
            if got is None:
                if victim_segment == "window":
                    self._put("probation", victim, candidate_size)  # cannot go now: on probation
                else:
                    self._queue(victim_segment).move_to_end(victim)  # cannot go now: another round
                    refused[victim_segment].add(victim)
                continue
            if victim_segment != "window":
                self._remove(victim_segment, victim)
            freed += got[0]
            taken += 1
            last = victim
            parent = got[1]
            while parent is not None and freed < needed and taken < max_victims:
                segment = self._segment(parent)
                hotter = self.sketch.estimate(parent) > self.sketch.estimate(last)
                if segment is None or segment == "protected" or hotter:
                    break
                got = take(parent)
                if got is None:
                    break
                self._remove(segment, parent)
                if segment != "window":
                    refused[segment].discard(parent)
                freed += got[0]
                taken += 1
                last, parent = parent, got[1]

    # ---- internals -------------------------------------------------------------------------

    def _count(self, object_id: ObjectId) -> None:
        self.sketch.add(object_id, max(SAMPLE_FLOOR, SAMPLE_PER_OBJECT * len(self)))

    def _main_victim(self, refused: Mapping[str, set[ObjectId]]) -> tuple[ObjectId | None, str | None]:
        """Probation's least recent object, else protected's; a segment whose every object was
        refused in this `choose` is passed over."""
        for segment, queue in (("probation", self._probation), ("protected", self._protected)):
            if len(queue) > len(refused[segment]):
                return next(iter(queue)), segment
        return None, None

    def _segment(self, object_id: ObjectId) -> str | None:
        if object_id in self._window:
            return "window"
        if object_id in self._probation:
            return "probation"
        if object_id in self._protected:
            return "protected"
        return None

    def _queue(self, segment: str) -> OrderedDict[ObjectId, int]:
        return {"window": self._window, "probation": self._probation, "protected": self._protected}[segment]

    def _put(self, segment: str, object_id: ObjectId, size: int) -> None:
        self._queue(segment)[object_id] = size
        self._bytes[segment] += size

    def _remove(self, segment: str, object_id: ObjectId) -> int:
        size = self._queue(segment).pop(object_id)
        self._bytes[segment] -= size
        return size

    def check(self, resident: Mapping[ObjectId, int]) -> None:
        queued = {**self._window, **self._probation, **self._protected}
        invariant(len(queued) == len(self), "wtinylfu: object in two segments")
        invariant(queued == dict(resident), "wtinylfu: queued objects differ from resident ones")
        for segment in self._bytes:
            invariant(
                self._bytes[segment] == sum(self._queue(segment).values()),
                "wtinylfu: segment bytes drifted",
                segment=segment,
            )
