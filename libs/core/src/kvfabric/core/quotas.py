"""Per-tenant quotas and request-rate limits of the directory (pure: no clock, no I/O).

## Tenant
The tenant of a key, chunk group id or namespace is its share domain: the 16-byte domain digest
at bytes [4:20] of each (see `kvfabric.format.key`'s layout). `tenant_of` is the one place that
says so; an authenticated identity can replace it later without touching the accounting.

## Usage (what a tenant holds)
- `bytes`: size × replicas of every object of the tenant that holds space anywhere: placements of
  building members, replicas in published records (also on a segment declared down, until the
  sweep drops them), extra replicas being copied, and slots handed back until the segment
  acknowledges the free. It mirrors the segments' reservations, per tenant.
- `objects`: members of building and published chunk groups (an evicted group stops counting at
  once; its bytes count until freed).
The directory core adjusts usage incrementally at every change of its records (`add`) and
recomputes it from scratch in `check_invariants`. A tenant holding nothing has no usage entry.

## Limits
`TenantQuota` (0 = unlimited): `bytes_max`, `objects_max` are checked by `admits` before an
object is placed (`put_begin` answers `quota_exceeded` for that object); repair and prefetch
copies are counted but never refused. `requests_per_s` with `burst` is a token bucket per
tenant, charged per request by `charge(tenants, now_ms, tokens)`; time only moves forward
(an older `now_ms` refills nothing).

## Cost-weighted requests
A request costs tokens in proportion to its size, not one each: a lookup or pin of n chunk
groups, a put_begin or put_commit of n keys costs `request_tokens(n)` = ceil(n /
`ITEMS_PER_TOKEN`) (a prefix of up to 64 chunks in one shard: one token; the 4,096-group
maximum: 64), so a tenant's rate bounds the directory's work for it, not its message count
(issue 21 row 2: max-size lookups, 16 in flight, took the event loop from every other tenant).
A request never costs more than the tenant's burst (it would never be admitted): the largest
ones empty the bucket.

## One token bucket
`TokenBucket` is the project's one token bucket (issue 26, duplicates): these quotas, the
directory's fair admission and give-back budget (`kvfabric.directory.admission`) and its
per-tenant shard-map and suspect-report rates (`kvfabric.directory.shard_host`), the repair core's
copy budget (`kvfabric.core.repair`) and the segment scrubber's pacer
(`kvfabric.segment_storage.scrubber`) all use it. Time is passed in (seconds on any monotonic
clock; these quotas pass `now_ms / 1000`; the repair core passes ms with milli-byte tokens, so
the rate is still per second and every level an exact integer-valued float).

## Bounds
Buckets and rejection counts live in an LRU table of at most `tenants_max` entries: the least
recently used is forgotten first (its tenant starts again with a full bucket). Usage entries
are bounded by the objects held.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Final, TypeAlias

from kvfabric.format.ids import DOMAIN_SLICE, DomainDigest
from kvfabric.format.invariant import invariant

__all__ = [
    "DOMAIN_DIGEST",
    "ITEMS_PER_TOKEN",
    "UNLIMITED",
    "Quotas",
    "Tenant",
    "TenantQuota",
    "TenantStats",
    "TenantUsage",
    "TokenBucket",
    "request_tokens",
    "tenant_of",
]

Tenant: TypeAlias = DomainDigest  # a tenant is its share domain (the module docstring)
DOMAIN_DIGEST: Final = DOMAIN_SLICE  # [4:20] inside a key, a chunk group id and a namespace alike
ITEMS_PER_TOKEN: Final = 64  # a request costs one rate token per this many groups or keys it names


def request_tokens(items: int) -> int:
    """The rate tokens a request naming `items` chunk groups or keys costs (at least one)."""
    return max(1, -(-items // ITEMS_PER_TOKEN))


def tenant_of(raw: bytes) -> Tenant:
    """The tenant of a key, chunk group id (90 B) or namespace (its leading 54 B)."""
    return Tenant(bytes(raw[DOMAIN_DIGEST]))


@dataclass(slots=True)
class TokenBucket:
    """A token bucket, pure: `tokens` refill at `rate_per_s` up to `capacity`, time `now_s` passed
    in (seconds on any monotonic clock). Time only moves forward: an `now_s` older than the last
    one refills nothing and leaves `updated_s` where it was.

    `take(n)` takes `n` tokens when the bucket holds them (else takes nothing); `charge(n, floor)`
    takes `n` whatever it holds, down to `floor` (below zero: a debt that refills before anything
    is taken again). Invariant: `floor <= tokens <= capacity` for the floors charged with
    (`check`)."""

    rate_per_s: float
    capacity: float
    tokens: float
    updated_s: float

    def __post_init__(self) -> None:
        invariant(self.rate_per_s > 0 and self.capacity > 0, "a bucket needs a rate and a capacity")

    @classmethod
    def full(cls, rate_per_s: float, capacity: float, now_s: float) -> TokenBucket:
        return cls(rate_per_s, float(capacity), float(capacity), now_s)

    def level(self, now_s: float) -> float:
        """The tokens it holds at `now_s` (changes nothing)."""
        refill = max(0.0, now_s - self.updated_s) * self.rate_per_s
        return min(self.capacity, self.tokens + refill)

    def refill(self, now_s: float) -> float:
        """Bring the bucket to `now_s`; its tokens."""
        self.tokens = self.level(now_s)
        self.updated_s = max(self.updated_s, now_s)
        return self.tokens

    def take(self, n: float, now_s: float) -> bool:
        """Take `n` tokens if it holds them (True), else nothing (False)."""
        if self.refill(now_s) < n:
            return False
        self.tokens -= n
        return True

    def charge(self, n: float, now_s: float, floor: float = 0.0) -> None:
        """Take `n` tokens whatever it holds, leaving at least `floor`."""
        self.tokens = max(min(floor, self.refill(now_s)), self.tokens - n)

    def suspend(self, now_s: float, until_s: float) -> None:
        """Empty it (a debt stays) and refill nothing before `until_s`: `updated_s` moves there,
        so every read before then sees the same tokens (time only moves forward)."""
        self.tokens = min(self.refill(now_s), 0.0)
        self.updated_s = max(self.updated_s, until_s)

    def wait_s(self, n: float, now_s: float) -> float:
        """How long until it holds `n` tokens (0 when it does), a suspension (`suspend`) included."""
        missing = n - self.level(now_s)
        if missing <= 0:
            return 0.0
        return max(0.0, self.updated_s - now_s) + missing / self.rate_per_s

    def full_at_s(self) -> float:
        """When it will be full, with nothing taken meanwhile."""
        return self.updated_s + max(0.0, self.capacity - self.tokens) / self.rate_per_s

    def check(self, floor: float = 0.0) -> None:
        invariant(
            floor - 1e-9 <= self.tokens <= self.capacity + 1e-9, "tokens out of bounds", tokens=self.tokens
        )


@dataclass(frozen=True, slots=True)
class TenantQuota:
    bytes_max: int = 0  # 0 = unlimited
    objects_max: int = 0  # 0 = unlimited
    requests_per_s: float = 0.0  # 0 = unlimited
    burst: int = 0  # requests allowed at once; 0 = max(1, ceil(requests_per_s))

    def __post_init__(self) -> None:
        invariant(
            self.bytes_max >= 0 and self.objects_max >= 0 and self.requests_per_s >= 0 and self.burst >= 0,
            "negative quota",
        )

    @property
    def burst_effective(self) -> int:
        return self.burst or max(1, math.ceil(self.requests_per_s))


UNLIMITED: Final = TenantQuota()


@dataclass(slots=True)
class TenantUsage:
    bytes: int = 0
    objects: int = 0


@dataclass(slots=True)
class TenantStats:
    """A tenant's token bucket and rejection counts (forgotten when least recently used)."""

    bucket: TokenBucket | None  # None: the tenant has no rate limit
    quota_exceeded: int = 0  # objects refused by put_begin
    rate_limited: int = 0  # requests refused


class Quotas:
    def __init__(
        self,
        default: TenantQuota,
        per_tenant: Mapping[bytes, TenantQuota],
        tenants_max: int,
        count: Callable[[str, int], None],
    ) -> None:
        invariant(tenants_max >= 1, "tenants_max must be positive")
        invariant(all(len(t) == 16 for t in per_tenant), "a tenant is a 16-byte domain digest")
        self.default = default
        self.per_tenant = dict(per_tenant)
        self.tenants_max = tenants_max
        self._count = count
        self.usage: dict[Tenant, TenantUsage] = {}
        self.stats: OrderedDict[Tenant, TenantStats] = OrderedDict()
        # Fast path: no bucket at all when no tenant has a rate limit.
        self.rate_limited = default.requests_per_s > 0 or any(
            q.requests_per_s > 0 for q in self.per_tenant.values()
        )

    def quota(self, tenant: Tenant) -> TenantQuota:
        return self.per_tenant.get(tenant, self.default)

    # ---- usage ---------------------------------------------------------------------------

    def add(self, tenant: Tenant, nbytes: int, objects: int = 0) -> None:
        """Adjust what `tenant` holds (negative: released)."""
        use = self.usage.get(tenant)
        if use is None:
            use = self.usage[tenant] = TenantUsage()
        use.bytes += nbytes
        use.objects += objects
        invariant(use.bytes >= 0 and use.objects >= 0, "negative tenant usage", tenant=tenant.hex())
        if not use.bytes and not use.objects:
            del self.usage[tenant]

    def admits(self, tenant: Tenant, nbytes: int, objects: int) -> bool:
        """Whether `tenant` may hold `nbytes` and `objects` more (counts a refusal if not)."""
        quota = self.quota(tenant)
        use = self.usage.get(tenant) or TenantUsage()
        if (quota.bytes_max and use.bytes + nbytes > quota.bytes_max) or (
            quota.objects_max and use.objects + objects > quota.objects_max
        ):
            self._stats(tenant, None).quota_exceeded += 1
            return False
        return True

    # ---- request rate --------------------------------------------------------------------

    def charge(self, tenants: Iterable[Tenant], now_ms: int, tokens: int = 1) -> int:
        """Take `tokens` (at most its burst) from each tenant's bucket: 0 when every one had
        them, else the milliseconds until the emptiest one will have (and nothing is taken)."""
        invariant(tokens >= 1, "a request costs at least one token")
        if not self.rate_limited:
            return 0
        limited = [(t, q) for t in set(tenants) if (q := self.quota(t)).requests_per_s > 0]
        now_s = now_ms / 1000
        wait_ms = 0
        buckets: list[tuple[TenantStats, TokenBucket, int]] = []
        for tenant, quota in limited:
            stats = self._stats(tenant, quota)
            bucket = stats.bucket
            assert bucket is not None  # a limited tenant's stats carry its bucket
            cost = min(tokens, quota.burst_effective)
            if bucket.refill(now_s) < cost:
                wait_ms = max(wait_ms, math.ceil((cost - bucket.tokens) * 1000 / quota.requests_per_s))
            buckets.append((stats, bucket, cost))
        if wait_ms:
            for stats, _, _ in buckets:
                stats.rate_limited += 1
            return max(1, wait_ms)
        for _, bucket, cost in buckets:
            bucket.charge(cost, now_s)
        return 0

    def wait_ms(self, tenants: Iterable[Tenant], now_ms: int, tokens: int = 1) -> int:
        """What `charge` would answer now, taking nothing and remembering no new tenant (one not
        remembered has a full bucket): asked before a request's per-id work, so a tenant out of
        tokens is refused before it, not after (review, stop 68). A refusal is counted."""
        if not self.rate_limited:
            return 0
        now_s = now_ms / 1000
        wait_ms = 0
        refused: list[TenantStats] = []
        for tenant in set(tenants):
            stats = self.stats.get(tenant)
            quota = self.quota(tenant)
            if stats is None or stats.bucket is None or quota.requests_per_s <= 0:
                continue
            cost = min(tokens, quota.burst_effective)
            level = stats.bucket.level(now_s)
            if level < cost:
                wait_ms = max(wait_ms, math.ceil((cost - level) * 1000 / quota.requests_per_s))
                refused.append(stats)
        for stats in refused:
            stats.rate_limited += 1
        return max(1, wait_ms) if refused else 0

    def _stats(self, tenant: Tenant, quota: TenantQuota | None) -> TenantStats:
        stats = self.stats.get(tenant)
        if stats is not None:
            self.stats.move_to_end(tenant)
            return stats
        quota = quota or self.quota(tenant)
        bucket = None
        if quota.requests_per_s > 0:  # full, refilled from the first request on
            bucket = TokenBucket.full(quota.requests_per_s, quota.burst_effective, float("-inf"))
        stats = self.stats[tenant] = TenantStats(bucket)
        while len(self.stats) > self.tenants_max:
            self.stats.popitem(last=False)
            self._count("tenants_forgotten_total", 1)
        return stats

    def tenants(self) -> list[Tenant]:
        """Every tenant with usage, a configured quota, or a bucket/rejections, sorted."""
        return sorted(self.usage.keys() | self.stats.keys() | {Tenant(t) for t in self.per_tenant})

    def check(self, recomputed: Mapping[Tenant, TenantUsage]) -> None:
        """`recomputed` (from the directory's records, from scratch) must equal the counters."""
        want = {t: (u.bytes, u.objects) for t, u in recomputed.items() if u.bytes or u.objects}
        have = {t: (u.bytes, u.objects) for t, u in self.usage.items()}
        if have != want:
            tenant = next(t for t in sorted(have.keys() | want.keys()) if have.get(t) != want.get(t))
            invariant(
                False, "tenant usage drift", tenant=tenant.hex(), have=have.get(tenant), want=want.get(tenant)
            )
        invariant(len(self.stats) <= self.tenants_max, "tenant table over its bound")
