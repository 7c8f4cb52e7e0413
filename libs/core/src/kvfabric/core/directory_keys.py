"""What the directory core needs from a binary key or chunk group id (pure, fast path).

The directory indexes a chunk group by its chain hash (32 bytes, salted per share domain, so
unique across tenants and models) and interns the rest of the identity (format, domain, model,
TP/PP/layer-group sizes, chunk size, layout) as a "namespace". A caller that pairs a known chain
hash with other namespace fields is refused: every lookup compares both.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfabric.format.errors import BadRequest
from kvfabric.format.key import CHUNK_GROUP_BYTES, KEY_BYTES, ChunkGroupId, KVKey

__all__ = ["GroupInfo", "KeyInfo", "parse_group", "parse_key"]

# Byte ranges inside ChunkGroupId.to_bytes() (see kvfabric.format.key's layout table).
_NAMESPACE = slice(0, 54)
_CHUNK_INDEX = slice(54, 58)
_CHAIN = slice(58, 90)


@dataclass(frozen=True, slots=True)
class GroupInfo:
    group_id: bytes  # the chain hash
    namespace: bytes
    chunk_index: int
    expected_members: int


@dataclass(frozen=True, slots=True)
class KeyInfo:
    group: GroupInfo
    member: tuple[int, int, int]


def _group_info(raw: bytes) -> GroupInfo:
    gid = ChunkGroupId.from_bytes(raw)  # validates versions, sizes and ranges
    return GroupInfo(
        group_id=bytes(raw[_CHAIN]),
        namespace=bytes(raw[_NAMESPACE]),
        chunk_index=int.from_bytes(raw[_CHUNK_INDEX], "little"),
        expected_members=gid.tp_size * gid.pp_size * gid.layer_group_count,
    )


def parse_group(raw: bytes) -> GroupInfo:
    if len(raw) != CHUNK_GROUP_BYTES:
        raise BadRequest(f"chunk group id must be {CHUNK_GROUP_BYTES} bytes, got {len(raw)}")
    return _group_info(raw)


def parse_key(raw: bytes) -> KeyInfo:
    if len(raw) != KEY_BYTES:
        raise BadRequest(f"key must be {KEY_BYTES} bytes, got {len(raw)}")
    key = KVKey.from_bytes(raw)  # validates rank < size etc.
    return KeyInfo(
        group=_group_info(raw[:CHUNK_GROUP_BYTES]),
        member=(key.tp_rank, key.pp_stage, key.layer_group),
    )
