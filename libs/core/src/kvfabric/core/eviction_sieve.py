"""SIEVE as a victim order (`kvfabric.core.eviction_order`): Zhang, Yang, Yue, Vigfusson,
Rashmi, "SIEVE is Simpler than LRU: an Efficient Turn-Key Eviction Algorithm for Web Caches",
NSDI 2024.

One FIFO queue, newest at the head, and a *hand*. A new object enters at the head, not
visited; a hit sets its visited bit (nothing moves). To evict, the hand walks from where it
stopped toward the head (wrapping to the tail): a visited object has its bit cleared and stays
where it is; the first unvisited one goes, and the hand stops at the next newer object.

Adaptations to `EvictionCore` (module docstring of `eviction_order`):
- An object `take` refuses (a prefix head whose tail is resident, a refused object cooling
  down, another pool's object) is passed over like a visited one, but keeps its bit.
- A victim's parent that just became a leaf and is not visited goes at once (prefix chains).
- A chosen object the directory refused comes back at the head, visited (it is being read).

Bounds: per object one visited flag and two links (three dict entries); `choose` walks at most
`SCAN_ROUNDS` times around the queue (the first round clears every bit, so a second round finds
an unvisited object if `take` accepts any), then stops.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from kvfabric.core.eviction_order import ObjectId, Take
from kvfabric.format.invariant import invariant

__all__ = ["Sieve"]

SCAN_ROUNDS: Final = 2  # full turns of the hand per `choose`, at most


class Sieve:
    """See the module docstring."""

    def __init__(self) -> None:
        self._visited: dict[ObjectId, bool] = {}
        self._size: dict[ObjectId, int] = {}
        self._newer: dict[ObjectId, ObjectId | None] = {}  # toward the head
        self._older: dict[ObjectId, ObjectId | None] = {}  # toward the tail
        self._head: ObjectId | None = None  # newest
        self._tail: ObjectId | None = None  # oldest
        self._hand: ObjectId | None = None  # next object the hand examines (None: the tail)

    def __len__(self) -> int:
        return len(self._visited)

    # ---- events ----------------------------------------------------------------------------

    def inserted(self, object_id: ObjectId, size: int) -> None:
        self._link(object_id, size, visited=False)

    def accessed(self, object_id: ObjectId) -> None:
        if object_id in self._visited:
            self._visited[object_id] = True

    def forgotten(self, object_id: ObjectId) -> None:
        if object_id in self._visited:
            self._unlink(object_id)

    def returned(self, object_id: ObjectId, size: int) -> None:
        self._link(object_id, size, visited=True)

    def resized(self, object_id: ObjectId, size: int) -> None:
        if object_id in self._size:
            self._size[object_id] = size

    def choose(self, take: Take, needed: int, max_victims: int) -> None:
        freed = taken = 0
        steps_left = SCAN_ROUNDS * len(self._visited) + 1
        current = self._hand if self._hand is not None else self._tail
        while current is not None and freed < needed and taken < max_victims and steps_left > 0:
            steps_left -= 1
            following = self._newer[current]
            if following is None:
                following = self._tail  # wrap around
            if self._visited[current]:
                self._visited[current] = False
                current = following
                continue
            got = take(current)
            if got is None:
                current = following  # cannot go now: passed over, bit kept
                continue
            self._hand = following if following != current else None
            self._unlink(current)
            freed += got[0]
            taken += 1
            parent = got[1]
            while parent is not None and freed < needed and taken < max_victims:
                if parent not in self._visited or self._visited[parent]:
                    break
                got = take(parent)
                if got is None:
                    break
                self._unlink(parent)
                freed += got[0]
                taken += 1
                parent = got[1]
            current = self._hand if self._hand is not None else self._tail

    # ---- internals -------------------------------------------------------------------------

    def _link(self, object_id: ObjectId, size: int, *, visited: bool) -> None:
        invariant(object_id not in self._visited, "sieve: object already queued", object_id=object_id)
        self._visited[object_id] = visited
        self._size[object_id] = size
        self._newer[object_id] = None
        self._older[object_id] = self._head
        if self._head is not None:
            self._newer[self._head] = object_id
        self._head = object_id
        if self._tail is None:
            self._tail = object_id

    def _unlink(self, object_id: ObjectId) -> None:
        newer = self._newer.pop(object_id)
        older = self._older.pop(object_id)
        del self._visited[object_id]
        del self._size[object_id]
        if self._hand == object_id:
            self._hand = newer
        if newer is not None:
            self._older[newer] = older
        else:
            self._head = older
        if older is not None:
            self._newer[older] = newer
        else:
            self._tail = newer

    def check(self, resident: Mapping[ObjectId, int]) -> None:
        invariant(self._size == dict(resident), "sieve: queued objects differ from resident ones")
        seen: list[ObjectId] = []
        current = self._tail
        while current is not None:
            seen.append(current)
            invariant(len(seen) <= len(self._visited), "sieve: the queue has a cycle")
            newer = self._newer[current]
            invariant(newer is None or self._older[newer] == current, "sieve: links disagree")
            current = newer
        invariant(len(seen) == len(self._visited) and set(seen) == set(self._visited), "sieve: lost links")
        invariant(self._hand is None or self._hand in self._visited, "sieve: hand off the queue")
        invariant(set(self._newer) == set(self._older) == set(self._visited), "sieve: per-object maps differ")
