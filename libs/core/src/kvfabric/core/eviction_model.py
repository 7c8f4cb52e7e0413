"""The eviction core's vocabulary (`kvfabric.core.eviction`): its configuration, tenant quotas,
the effects it returns with their reason codes, and what it tracks per object and per pool.

Plain data, no behaviour but the configuration's checks: the core (`eviction.py`) keeps the
accounting and the rules, the ranking of leaves per policy is `eviction_ranking.py`. Callers
import these names from `kvfabric.core.eviction`, the core's public face.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Final, Literal, TypeAlias, get_args

from kvfabric.core.eviction_density import DENSITY_RECOMPUTE_EVERY, DensityClass
from kvfabric.format.invariant import invariant

__all__ = [
    "ADMIT_REASONS",
    "POLICY_NAMES",
    "REFUSE_REASONS",
    "VICTIM_REASONS",
    "AdmissionName",
    "Admitted",
    "Effect",
    "EvictBatch",
    "EvictionConfig",
    "ObjectId",
    "PolicyName",
    "PoolUsage",
    "Refused",
    "TenantQuota",
    "Tracked",
]

ObjectId: TypeAlias = Hashable
PolicyName = Literal["lru", "gdsf", "lru2", "sieve", "s3fifo", "wtinylfu", "reuse", "density"]
POLICY_NAMES: Final[tuple[PolicyName, ...]] = get_args(PolicyName)
AdmissionName = Literal["always", "second_hit", "predicted"]


@dataclass(frozen=True, slots=True)
class TenantQuota:
    hard_bytes: int | None = None  # over it, the tenant evicts its own objects
    guaranteed_bytes: int = 0  # at or below it, other tenants' pressure cannot evict it


@dataclass(frozen=True, slots=True)
class EvictionConfig:
    # The core's default (tests, tools); the service's is `density` (KVF_EVICTION_POLICY).
    policy: PolicyName = "lru"
    admission: AdmissionName = "always"
    high_watermark: float = 0.90
    low_watermark: float = 0.80
    batch_max: int = 256
    refused_cooldown_ms: int = 5_000
    position_weight: float = 0.05  # recompute cost per chunk grows by this per preceding chunk
    tokens_per_chunk: int = 512
    sketch_halve_every: int = 1 << 20  # sketch increments between agings (halving)
    # reuse: a chunk whose class is e times as likely to be reused stays this much longer
    reuse_horizon_ms: int = 60_000
    # density: namings between two recomputations of the hit densities (`eviction_density`)
    density_recompute_every: int = DENSITY_RECOMPUTE_EVERY
    # Tail before head within a prefix. False only to measure the plain-LRU baseline peers ship
    # (it evicts heads whose tails stay, which the simulator shows to waste capacity).
    prefix_order: bool = True
    # Headroom for writers (0: off, the simulator's and the tests' default): a pool's watermarks
    # are lowered by what its writers store in this long at their recent rate (`eviction`
    # module doc, "Writers faster than the ticks"); the service passes KVF_EVICTION_INFLOW_HORIZON_MS.
    inflow_horizon_ms: int = 0

    def __post_init__(self) -> None:
        invariant(0 < self.low_watermark <= self.high_watermark <= 1.0, "need 0 < low <= high <= 1")
        invariant(self.batch_max >= 1, "batch_max must be at least 1")
        invariant(
            self.admission != "predicted" or self.policy in ("reuse", "density"),
            "admission 'predicted' needs policy 'reuse' or 'density' (it compares their priorities)",
        )
        invariant(self.reuse_horizon_ms >= 0, "reuse_horizon_ms must not be negative")
        invariant(self.density_recompute_every >= 1, "density_recompute_every must be at least 1")
        invariant(self.inflow_horizon_ms >= 0, "inflow_horizon_ms must not be negative")


@dataclass(frozen=True, slots=True)
class EvictBatch:
    """Ask the directory to evict `victims`, in order (tails before their heads). `pool` is the
    pool under pressure, or None when a tenant is over its quota; `reason` says why the batch;
    `victim_reasons` (one code per victim, `VICTIM_REASONS`) why each was chosen."""

    pool: Hashable | None
    victims: tuple[ObjectId, ...]
    reason: str
    victim_reasons: tuple[str, ...] = field(default=(), compare=False)


@dataclass(frozen=True, slots=True)
class Admitted:
    """`reason` (`ADMIT_REASONS`) says why; it does not take part in equality."""

    object_id: ObjectId
    reason: str = field(default="always", compare=False)


@dataclass(frozen=True, slots=True)
class Refused:
    """Admission said no: the writer should not store `object_id`. `reason`
    (`REFUSE_REASONS`) says why; it does not take part in equality."""

    object_id: ObjectId
    reason: str = field(default="", compare=False)


# Reason codes (what `kvctl` can show for a group; counted as admission_refused_<code>_total)
ADMIT_REASONS: Final = (
    "always",  # admission "always"
    "resident",  # already stored: an access
    "room",  # the pool is below its low watermark
    "seen_before",  # second_hit: the sketch saw it before this request
    "predicted_reuse",  # predicted: it ranks above the lowest evictable leaf
)
REFUSE_REASONS: Final = (
    "first_sighting",  # second_hit: first time seen and the pool is full
    "parent_absent",  # predicted: its parent is not resident or is being evicted (no hit reaches it)
    "below_frontier",  # predicted: it would rank below the next victim (bypass)
)
VICTIM_REASONS: Final = (
    "least_recent",  # lru
    "least_recent_second_access",  # lru2 (seen once: "seen_once")
    "seen_once",
    "lowest_gdsf",  # gdsf
    "queue_order",  # sieve, s3fifo, wtinylfu: the queue's own order
    "low_predicted_reuse",  # reuse: its class's reuse rate is below the prior
    "idle_longest",  # reuse: a likely class, but idle longest for its rate
    "lowest_hit_density",  # density: least expected hits per byte-ms at its age
)


Effect: TypeAlias = EvictBatch | Admitted | Refused


@dataclass(slots=True)
class Tracked:
    tenant: Hashable
    pools: dict[Hashable, int]  # pool -> bytes held there (> 0 each)
    size: int  # sum of `pools`
    parent: ObjectId | None
    chunk_index: int
    last_access_ms: int
    previous_access_ms: int | None = None  # lru2: the access before the last one
    frequency: int = 1
    children: int = 0  # resident objects naming this one as parent
    children_evicting: int = 0  # of those, already chosen as victims
    evicting: bool = False
    cooldown_until_ms: int = 0
    # pinned refusals in a row (`EvictionCore.refused`), at most REFUSED_BACKOFF_SHIFT_MAX + 1:
    # each doubles the next cooldown; back to 0 on any other refusal, or when an attempt succeeds
    # without removing it (a tier move)
    refusals: int = 0
    # heap policies (`eviction_ranking`): its current heap entry's sequence number (0: none in a
    # heap; other entries naming it are stale), and its key: the entry is re-keyed to it lazily
    version: int = 0
    priority: float = 0.0  # its rank (density: last access; gdsf's clock rises to a victim's)
    rank_seq: int = 0  # when the rank was last set: ties of priority go in this order
    turn: int = 1  # reuse: the prefix's generation (`kvfabric.core.eviction_reuse`)
    prompt_chunks: int = 1  # reuse: chunks of the prompt that wrote it
    density_class: DensityClass = (1, 1)  # density: (namings, length) (`eviction_density`)


@dataclass(slots=True)
class PoolUsage:
    capacity: int = 0
    used: int = 0
    evicting: int = 0
    pressed: bool = False  # crossed the high watermark, not yet back to the low one
    inserted: int = 0  # bytes of new objects since the last tick that measured the inflow
    inflow: float = 0.0  # bytes a second new objects bring, as last measured (`EvictionCore.tick`)
    writing_since_ms: int | None = None  # since when ticks saw inflow, no gap of WRITER_GAP_MS
    inflow_seen_ms: int | None = None  # the latest tick that saw inflow
    # A pass over this pool that found nothing more it may evict is not repeated before this
    # time, unless something that may go lands in it (`EvictionCore._park`); None: not parked.
    parked_until_ms: int | None = None
    # tenants whose guaranteed share kept leaves of this pool from going in that pass -> the
    # bytes (resident, not evicting) each must reach before one of them may go
    parked_by: dict[Hashable, int] | None = None
