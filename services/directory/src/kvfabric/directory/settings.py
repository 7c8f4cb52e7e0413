"""Directory-specific settings, from `KVF_DIRECTORY_*` / `KVF_CLUSTER_SECRET` environment variables.

The runtime's shared flags (NATS URL, metrics port, in-flight limit, logging) come from
`kvfabric.runtime.config`. These are read from the environment only:

| variable | default | meaning |
|---|---|---|
| `KVF_CLUSTER_SECRET` | required, ≥ 16 bytes | signs write tickets; segments share it, clients never |
| `KVF_DIRECTORY_REPLICAS_DEFAULT` | 1 | replicas per object when a put does not ask |
| `KVF_DIRECTORY_HEARTBEAT_INTERVAL_MS` | 1000 | told to segments at register |
| `KVF_DIRECTORY_HEARTBEAT_TIMEOUT_MS` | 5000 | silence after which a segment is down |
| `KVF_DIRECTORY_TICK_MS` | 100 | how often leases, deadlines and heartbeats are checked |
| `KVF_DIRECTORY_EVENTS_OUTBOX_MAX` | 10000 | events waiting for JetStream; when full, handlers wait |
| `KVF_DIRECTORY_EVENTS_MAX_AGE_S` | 86400 | JetStream retention of the events stream |
| `KVF_DIRECTORY_EVENTS_MAX_BYTES` | 1 GiB | its size bound, oldest dropped first (0: none) |
| `KVF_DIRECTORY_EVENTS_STUCK_AFTER_FAILURES` | 5 | failed tries at one event: stuck (then recreated) |
| `KVF_DIRECTORY_LEADER_LEASE_TTL_MS` | 3000; 15000 with KV replicas > 1 | leader lease (JetStream KV) |
| `KVF_DIRECTORY_LEASE_TTL_MS_MAX` | 30000 | longest read lease granted; a new leader's grace period |
| `KVF_DIRECTORY_TENANT_QUOTAS` | `{}` | JSON `{"<32 hex domain digest>": QUOTA}`: limits of listed tenants |
| `KVF_DIRECTORY_TENANT_DEFAULT_QUOTA` | `{}` (unlimited) | JSON QUOTA of every tenant not listed |
| `KVF_DIRECTORY_TENANTS_MAX` | 10000 | token buckets / rejection counts kept (least recently used go) |
| `KVF_DIRECTORY_TENANT_LEASES_MAX` / `_PINS_MAX` | 50000 / 2500 | leases / pins one tenant may hold |
| `KVF_DIRECTORY_TENANT_LEASE_GROUPS_MAX` | 262144 | groups one tenant's leases name, per shard |
| `KVF_DIRECTORY_TENANT_PIN_GROUPS_MAX` | 65536 | groups one tenant's pins name, per shard |
| `KVF_DIRECTORY_TENANT_PIN_TTL_MS_MAX` | 3600000 | longest pin a tenant gets (a longer one is shortened) |
| `KVF_DIRECTORY_PENDING_OBJECTS_MAX` | 200000 | objects being written (all tenants), per shard |
| `KVF_DIRECTORY_TENANT_PENDING_OBJECTS_MAX` | 50000 | objects one tenant may be writing, per shard |
| `KVF_DIRECTORY_TENANT_PENDING_CAPACITY_PCT` | 25 | % of capacity one tenant may hold reserved (writes) |
| `KVF_DIRECTORY_WRITE_TTL_MS_MAX` | 30000 | longest write deadline granted (a longer one is shortened) |
| `KVF_DIRECTORY_FREE_BYTES_GRANULES` | 64 | placement sees free space in 1/N of capacity (0 = exact) |
| `KVF_DIRECTORY_ADMISSION_STALE_MS` | 5000 | eviction admission filter applies while this fresh (0 = off) |
| `KVF_DIRECTORY_TENANT_GRANTS` | `{}` | JSON `{"<tenant>": [DIGEST, ...]}` (see below) |
| `KVF_DIRECTORY_TENANT_GRANTS_FILE` | unset | a file holding the GRANTS JSON (wins over the variable) |
| `KVF_DIRECTORY_LOOKUP_REPLY_MIN_MS` | 0 (off) | pad tenant lookup replies to this many ms |
| `KVF_DIRECTORY_WRITE_SLICE_IDS` | 64 | writes of over 256 ids: steps of this many ids (0 = whole) |
| `KVF_DIRECTORY_SHARDS` | 16 | virtual shards (fixed for a cluster's life: every instance must agree) |
| `KVF_DIRECTORY_KV_REPLICAS` | 1 | replicas of its KV buckets and events stream (3 on a NATS cluster) |
| `KVF_DIRECTORY_REBALANCE` | 0 | 1: shards move to a joining instance (rendezvous hashing); 0: sticky |
| `KVF_DIRECTORY_NATS_MONITOR_URL` | unset | nats-server monitor: a stuck lease bucket is recreated |
| `KVF_DIRECTORY_FAIR_TENANT_IDS_PER_S` | 8192 | fair admission: a tenant's refill, ids/s (per instance) |
| `KVF_DIRECTORY_FAIR_TENANT_BURST_IDS` | 65536 | … its bucket, ids (≥ 4,096 + the request cost) |
| `KVF_DIRECTORY_FAIR_REQUEST_COST_IDS` | 16 | … fixed part of each request's cost, ids |
| `KVF_DIRECTORY_FAIR_TENANT_QUEUE_MAX` | 16 | … a tenant's requests waiting for a turn (more: `busy`) |
| `KVF_DIRECTORY_FAIR_RUNNING_MAX` | 8 | … requests started and not done, all tenants |
| `KVF_DIRECTORY_FAIR_TENANT_RUNNING_MAX` | 1 | … of one tenant (≤ the above) |
| `KVF_DIRECTORY_GIVEBACK_EMPTY_IDS_PER_S` | 16384 | give-back ids that released nothing, ids/s a tenant |
| `KVF_DIRECTORY_GIVEBACK_EMPTY_BURST_IDS` | 65536 | … its bucket and deepest debt, ids |
| `KVF_DIRECTORY_CPU_PRIORITY` | `nice:-10` | CPU priority: `nice:N`, `rr:P` or `off` (`.cpu_priority`) |
| `KVF_DIRECTORY_TENANT_REFUSAL_HOLD_MS` | 250 | a tenant past its in-flight share is refused this late, ms |
| `KVF_DIRECTORY_TENANT_TARPIT_REFUSALS` | 48 | its own `busy` answers in 1 s that tarpit a tenant (0: off) |
| `KVF_DIRECTORY_TENANT_TARPIT_MS` | 2000 | first tarpit, ms (then ¼ the refusals: twice as long, ≤ 30 s) |

The leader lease is how long a standby waits before it takes over the shards of an instance that
died without a word (a leader renews every second, or every third of a shorter lease). On a NATS
cluster it must outlast a JetStream stream-leader election of the leaders bucket (4-9 s in
nats-server) plus a renewal, or one NATS node lost moves shards that did not need to move:
hence 15 s there (`kvfabric.directory.leader`, docs/chaos.md nats-node-kill).

With more than one shard, every shard's core enforces a tenant's `bytes_max` and `objects_max`
divided by the shard count (rounded up; keys spread evenly over shards), and its request rate
as configured (a request split by shard costs one token in each shard it touches). The same
holds for `KVF_DIRECTORY_TENANT_PENDING_CAPACITY_PCT`: each shard's core lets a tenant reserve
that share of the capacity divided by the shard count (a chunk group's members all go to one
shard: a chunk group larger than that share can never be written; raise the percentage).

QUOTA is a JSON object with any of `bytes_max`, `objects_max` (integers ≥ 0), `requests_per_s`
(number ≥ 0) and `burst` (integer ≥ 0, needs `requests_per_s`); absent or 0 = unlimited.

GRANTS name, per authenticated tenant (NATS user `tenant-<name>`, written by `kvctl auth init`),
the share-domain digests (32 hex) it may use; a tenant not listed is refused. Lookup padding
hides the hit/miss timing difference (docs/security.md).

FAIR admission (`kvfabric.directory.admission`, `.fair`) is always on: every tenant request
except a give-back (release, unpin, abort) costs `KVF_DIRECTORY_FAIR_REQUEST_COST_IDS` + the ids
it names from its tenant's bucket and waits for its turn (tenants take turns by ids: fair
queueing) before a core sees it; a full bucket or queue is `busy` at once. It is per instance
(all shards led there share the event loop) and on top of the optional per-domain
`requests_per_s` quotas above. A give-back (release, unpin, abort, lease_release_many) never
waits and is never refused for load: only its ids that released nothing are charged, to the
tenant's `KVF_DIRECTORY_GIVEBACK_EMPTY_*` bucket; once that is spent, the tenant's give-back runs
its first 64 ids (one part of a lease_release_many) and is `busy` if they released nothing
(`kvfabric.directory.giveback`); after that, its give-backs are `busy` before they are decoded until
a token has refilled (the bucket keeps a debt of up to its burst).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from kvfabric.core.authz import TenantGrant
from kvfabric.core.directory import DirectoryConfig
from kvfabric.core.quotas import UNLIMITED, TenantQuota
from kvfabric.directory.admission import AdmissionConfig
from kvfabric.directory.cpu_priority import CPU_PRIORITY_DEFAULT, CpuPriority
from kvfabric.directory.cpu_priority import parse as parse_cpu_priority
from kvfabric.directory.shell import WRITE_SLICE_IDS as WRITE_SLICE_IDS_DEFAULT
from kvfabric.format.ids import DomainDigest
from kvfabric.proto.directory import (
    LOOKUP_BATCH_GROUPS_MAX,
    PIN_TTL_MS_MAX,
    PUT_BATCH_OBJECTS_MAX,
    WRITE_TTL_MS_MAX,
)
from kvfabric.proto.shards import SHARDS_MAX
from kvfabric.proto.subjects import check_tenant
from kvfabric.proto.tickets import SECRET_BYTES_MIN
from kvfabric.runtime.config import SettingsError, env_int
from kvfabric.runtime.service import TENANT_REFUSAL_HOLD_MS_DEFAULT, TENANT_REFUSAL_HOLD_MS_MAX
from kvfabric.runtime.tarpit_core import TarpitConfig

TARPIT_DEFAULT: Final = TarpitConfig()

__all__ = [
    "FAIR_DEFAULT",
    "DirectorySettings",
    "load_directory_settings",
    "load_fair_admission",
    "parse_grants",
    "parse_quota",
    "parse_tenant_quotas",
    "per_shard",
]

# Leader lease: one nats-server (no election to ride out) / a NATS cluster (KV replicas > 1: a
# stream-leader election takes 4-9 s, server/raft.go, and the lease must outlast it).
LEADER_LEASE_TTL_MS_DEFAULT: Final = 3_000
LEADER_LEASE_TTL_MS_CLUSTER_DEFAULT: Final = 15_000
# The events stream's size bound: lookups' `accessed` events alone grew it ~0.4 MB/s per tenant
# at its fair rate, kept 24 h (38 GB a day, x3 on a NATS cluster) in the store the leader
# leases need (review, 2026-12-06). A follower that falls behind the oldest kept event
# resynchronises from the listings, as after any gap.
EVENTS_MAX_BYTES_DEFAULT: Final = 1 << 30
_QUOTA_FIELDS: Final = ("bytes_max", "objects_max", "requests_per_s", "burst")
_COUNT_MAX: Final = 2**63 - 1
# Fair admission's defaults (docs/security.md has the measurements): a lookup hit costs the
# shared 2-core VM's loop ~50 us an id, so 8,192 ids/s is about 40 % of it for one tenant's
# sustained flood of max-size hits (2 a second; 400 4-id lookups at cost 20); the 65,536 burst
# lets a 20,000-chunk save through at once (its put_begins and commits: ~43,000).
FAIR_DEFAULT: Final = AdmissionConfig(
    ids_per_s=8_192.0,
    burst_ids=65_536,
    request_cost_ids=16,
    queue_max=16,
    running_max=8,
    tenant_running_max=1,
    # A 4,096-key put_abort naming nothing costs this VM's loop ~29 ms (7 us a key): 16,384
    # empty ids/s is ~12 % of it; honest give-backs release what they name and cost nothing here.
    giveback_empty_ids_per_s=16_384.0,
    giveback_empty_burst_ids=65_536,
)


@dataclass(frozen=True, kw_only=True)
class DirectorySettings:
    core: DirectoryConfig
    tick_ms: int = 100
    events_outbox_max: int = 10_000
    events_max_age_s: int = 86_400
    events_max_bytes: int = EVENTS_MAX_BYTES_DEFAULT
    events_stuck_after_failures: int = 5
    free_timeout_s: float = 2.0
    leader_lease_ttl_ms: int = 3_000
    grants: Mapping[str, TenantGrant] = dataclasses.field(default_factory=dict)
    lookup_reply_min_ms: int = 0
    write_slice_ids: int = WRITE_SLICE_IDS_DEFAULT
    tenant_refusal_hold_ms: int = TENANT_REFUSAL_HOLD_MS_DEFAULT
    # The tarpit (kvfabric.runtime.tarpit; docs/security.md): None = off.
    tarpit: TarpitConfig | None = TARPIT_DEFAULT
    shards: int = 16
    rebalance: bool = False
    kv_replicas: int = 1
    nats_monitor_url: str = ""
    fair: AdmissionConfig = FAIR_DEFAULT
    cpu_priority: CpuPriority = dataclasses.field(
        default_factory=lambda: parse_cpu_priority(CPU_PRIORITY_DEFAULT)
    )


def load_directory_settings(env: Mapping[str, str]) -> DirectorySettings:
    secret = env.get("KVF_CLUSTER_SECRET", "").encode()
    if len(secret) < SECRET_BYTES_MIN:
        raise SettingsError(f"KVF_CLUSTER_SECRET must be set to at least {SECRET_BYTES_MIN} bytes")
    core = DirectoryConfig(
        ticket_secret=secret,
        replicas_default=env_int(env, "KVF_DIRECTORY_REPLICAS_DEFAULT", 1, 1, 5),
        heartbeat_interval_ms=env_int(env, "KVF_DIRECTORY_HEARTBEAT_INTERVAL_MS", 1_000, 10, 600_000),
        heartbeat_timeout_ms=env_int(env, "KVF_DIRECTORY_HEARTBEAT_TIMEOUT_MS", 5_000, 20, 3_600_000),
        lease_ttl_ms_max=env_int(env, "KVF_DIRECTORY_LEASE_TTL_MS_MAX", 30_000, 100, 600_000),
        tenant_quotas=parse_tenant_quotas(
            "KVF_DIRECTORY_TENANT_QUOTAS", env.get("KVF_DIRECTORY_TENANT_QUOTAS", "")
        ),
        tenant_quota_default=_parse_default(env.get("KVF_DIRECTORY_TENANT_DEFAULT_QUOTA", "")),
        tenants_max=env_int(env, "KVF_DIRECTORY_TENANTS_MAX", 10_000, 1, 10_000_000),
        tenant_leases_max=env_int(env, "KVF_DIRECTORY_TENANT_LEASES_MAX", 50_000, 1, 10_000_000),
        tenant_pins_max=env_int(env, "KVF_DIRECTORY_TENANT_PINS_MAX", 2_500, 1, 10_000_000),
        tenant_lease_groups_max=env_int(
            env, "KVF_DIRECTORY_TENANT_LEASE_GROUPS_MAX", 262_144, 4_096, 1 << 30
        ),
        tenant_pin_groups_max=env_int(env, "KVF_DIRECTORY_TENANT_PIN_GROUPS_MAX", 65_536, 4_096, 1 << 30),
        tenant_pin_ttl_ms_max=env_int(
            env, "KVF_DIRECTORY_TENANT_PIN_TTL_MS_MAX", 3_600_000, 1_000, PIN_TTL_MS_MAX
        ),
        pending_objects_max=env_int(env, "KVF_DIRECTORY_PENDING_OBJECTS_MAX", 200_000, 1, 100_000_000),
        tenant_pending_objects_max=env_int(
            env, "KVF_DIRECTORY_TENANT_PENDING_OBJECTS_MAX", 50_000, 1, 100_000_000
        ),
        tenant_pending_capacity_fraction=env_int(env, "KVF_DIRECTORY_TENANT_PENDING_CAPACITY_PCT", 25, 1, 100)
        / 100,
        write_ttl_ms_max=env_int(env, "KVF_DIRECTORY_WRITE_TTL_MS_MAX", 30_000, 100, WRITE_TTL_MS_MAX),
        free_bytes_granules=env_int(env, "KVF_DIRECTORY_FREE_BYTES_GRANULES", 64, 0, 1_000_000),
        admission_stale_ms=env_int(env, "KVF_DIRECTORY_ADMISSION_STALE_MS", 5_000, 0, 600_000),
    )
    shards = env_int(env, "KVF_DIRECTORY_SHARDS", 16, 1, SHARDS_MAX)
    if shards > 1:
        core = dataclasses.replace(
            core,
            segments_shared=True,
            tenant_quotas={d: per_shard(q, shards) for d, q in core.tenant_quotas.items()},
            tenant_quota_default=per_shard(core.tenant_quota_default, shards),
            tenant_pending_capacity_fraction=core.tenant_pending_capacity_fraction / shards,
        )
    kv_replicas = env_int(env, "KVF_DIRECTORY_KV_REPLICAS", 1, 1, 5)
    lease_default_ms = (
        LEADER_LEASE_TTL_MS_DEFAULT if kv_replicas == 1 else LEADER_LEASE_TTL_MS_CLUSTER_DEFAULT
    )
    return DirectorySettings(
        shards=shards,
        rebalance=env_int(env, "KVF_DIRECTORY_REBALANCE", 0, 0, 1) == 1,
        kv_replicas=kv_replicas,
        nats_monitor_url=env.get("KVF_DIRECTORY_NATS_MONITOR_URL", "").strip(),
        core=core,
        tick_ms=env_int(env, "KVF_DIRECTORY_TICK_MS", 100, 5, 60_000),
        events_outbox_max=env_int(env, "KVF_DIRECTORY_EVENTS_OUTBOX_MAX", 10_000, 1, 1_000_000),
        events_max_age_s=env_int(env, "KVF_DIRECTORY_EVENTS_MAX_AGE_S", 86_400, 60, 365 * 86_400),
        events_max_bytes=env_int(env, "KVF_DIRECTORY_EVENTS_MAX_BYTES", EVENTS_MAX_BYTES_DEFAULT, 0, 1 << 44),
        events_stuck_after_failures=env_int(env, "KVF_DIRECTORY_EVENTS_STUCK_AFTER_FAILURES", 5, 1, 1_000),
        leader_lease_ttl_ms=env_int(env, "KVF_DIRECTORY_LEADER_LEASE_TTL_MS", lease_default_ms, 300, 600_000),
        grants=_grants(env),
        lookup_reply_min_ms=env_int(env, "KVF_DIRECTORY_LOOKUP_REPLY_MIN_MS", 0, 0, 10_000),
        write_slice_ids=env_int(
            env, "KVF_DIRECTORY_WRITE_SLICE_IDS", WRITE_SLICE_IDS_DEFAULT, 0, PUT_BATCH_OBJECTS_MAX
        ),
        tenant_refusal_hold_ms=env_int(
            env,
            "KVF_DIRECTORY_TENANT_REFUSAL_HOLD_MS",
            TENANT_REFUSAL_HOLD_MS_DEFAULT,
            0,
            TENANT_REFUSAL_HOLD_MS_MAX,
        ),
        tarpit=_tarpit(env),
        fair=load_fair_admission(env),
        cpu_priority=parse_cpu_priority(env.get("KVF_DIRECTORY_CPU_PRIORITY", CPU_PRIORITY_DEFAULT)),
    )


def load_fair_admission(env: Mapping[str, str]) -> AdmissionConfig:
    """`KVF_DIRECTORY_FAIR_*` and `KVF_DIRECTORY_GIVEBACK_EMPTY_*` (module docstring); the burst
    must hold a max-size request."""
    d = FAIR_DEFAULT
    cost_ids = env_int(env, "KVF_DIRECTORY_FAIR_REQUEST_COST_IDS", d.request_cost_ids, 0, 1_000_000)
    burst_min = LOOKUP_BATCH_GROUPS_MAX + cost_ids
    running_max = env_int(env, "KVF_DIRECTORY_FAIR_RUNNING_MAX", d.running_max, 1, 100_000)
    return AdmissionConfig(
        ids_per_s=float(env_int(env, "KVF_DIRECTORY_FAIR_TENANT_IDS_PER_S", int(d.ids_per_s), 1, 10**9)),
        burst_ids=env_int(
            env, "KVF_DIRECTORY_FAIR_TENANT_BURST_IDS", max(d.burst_ids, burst_min), burst_min, 10**9
        ),
        request_cost_ids=cost_ids,
        queue_max=env_int(env, "KVF_DIRECTORY_FAIR_TENANT_QUEUE_MAX", d.queue_max, 1, 100_000),
        running_max=running_max,
        tenant_running_max=env_int(
            env,
            "KVF_DIRECTORY_FAIR_TENANT_RUNNING_MAX",
            min(d.tenant_running_max, running_max),
            1,
            running_max,
        ),
        giveback_empty_ids_per_s=float(
            env_int(env, "KVF_DIRECTORY_GIVEBACK_EMPTY_IDS_PER_S", int(d.giveback_empty_ids_per_s), 1, 10**9)
        ),
        giveback_empty_burst_ids=env_int(
            env, "KVF_DIRECTORY_GIVEBACK_EMPTY_BURST_IDS", d.giveback_empty_burst_ids, 1, 10**9
        ),
    )


def per_shard(quota: TenantQuota, shards: int) -> TenantQuota:
    """The part of a tenant's byte and object quota one of `shards` cores enforces."""
    return dataclasses.replace(
        quota,
        bytes_max=math.ceil(quota.bytes_max / shards),
        objects_max=math.ceil(quota.objects_max / shards),
    )


def _tarpit(env: Mapping[str, str]) -> TarpitConfig | None:
    """The tarpit's trigger and first duration (table above); 0 refusals: off."""
    default = TARPIT_DEFAULT
    refusals = env_int(env, "KVF_DIRECTORY_TENANT_TARPIT_REFUSALS", default.refusals_max, 0, 1_000_000)
    if refusals == 0:
        return None
    first_ms = env_int(env, "KVF_DIRECTORY_TENANT_TARPIT_MS", round(default.duration_s * 1000), 1, 30_000)
    return TarpitConfig(refusals_max=refusals, duration_s=first_ms / 1000)


def _grants(env: Mapping[str, str]) -> dict[str, TenantGrant]:
    path = env.get("KVF_DIRECTORY_TENANT_GRANTS_FILE", "")
    if not path:
        return parse_grants("KVF_DIRECTORY_TENANT_GRANTS", env.get("KVF_DIRECTORY_TENANT_GRANTS", ""))
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise SettingsError(f"KVF_DIRECTORY_TENANT_GRANTS_FILE: cannot read {path}: {exc}") from None
    return parse_grants("KVF_DIRECTORY_TENANT_GRANTS_FILE", text)


def parse_grants(name: str, raw: str) -> dict[str, TenantGrant]:
    """`{"<tenant>": ["<32 hex domain digest>", ...], ...}` → tenant → `TenantGrant`; empty: `{}`."""
    if not raw.strip():
        return {}
    doc = _json(name, raw)
    if not isinstance(doc, dict):
        raise SettingsError(f"{name}: want a JSON object of tenant -> list of domain digests")
    grants: dict[str, TenantGrant] = {}
    for tenant, digests in doc.items():
        try:
            check_tenant(tenant)
        except ValueError as exc:
            raise SettingsError(f"{name}: {exc}") from None
        if not isinstance(digests, list) or not digests:
            raise SettingsError(f"{name}[{tenant}]: want a non-empty list of domain digests")
        domains: set[DomainDigest] = set()
        for digest_hex in digests:
            try:
                digest = DomainDigest(bytes.fromhex(digest_hex) if isinstance(digest_hex, str) else b"")
            except ValueError:
                digest = DomainDigest(b"")
            if len(digest) != 16:
                raise SettingsError(f"{name}[{tenant}]: {digest_hex!r} is not a domain digest (32 hex)")
            domains.add(digest)
        home = DomainDigest(bytes.fromhex(digests[0]))  # the tenant's own domain is listed first
        grants[tenant] = TenantGrant(tenant=tenant, domains=frozenset(domains), home=home)
    return grants


def _json(name: str, raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise SettingsError(f"{name}: not valid JSON ({exc})") from None


def _parse_default(raw: str) -> TenantQuota:
    name = "KVF_DIRECTORY_TENANT_DEFAULT_QUOTA"
    return parse_quota(name, _json(name, raw)) if raw.strip() else UNLIMITED


def parse_tenant_quotas(name: str, raw: str) -> dict[bytes, TenantQuota]:
    """`{"<32 hex digest>": QUOTA, ...}` → digest bytes → `TenantQuota`; empty: `{}`."""
    if not raw.strip():
        return {}
    doc = _json(name, raw)
    if not isinstance(doc, dict):
        raise SettingsError(f"{name}: want a JSON object of domain digest -> quota")
    quotas: dict[bytes, TenantQuota] = {}
    for digest_hex, value in doc.items():
        try:
            digest = bytes.fromhex(digest_hex)
        except ValueError:
            digest = b""
        if len(digest) != 16:
            raise SettingsError(f"{name}: {digest_hex!r} is not a domain digest (32 hex characters)")
        if digest in quotas:
            raise SettingsError(f"{name}: domain digest {digest.hex()} given twice")
        quotas[digest] = parse_quota(f"{name}[{digest.hex()}]", value)
    return quotas


def parse_quota(name: str, value: Any) -> TenantQuota:
    """One QUOTA object; strict: unknown keys, wrong types and negative values are refused."""
    if not isinstance(value, dict):
        raise SettingsError(f"{name}: want a JSON object with {', '.join(_QUOTA_FIELDS)}")
    unknown = sorted(set(value) - set(_QUOTA_FIELDS))
    if unknown:
        raise SettingsError(
            f"{name}: unknown field(s) {', '.join(unknown)}; known: {', '.join(_QUOTA_FIELDS)}"
        )
    counts = {}
    for field in ("bytes_max", "objects_max", "burst"):
        v = value.get(field, 0)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= _COUNT_MAX:
            raise SettingsError(f"{name}.{field}={v!r}: want an integer >= 0 (0 = unlimited)")
        counts[field] = v
    rate = value.get("requests_per_s", 0)
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not math.isfinite(rate) or rate < 0:
        raise SettingsError(f"{name}.requests_per_s={rate!r}: want a number >= 0 (0 = unlimited)")
    if counts["burst"] and not rate:
        raise SettingsError(f"{name}.burst needs requests_per_s > 0")
    return TenantQuota(
        bytes_max=counts["bytes_max"],
        objects_max=counts["objects_max"],
        requests_per_s=float(rate),
        burst=counts["burst"],
    )
