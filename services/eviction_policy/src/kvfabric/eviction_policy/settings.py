"""Eviction-policy settings, from `KVF_EVICTION_*` environment variables.

The runtime's shared flags (NATS URL, metrics port, logging) come from `kvfabric.runtime.config`.

| variable | default | meaning |
|---|---|---|
| `KVF_EVICTION_POLICY` | `density` | or `lru`, `gdsf`, `lru2`, `sieve`, `s3fifo`, `wtinylfu`, `reuse` |
| `KVF_EVICTION_HIGH_WATERMARK_PCT` | 90 | a segment fuller than this (% of capacity, at most 99) evicts ... |
| `KVF_EVICTION_LOW_WATERMARK_PCT` | 80 | ... down to this |
| `KVF_EVICTION_BATCH_MAX` | 1024 | victims a tick per pool or over-quota tenant (one batch) |
| `KVF_EVICTION_REFUSED_COOLDOWN_MS` | 5000 | a refused victim waits this (a pin: x2 a refusal, to 16x) |
| `KVF_EVICTION_TICK_MS` | 200 | how often watermarks and quotas are checked |
| `KVF_EVICTION_INFLOW_HORIZON_MS` | 2 x tick | watermarks lowered by what writers store in this (0: off) |
| `KVF_EVICTION_SEGMENTS_REFRESH_MS` | 5000 | how often segment capacities are re-read from the directory |
| `KVF_EVICTION_REQUEST_TIMEOUT_MS` | 2000 | per directory request |
| `KVF_EVICTION_TENANT_QUOTAS` | empty | JSON, see `parse_quotas` |
| `KVF_EVICTION_DEMOTE` | 1 | a segment's arena victims go to its disk tier when it has one (0: dropped) |
| `KVF_EVICTION_DEMOTE_MIN_HITS` | 0 | ... read at least this often since published (`demote_or_drop`) |
| `KVF_EVICTION_DEMOTE_CUT_FOR_ROOM` | 1 | drop victims the disk cannot take before writers fill the arena |
| `KVF_EVICTION_SSD_HIGH_WATERMARK_PCT` | 90 | a disk tier fuller than this drops its own victims |
| `KVF_EVICTION_DEMOTE_TIMEOUT_MS` | 30000 | per demote request (up to 64 objects written to disk) |
| `KVF_EVICTION_DENSITY_RECOMPUTE_EVERY` | 2048 | `density`: namings between two density recomputations |
| `KVF_EVICTION_ADMISSION` | `off` | `predicted` (`density` only): publish an admission filter |
| `KVF_EVICTION_ADMISSION_PUBLISH_MS` | 1000 | how often (below the directory's staleness bound) |
| `KVF_EVICTION_DECISIONS_MAX` | 16384 | groups whose decisions `kvctl eviction explain` shows (0: none) |

Live admission (`predicted`) is published as a filter (`kvfabric.core.eviction_admission`); the
policy's own core keeps admission `always` (what it hears of is stored already). Second-hit
admission stays a simulator policy: the policy hears of no miss (docs/eviction-policy.md).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvfabric.core.eviction import POLICY_NAMES, EvictionConfig, TenantQuota
from kvfabric.core.eviction_density import DENSITY_RECOMPUTE_EVERY
from kvfabric.eviction_policy.decisions import DECISIONS_GROUPS_DEFAULT
from kvfabric.runtime.config import SettingsError, env_int

__all__ = ["EvictionSettings", "load_eviction_settings", "parse_quotas"]

BATCH_MAX_DEFAULT = 1024  # KVF_EVICTION_BATCH_MAX: victims a tick (5,120 groups a second at 200 ms)

DOMAIN_DIGEST_BYTES = 16


@dataclass(frozen=True, kw_only=True)
class EvictionSettings:
    core: EvictionConfig
    quotas: dict[bytes, TenantQuota] = field(default_factory=dict)
    tick_ms: int = 200
    segments_refresh_ms: int = 5_000
    request_timeout_s: float = 2.0
    demote: bool = True
    demote_min_hits: int = 0
    demote_cut_for_room: bool = True
    ssd_high_watermark: float = 0.9
    demote_timeout_s: float = 30.0
    admission: bool = False  # publish the density policy's admission filter
    admission_publish_ms: int = 1_000
    decisions_max: int = DECISIONS_GROUPS_DEFAULT


def parse_quotas(text: str) -> dict[bytes, TenantQuota]:
    """`{"<32 hex chars>": {"hard_bytes": int, "guaranteed_bytes": int}}` → quotas by digest."""
    if not text.strip():
        return {}
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SettingsError(f"KVF_EVICTION_TENANT_QUOTAS is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise SettingsError("KVF_EVICTION_TENANT_QUOTAS must be a JSON object")
    quotas: dict[bytes, TenantQuota] = {}
    for digest_hex, spec in raw.items():
        try:
            digest = bytes.fromhex(digest_hex)
        except ValueError:
            digest = b""
        if len(digest) != DOMAIN_DIGEST_BYTES:
            raise SettingsError(f"tenant quota key {digest_hex!r} is not a 16-byte domain digest in hex")
        if not isinstance(spec, dict) or set(spec) - {"hard_bytes", "guaranteed_bytes"}:
            raise SettingsError(f"tenant quota {digest_hex}: want hard_bytes and/or guaranteed_bytes")
        hard, guaranteed = spec.get("hard_bytes"), spec.get("guaranteed_bytes", 0)
        if (hard is not None and (not isinstance(hard, int) or hard < 0)) or not isinstance(guaranteed, int):
            raise SettingsError(f"tenant quota {digest_hex}: byte counts must be non-negative integers")
        if guaranteed < 0 or (hard is not None and guaranteed > hard):
            raise SettingsError(f"tenant quota {digest_hex}: guaranteed_bytes must be in 0..hard_bytes")
        quotas[digest] = TenantQuota(hard_bytes=hard, guaranteed_bytes=guaranteed)
    return quotas


def load_eviction_settings(env: Mapping[str, str]) -> EvictionSettings:
    # density: the best online policy on the traces, never 1 point below lru (docs/eviction-policy.md)
    name = env.get("KVF_EVICTION_POLICY", "density")
    policy = next((p for p in POLICY_NAMES if p == name), None)
    if policy is None:
        raise SettingsError(f"KVF_EVICTION_POLICY must be one of {', '.join(POLICY_NAMES)}, got {name!r}")
    # At most 99: a segment never holds more than its capacity, so at 100 a full one (its
    # writers refused, no inflow margin) was never pressed and nothing was evicted (review, stop 68)
    high = env_int(env, "KVF_EVICTION_HIGH_WATERMARK_PCT", 90, 1, 99)
    low = env_int(env, "KVF_EVICTION_LOW_WATERMARK_PCT", 80, 1, 100)
    if low >= high:
        raise SettingsError("KVF_EVICTION_LOW_WATERMARK_PCT must be below the high watermark")
    tick_ms = env_int(env, "KVF_EVICTION_TICK_MS", 200, 5, 60_000)
    core = EvictionConfig(
        policy=policy,
        high_watermark=high / 100,
        low_watermark=low / 100,
        # One batch a tick: at 256 a 200 ms tick (1,280 groups a second) a co-located client
        # saving 8 x 256 KiB back to back lost a third of its chunks to no_capacity
        # (docs/eviction-policy.md, "Keeping up").
        batch_max=env_int(env, "KVF_EVICTION_BATCH_MAX", BATCH_MAX_DEFAULT, 1, 4096),
        refused_cooldown_ms=env_int(env, "KVF_EVICTION_REFUSED_COOLDOWN_MS", 5_000, 0, 3_600_000),
        density_recompute_every=env_int(
            env, "KVF_EVICTION_DENSITY_RECOMPUTE_EVERY", DENSITY_RECOMPUTE_EVERY, 1, 1 << 20
        ),
        # Victims land a tick and the events' lag after a pool crosses its high watermark; a
        # writer faster than that filled the rest first (8 x 16 MiB saves into a 4 GiB segment
        # lost 46-70 % of their chunks to no_capacity: docs/eviction-policy.md, "Writers faster
        # than the ticks").
        inflow_horizon_ms=env_int(env, "KVF_EVICTION_INFLOW_HORIZON_MS", 2 * tick_ms, 0, 600_000),
    )
    admission = env.get("KVF_EVICTION_ADMISSION", "off")
    if admission not in ("off", "predicted"):
        raise SettingsError(f"KVF_EVICTION_ADMISSION must be off or predicted, got {admission!r}")
    if admission == "predicted" and policy != "density":
        raise SettingsError("KVF_EVICTION_ADMISSION=predicted needs KVF_EVICTION_POLICY=density")
    return EvictionSettings(
        core=core,
        admission=admission == "predicted",
        admission_publish_ms=env_int(env, "KVF_EVICTION_ADMISSION_PUBLISH_MS", 1_000, 10, 600_000),
        quotas=parse_quotas(env.get("KVF_EVICTION_TENANT_QUOTAS", "")),
        tick_ms=tick_ms,
        segments_refresh_ms=env_int(env, "KVF_EVICTION_SEGMENTS_REFRESH_MS", 5_000, 50, 3_600_000),
        request_timeout_s=env_int(env, "KVF_EVICTION_REQUEST_TIMEOUT_MS", 2_000, 10, 600_000) / 1000,
        demote=bool(env_int(env, "KVF_EVICTION_DEMOTE", 1, 0, 1)),
        demote_min_hits=env_int(env, "KVF_EVICTION_DEMOTE_MIN_HITS", 0, 0, 1_000_000),
        demote_cut_for_room=bool(env_int(env, "KVF_EVICTION_DEMOTE_CUT_FOR_ROOM", 1, 0, 1)),
        ssd_high_watermark=env_int(env, "KVF_EVICTION_SSD_HIGH_WATERMARK_PCT", 90, 1, 100) / 100,
        demote_timeout_s=env_int(env, "KVF_EVICTION_DEMOTE_TIMEOUT_MS", 30_000, 10, 600_000) / 1000,
        decisions_max=env_int(env, "KVF_EVICTION_DECISIONS_MAX", DECISIONS_GROUPS_DEFAULT, 0, 1_048_576),
    )
