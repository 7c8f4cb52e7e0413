"""The interface between `EvictionCore` and a queue-based victim order (SIEVE, S3-FIFO, W-TinyLFU).

`EvictionCore` owns everything the directory cares about (objects, pools, tenants, leases and
refusals, prefix order, watermarks and quotas); a *victim order* owns only the policy's queues
and decides in which order resident objects are offered as victims. Heap policies (`lru`,
`gdsf`, `lru2`) stay inside the core; this interface is for policies whose state is queues,
hands and ghosts rather than one priority per object.

Synchronous and I/O-free; no time: these policies order by events, not clocks.

## What the core tells the order (each object is in the order exactly while it is resident and
## not chosen)
- `inserted(id, size)`: a new resident object (never one the order holds).
- `accessed(id)`: a hit on a resident object (ignored for one the order does not hold: chosen).
- `forgotten(id)`: a resident, not chosen object is gone (freed elsewhere, its pool lost).
- `returned(id, size)`: a chosen object the directory refused (leased, pinned): resident again.
- `resized(id, size)`: a resident object lost the bytes of a dropped pool.
- `choose(take, needed, max_victims)`: offer victims to `take`, in the policy's order, until
  `needed` bytes are taken, `max_victims` objects are, or the policy's scan bound is reached.

## `take(id) -> (freed bytes, parent that just became a leaf or None) | None`
The core's callback. `None`: the object cannot go now (it still has a resident tail, it cools
down after a refusal, it is not in the pressed pool or belongs to a protected tenant); the order
keeps it and moves on as the policy treats a survivor (documented per policy). Otherwise the
object is now EVICTING: the order drops it from its queues (ghosts may remember it) and never
offers it again unless it is `returned`.

## Prefix chains
A prefix's head is inserted before its tail, so a FIFO-like walk meets the head first, while it
still has a tail, and must skip it. When `take` reports that a victim's parent just became a
leaf, the order offers the parent at once if the policy would evict it were it at the eviction
point now (SIEVE: not visited; S3-FIFO: in the small queue below the promotion threshold, or in
the main queue with no credit left; W-TinyLFU: not protected and no more frequent than the
victim). A cold prefix then goes tail to head in one batch, as the heap policies do.

## Invariants (`check(resident)`, in tests after every step)
1. The order holds exactly the resident, not chosen objects, each once, with its size.
2. Its byte and entry counters match its queues.
3. Bounded: ghosts hold at most as many ids as named in each policy (a share of the resident
   objects, plus a floor); per-object state is a few small fields.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Protocol, TypeAlias

__all__ = ["ObjectId", "Take", "VictimOrder"]

ObjectId: TypeAlias = Hashable
Take: TypeAlias = Callable[[ObjectId], "tuple[int, ObjectId | None] | None"]


class VictimOrder(Protocol):
    def __len__(self) -> int: ...

    def inserted(self, object_id: ObjectId, size: int) -> None: ...

    def accessed(self, object_id: ObjectId) -> None: ...

    def forgotten(self, object_id: ObjectId) -> None: ...

    def returned(self, object_id: ObjectId, size: int) -> None: ...

    def resized(self, object_id: ObjectId, size: int) -> None: ...

    def choose(self, take: Take, needed: int, max_victims: int) -> None: ...

    def check(self, resident: Mapping[ObjectId, int]) -> None: ...
