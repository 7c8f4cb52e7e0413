"""Hit density learned from reuse gaps (issue 25): policy `density` of `EvictionCore`.

The value of keeping a chunk is the hits it will still bring per unit of cache it still takes
up: its *hit density* (Beckmann, Chen, Cidon, "LHD: Improving Cache Hit Rate by Maximizing Hit
Density", NSDI 2018). LHD learns it from the cache's own hits and evictions, which a cache that
never keeps a chunk long cannot see (it never observes a late hit, so it learns that old chunks
are worthless). Here the density is learned from *reuse gaps* seen by a bounded ghost of named
ids, resident or not, so what is learned does not depend on what the policy kept.

## Classes
A chunk's class is `(namings, length)`: `namings` = requests that named it while the ghost (or
the resident object) remembered it, 1..`DENSITY_NAMING_CLASSES` (the last one: that many or
more); `length` = bit length of the chunks of the prompt that wrote it, capped at
`DENSITY_LENGTH_CLASSES - 1` (a short prompt is more likely continued than a long one on the
conversation trace). At most `DENSITY_NAMING_CLASSES x DENSITY_LENGTH_CLASSES` classes.

## Learning (no future, no training beforehand)
Every naming (`name`): if the ghost remembers the id, the gap since its last naming is a
*reuse at that gap* for the class it had then (histogram over `DENSITY_AGE_BUCKETS`
log-spaced age buckets: [0, 1 s), [1 s, 1.5 s), ... x1.5 each); then the id takes its new class,
the class's naming count grows by one and the id goes to the ghost's young end. An id pushed out
of the ghost was not reused within the ghost's reach. The ghost holds at most
`DENSITY_GHOST_PER_OBJECT x max(resident objects, DENSITY_GHOST_FLOOR)` ids; a class's counts
halve when its namings reach `DENSITY_HALVE_AT` (old evidence ages out), and a reuse of a naming
counted before k halvings of its class is credited 2^-k, as its naming now counts (credited
whole, a class's reuses outgrew its namings after a halving and its densities blew up; review,
stop 68): a class's reuses never exceed its namings.

## Density (recomputed every `DENSITY_RECOMPUTE_EVERY` namings, or as configured: O(classes x buckets^2))
For a class with n namings and h[j] reuses in gap bucket j, a chunk of age a (time since its
last naming, in bucket i) still alive has, if kept until bucket k, expected hits
H = sum_{j=i..k} h[j] and expected occupancy L = sum_{j=i..k} width_j x (alive_j - h[j] / 2),
alive_j = n - sum_{j'<j} h[j'] (both relative to the same population, so the ratio needs no
conditioning). Its density is max over k of H / L (hits per ms of cache, for the best horizon:
a chunk whose reuse comes late is worth keeping only as long as that pays). A class not yet
computed has density +inf (kept; ties go least recent first, so an untrained cache is LRU).
The core divides by the chunk's bytes (hits per byte-ms) and evicts the leaf with the lowest
density, read at each class's least recent leaf (exact where a class's density falls with age,
an approximation where it rises), so a victim costs O(classes + log n).

## Admission (`admission="predicted"`)
A chunk whose parent is absent is refused (as for `reuse`); above the low watermark a new chunk
whose density at age 0 is below the lowest evictable leaf's is refused: it would be the next
victim (the offline reference's bypass, with learned densities instead of the future).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable
from typing import Final, TypeAlias

from kvfabric.format.invariant import invariant

__all__ = [
    "DENSITY_AGE_BUCKETS",
    "DENSITY_GHOST_FLOOR",
    "DENSITY_GHOST_PER_OBJECT",
    "DENSITY_HALVE_AT",
    "DENSITY_LENGTH_CLASSES",
    "DENSITY_NAMING_CLASSES",
    "DENSITY_RECOMPUTE_EVERY",
    "DensityClass",
    "DensityPredictor",
    "age_bucket",
]

DensityClass: TypeAlias = tuple[int, int]  # (namings, length), each capped

DENSITY_NAMING_CLASSES: Final = 4  # namings 1, 2, 3, 4 or more
DENSITY_LENGTH_CLASSES: Final = 8  # bit length of the prompt's chunks: 1, 2-3, 4-7, ..., 7 = 64 or more
DENSITY_AGE_BUCKETS: Final = 26  # log-spaced age buckets; the last holds every older age
DENSITY_AGE_BASE_MS: Final = 1000.0  # the first bucket is [0, this)
DENSITY_AGE_GROWTH: Final = 1.5  # each later bucket is this much wider than the one before
DENSITY_GHOST_PER_OBJECT: Final = 16  # ghost ids kept per resident object ...
DENSITY_GHOST_FLOOR: Final = 256  # ... counting at least this many objects
DENSITY_HALVE_AT: Final = float(1 << 16)  # a class's counts halve when its namings reach this
DENSITY_RECOMPUTE_EVERY: Final = 2048  # namings between two recomputations of the densities

# Bucket i covers [_EDGES[i], _EDGES[i + 1]); the last one is given the width it would have.
_EDGES: Final = (0.0, *(DENSITY_AGE_BASE_MS * DENSITY_AGE_GROWTH**i for i in range(DENSITY_AGE_BUCKETS - 1)))
_WIDTHS: Final = (
    *(_EDGES[i + 1] - _EDGES[i] for i in range(DENSITY_AGE_BUCKETS - 1)),
    _EDGES[-1] * (DENSITY_AGE_GROWTH - 1),
)
_LOG_GROWTH: Final = math.log(DENSITY_AGE_GROWTH)


def age_bucket(age_ms: float) -> int:
    """The age bucket of `age_ms` (negative ages count as 0)."""
    if age_ms < DENSITY_AGE_BASE_MS:
        return 0
    return min(DENSITY_AGE_BUCKETS - 1, int(math.log(age_ms / DENSITY_AGE_BASE_MS) / _LOG_GROWTH) + 1)


def density_class(namings: int, prompt_chunks: int) -> DensityClass:
    return (
        min(max(namings, 1), DENSITY_NAMING_CLASSES),
        min(max(prompt_chunks, 1).bit_length(), DENSITY_LENGTH_CLASSES - 1),
    )


HALVINGS_MOD: Final = 1 << 16  # a ghost entry keeps its class's halvings modulo this


def _pack(cls: DensityClass, ms: int, namings: int, halvings: int) -> int:
    """A ghost entry as one int: ms above five bytes (the class's halvings mod `HALVINGS_MOD` in
    two, naming class, length class, namings; each below 256, checked at import). Python's ints
    shift as two's complement, so a negative ms (a test's clock) packs too."""
    return (ms << 40) | ((halvings % HALVINGS_MOD) << 24) | (cls[0] << 16) | (cls[1] << 8) | namings


def _unpack(packed: int) -> tuple[DensityClass, int, int, int]:
    """(class, ms, namings, the class's halvings mod `HALVINGS_MOD`) of a ghost entry."""
    cls = ((packed >> 16) & 0xFF, (packed >> 8) & 0xFF)
    return cls, packed >> 40, packed & 0xFF, (packed >> 24) % HALVINGS_MOD


def _credit(halvings_now: int, halvings_then: int) -> float:
    """What a reuse of a naming counted `halvings_then` (mod `HALVINGS_MOD`) is worth now: halved
    as often as its class since (past 64 halvings, nothing). Two bytes, not one: a ghost entry
    that outlived 256 halvings (a ghost of millions of ids) was credited whole again."""
    since = (halvings_now - halvings_then) % HALVINGS_MOD
    return 0.0 if since > 64 else 0.5**since


invariant(
    DENSITY_NAMING_CLASSES < 256 and DENSITY_LENGTH_CLASSES < 256, "a ghost entry packs each class in a byte"
)


class DensityPredictor:
    """See the module docstring. Pure and synchronous; ids are any hashable, times in ms."""

    def __init__(self, recompute_every: int = DENSITY_RECOMPUTE_EVERY) -> None:
        invariant(recompute_every >= 1, "recompute_every must be at least 1")
        self._recompute_every = recompute_every
        self._named: dict[DensityClass, float] = {}
        self._halvings: dict[DensityClass, int] = {}  # class -> times its counts were halved
        self._reused: dict[DensityClass, list[float]] = {}  # class -> reuses per gap bucket
        self._density: dict[DensityClass, tuple[float, ...]] = {}  # class -> per age bucket
        # id -> its class, last naming's ms and namings, packed in one int (`_pack`): a tuple
        # of them cost 261 bytes an id in CPython, the int 141 (tracemalloc, 200,000 namings;
        # the id itself not counted: a resident object shares it)
        self._ghost: OrderedDict[Hashable, int] = OrderedDict()
        self._since_recompute = 0

    def name(
        self, object_id: Hashable, now_ms: int, prompt_chunks: int, namings_at_least: int = 1
    ) -> DensityClass:
        """A request names `object_id` at `now_ms` (written or hit): learn from its gap, return
        its new class (namings: the ghost's count + 1, at least `namings_at_least`)."""
        namings = 1
        seen = self._ghost.pop(object_id, None)
        if seen is not None:
            cls, last_ms, before, halvings = _unpack(seen)
            credit = _credit(self._halvings.get(cls, 0), halvings)
            self._reused.setdefault(cls, [0.0] * DENSITY_AGE_BUCKETS)[age_bucket(now_ms - last_ms)] += credit
            namings = before + 1
        namings = max(namings, namings_at_least)
        cls = density_class(namings, prompt_chunks)
        count = self._named.get(cls, 0.0) + 1.0
        halvings = self._halvings.get(cls, 0)  # this naming's, before it halves its class below
        if count >= DENSITY_HALVE_AT:
            count /= 2
            self._reused[cls] = [r / 2 for r in self._reused.get(cls, [0.0] * DENSITY_AGE_BUCKETS)]
            self._halvings[cls] = self._halvings.get(cls, 0) + 1
        self._named[cls] = count
        self._ghost[object_id] = _pack(cls, now_ms, min(namings, DENSITY_NAMING_CLASSES), halvings)
        self._since_recompute += 1
        if self._since_recompute >= self._recompute_every:
            self.recompute()
        return cls

    def trim(self, resident_objects: int) -> None:
        """Forget the oldest ghost ids beyond the bound (the core calls it as objects come and go)."""
        bound = self.ghost_bound(resident_objects)
        while len(self._ghost) > bound:
            self._ghost.popitem(last=False)

    @staticmethod
    def ghost_bound(resident_objects: int) -> int:
        return DENSITY_GHOST_PER_OBJECT * max(resident_objects, DENSITY_GHOST_FLOOR)

    def ghost_size(self) -> int:
        return len(self._ghost)

    def recompute(self) -> None:
        """Densities from the learned gaps (module docstring); O(classes x buckets^2)."""
        self._since_recompute = 0
        for cls, named in self._named.items():
            reused = self._reused.get(cls, [0.0] * DENSITY_AGE_BUCKETS)
            alive: list[float] = []
            left = named
            for hits in reused:
                alive.append(left)
                left -= hits
            densities: list[float] = []
            for i in range(DENSITY_AGE_BUCKETS):
                best = hits_after = occupancy = 0.0
                for k in range(i, DENSITY_AGE_BUCKETS):
                    hits_after += reused[k]
                    occupancy += _WIDTHS[k] * max(alive[k] - reused[k] / 2, 1e-9)
                    best = max(best, hits_after / occupancy)
                densities.append(best)
            self._density[cls] = tuple(densities)

    def density(self, cls: DensityClass, age_ms: float) -> float:
        """Expected hits per ms of a chunk of class `cls`, `age_ms` after its last naming; +inf
        for a class not computed yet (keep it: no evidence against it)."""
        table = self._density.get(cls)
        return math.inf if table is None else table[age_bucket(age_ms)]

    def classes(self) -> dict[DensityClass, tuple[float, float]]:
        """Learned (reused, named) counts per class (for status and docs)."""
        return {c: (sum(self._reused.get(c, ())), n) for c, n in sorted(self._named.items())}

    def table(self, cls: DensityClass) -> tuple[float, ...] | None:
        """The class's density per age bucket (hits per ms), None before the first computation."""
        return self._density.get(cls)

    def check(self, resident_objects: int) -> None:
        """Bounded memory: ghost within its bound, classes within the class grid, counts sane."""
        invariant(
            len(self._ghost) <= self.ghost_bound(resident_objects),
            "density ghost unbounded",
            ghost=len(self._ghost),
            resident=resident_objects,
        )
        invariant(
            len(self._named) <= DENSITY_NAMING_CLASSES * DENSITY_LENGTH_CLASSES, "density classes unbounded"
        )
        invariant(set(self._reused) <= set(self._named), "reuses of a class never named")
        for cls, named in self._named.items():
            invariant(0 < named < DENSITY_HALVE_AT, "density namings drifted", cls=cls)
            invariant(all(r >= 0 for r in self._reused.get(cls, ())), "negative reuse count", cls=cls)
            reused = sum(self._reused.get(cls, ()))
            invariant(
                reused <= named * (1 + 1e-9), "reuses outgrew namings", cls=cls, reused=reused, named=named
            )
