"""What the directory core needs from a binary key or chunk group id (pure, fast path).

The directory indexes a chunk group by its *group key*: the share domain's digest (16 bytes)
followed by the chain hash (32 bytes, salted per share domain). The domain is part of the key so
that one tenant can never reach, claim or probe another's group by writing its own domain digest
into a chain hash it learned (the chain hash alone is what events and listings show:
`chain_of`). The rest of the identity (format, model, TP/PP/layer-group sizes, chunk size,
layout) is interned as a "namespace"; a caller that pairs a known group key with other namespace
fields is refused: every verb compares both.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfabric.format.errors import BadRequest
from kvfabric.format.key import CHUNK_GROUP_BYTES, KEY_BYTES, ChunkGroupId, KVKey

__all__ = [
    "CHAIN_BYTES",
    "GROUP_KEY_BYTES",
    "GroupInfo",
    "KeyInfo",
    "chain_of",
    "domain_of",
    "parse_group",
    "parse_key",
]

# Byte ranges inside ChunkGroupId.to_bytes() (see kvfabric.format.key's layout table).
_NAMESPACE = slice(0, 54)
_CHUNK_INDEX = slice(54, 58)
_CHAIN = slice(58, 90)
_DOMAIN = slice(4, 20)
CHAIN_BYTES = 32
GROUP_KEY_BYTES = 48  # domain digest + chain hash


def chain_of(group_key: bytes) -> bytes:
    """The chain hash of a group key: what events, listings and `show_group` use."""
    return group_key[-CHAIN_BYTES:]


def domain_of(group_key: bytes) -> bytes:
    """The share domain digest of a group key (events carry it next to the chain hash)."""
    return group_key[:-CHAIN_BYTES]


@dataclass(frozen=True, slots=True)
class GroupInfo:
    group_id: bytes  # the group key: domain digest + chain hash (48 bytes)
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
        group_id=bytes(raw[_DOMAIN]) + bytes(raw[_CHAIN]),
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
