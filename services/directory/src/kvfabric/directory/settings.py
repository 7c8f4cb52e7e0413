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
| `KVF_DIRECTORY_LEADER_LEASE_TTL_MS` | 3000 | leader lease (JetStream KV): standby takeover delay |
| `KVF_DIRECTORY_LEASE_TTL_MS_MAX` | 30000 | longest read lease granted; a new leader's grace period |
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvfabric.core.directory import DirectoryConfig
from kvfabric.proto.tickets import SECRET_BYTES_MIN
from kvfabric.runtime.config import SettingsError, env_int

__all__ = ["DirectorySettings", "load_directory_settings"]


@dataclass(frozen=True, kw_only=True)
class DirectorySettings:
    core: DirectoryConfig
    tick_ms: int = 100
    events_outbox_max: int = 10_000
    events_max_age_s: int = 86_400
    free_timeout_s: float = 2.0
    leader_lease_ttl_ms: int = 3_000


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
    )
    return DirectorySettings(
        core=core,
        tick_ms=env_int(env, "KVF_DIRECTORY_TICK_MS", 100, 5, 60_000),
        events_outbox_max=env_int(env, "KVF_DIRECTORY_EVENTS_OUTBOX_MAX", 10_000, 1, 1_000_000),
        events_max_age_s=env_int(env, "KVF_DIRECTORY_EVENTS_MAX_AGE_S", 86_400, 60, 365 * 86_400),
        leader_lease_ttl_ms=env_int(env, "KVF_DIRECTORY_LEADER_LEASE_TTL_MS", 3_000, 300, 600_000),
    )
