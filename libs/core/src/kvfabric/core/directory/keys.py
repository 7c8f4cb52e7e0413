"""What the directory core needs from a binary key or chunk group id (pure, fast path).

The directory indexes a chunk group by its *group key*: the share domain's digest (16 bytes)
followed by the chain hash (32 bytes, salted per share domain). The domain is part of the key so
that one tenant can never reach, claim or probe another's group by writing its own domain digest
into a chain hash it learned (the chain hash alone is what events and listings show:
`chain_of`). The rest of the identity (format, model, TP/PP/layer-group sizes, chunk size,
layout) is interned as a "namespace"; a caller that pairs a known group key with other namespace
fields is refused: every verb compares both.

The bytes are cut by `kvfabric.format.ids` (the one layout): `GroupInfo.group_id` is a
`GroupKey`, `namespace` a `Namespace`; `chain_of`/`domain_of` are `chain_in_group_key` and
`domain_in_group_key` under the names the tables use.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfabric.format.errors import BadRequest
from kvfabric.format.ids import (
    CHAIN_HASH_BYTES,
    GROUP_ID_BYTES,
    GROUP_KEY_BYTES,
    OBJECT_KEY_BYTES,
    ChainHash,
    DomainDigest,
    GroupId,
    GroupKey,
    Namespace,
    ObjectKey,
    chain_in_group_key,
    chunk_index_in_id,
    domain_in_group_key,
    group_id_in_key,
    group_key_of_id,
    namespace_in_id,
)
from kvfabric.format.key import ChunkGroupId, KVKey

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

# The layout is kvfabric.format.ids' (the one definition); these names are the core's.
CHAIN_BYTES = CHAIN_HASH_BYTES


def chain_of(group_key: bytes) -> ChainHash:
    """The chain hash of a group key: what events, listings and `show_group` use."""
    return chain_in_group_key(GroupKey(group_key))


def domain_of(group_key: bytes) -> DomainDigest:
    """The share domain digest of a group key (events carry it next to the chain hash)."""
    return domain_in_group_key(GroupKey(group_key))


@dataclass(frozen=True, slots=True)
class GroupInfo:
    group_id: GroupKey  # the group key: domain digest + chain hash (48 bytes)
    namespace: Namespace
    chunk_index: int
    expected_members: int


@dataclass(frozen=True, slots=True)
class KeyInfo:
    group: GroupInfo
    member: tuple[int, int, int]


def _group_info(raw: GroupId) -> GroupInfo:
    gid = ChunkGroupId.from_bytes(raw)  # validates versions, sizes and ranges
    return GroupInfo(
        group_id=group_key_of_id(raw),
        namespace=namespace_in_id(raw),
        chunk_index=chunk_index_in_id(raw),
        expected_members=gid.tp_size * gid.pp_size * gid.layer_group_count,
    )


def parse_group(raw: bytes) -> GroupInfo:
    if len(raw) != GROUP_ID_BYTES:
        raise BadRequest(f"chunk group id must be {GROUP_ID_BYTES} bytes, got {len(raw)}")
    return _group_info(GroupId(raw))


def parse_key(raw: bytes) -> KeyInfo:
    if len(raw) != OBJECT_KEY_BYTES:
        raise BadRequest(f"key must be {OBJECT_KEY_BYTES} bytes, got {len(raw)}")
    key = KVKey.from_bytes(raw)  # validates rank < size etc.
    return KeyInfo(
        group=_group_info(group_id_in_key(ObjectKey(raw))),
        member=(key.tp_rank, key.pp_stage, key.layer_group),
    )
