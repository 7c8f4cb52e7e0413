"""Messages of the `eviction` service (subjects `kvf.v1.eviction.<verb>`).

The eviction-policy service follows the directory's events and asks the directory to evict;
it serves one verb for operators: `status` (`EvictionStatusRequest` → `EvictionStatus`), what
it tracks per pool (segment) and tenant (share domain) and its counters.
"""

from __future__ import annotations

import msgspec

from kvfabric.proto.codec import FamilyDecoder

__all__ = [
    "EvictionMessage",
    "EvictionStatus",
    "EvictionStatusRequest",
    "PoolUsage",
    "TenantUsage",
    "eviction_decoder",
]


class EvictionStatusRequest(msgspec.Struct, frozen=True, kw_only=True, tag="evict.status.v1", tag_field="t"):
    """Ask the policy for its state (no fields)."""


class PoolUsage(msgspec.Struct, frozen=True, kw_only=True):
    segment_id: str
    capacity_bytes: int
    used_bytes: int  # bytes of published groups the policy tracks on it
    evicting_bytes: int


class TenantUsage(msgspec.Struct, frozen=True, kw_only=True):
    domain_digest: bytes  # 16 bytes
    used_bytes: int
    hard_bytes: int = 0  # 0 = no quota
    guaranteed_bytes: int = 0


class EvictionStatus(msgspec.Struct, frozen=True, kw_only=True, tag="evict.status_reply.v1", tag_field="t"):
    policy: str
    high_watermark: float
    low_watermark: float
    objects: int
    events_applied: int
    pools: list[PoolUsage]
    tenants: list[TenantUsage]
    counters: dict[str, int]


EvictionMessage = EvictionStatusRequest | EvictionStatus

eviction_decoder: FamilyDecoder[EvictionMessage] = FamilyDecoder(EvictionMessage, "eviction")
