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

`parse_key` validates a key in full once (`KVKey.from_bytes`: versions, sizes, ranges) and derives
its group from that one parse. A save names each key three times (put_begin, the segment's
confirm, put_commit), so the last `KEY_CACHE_MAX` accepted keys are remembered by their bytes: a
memo of a pure function (same bytes, same answer; only accepted keys are kept, so a refused key
is refused again in full every time). The KV data format version is checked again on every hit:
it is the one input of the validation outside the bytes (`SUPPORTED_FORMAT_VERSIONS`). Entries are
tuples of bytes and ints, which CPython's cyclic GC stops tracking after their first collection
(docs/directory.md, garbage collector): the memo adds no tracked objects. Full, it is emptied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

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
from kvfabric.format.key import ChunkGroupId, KVKey, check_format_version
from kvfabric.proto import directory as m

__all__ = [
    "CHAIN_BYTES",
    "GROUP_KEY_BYTES",
    "GROUP_MEMBERS_MAX",
    "KEY_CACHE_MAX",
    "GroupInfo",
    "KeyInfo",
    "chain_of",
    "check_group_members",
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


GROUP_MEMBERS_MAX: Final = m.GROUP_MEMBERS_MAX
"""Members one chunk group may have (tp_size x pp_size x layer_group_count): a published group's
record counts them in one byte (`records.pack_group`). A key of a larger group is refused
(`bad_request`) wherever it is named; before (review, 2026-12-06) a commit of 256 members broke
the record's invariant and stopped the instance, and every instance that adopted the shard from
the segments after it: one tenant could take the directory down for good."""


def check_group_members(tp_size: int, pp_size: int, layer_group_count: int) -> int:
    """A chunk group's member count, `BadRequest` above `GROUP_MEMBERS_MAX` (the client checks
    its layout with it at start)."""
    members = tp_size * pp_size * layer_group_count
    if members > GROUP_MEMBERS_MAX:
        raise BadRequest(
            f"a chunk group has at most {GROUP_MEMBERS_MAX} members (tp x pp x layer groups)",
            members=members,
        )
    return members


def _group_info(raw: GroupId) -> GroupInfo:
    gid = ChunkGroupId.from_bytes(raw)  # validates versions, sizes and ranges
    return GroupInfo(
        group_id=group_key_of_id(raw),
        namespace=namespace_in_id(raw),
        chunk_index=chunk_index_in_id(raw),
        expected_members=check_group_members(gid.tp_size, gid.pp_size, gid.layer_group_count),
    )


def parse_group(raw: bytes) -> GroupInfo:
    if len(raw) != GROUP_ID_BYTES:
        raise BadRequest(f"chunk group id must be {GROUP_ID_BYTES} bytes, got {len(raw)}")
    return _group_info(GroupId(raw))


KEY_CACHE_MAX: Final = 4096
"""Accepted keys `parse_key` remembers (~0.5 KB each): a save's keys are named again within
milliseconds, by its confirms and its put_commit."""

# key bytes -> (format version, group key, namespace, chunk index, expected members, tp rank,
# pp stage, layer group): flat, so that one collection finds it holds nothing tracked
_KeyEntry = tuple[int, GroupKey, Namespace, int, int, int, int, int]
_key_cache: dict[bytes, _KeyEntry] = {}


def parse_key(raw: bytes) -> KeyInfo:
    if len(raw) != OBJECT_KEY_BYTES:
        raise BadRequest(f"key must be {OBJECT_KEY_BYTES} bytes, got {len(raw)}")
    data = raw if type(raw) is bytes else bytes(raw)
    entry = _key_cache.get(data)
    if entry is None:
        entry = _key_entry(data)
        if len(_key_cache) >= KEY_CACHE_MAX:
            _key_cache.clear()
        _key_cache[data] = entry
    else:
        check_format_version(entry[0])
    _, group_key, namespace, chunk_index, expected, tp_rank, pp_stage, layer_group = entry
    return KeyInfo(
        group=GroupInfo(group_key, namespace, chunk_index, expected), member=(tp_rank, pp_stage, layer_group)
    )


def _key_entry(data: bytes) -> _KeyEntry:
    key = KVKey.from_bytes(data)  # validates versions, sizes and ranges (rank < size etc.), once
    gid = key.chunk_group
    raw_group = group_id_in_key(ObjectKey(data))
    return (
        gid.format_version,
        group_key_of_id(raw_group),
        namespace_in_id(raw_group),
        gid.chunk_index,
        check_group_members(gid.tp_size, gid.pp_size, gid.layer_group_count),
        key.tp_rank,
        key.pp_stage,
        key.layer_group,
    )
