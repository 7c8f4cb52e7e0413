"""Repair settings, from `KVF_REPAIR_*` environment variables.

| variable | default | meaning |
|---|---|---|
| `KVF_REPAIR_REPLICAS_TARGET` | `KVF_DIRECTORY_REPLICAS_DEFAULT`, else 1 | replicas per object |
| `KVF_REPAIR_BANDWIDTH_BYTES_PER_S` | 209715200 (200 MiB/s) | copy budget: online reads keep the rest |
| `KVF_REPAIR_BURST_BYTES` | 268435456 | token bucket size (and the largest object repaired) |
| `KVF_REPAIR_COPIES_IN_FLIGHT_MAX` | 8 | copies running at once |
| `KVF_REPAIR_COPIES_PER_SEGMENT_MAX` | 4 | copies at once to one segment (`KVF_SEGMENT_COPIES_MAX`) |
| `KVF_REPAIR_SCAN_MS` | 2000 | anti-entropy pass period (list segments + objects below target) |
| `KVF_REPAIR_TICK_MS` | 100 | how often copies are planned |
| `KVF_REPAIR_COPY_TIMEOUT_MS` | 10000 | one copy, ticket to confirm (a failed copy aborts its ticket) |
| `KVF_REPAIR_REQUEST_TIMEOUT_MS` | 5000 | per directory request |
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvfabric.core.repair import RepairConfig
from kvfabric.runtime.config import env_int

__all__ = ["RepairSettings", "load_repair_settings"]


@dataclass(frozen=True, kw_only=True)
class RepairSettings:
    core: RepairConfig
    replicas_target: int
    scan_ms: int
    tick_ms: int
    copy_timeout_s: float
    request_timeout_s: float


def load_repair_settings(env: Mapping[str, str]) -> RepairSettings:
    # the directory's target, as its own default (1): with neither set, repair wanted 2 while the
    # directory listed only groups below 1, and a drain kept copies on the draining segment
    # that it could never retire (review, stop 70)
    default_target = env_int(env, "KVF_DIRECTORY_REPLICAS_DEFAULT", 1, 1, 5)
    copy_timeout_ms = env_int(env, "KVF_REPAIR_COPY_TIMEOUT_MS", 10_000, 100, 600_000)
    core = RepairConfig(
        bandwidth_bytes_per_s=env_int(env, "KVF_REPAIR_BANDWIDTH_BYTES_PER_S", 200 << 20, 1, 1 << 40),
        burst_bytes=env_int(env, "KVF_REPAIR_BURST_BYTES", 256 << 20, 1, 1 << 40),
        copies_in_flight_max=env_int(env, "KVF_REPAIR_COPIES_IN_FLIGHT_MAX", 8, 1, 1024),
        copies_per_destination_max=env_int(env, "KVF_REPAIR_COPIES_PER_SEGMENT_MAX", 4, 1, 1024),
        copy_timeout_ms=2 * copy_timeout_ms + 2_000,  # the shell times out first and reports failure
    )
    return RepairSettings(
        core=core,
        replicas_target=env_int(env, "KVF_REPAIR_REPLICAS_TARGET", default_target, 1, 5),
        scan_ms=env_int(env, "KVF_REPAIR_SCAN_MS", 2_000, 10, 3_600_000),
        tick_ms=env_int(env, "KVF_REPAIR_TICK_MS", 100, 5, 60_000),
        copy_timeout_s=copy_timeout_ms / 1000,
        request_timeout_s=env_int(env, "KVF_REPAIR_REQUEST_TIMEOUT_MS", 5_000, 10, 600_000) / 1000,
    )
