"""Typed identities and the one definition of their binary layout (pure; no I/O).

Every id the system passes around is bytes cut from one layout, `ChunkGroupId.to_bytes()` (the
table in `kvfabric.format.key`). This module is the only place that knows the offsets: every
other package packs, unpacks and slices through the functions below, so a change of layout is
one edit here: `tests/unit/test_id_layout_sites.py` fails if a module re-derives it, and
`tests/unit/format/test_format_key.py` checks key.py's table against `GROUP_ID_FIELDS`.

    ObjectKey     96  one stored object: group id + member (tp_rank, pp_stage, layer_group,
                      u16 LE each)                         KVKey.to_bytes, pack_object_key
    GroupId       90  one chunk group: namespace + chunk index (u32 LE) + chain hash
                                                           ChunkGroupId.to_bytes, pack_group_id
    Namespace     54  a group id's leading bytes: encoding, format, domain, model, sizes,
                      layout (what events and listings carry)              namespace_in_id
    GroupKey      48  how the directory, the policies and the router name a group: domain
                      digest + chain hash                  pack_group_key, group_key_of_id
    ChainHash     32  the salted prefix hash of a chunk; events name a group by it, its
                      first 4 bytes pick the shard (kvfabric.proto.shards)   chain_in_id
    DomainDigest  16  the share domain (the tenant): bytes [4:20] of a key, group id and
                      namespace                            ShareDomain.digest, domain_in_id

The types are `typing.NewType`s over `bytes`: a type checker keeps a 48-byte group key from
being passed where a 90-byte group id is wanted, while at run time each value is the plain
`bytes` object, so hashing, comparing, dict lookups and msgspec (which encodes and decodes a
NewType as its base type: the wire format and the JSON Schemas are unchanged) cost exactly what
they did. Wrapping a value costs one call (about 35 ns on CPython 3.11, measured 2026-12-02:
`GK(a + b)` 0.166 s vs `a + b` 0.131 s per million in one `timeit` run on the shared 2-core
VM); small frozen classes would cost an allocation per id and an attribute read per use, on the
directory's per-group fast path. That path as a whole did not move: `parse_group` / `parse_key`
through these functions over the hand-sliced version they replaced, 0.91 and 1.06 / 1.03 and
0.77 in two interleaved runs (`.venv/bin/python -m bench.id_layout_cost`, 2026-12-02, shared
2-core VM at load 6-10: within noise). The pack functions check nothing (callers pass parts they
already hold typed); decoding external input is `ChunkGroupId.from_bytes` / `KVKey.from_bytes`.
The wire structs (`kvfabric.proto`) carry these types in every field that holds an id: object
keys (`ObjectSpec`, `WriteTicket`, begin/commit results and `put_commit`/`put_abort` lists,
confirms, frees, replica requests, a segment's held and demoted objects), group-id lists
(`Lookup`, `LookupPart`, `Pin`, `Evict`, `EvictResult`, `PrefetchHint`), the events' chain hash,
namespace, parent and domain, `GroupSummary`, the listing's `domain_digest` and its `after` /
`next_after` cursor (a `GroupKey`), tenant rows, the admission filter's and a verify request's
domains. A decoded message's ids are therefore typed as they arrive (not checked: decoding
external input is still `ChunkGroupId.from_bytes` / `KVKey.from_bytes` or the directory's
`parse_key`); a producer packs them here, takes them from `KVKey.object_key()` /
`ChunkGroupId.group_id()`, or wraps what it holds. `ShowGroup.group` stays `bytes` by design: it
takes a group id, a group key or a chain hash. The directory core names its groups by
`GroupKey` throughout (its tables, index, leases, frees).
"""

from __future__ import annotations

import struct
from typing import Final, NamedTuple, NewType

from kvfabric.format.invariant import invariant

__all__ = [
    "CHAIN_HASH_BYTES",
    "CHAIN_SLICE",
    "CHUNK_INDEX_SLICE",
    "DOMAIN_DIGEST_BYTES",
    "DOMAIN_SLICE",
    "GROUP_ID_BYTES",
    "GROUP_ID_FIELDS",
    "GROUP_ID_STRUCT",
    "GROUP_KEY_BYTES",
    "LAYOUT_DIGEST_BYTES",
    "MEMBER_BYTES",
    "MEMBER_FIELDS",
    "MEMBER_STRUCT",
    "MODEL_DIGEST_BYTES",
    "NAMESPACE_BYTES",
    "NAMESPACE_SLICE",
    "OBJECT_KEY_BYTES",
    "ChainHash",
    "DomainDigest",
    "GroupId",
    "GroupKey",
    "LayoutDigest",
    "MemberId",
    "ModelDigest",
    "Namespace",
    "ObjectKey",
    "chain_in_any",
    "chain_in_group_key",
    "chain_in_id",
    "chunk_index_in_id",
    "domain_in_group_key",
    "domain_in_id",
    "group_id_in_key",
    "group_key_of_id",
    "member_in_key",
    "namespace_in_id",
    "pack_group_id",
    "pack_group_key",
    "pack_member",
    "pack_object_key",
]

# --- the types -----------------------------------------------------------------------------------

ObjectKey = NewType("ObjectKey", bytes)
GroupId = NewType("GroupId", bytes)
Namespace = NewType("Namespace", bytes)
GroupKey = NewType("GroupKey", bytes)
ChainHash = NewType("ChainHash", bytes)
DomainDigest = NewType("DomainDigest", bytes)
ModelDigest = NewType("ModelDigest", bytes)
LayoutDigest = NewType("LayoutDigest", bytes)


class MemberId(NamedTuple):
    """One object of a chunk group. A plain `(tp_rank, pp_stage, layer_group)` tuple compares equal."""

    tp_rank: int
    pp_stage: int
    layer_group: int


# --- the layout (little-endian, fixed width) -----------------------------------------------------

DOMAIN_DIGEST_BYTES: Final = 16
MODEL_DIGEST_BYTES: Final = 16
LAYOUT_DIGEST_BYTES: Final = 8
CHAIN_HASH_BYTES: Final = 32

GROUP_ID_FIELDS: Final[tuple[tuple[str, str], ...]] = (
    ("key_encoding", "B"),
    ("reserved", "B"),
    ("format_version", "H"),
    ("domain_digest", f"{DOMAIN_DIGEST_BYTES}s"),
    ("model_digest", f"{MODEL_DIGEST_BYTES}s"),
    ("tp_size", "H"),
    ("pp_size", "H"),
    ("layer_group_count", "H"),
    ("tokens_per_chunk", "I"),
    ("layout_digest", f"{LAYOUT_DIGEST_BYTES}s"),
    ("chunk_index", "I"),
    ("chain_hash", f"{CHAIN_HASH_BYTES}s"),
)
"""The fields of a group id in order, as `struct` codes (no padding: every code is packed `<`)."""

MEMBER_FIELDS: Final[tuple[tuple[str, str], ...]] = (
    ("tp_rank", "H"),
    ("pp_stage", "H"),
    ("layer_group", "H"),
)
"""The member fields a key appends to its group id."""

GROUP_ID_STRUCT: Final = struct.Struct("<" + "".join(code for _, code in GROUP_ID_FIELDS))
MEMBER_STRUCT: Final = struct.Struct("<" + "".join(code for _, code in MEMBER_FIELDS))


def _slices(fields: tuple[tuple[str, str], ...]) -> dict[str, slice]:
    out: dict[str, slice] = {}
    at = 0
    for name, code in fields:
        size = struct.calcsize("<" + code)
        out[name] = slice(at, at + size)
        at += size
    return out


_GROUP_SLICES: Final = _slices(GROUP_ID_FIELDS)

GROUP_ID_BYTES: Final = GROUP_ID_STRUCT.size  # 90
MEMBER_BYTES: Final = MEMBER_STRUCT.size  # 6
OBJECT_KEY_BYTES: Final = GROUP_ID_BYTES + MEMBER_BYTES  # 96
DOMAIN_SLICE: Final = _GROUP_SLICES["domain_digest"]  # [4:20] of a key, group id or namespace
CHUNK_INDEX_SLICE: Final = _GROUP_SLICES["chunk_index"]  # [54:58]
CHAIN_SLICE: Final = _GROUP_SLICES["chain_hash"]  # [58:90]
NAMESPACE_SLICE: Final = slice(0, CHUNK_INDEX_SLICE.start)  # [0:54]: everything but index and chain
NAMESPACE_BYTES: Final = NAMESPACE_SLICE.stop  # 54
GROUP_KEY_BYTES: Final = DOMAIN_DIGEST_BYTES + CHAIN_HASH_BYTES  # 48

invariant(
    CHAIN_SLICE.stop == GROUP_ID_BYTES and CHUNK_INDEX_SLICE.stop == CHAIN_SLICE.start,
    "a group id must end with its chunk index and chain hash (the namespace is what precedes them)",
)

_CHUNK_INDEX: Final = struct.Struct("<I")

# --- group ids and object keys -------------------------------------------------------------------


def pack_group_id(namespace: Namespace, chunk_index: int, chain_hash: ChainHash) -> GroupId:
    """The group id of a namespace, chunk index and chain hash (what events and listings carry)."""
    return GroupId(namespace + _CHUNK_INDEX.pack(chunk_index) + chain_hash)


def pack_member(tp_rank: int, pp_stage: int, layer_group: int) -> bytes:
    """The member bytes a key appends to its group id."""
    return MEMBER_STRUCT.pack(tp_rank, pp_stage, layer_group)


def pack_object_key(group_id: GroupId, tp_rank: int, pp_stage: int, layer_group: int) -> ObjectKey:
    """The key of one member of a chunk group."""
    return ObjectKey(group_id + MEMBER_STRUCT.pack(tp_rank, pp_stage, layer_group))


def group_id_in_key(key: ObjectKey) -> GroupId:
    """The group id a key begins with."""
    return GroupId(key[:GROUP_ID_BYTES])


def member_in_key(key: ObjectKey) -> MemberId:
    """The member a key names."""
    return MemberId(*MEMBER_STRUCT.unpack_from(key, GROUP_ID_BYTES))


def namespace_in_id(raw: GroupId | ObjectKey) -> Namespace:
    """The namespace of a group id or key."""
    return Namespace(raw[NAMESPACE_SLICE])


def chunk_index_in_id(raw: GroupId | ObjectKey) -> int:
    """The chunk index of a group id or key."""
    index: int = _CHUNK_INDEX.unpack_from(raw, CHUNK_INDEX_SLICE.start)[0]
    return index


def chain_in_id(raw: GroupId | ObjectKey) -> ChainHash:
    """The chain hash of a group id or key."""
    return ChainHash(raw[CHAIN_SLICE])


def domain_in_id(raw: GroupId | ObjectKey | Namespace) -> DomainDigest:
    """The share domain digest (the tenant) of a key, group id or namespace."""
    return DomainDigest(raw[DOMAIN_SLICE])


# --- group keys ----------------------------------------------------------------------------------


def pack_group_key(domain: DomainDigest, chain_hash: ChainHash) -> GroupKey:
    """A group's key: its share domain digest, then its chain hash (sorted by domain first)."""
    return GroupKey(domain + chain_hash)


def group_key_of_id(raw: GroupId | ObjectKey) -> GroupKey:
    """The group key of a group id or key."""
    return GroupKey(raw[DOMAIN_SLICE] + raw[CHAIN_SLICE])


def chain_in_group_key(group_key: GroupKey) -> ChainHash:
    """The chain hash of a group key (what events, listings and `show_group` name a group by)."""
    return ChainHash(group_key[-CHAIN_HASH_BYTES:])


def domain_in_group_key(group_key: GroupKey) -> DomainDigest:
    """The share domain digest of a group key."""
    return DomainDigest(group_key[:-CHAIN_HASH_BYTES])


def chain_in_any(raw: bytes) -> ChainHash:
    """The chain hash inside any id that carries one: a key or group id (at least 90 bytes: by
    offset), a group key or a bare chain hash (its last 32 bytes). `ValueError` for other sizes."""
    if len(raw) >= GROUP_ID_BYTES:
        return ChainHash(bytes(raw[CHAIN_SLICE]))
    if len(raw) in (GROUP_KEY_BYTES, CHAIN_HASH_BYTES):
        return ChainHash(bytes(raw[-CHAIN_HASH_BYTES:]))
    raise ValueError(f"no chain hash in a {len(raw)}-byte id")
