"""What the client hands engines: a folded hit (with its read lease), a load's and a save's outcome."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfabric.format.key import ChunkGroupId, MemberId
from kvfabric.proto.directory import ObjectLocation

__all__ = ["Hit", "LoadResult", "SaveResult"]


@dataclass(frozen=True, slots=True)
class Hit:
    """The longest stored prefix complete for every required member, read-leased.

    `objects[c][j]` locates chunk `c`'s object for `members[j]`. The lease keeps those objects
    from being evicted until `release` (or `lease_expires_ms`); a hit with `lease_id == 0` holds
    nothing. A prefix's chunks live in several directory shards: the hit holds one lease per shard
    it touched (`shard_leases`, (shard, lease id) pairs; `lease_id` is the first, expiry the
    earliest). `cause` says why there is no (or a shorter) hit: "" when the directory answered.
    """

    tokens: int
    tokens_per_chunk: int
    groups: tuple[ChunkGroupId, ...]
    members: tuple[MemberId, ...]
    objects: tuple[tuple[ObjectLocation, ...], ...] = ()
    lease_id: int = 0
    lease_expires_ms: int = 0
    cause: str = ""
    trace_id: str = ""  # sent as the Kvf-Trace-Id header: the directory's logs carry it
    shard_leases: tuple[tuple[int, int], ...] = ()

    @property
    def chunks(self) -> int:
        return len(self.objects)

    @property
    def size_bytes(self) -> int:
        return sum(o.size_bytes for chunk in self.objects for o in chunk)


@dataclass(frozen=True, slots=True)
class LoadResult:
    """`tokens` were loaded and verified (a whole-chunk prefix from token 0, counting chunks the
    engine already had); everything past it must be recomputed. `failed_chunks` lists chunk
    indices whose bytes may have been (partly) written and must not be used."""

    tokens: int
    chunks_loaded: int
    bytes_loaded: int
    failed_chunks: tuple[int, ...] = ()
    cause: str = ""  # the first failure's cause; "" when every asked chunk loaded


@dataclass(frozen=True, slots=True)
class SaveResult:
    """What one save did: chunks newly published, already stored, or failed (with causes)."""

    chunks_saved: int = 0
    chunks_existing: int = 0
    chunks_failed: int = 0
    bytes_written: int = 0
    causes: dict[str, int] = field(default_factory=dict)
