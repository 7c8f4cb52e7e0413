"""Messages of the `eviction` service (subjects `kvf.v1.eviction.<verb>`).

The eviction-policy service follows the directory's events and asks the directory to evict;
it serves two verbs for operators (`kvctl eviction status|explain`): `status`
(`EvictionStatusRequest` → `EvictionStatus`), what it tracks per pool (segment) and tenant
(share domain) and its counters; `explain` (`EvictionExplainRequest` → `EvictionExplain`), why
it holds, held or dropped one chunk group: the core's features and rank of it while tracked,
its latest decisions (`EvictionDecision`, what in `DECISION_KINDS`, with their reason codes)
and, with live admission, what the policy's latest admission filter says of it.

It also publishes (plain NATS, no reply) its admission filter on `kvf.v1.eviction.admission_filter`
(`ADMISSION_FILTER_VERB`) every `KVF_EVICTION_ADMISSION_PUBLISH_MS`; every directory instance
applies the latest one at `put_begin` while it is fresh (`kvfabric.core.eviction_admission`).
"""

from __future__ import annotations

from typing import Final

import msgspec

from kvfabric.format.ids import DomainDigest, GroupId
from kvfabric.proto.codec import FamilyDecoder

__all__ = [
    "ADMISSION_BLOOM_BYTES_MAX",
    "ADMISSION_FILTER_DOMAINS_MAX",
    "ADMISSION_FILTER_POOLS_MAX",
    "ADMISSION_FILTER_VERB",
    "ADMISSION_LENGTH_CLASSES",
    "ADMISSION_UNLIMITED",
    "DECISIONS_PER_GROUP_MAX",
    "DECISION_KINDS",
    "AdmissionExplain",
    "AdmissionFilter",
    "EvictionDecision",
    "EvictionExplain",
    "EvictionExplainRequest",
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


# What an `EvictionDecision` records of a chunk group (its `reason` code in brackets):
DECISION_KINDS: Final = (
    "tracked",  # a published event took it into the core (`ADMIT_REASONS`: always, resident)
    "moved",  # published again with its bytes on other pools (a demotion, an adoption)
    "chosen",  # a victim (`VICTIM_REASONS`, or tail_of_victim; `cause`: watermark | tenant_quota)
    "evicted",  # the directory answered `evicting` ... (cause: the batch's), or sent `evicted`
    "stays",  # the directory kept it (`EVICT_STAYS` status, `waits_for_tail`, `no_answer`)
    "unpinned",  # its last pin ended: its refusal's cooldown ended (its_last_pin_ended)
    "demoted",  # its arena replicas copied to the segment's disk tier (`pool`: the disk pool)
    "not_demoted",  # a demotion that did not happen (the segment's outcome: copied, failed ...)
    "disk_dropped",  # only its disk replicas dropped (its arena copy stays)
    "invalidated",  # the directory invalidated it (its reason, e.g. replica_lost)
    "lost",  # its segment went down (`pool`); this and its invalidation only if already logged
)
DECISIONS_PER_GROUP_MAX: Final = 8  # an explain lists at most this many, newest last


class EvictionExplainRequest(
    msgspec.Struct, frozen=True, kw_only=True, tag="evict.explain.v1", tag_field="t"
):
    """Why the policy holds, held or dropped the chunk group `group_id` (90 bytes)."""

    group_id: GroupId


class EvictionDecision(msgspec.Struct, frozen=True, kw_only=True):
    at_ms: int  # the policy's clock (wall, ms since the epoch)
    what: str  # DECISION_KINDS
    reason: str = ""  # its reason code
    pool: str = ""  # the pool (segment, `<segment>#ssd` for a disk tier) it concerns
    cause: str = ""  # a victim's batch: watermark | tenant_quota


class AdmissionExplain(msgspec.Struct, frozen=True, kw_only=True):
    """What the policy's latest admission filter (`AdmissionFilter`) says of a group of this id
    when first named: admitted whatever its size if `protected` or `seen`, else refused on a
    listed pool if its bytes exceed that pool's limit for its length class."""

    generated_ms: int  # when the policy built that filter
    length_class: int  # of the group's chunk index
    protected: bool  # its share domain is below its guaranteed share
    seen: bool  # in the filter's bloom of recently named groups
    limits: dict[str, int]  # listed pool -> largest group bytes admitted (ADMISSION_UNLIMITED)


class EvictionExplain(msgspec.Struct, frozen=True, kw_only=True, tag="evict.explain_reply.v1", tag_field="t"):
    policy: str
    tracked: bool  # the core holds it now
    # The core's `explain` while tracked: its features (tenant, bytes, accesses, chunk index,
    # leaf, evicting; per policy its priority, class, predicted reuse or hit density)
    features: dict[str, str | int | float | bool] = msgspec.field(default_factory=dict)
    decisions: list[EvictionDecision] = msgspec.field(default_factory=list)  # oldest first
    decisions_kept: bool = True  # False: the policy keeps no decisions (`KVF_EVICTION_DECISIONS_MAX=0`)
    admission: AdmissionExplain | None = None  # None: no live admission filter built


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


EvictionMessage = (
    EvictionStatusRequest | EvictionStatus | AdmissionFilter | EvictionExplainRequest | EvictionExplain
)

eviction_decoder: FamilyDecoder[EvictionMessage] = FamilyDecoder(EvictionMessage, "eviction")
