"""Reuse predictor for KV prefixes (issue 25, item 3): online, cheap, explainable.

It learns, while the cache runs, how often a chunk of each *reuse class* is named again by a
later request, and the eviction core (`policy="reuse"`) turns that into a priority and an
admission decision. Nothing is trained on a trace beforehand: every class starts at the prior
`REUSE_PRIOR_REUSED / REUSE_PRIOR_NAMED` and follows what the cache sees.

## Classes (features a KV cache has at `put` time)
A chunk's class is `(accesses, turn, length, last)`:
- `accesses`: requests that named it while resident (1 when written), capped at
  `REUSE_ACCESS_CLASSES`.
- `turn`: the prefix's generation. A chunk with no parent is turn 1; a chunk written after a
  parent that had been hit before (the request reused a prefix and extends it: a conversation's
  next turn, a shared system prompt's new user) is the parent's turn + 1; otherwise it inherits
  its parent's turn. Capped at `REUSE_TURN_CLASSES`.
- `length`: floor(log2(chunks of the prompt that wrote it)), capped at `REUSE_LENGTH_CLASSES - 1`
  (the writer knows the prompt's length; without it, the chunk's position + 1).
- `last`: 1 if it is the prompt's last full chunk (the one a longer next prompt may not share
  the same way), else 0.
At most `REUSE_ACCESS_CLASSES x REUSE_TURN_CLASSES x REUSE_LENGTH_CLASSES x 2` classes.

## Learning (labels without the future)
Every time a request names a chunk (`named`), the predictor first credits the class recorded
for it in its *ghost* (a bounded FIFO of recently named chunk ids -> class, resident or not):
that naming was a reuse. Then the caller records the chunk's current class (`track`): the
class's `named` count grows by one and the id goes (back) to the ghost's young end. An id
pushed out of the ghost was not reused within the ghost's reach; its naming stays counted,
so `reused / named` is the class's share of namings followed by another one while the ghost
remembered it. The ghost holds at most `REUSE_GHOST_PER_OBJECT x max(resident objects,
REUSE_GHOST_FLOOR)` ids; a class's counts halve once `named` reaches `REUSE_HALVE_AT` (old
evidence ages out), and the reuse of a naming counted before k halvings of its class is
credited 2^-k, as that naming now counts (credited whole, a class's reuses outgrew its namings
after a halving and p saturated at 1; review, stop 68). State: the ghost (one int an id: the
class and its halvings then) plus two floats per class.

## Use (in `kvfabric.core.eviction`)
- Victim choice: priority = last access (ms) + `reuse_horizon_ms` x ln(p) where p is the class's
  reuse rate: a chunk twice as likely to be reused stays `reuse_horizon_ms` x ln 2 longer than
  LRU would keep it. Leaves only, tails before heads, as every heap policy.
- Admission (`admission="predicted"`): a chunk whose parent is not resident, or is being
  evicted, is refused (a prefix hit can never reach it); when the pool is above its low
  watermark, a chunk whose priority is below the lowest evictable leaf's (it would be the next
  victim) is refused (bypass, as the offline reference does).
- Explanation: `EvictionCore.explain(id)` gives the class, p and priority; every admission and
  every victim carries a reason code.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable
from typing import Final, TypeAlias

from kvfabric.format.invariant import invariant

__all__ = [
    "REUSE_ACCESS_CLASSES",
    "REUSE_GHOST_FLOOR",
    "REUSE_GHOST_PER_OBJECT",
    "REUSE_LENGTH_CLASSES",
    "REUSE_TURN_CLASSES",
    "ReuseClass",
    "ReusePredictor",
]

ReuseClass: TypeAlias = tuple[int, int, int, int]  # (accesses, turn, length, last), each capped

REUSE_ACCESS_CLASSES: Final = 3  # accesses 1, 2, 3 or more
REUSE_TURN_CLASSES: Final = 4  # turns 1, 2, 3, 4 or more
REUSE_LENGTH_CLASSES: Final = 8  # log2(prompt chunks) 0..6, 7 = 128 chunks or more
REUSE_PRIOR_REUSED: Final = 1.0  # pseudo-counts every class starts with: p = 1/4 ...
REUSE_PRIOR_NAMED: Final = 4.0  # ... until the class has evidence of its own
REUSE_HALVE_AT: Final = float(1 << 16)  # a class's counts halve when `named` reaches this
REUSE_GHOST_PER_OBJECT: Final = 4  # ghost ids kept per resident object ...
REUSE_GHOST_FLOOR: Final = 256  # ... counting at least this many objects


def reuse_class(accesses: int, turn: int, prompt_chunks: int, last: bool) -> ReuseClass:
    """The class of a chunk named `accesses` times, of prefix generation `turn`, written by a
    prompt of `prompt_chunks` chunks (each at least 1), `last` if it was that prompt's last."""
    return (
        min(max(accesses, 1), REUSE_ACCESS_CLASSES),
        min(max(turn, 1), REUSE_TURN_CLASSES),
        min(max(prompt_chunks, 1).bit_length() - 1, REUSE_LENGTH_CLASSES - 1),
        int(last),
    )


HALVINGS_MOD: Final = 1 << 16  # a ghost entry keeps its class's halvings modulo this


def _pack(cls: ReuseClass, halvings: int) -> int:
    """A ghost entry: the class's four fields (each below 16, checked at import) and its
    halvings mod `HALVINGS_MOD` in one int (a 4-tuple an id cost more)."""
    accesses, turn, length, last = cls
    return ((halvings % HALVINGS_MOD) << 16) | (accesses << 12) | (turn << 8) | (length << 4) | last


def _unpack(packed: int) -> tuple[ReuseClass, int]:
    cls = ((packed >> 12) & 0xF, (packed >> 8) & 0xF, (packed >> 4) & 0xF, packed & 0xF)
    return cls, (packed >> 16) % HALVINGS_MOD


invariant(
    max(REUSE_ACCESS_CLASSES, REUSE_TURN_CLASSES, REUSE_LENGTH_CLASSES) < 16,
    "a ghost entry packs each field in 4 bits",
)


class ReusePredictor:
    """See the module docstring. Pure and synchronous; ids are any hashable."""

    def __init__(self) -> None:
        self._reused: dict[ReuseClass, float] = {}
        self._named: dict[ReuseClass, float] = {}
        self._halvings: dict[ReuseClass, int] = {}  # class -> times its counts were halved
        # id -> (its class, the class's halvings then), packed in one int (`_pack`)
        self._ghost: OrderedDict[Hashable, int] = OrderedDict()

    def probability(self, cls: ReuseClass) -> float:
        """The class's learned reuse rate, in (0, 1]."""
        reused = self._reused.get(cls, 0.0) + REUSE_PRIOR_REUSED
        named = self._named.get(cls, 0.0) + REUSE_PRIOR_NAMED
        return min(1.0, reused / named)

    def log_probability(self, cls: ReuseClass) -> float:
        return math.log(self.probability(cls))

    def named(self, object_id: Hashable) -> None:
        """A request names `object_id` (hit or miss): if the ghost remembers it, its class was
        reused. Idempotent until the next `track`."""
        packed = self._ghost.pop(object_id, None)
        if packed is not None:
            cls, halvings = _unpack(packed)
            since = (self._halvings.get(cls, 0) - halvings) % HALVINGS_MOD  # (two bytes: see density)
            self._reused[cls] = self._reused.get(cls, 0.0) + (0.0 if since > 64 else 0.5**since)

    def track(self, object_id: Hashable, cls: ReuseClass, resident_objects: int) -> None:
        """Record one naming of `object_id` in class `cls` (after `named`), bounded by the ghost."""
        named = self._named.get(cls, 0.0) + 1.0
        halvings = self._halvings.get(cls, 0)  # this naming's, before it halves its class below
        if named >= REUSE_HALVE_AT:
            named /= 2
            self._reused[cls] = self._reused.get(cls, 0.0) / 2
            self._halvings[cls] = halvings + 1
        self._named[cls] = named
        self._ghost[object_id] = _pack(cls, halvings)
        self._ghost.move_to_end(object_id)
        self.trim(resident_objects)

    def trim(self, resident_objects: int) -> None:
        """Forget the oldest ghost ids beyond the bound (the core calls it as objects go)."""
        bound = self.ghost_bound(resident_objects)
        while len(self._ghost) > bound:
            self._ghost.popitem(last=False)

    @staticmethod
    def ghost_bound(resident_objects: int) -> int:
        return REUSE_GHOST_PER_OBJECT * max(resident_objects, REUSE_GHOST_FLOOR)

    def ghost_size(self) -> int:
        return len(self._ghost)

    def classes(self) -> dict[ReuseClass, tuple[float, float]]:
        """Learned (reused, named) counts per class seen so far (for status and docs)."""
        return {c: (self._reused.get(c, 0.0), n) for c, n in sorted(self._named.items())}

    def check(self, resident_objects: int) -> None:
        """Bounded memory: ghost within its bound, classes within the class grid, counts sane."""
        invariant(
            len(self._ghost) <= self.ghost_bound(resident_objects),
            "reuse ghost unbounded",
            ghost=len(self._ghost),
            resident=resident_objects,
        )
        invariant(
            len(self._named) <= REUSE_ACCESS_CLASSES * REUSE_TURN_CLASSES * REUSE_LENGTH_CLASSES * 2,
            "reuse classes unbounded",
        )
        for cls, named in self._named.items():
            invariant(self._reused.get(cls, 0.0) >= 0 and 0 < named < REUSE_HALVE_AT, "reuse counts drifted")
            invariant(self._reused.get(cls, 0.0) <= named * (1 + 1e-9), "reuses outgrew namings", cls=cls)
