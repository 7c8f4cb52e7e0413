"""Live admission at `put_begin` (issue 25, item 4): the filter the eviction policy publishes and
the gate each directory shard applies. Pure: no I/O, time passed in (ms).

The policy service cannot be asked synchronously at `put_begin` (the directory never waits on
it), so the policy publishes what it would decide as a compact filter on a bounded cadence
(`AdmissionFilter`, `kvf.v1.eviction.admission_filter`) and the directory applies the latest one
while it is fresh. A refused key is answered `not_admitted`: nothing is reserved, no bytes move,
the writer counts it and the engine recomputes the chunk next time, as on a miss.

## The rule (`build_filter`, policy `density` with `KVF_EVICTION_ADMISSION=predicted`)
The core's predicted admission for `density` (`kvfabric.core.eviction`, `_admit`): above the low
watermark, a new chunk whose hit density at age 0, per byte, is below the lowest evictable leaf's
(the *frontier*) is refused: it would be the next victim. For a first-named chunk of length class
`c` (the service's class: bit length of chunk index + 1, capped) with density `d_c` and a frontier
`F > 0`, "d_c / bytes < F" is "bytes > d_c / F", so the filter carries per class the largest
group size admitted, `floor(d_c / F)` (`ADMISSION_UNLIMITED` for an untrained class, d = +inf),
for each pool at or past its low watermark; pools with room are not listed (admit). Share
domains below their guaranteed share are listed as protected (always admitted: another tenant's
scan cannot starve them, issue 25 item 5). The groups the policy's ghost remembers (named
before: resident, or evicted and remembered) are not first-named: a bloom filter of the
`ADMISSION_BLOOM_IDS_MAX` most recent of them (`ADMISSION_BLOOM_BYTES` bytes,
`ADMISSION_BLOOM_HASHES` bit positions each: about 2 % false positives when full) exempts them.
Other policies, or admission `off` (the default):
no filter is published, so the directory admits everything.
Not carried (the filter's approximation of the core): a re-named group's own class (the bloom
admits it whatever its class's density; a false positive admits a first-named one too), ghost
ids beyond the bloom's most recent ones (judged first-named), and the parent rule
(`parent_absent`: the client drops the rest of a prompt after a refused chunk).

## The gate (`AdmissionGate`, one per directory shard core)
States: EMPTY (no filter yet) --install--> FRESH --(now - received > stale_ms)--> STALE
--install--> FRESH. A filter is installed when it is valid (`AdmissionView.of`: at most
`ADMISSION_FILTER_POOLS_MAX` pools and `ADMISSION_FILTER_DOMAINS_MAX` domains, one limit per
class) and not older (`generated_ms`) than a FRESH one held; else it is dropped (counted).
`decide` for one key (its chunk group key) placed on some segments, in order:
1. `stale_ms` = 0 (admission off) -> admit `off`; EMPTY -> admit `no_filter`; STALE -> admit `stale`;
2. the key's share domain is protected -> admit `guaranteed`; its group key is in the seen
   bloom -> admit `seen_before`;
3. a target segment listed with `group_bytes > limit[class]` -> refuse `below_frontier`;
4. else admit `filter`.

## Invariants
- Never waits and never fails: `decide` is O(segments) dict reads; no filter, a stale one or
  an invalid one admits.
- Bounded memory: one filter per gate, its pools and domains within the bounds above, each
  pool with exactly `ADMISSION_LENGTH_CLASSES` limits, its bloom at most
  `ADMISSION_BLOOM_BYTES_MAX` bytes (the policy builds it from at most `ADMISSION_BLOOM_IDS_MAX`
  ids a publish).
- Never refuses a key the filter admits: a refusal names a listed pool whose limit for the
  key's class is below the key's group bytes, and only while the filter is fresh.
- Bounded staleness: a filter received more than `stale_ms` ago decides nothing.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import msgspec
import xxhash

from kvfabric.core.eviction_density import DENSITY_LENGTH_CLASSES, density_class
from kvfabric.format.errors import BadRequest
from kvfabric.format.ids import DOMAIN_DIGEST_BYTES, DomainDigest, GroupKey, domain_in_group_key
from kvfabric.format.invariant import invariant
from kvfabric.proto.eviction import (
    ADMISSION_BLOOM_BYTES_MAX,
    ADMISSION_FILTER_DOMAINS_MAX,
    ADMISSION_FILTER_POOLS_MAX,
    ADMISSION_LENGTH_CLASSES,
    ADMISSION_UNLIMITED,
    AdmissionFilter,
    PoolAdmission,
)

if TYPE_CHECKING:
    from kvfabric.core.eviction import EvictionCore

__all__ = [
    "ADMISSION_ADMIT_REASONS",
    "ADMISSION_BLOOM_BYTES",
    "ADMISSION_BLOOM_HASHES",
    "ADMISSION_BLOOM_IDS_MAX",
    "ADMISSION_GROUP_BYTES_LIMIT_MAX",
    "ADMISSION_REFUSE_REASONS",
    "ADMISSION_STALE_MS_DEFAULT",
    "AdmissionGate",
    "AdmissionView",
    "bloom_has",
    "bloom_of",
    "build_filter",
    "filter_parts",
    "length_class",
    "with_bloom",
]

ADMISSION_STALE_MS_DEFAULT: Final = 5_000  # a filter older than this (directory clock) admits all
ADMISSION_GROUP_BYTES_LIMIT_MAX: Final = 1 << 62  # a larger computed limit is ADMISSION_UNLIMITED
ADMISSION_ADMIT_REASONS: Final = ("off", "no_filter", "stale", "guaranteed", "seen_before", "filter")
ADMISSION_BLOOM_BYTES: Final = ADMISSION_BLOOM_BYTES_MAX  # the bloom the policy publishes ...
ADMISSION_BLOOM_IDS_MAX: Final = 65_536  # ... of at most this many recent ghost ids (8 bits each)
ADMISSION_BLOOM_HASHES: Final = 4  # bit positions per id (at most BLOOM_HASHES_MAX)
BLOOM_HASHES_MAX: Final = 4  # one 32-bit slice of a 128-bit hash each
ADMISSION_REFUSE_REASONS: Final = ("below_frontier",)
SEGMENT_ID_BYTES_MAX: Final = 64  # as `kvfabric.proto.subjects.check_segment_id`

invariant(DENSITY_LENGTH_CLASSES == ADMISSION_LENGTH_CLASSES, "admission classes follow density's")


def length_class(chunk_index: int) -> int:
    """The length class the service's density policy gives a chunk (it passes no prompt length:
    the prompt's chunks count as chunk index + 1)."""
    return density_class(1, chunk_index + 1)[1]


def _positions(key: bytes, nbits: int, hashes: int) -> Iterable[int]:
    h = xxhash.xxh3_128_intdigest(key)
    return (((h >> (32 * i)) & 0xFFFF_FFFF) % nbits for i in range(hashes))


def bloom_of(
    keys: Iterable[bytes], nbytes: int = ADMISSION_BLOOM_BYTES, hashes: int = ADMISSION_BLOOM_HASHES
) -> bytes:
    """A bloom filter of `keys`: `nbytes` bytes, `hashes` bit positions per key."""
    bits = bytearray(nbytes)
    nbits = nbytes * 8
    digest = xxhash.xxh3_128_intdigest
    for key in keys:  # `_positions` inlined: the policy hashes up to ADMISSION_BLOOM_IDS_MAX a publish
        h = digest(key)
        for _ in range(hashes):
            p = (h & 0xFFFF_FFFF) % nbits
            bits[p >> 3] |= 1 << (p & 7)
            h >>= 32
    return bytes(bits)


def bloom_has(bloom: bytes, hashes: int, key: bytes) -> bool:
    """Whether `key` may be in `bloom` (never False for a key put in; an empty bloom: False)."""
    if not bloom:
        return False
    return all(bloom[p >> 3] >> (p & 7) & 1 for p in _positions(key, len(bloom) * 8, hashes))


def id_bytes(object_id: Hashable) -> bytes:
    """An eviction object id as the bloom hashes it: the service's group keys as they are."""
    return object_id if isinstance(object_id, bytes) else repr(object_id).encode()


# ---- the policy side ---------------------------------------------------------------------------


def build_filter(
    core: EvictionCore, capacities: Mapping[str, int], now_ms: int, events_seq: int
) -> AdmissionFilter:
    """The filter of `core` now, bloom included: `with_bloom(*filter_parts(...))` in one call."""
    return with_bloom(*filter_parts(core, capacities, now_ms, events_seq))


def filter_parts(
    core: EvictionCore, capacities: Mapping[str, int], now_ms: int, events_seq: int
) -> tuple[AdmissionFilter, list[Hashable]]:
    """The filter of `core` (policy `density`) now without its bloom, and the ids the bloom must
    hold (the ghost's most recent, copied: the core may change while the bloom is built elsewhere,
    e.g. off the event loop, by `with_bloom`). The filter: its pools (of `capacities`, segment id ->
    bytes) at or past the low watermark with the per-class group byte limits, and the protected
    domains (module docstring). Bounded: the first `ADMISSION_FILTER_POOLS_MAX` pressed pools and
    `ADMISSION_FILTER_DOMAINS_MAX` protected domains (more than that protected: no pool listed,
    everything admitted: a domain left out would lose its guarantee; pools past the bound: admitted)."""
    invariant(core.config.policy == "density", "admission filters are built for the density policy")
    density = core._density  # the core's own predictor and frontier: this module mirrors `_admit`
    assert density is not None
    frontier = core._density_frontier(now_ms)
    pools: list[PoolAdmission] = []
    if frontier is not None:
        limits = [_limit(density.density((1, c), 0), frontier) for c in range(ADMISSION_LENGTH_CLASSES)]
        if any(limit != ADMISSION_UNLIMITED for limit in limits):
            low = core.config.low_watermark
            for pool in sorted(capacities):
                capacity = capacities[pool]
                if capacity > 0 and core.used_bytes(pool) >= low * capacity:
                    pools.append(PoolAdmission(segment_id=pool, group_bytes_max=list(limits)))
                    if len(pools) == ADMISSION_FILTER_POOLS_MAX:
                        break
    protected: list[DomainDigest] = []
    for tenant in sorted(t for t in core.quotas if isinstance(t, bytes)):
        quota = core.quotas[tenant]
        if quota.guaranteed_bytes and core.tenant_bytes(tenant) < quota.guaranteed_bytes:
            protected.append(DomainDigest(tenant))  # the core's tenants: share domain digests
    if len(protected) > ADMISSION_FILTER_DOMAINS_MAX:
        # More protected domains than a filter can name: one left out would lose its guarantee,
        # so the filter lists no pool (admits everything) until the count is back under the bound.
        pools, protected = [], []
    recent = list(itertools.islice(reversed(density._ghost), ADMISSION_BLOOM_IDS_MAX)) if pools else []
    message = AdmissionFilter(
        generated_ms=now_ms,
        events_seq=events_seq,
        policy=core.config.policy,
        pools=pools,
        protected_domains=protected,
        seen_bloom=b"",
        seen_bloom_hashes=0,
    )
    return message, recent


def with_bloom(message: AdmissionFilter, recent: list[Hashable]) -> AdmissionFilter:
    """`message` with the bloom of `recent` (only while it lists a pool: the bloom only exempts
    groups from a pool's limit). Pure and independent of the core: safe on another thread."""
    if not message.pools:
        return message
    return msgspec.structs.replace(
        message,
        seen_bloom=bloom_of(id_bytes(k) for k in recent),
        seen_bloom_hashes=ADMISSION_BLOOM_HASHES,
    )


def _limit(class_density: float, frontier: float) -> int:
    """The largest group bytes b with class_density / b >= frontier (admitted), or unlimited."""
    if math.isinf(class_density) or frontier <= 0:
        return ADMISSION_UNLIMITED
    limit = class_density / frontier
    return ADMISSION_UNLIMITED if limit >= ADMISSION_GROUP_BYTES_LIMIT_MAX else math.floor(limit)


# ---- the directory side ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AdmissionView:
    """A validated filter as the gate reads it (built once, shared by every shard's gate)."""

    generated_ms: int
    events_seq: int
    policy: str
    limits: Mapping[str, tuple[int, ...]]  # segment id -> group bytes max per length class
    protected: frozenset[bytes]
    seen_bloom: bytes  # recently named group keys (`bloom_has`); empty: none
    seen_hashes: int
    encoded_bytes: int  # the filter's size on the wire (metrics, status)

    @classmethod
    def of(cls, message: AdmissionFilter, encoded_bytes: int) -> AdmissionView:
        """Validate `message` (`BadRequest` when over a bound or malformed)."""
        if len(message.pools) > ADMISSION_FILTER_POOLS_MAX:
            raise BadRequest(
                f"admission filter lists {len(message.pools)} pools, over {ADMISSION_FILTER_POOLS_MAX}"
            )
        if len(message.protected_domains) > ADMISSION_FILTER_DOMAINS_MAX:
            raise BadRequest(f"admission filter lists over {ADMISSION_FILTER_DOMAINS_MAX} domains")
        limits: dict[str, tuple[int, ...]] = {}
        for pool in message.pools:
            if not 0 < len(pool.segment_id.encode()) <= SEGMENT_ID_BYTES_MAX:
                raise BadRequest("admission filter: bad segment id")
            if len(pool.group_bytes_max) != ADMISSION_LENGTH_CLASSES or any(
                b < ADMISSION_UNLIMITED for b in pool.group_bytes_max
            ):
                raise BadRequest(f"admission filter: want {ADMISSION_LENGTH_CLASSES} limits >= -1 a pool")
            limits[pool.segment_id] = tuple(pool.group_bytes_max)
        if any(len(d) != DOMAIN_DIGEST_BYTES for d in message.protected_domains):
            raise BadRequest("admission filter: a protected domain is not a 16-byte digest")
        if len(message.seen_bloom) > ADMISSION_BLOOM_BYTES_MAX or (
            message.seen_bloom and not 1 <= message.seen_bloom_hashes <= BLOOM_HASHES_MAX
        ):
            raise BadRequest(
                f"admission filter: a bloom of at most {ADMISSION_BLOOM_BYTES_MAX} bytes, 1-4 hashes"
            )
        return cls(
            message.generated_ms,
            message.events_seq,
            message.policy,
            limits,
            frozenset(message.protected_domains),
            message.seen_bloom,
            message.seen_bloom_hashes,
            encoded_bytes,
        )


class AdmissionGate:
    """See the module docstring. One per directory shard core; `count` is its counter sink."""

    def __init__(self, stale_ms: int, count: Callable[[str], None] | None = None) -> None:
        invariant(stale_ms >= 0, "stale_ms must be >= 0")
        self.stale_ms = stale_ms
        self.view: AdmissionView | None = None
        self.received_ms = 0
        self._count = count or (lambda name: None)

    def install(self, view: AdmissionView, now_ms: int) -> bool:
        """Hold `view` from now on (received at `now_ms`), unless a fresh one held is newer."""
        if self.view is not None and self.fresh(now_ms) and view.generated_ms < self.view.generated_ms:
            self._count("admission_filter_out_of_order_total")
            return False
        self.view, self.received_ms = view, now_ms
        return True

    def fresh(self, now_ms: int) -> bool:
        return self.view is not None and now_ms - self.received_ms <= self.stale_ms

    def age_ms(self, now_ms: int) -> int | None:
        """How long ago the held filter arrived; None without one."""
        return None if self.view is None else max(0, now_ms - self.received_ms)

    def decide(
        self,
        segment_ids: Sequence[str],
        group_key: bytes,
        chunk_index: int,
        group_bytes: int,
        now_ms: int,
    ) -> tuple[bool, str]:
        """(admit?, reason) for a key of the chunk group `group_key` (its share domain digest, then
        its chain hash) that holds `group_bytes` (all members and replicas), to be placed on
        `segment_ids` (rules in the module docstring); counted."""
        return self.counted(self.verdict(segment_ids, group_key, chunk_index, group_bytes, now_ms))

    def counted(self, verdict: tuple[bool, str]) -> tuple[bool, str]:
        """Count a verdict given (`admission_{admitted,refused}_<reason>`); returns it."""
        self._count(f"admission_{'admitted' if verdict[0] else 'refused'}_{verdict[1]}_total")
        return verdict

    def verdict(
        self, segment_ids: Sequence[str], group_key: bytes, chunk_index: int, group_bytes: int, now_ms: int
    ) -> tuple[bool, str]:
        """`decide`'s verdict, not counted (a caller that may place the key elsewhere counts the
        verdict of the placement it answers)."""
        exempt = self._admitted_whatever_the_limits(group_key, now_ms)
        if exempt is not None:
            return True, exempt
        if self.refusing(segment_ids, group_key, chunk_index, group_bytes, now_ms, exempt=False):
            return False, "below_frontier"
        return True, "filter"

    def refusing(
        self,
        segment_ids: Sequence[str],
        group_key: bytes,
        chunk_index: int,
        group_bytes: int,
        now_ms: int,
        *,
        exempt: bool | None = None,
    ) -> list[str]:
        """The segments among `segment_ids` whose limit refuses the group (none when the filter
        admits it whatever the limits: `exempt`, found here unless the caller knows it)."""
        if exempt is None:
            exempt = self._admitted_whatever_the_limits(group_key, now_ms) is not None
        if exempt or self.view is None:
            return []
        cls = length_class(chunk_index)
        over = []
        for segment_id in segment_ids:
            limit = self.view.limits.get(segment_id)
            if limit is not None and limit[cls] != ADMISSION_UNLIMITED and group_bytes > limit[cls]:
                over.append(segment_id)
        return over

    def _admitted_whatever_the_limits(self, group_key: bytes, now_ms: int) -> str | None:
        """The reason the group is admitted before any segment's limit is read, or None."""
        view = self.view
        if self.stale_ms == 0:
            return "off"
        if view is None:
            return "no_filter"
        if now_ms - self.received_ms > self.stale_ms:
            return "stale"
        if not view.limits:
            return "filter"
        if domain_in_group_key(GroupKey(group_key)) in view.protected:
            return "guaranteed"
        if bloom_has(view.seen_bloom, view.seen_hashes, group_key):
            return "seen_before"
        return None

    def check(self) -> None:
        """Bounded memory (module invariants)."""
        view = self.view
        if view is None:
            return
        invariant(len(view.limits) <= ADMISSION_FILTER_POOLS_MAX, "admission filter pools unbounded")
        invariant(len(view.protected) <= ADMISSION_FILTER_DOMAINS_MAX, "admission filter domains unbounded")
        invariant(len(view.seen_bloom) <= ADMISSION_BLOOM_BYTES_MAX, "admission bloom unbounded")
        invariant(
            all(len(v) == ADMISSION_LENGTH_CLASSES for v in view.limits.values()),
            "admission limits malformed",
        )
