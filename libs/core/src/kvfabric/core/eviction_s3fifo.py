"""S3-FIFO as a victim order (`kvfabric.core.eviction_order`): Yang, Zhang, Qiu, Yue, Rashmi,
"FIFO queues are all you need for cache eviction", SOSP 2023; parameters as in libCacheSim's
`S3FIFO.c` (small queue 10 %, ghost 90 %, move to main at 2 hits).

Three FIFO queues: *small* S (new objects), *main* M, and *ghost* G (ids only). Each resident
object has a hit counter capped at `FREQ_MAX`.
- A new object enters S, unless its id is in G (it was evicted from S and asked for again):
  then it enters M. Its counter starts at 0.
- A hit increments the counter (nothing moves).
- To evict: if S holds at least `SMALL_SHARE` of the bytes (or M is empty), look at S's oldest:
  with `PROMOTE_HITS` or more hits it moves to M's head, counter reset; else it goes and its id
  enters G. Otherwise look at M's oldest: with hits left it goes back to M's head with one hit
  less (a 2-bit CLOCK); with none it goes.

Adaptations to `EvictionCore` (module docstring of `eviction_order`):
- Sizes are bytes: S's share is of the bytes S and M hold (the simulator's size is 1 a block,
  so it is the paper's count).
- An object `take` refuses goes back to its queue's head with its counter (another round).
- A victim's parent that just became a leaf goes at once if it is in S below `PROMOTE_HITS`
  hits, or in M with no hits left (prefix chains).
- A chosen object the directory refused comes back at M's head.

Bounds: per object its size, queue and counter (two dict entries); G holds at most
`GHOST_SHARE` x the objects resident at its last insertion, plus `GHOST_FLOOR` ids; `choose` examines at most
`SCAN_STEPS_PER_OBJECT` x the resident objects (+1) queue heads, then stops.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Final

from kvfabric.core.eviction_order import ObjectId, Take
from kvfabric.format.invariant import invariant

__all__ = ["S3Fifo"]

SMALL_SHARE: Final = 0.10  # of the resident bytes, in S
GHOST_SHARE: Final = 0.90  # ghost ids, per resident object
GHOST_FLOOR: Final = 64  # ghost ids kept however few objects are resident
PROMOTE_HITS: Final = 2  # hits in S that move an object to M
FREQ_MAX: Final = 3  # the counter's cap (2 bits)
SCAN_STEPS_PER_OBJECT: Final = FREQ_MAX + 2  # enough to drain every counter and rotate once


class S3Fifo:
    """See the module docstring."""

    def __init__(self) -> None:
        self._small: OrderedDict[ObjectId, int] = OrderedDict()  # id -> size, oldest first
        self._main: OrderedDict[ObjectId, int] = OrderedDict()
        self._ghost: OrderedDict[ObjectId, None] = OrderedDict()
        self._freq: dict[ObjectId, int] = {}
        self._small_bytes = 0
        self._main_bytes = 0
        self._ghost_bound = GHOST_FLOOR  # at the last ghost insertion

    def __len__(self) -> int:
        return len(self._freq)

    def ghost_ids(self) -> int:
        return len(self._ghost)

    # ---- events ----------------------------------------------------------------------------

    def inserted(self, object_id: ObjectId, size: int) -> None:
        invariant(object_id not in self._freq, "s3fifo: object already queued", object_id=object_id)
        self._freq[object_id] = 0
        if object_id in self._ghost:  # evicted from S, asked for again: straight to M
            del self._ghost[object_id]
            self._to_main(object_id, size)
        else:
            self._small[object_id] = size
            self._small_bytes += size

    def accessed(self, object_id: ObjectId) -> None:
        freq = self._freq.get(object_id)
        if freq is not None:
            self._freq[object_id] = min(freq + 1, FREQ_MAX)

    def forgotten(self, object_id: ObjectId) -> None:
        if object_id in self._freq:
            self._drop(object_id)

    def returned(self, object_id: ObjectId, size: int) -> None:
        invariant(object_id not in self._freq, "s3fifo: returned object still queued", object_id=object_id)
        self._ghost.pop(object_id, None)
        self._freq[object_id] = 0
        self._to_main(object_id, size)

    def resized(self, object_id: ObjectId, size: int) -> None:
        for queue in (self._small, self._main):
            old = queue.get(object_id)
            if old is not None:
                queue[object_id] = size
                if queue is self._small:
                    self._small_bytes += size - old
                else:
                    self._main_bytes += size - old

    def choose(self, take: Take, needed: int, max_victims: int) -> None:
        freed = taken = 0
        steps_left = SCAN_STEPS_PER_OBJECT * len(self._freq) + 1
        # Objects `take` refused in this call, per queue: a queue whose every object was refused
        # is skipped (else a small queue of prefix heads, whose tails were promoted, would spin).
        refused: dict[bool, set[ObjectId]] = {True: set(), False: set()}  # from_small -> ids
        while freed < needed and taken < max_victims and steps_left > 0:
            steps_left -= 1
            small_open = len(self._small) > len(refused[True])
            main_open = len(self._main) > len(refused[False])
            if not (small_open or main_open):
                break
            total = self._small_bytes + self._main_bytes
            from_small = small_open and (not main_open or self._small_bytes >= SMALL_SHARE * total)
            queue = self._small if from_small else self._main
            object_id, size = next(iter(queue.items()))
            freq = self._freq[object_id]
            if from_small and freq >= PROMOTE_HITS:
                self._drop(object_id)
                self._freq[object_id] = 0
                self._to_main(object_id, size)
                continue
            if not from_small and freq > 0:
                self._freq[object_id] = freq - 1
                queue.move_to_end(object_id)
                continue
            got = take(object_id)
            if got is None:
                queue.move_to_end(object_id)  # cannot go now: another round, counter kept
                refused[from_small].add(object_id)
                continue
            self._evict(object_id, from_small)
            freed += got[0]
            taken += 1
            parent = got[1]
            while parent is not None and freed < needed and taken < max_victims and self._cold(parent):
                in_small = parent in self._small
                got = take(parent)
                if got is None:
                    break
                self._evict(parent, in_small)
                refused[in_small].discard(parent)
                freed += got[0]
                taken += 1
                parent = got[1]

    # ---- internals -------------------------------------------------------------------------

    def _cold(self, object_id: ObjectId) -> bool:
        freq = self._freq.get(object_id)
        if freq is None:
            return False
        return freq < PROMOTE_HITS if object_id in self._small else freq == 0

    def _to_main(self, object_id: ObjectId, size: int) -> None:
        self._main[object_id] = size
        self._main_bytes += size

    def _drop(self, object_id: ObjectId) -> None:
        del self._freq[object_id]
        size = self._small.pop(object_id, None)
        if size is not None:
            self._small_bytes -= size
        else:
            self._main_bytes -= self._main.pop(object_id)

    def _evict(self, object_id: ObjectId, from_small: bool) -> None:
        self._drop(object_id)
        if from_small:
            self._ghost[object_id] = None
            self._ghost.move_to_end(object_id)
            self._ghost_bound = int(GHOST_SHARE * len(self._freq)) + GHOST_FLOOR
            while len(self._ghost) > self._ghost_bound:
                self._ghost.popitem(last=False)

    def check(self, resident: Mapping[ObjectId, int]) -> None:
        queued = {**self._small, **self._main}
        invariant(len(queued) == len(self._small) + len(self._main), "s3fifo: object in both queues")
        invariant(queued == dict(resident), "s3fifo: queued objects differ from resident ones")
        invariant(set(self._freq) == set(queued), "s3fifo: counters differ from queues")
        invariant(all(0 <= f <= FREQ_MAX for f in self._freq.values()), "s3fifo: counter out of range")
        invariant(self._small_bytes == sum(self._small.values()), "s3fifo: small bytes drifted")
        invariant(self._main_bytes == sum(self._main.values()), "s3fifo: main bytes drifted")
        invariant(len(self._ghost) <= self._ghost_bound, "s3fifo: ghost over its bound")
        invariant(not self._ghost.keys() & queued.keys(), "s3fifo: a resident object is a ghost")
