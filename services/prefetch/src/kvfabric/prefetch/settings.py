"""Prefetch settings, from `KVF_PREFETCH_*` environment variables.

| variable | default | meaning |
|---|---|---|
| `KVF_PREFETCH_HINTS_QUEUED_MAX` | 1024 | live hints; more answer `busy` |
| `KVF_PREFETCH_OBJECTS_QUEUED_MAX` | 16384 | objects of live hints not yet copied |
| `KVF_PREFETCH_HINTS_QUEUED_PER_TENANT_MAX` | 0 | of the live hints, one tenant's (0: all but a quarter) |
| `KVF_PREFETCH_OBJECTS_QUEUED_PER_TENANT_MAX` | 0 | of the objects, one tenant's (0: all but a quarter) |
| `KVF_PREFETCH_BYTES_IN_FLIGHT_MAX` | 268435456 | bytes being copied at once |
| `KVF_PREFETCH_COPIES_IN_FLIGHT_MAX` | 4 | copies at once (a segment takes 4 by default) |
| `KVF_PREFETCH_RESOLVING_MAX` | 64 | hints being resolved (directory lookups) at once |
| `KVF_PREFETCH_HOT_READS_PER_S` | 50 | an object read this often gets an extra replica |
| `KVF_PREFETCH_COLD_READS_PER_S` | 5 | an extra replica read less often is dropped |
| `KVF_PREFETCH_HOT_EXTRA_REPLICAS_MAX` | 256 | extra replicas at once |
| `KVF_PREFETCH_HOT_EXTRA_REPLICAS_PER_DOMAIN_MAX` | 0 | of those, one share domain's (0: a quarter) |
| `KVF_PREFETCH_HOT_WINDOW_MS` | 10000 | read rates are measured over this window |
| `KVF_PREFETCH_HINT_HOLD_MS_MAX` | 300000 | a hint's deadline at most this far ahead (leases renewed to it) |
| `KVF_PREFETCH_TICK_MS` / `_SCAN_MS` | 20 / 2000 | planning period / segment refresh + cold sweep |
| `KVF_PREFETCH_COPY_TIMEOUT_MS` | 10000 | one copy, ticket to confirm |
| `KVF_PREFETCH_GROUP_CACHE_MS` | 10000 | a group shown for hot reads is trusted this long (0: never) |
| `KVF_DIRECTORY_TICK_MS` | 100 | the directory's: an `accessed` event's hits are over this long |
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvfabric.core.prefetch import PrefetchConfig
from kvfabric.runtime.config import env_int

__all__ = ["PrefetchSettings", "load_prefetch_settings"]


@dataclass(frozen=True, kw_only=True)
class PrefetchSettings:
    core: PrefetchConfig
    tick_ms: int
    scan_ms: int
    resolving_max: int
    copy_timeout_s: float
    request_timeout_s: float
    group_cache_ms: int
    access_period_ms: int


def load_prefetch_settings(env: Mapping[str, str]) -> PrefetchSettings:
    hot = env_int(env, "KVF_PREFETCH_HOT_READS_PER_S", 50, 1, 1_000_000)
    core = PrefetchConfig(
        hints_queued_max=env_int(env, "KVF_PREFETCH_HINTS_QUEUED_MAX", 1024, 1, 1_000_000),
        objects_queued_max=env_int(env, "KVF_PREFETCH_OBJECTS_QUEUED_MAX", 16_384, 1, 10_000_000),
        hints_queued_per_tenant_max=env_int(env, "KVF_PREFETCH_HINTS_QUEUED_PER_TENANT_MAX", 0, 0, 1_000_000),
        objects_queued_per_tenant_max=env_int(
            env, "KVF_PREFETCH_OBJECTS_QUEUED_PER_TENANT_MAX", 0, 0, 10_000_000
        ),
        bytes_in_flight_max=env_int(env, "KVF_PREFETCH_BYTES_IN_FLIGHT_MAX", 256 << 20, 1, 1 << 40),
        copies_in_flight_max=env_int(env, "KVF_PREFETCH_COPIES_IN_FLIGHT_MAX", 4, 1, 4096),
        hot_reads_per_s=float(hot),
        cold_reads_per_s=float(min(hot, env_int(env, "KVF_PREFETCH_COLD_READS_PER_S", 5, 0, 1_000_000))),
        hot_extra_replicas_max=env_int(env, "KVF_PREFETCH_HOT_EXTRA_REPLICAS_MAX", 256, 0, 1_000_000),
        hot_extra_replicas_per_domain_max=env_int(
            env, "KVF_PREFETCH_HOT_EXTRA_REPLICAS_PER_DOMAIN_MAX", 0, 0, 1_000_000
        ),
        hot_window_ms=env_int(env, "KVF_PREFETCH_HOT_WINDOW_MS", 10_000, 1, 3_600_000),
        hint_hold_ms_max=env_int(env, "KVF_PREFETCH_HINT_HOLD_MS_MAX", 300_000, 1_000, 3_600_000),
    )
    return PrefetchSettings(
        core=core,
        tick_ms=env_int(env, "KVF_PREFETCH_TICK_MS", 20, 1, 60_000),
        scan_ms=env_int(env, "KVF_PREFETCH_SCAN_MS", 2_000, 10, 3_600_000),
        resolving_max=env_int(env, "KVF_PREFETCH_RESOLVING_MAX", 64, 1, 10_000),
        copy_timeout_s=env_int(env, "KVF_PREFETCH_COPY_TIMEOUT_MS", 10_000, 100, 600_000) / 1000,
        request_timeout_s=2.0,
        group_cache_ms=env_int(env, "KVF_PREFETCH_GROUP_CACHE_MS", 10_000, 0, 600_000),
        access_period_ms=env_int(env, "KVF_DIRECTORY_TICK_MS", 100, 5, 60_000),
    )
