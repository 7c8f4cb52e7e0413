"""Messages of the `eviction` service (subjects `kvf.v1.eviction.<verb>`).

The eviction-policy service follows the directory's events and asks the directory to evict;
it serves one verb for operators: `status` (`EvictionStatusRequest` → `EvictionStatus`), what
it tracks per pool (segment) and tenant (share domain) and its counters.

It also publishes (plain NATS, no reply) its admission filter on `kvf.v1.eviction.admission_filter`
(`ADMISSION_FILTER_VERB`) every `KVF_EVICTION_ADMISSION_PUBLISH_MS`; every directory instance
applies the latest one at `put_begin` while it is fresh (`kvfabric.core.eviction_admission`).
"""

from __future__ import annotations

from typing import Final

import msgspec

from kvfabric.format.ids import DomainDigest
from kvfabric.proto.codec import FamilyDecoder

__all__ = [
    "ADMISSION_BLOOM_BYTES_MAX",
    "ADMISSION_FILTER_DOMAINS_MAX",
    "ADMISSION_FILTER_POOLS_MAX",
    "ADMISSION_FILTER_VERB",
    "ADMISSION_LENGTH_CLASSES",
    "ADMISSION_UNLIMITED",
    "AdmissionFilter",
    "EvictionMessage",
    "EvictionStatus",
    "EvictionStatusRequest",
    "PoolAdmission",
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
    domain_digest: DomainDigest
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


ADMISSION_FILTER_VERB: Final = "admission_filter"  # kvf.v1.eviction.admission_filter (published)
ADMISSION_LENGTH_CLASSES: Final = 8  # per pool, one limit per prompt-length class (bit length 0..7)
ADMISSION_FILTER_POOLS_MAX: Final = 1_024  # pools (segments) one filter lists at most
ADMISSION_FILTER_DOMAINS_MAX: Final = 1_024  # protected share domains one filter lists at most
ADMISSION_UNLIMITED: Final = -1  # a class's limit when every group size is admitted
ADMISSION_BLOOM_BYTES_MAX: Final = 65_536  # the seen-ids bloom filter's size bound


class PoolAdmission(msgspec.Struct, frozen=True, kw_only=True):
    """One pool (segment) past its low watermark: a first-named chunk group of length class `c`
    (bit length of its chunk index + 1, capped at 7) whose bytes (all members and replicas)
    exceed `group_bytes_max[c]` would rank below the eviction frontier: not admitted."""

    segment_id: str
    group_bytes_max: list[int]  # ADMISSION_LENGTH_CLASSES entries; ADMISSION_UNLIMITED = no limit


class AdmissionFilter(
    msgspec.Struct, frozen=True, kw_only=True, tag="evict.admission_filter.v1", tag_field="t"
):
    """What the policy admits, published on a bounded cadence (bounded size: at most
    `ADMISSION_FILTER_POOLS_MAX` pools and `ADMISSION_FILTER_DOMAINS_MAX` domains). A pool not
    listed admits everything; a listed protected domain (below its guaranteed share), or a group
    in `seen_bloom`, is always admitted. The directory judges age by its own clock, from when it
    received the filter."""

    generated_ms: int  # the policy's clock when it built the filter
    events_seq: int  # the last directory event (stream sequence) the policy had applied
    policy: str
    pools: list[PoolAdmission]
    protected_domains: list[DomainDigest] = msgspec.field(default_factory=list)
    # A bloom filter of the chunk groups the policy named recently (its ghost: resident, or
    # evicted and remembered): such a group is not first-named, so the limits do not apply to
    # it. Empty: none. `seen_bloom_hashes` bit positions per group key.
    seen_bloom: bytes = b""
    seen_bloom_hashes: int = 0


EvictionMessage = EvictionStatusRequest | EvictionStatus | AdmissionFilter

eviction_decoder: FamilyDecoder[EvictionMessage] = FamilyDecoder(EvictionMessage, "eviction")
