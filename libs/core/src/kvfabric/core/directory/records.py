"""Compact records of published chunk groups (pure).

The directory may hold millions of published objects, so a published chunk group is kept as
one immutable `bytes` record (target: ≤ 300 B of directory RAM per object, measured by
`make bench`). Rich Python objects are used only for groups still being written (bounded by
`pending_objects_max`).

Record layout (little-endian):

| field | type | note |
|---|---|---|
| namespace index | u32 | interned (domain, model, layout-sans-rank) fields, see `DirectoryCore` |
| chunk index | u32 | position of the chunk in its prefix |
| member count | u8 | |
| flags | u8 | bit 0: degraded (fewer replicas than the target; repair wanted) |
| per member: tp_rank, pp_stage, layer_group | 3 × u16 | |
| per member: size | u64 | bytes |
| per member: checksum | 16 B | xxh3-128 of the bytes |
| per member: replica count | u8 | |
| per replica: placement index | u32 | interned (segment id, incarnation) |
| per replica: slot | u32 | |
| per replica: slot generation | u64 | |
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final

from kvfabric.format.invariant import invariant

__all__ = [
    "FLAG_DEGRADED",
    "MEMBER_REPLICAS_MAX",
    "MemberRecord",
    "PublishedGroup",
    "ReplicaRecord",
    "pack_group",
    "replica_segments",
    "unpack_group",
]

FLAG_DEGRADED: Final = 1
_HEADER = struct.Struct("<IIBB")
_MEMBER = struct.Struct("<HHHQ16sB")
_REPLICA = struct.Struct("<IIQ")


@dataclass(frozen=True, slots=True)
class ReplicaRecord:
    placement: int
    slot: int
    slot_generation: int


def replica_segments(replicas: tuple[ReplicaRecord, ...]) -> int:
    """How many segment incarnations hold these replicas: what counts toward a replica target.
    An arena replica and a disk replica on one segment are one (a head copied to disk keeps its
    arena copy; a promotion adds an arena copy next to the disk one): counted as two, a group on
    one segment met a target of 2 and was neither degraded nor repaired (review, 2026-12-06)."""
    return len({r.placement for r in replicas})


@dataclass(frozen=True, slots=True)
class MemberRecord:
    tp_rank: int
    pp_stage: int
    layer_group: int
    size_bytes: int
    checksum: bytes
    replicas: tuple[ReplicaRecord, ...]

    @property
    def member(self) -> tuple[int, int, int]:
        return (self.tp_rank, self.pp_stage, self.layer_group)


@dataclass(frozen=True, slots=True)
class PublishedGroup:
    namespace: int
    chunk_index: int
    flags: int
    members: tuple[MemberRecord, ...]

    @property
    def degraded(self) -> bool:
        return bool(self.flags & FLAG_DEGRADED)


MEMBER_REPLICAS_MAX: Final = 255  # a member record counts its replicas in a u8


def pack_group(group: PublishedGroup) -> bytes:
    invariant(0 < len(group.members) < 256, "member count out of range", n=len(group.members))
    parts = [_HEADER.pack(group.namespace, group.chunk_index, len(group.members), group.flags)]
    for m in group.members:
        invariant(len(m.checksum) == 16, "checksum must be 16 bytes")
        invariant(0 < len(m.replicas) <= MEMBER_REPLICAS_MAX, "replica count out of range", n=len(m.replicas))
        parts.append(
            _MEMBER.pack(m.tp_rank, m.pp_stage, m.layer_group, m.size_bytes, m.checksum, len(m.replicas))
        )
        parts.extend(_REPLICA.pack(r.placement, r.slot, r.slot_generation) for r in m.replicas)
    return b"".join(parts)


def unpack_group(record: bytes) -> PublishedGroup:
    namespace, chunk_index, n_members, flags = _HEADER.unpack_from(record, 0)
    offset = _HEADER.size
    members = []
    for _ in range(n_members):
        rank, stage, lgroup, size, checksum, n_replicas = _MEMBER.unpack_from(record, offset)
        offset += _MEMBER.size
        replicas = []
        for _ in range(n_replicas):
            replicas.append(ReplicaRecord(*_REPLICA.unpack_from(record, offset)))
            offset += _REPLICA.size
        members.append(MemberRecord(rank, stage, lgroup, size, checksum, tuple(replicas)))
    invariant(offset == len(record), "trailing bytes in group record", offset=offset, size=len(record))
    return PublishedGroup(namespace, chunk_index, flags, tuple(members))
