"""KV identity: share domains, model fingerprints, layouts, the chained prefix hash and `KVKey`.

A key must separate everything that changes the KV bytes (docs/design.md section 2). Two requests may
share a cached object only if every field below is equal; a field left out is a silent-garbage
bug (the engine would attend over KV computed by another model, dtype, sharding or layout).

Units of identity
-----------------
- `ShareDomain(tenant_id, salt)`: who may share. The salt (16..64 secret bytes) keys every hash of
  the chain, so a tenant that does not hold it can neither compute nor probe the domain's keys.
- `ModelFingerprint`: what computed the KV (weights, LoRA, KV dtype/quantization, attention and
  positional config).
- `KVLayout`: how the KV is cut into objects (TP/PP/layer-group sharding, chunk size, tensor
  layout). `tp_rank`, `pp_stage` and `layer_group` select one object of a chunk group; they are in
  the key but *not* in the chain hash.
- `ChunkGroupId`: one chunk of one prefix across all its (rank, stage, group) objects. It is the
  unit of atomic visibility and of directory sharding (by its chain hash:
  `kvfabric.proto.shards.shard_of`; not `shard()`, which routes nothing).
- `KVKey`: one object: a `ChunkGroupId` plus its member `(tp_rank, pp_stage, layer_group)`.

Hash chain
----------
All hashes are BLAKE2b (hashlib) with a personalization tag per use (domain separation); chain
hashes are keyed with the domain salt. Encoding is canonical: integers are fixed-width
little-endian, every variable-length field is prefixed by its length as u32 LE (`lp(x)`), so no
two different inputs encode to the same byte string. Strings are UTF-8.

    domain_digest (16 B) = BLAKE2b(key=salt, person="kvf1/domain"; lp(tenant_id))
    model_digest  (16 B) = BLAKE2b(person="kvf1/model"; u32 7, lp(model_id), lp(weights_revision),
                             lp(lora_id), lp(lora_revision), lp(kv_dtype), lp(kv_quant),
                             lp(attn_config_digest))
    layout_digest  (8 B) = BLAKE2b(person="kvf1/layout"; lp(tensor_layout))
    h_0           (32 B) = BLAKE2b(key=salt, person="kvf1/root"; u16 format_version,
                             domain_digest, model_digest, u16 tp_size, u16 pp_size,
                             u16 layer_group_count, u32 tokens_per_chunk, lp(tensor_layout))
    h_i           (32 B) = BLAKE2b(key=salt, person="kvf1/chunk"; h_{i-1}, u32 n, n x u32 token,
                             u32 e, e x lp(extra))          for chunk i = 1, 2, ...

`chain_hashes()` returns `[h_1, ..., h_N]` for the N *full* chunks of `tokens_per_chunk` tokens
(chunk index 0 is `h_1`); a trailing partial chunk is neither hashed nor cached. Extras (image
hashes, other non-token inputs) attach to a chunk index; attach each to the first chunk whose
tokens it affects: the chain carries it to every later chunk.

Binary key (`KVKey.to_bytes()`, fixed 96 bytes, little-endian)
---------------------------------------------------------------

| offset | size | field                                         |
|-------:|-----:|-----------------------------------------------|
|      0 |    1 | key encoding version, u8 (= 1)                |
|      1 |    1 | reserved, u8, must be 0                       |
|      2 |    2 | KV data format version, u16                   |
|      4 |   16 | domain digest                                 |
|     20 |   16 | model digest                                  |
|     36 |    2 | tp_size, u16                                  |
|     38 |    2 | pp_size, u16                                  |
|     40 |    2 | layer_group_count, u16                        |
|     42 |    4 | tokens_per_chunk, u32                         |
|     46 |    8 | layout digest                                 |
|     54 |    4 | chunk_index, u32                              |
|     58 |   32 | chain hash h_{chunk_index+1}                  |
|     90 |    2 | tp_rank, u16                                  |
|     92 |    2 | pp_stage, u16                                 |
|     94 |    2 | layer_group, u16                              |

Bytes 0..90 are exactly `ChunkGroupId.to_bytes()`: every member of a chunk group shares that
prefix (sorted stores keep a chunk group together). The layout is defined once, in
`kvfabric.format.ids` (`GROUP_ID_FIELDS`, `MEMBER_FIELDS`, the typed ids and every pack/unpack
and slice other packages use); `tests/unit/format/test_format_key.py` checks this table against it.

Readable forms (canonical: lowercase hex, decimal without leading zeros; round-trip exactly)
---------------------------------------------------------------------------------------------

    kvf1:<fmt>:<domain>:<model>:tp<size>.<rank>:pp<size>.<stage>:lg<group>/<count>:c<tpc>:<layout>:i<index>:<chain>
    kvg1:<fmt>:<domain>:<model>:tp<size>:pp<size>:lg<count>:c<tpc>:<layout>:i<index>:<chain>

Errors: building a value from bad arguments raises `ValueError`/`TypeError` (a caller bug);
decoding external input (`from_bytes`, `parse`) raises `BadRequest`, or `UnsupportedVersion`
for a key encoding or KV data format version this build does not read.

Not split (over 600 lines): one identity, its validation, binary and readable forms and the
hash chain that makes it; the binary layout alone lives in `ids`.
"""

from __future__ import annotations

import array
import hashlib
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final, Protocol, Self, TypeAlias, runtime_checkable

import msgspec
import numpy as np
import numpy.typing as npt

from kvfabric.format.errors import BadRequest, UnsupportedVersion
from kvfabric.format.ids import (
    CHAIN_HASH_BYTES,
    DOMAIN_DIGEST_BYTES,
    GROUP_ID_BYTES,
    GROUP_ID_STRUCT,
    LAYOUT_DIGEST_BYTES,
    MEMBER_STRUCT,
    MODEL_DIGEST_BYTES,
    OBJECT_KEY_BYTES,
    ChainHash,
    DomainDigest,
    GroupId,
    GroupKey,
    LayoutDigest,
    MemberId,
    ModelDigest,
    Namespace,
    ObjectKey,
    namespace_in_id,
    pack_group_key,
)

__all__ = [
    "CHAIN_HASH_BYTES",
    "CHUNK_GROUP_BYTES",
    "DOMAIN_DIGEST_BYTES",
    "FORMAT_VERSION",
    "KEY_BYTES",
    "KEY_ENCODING_VERSION",
    "LAYOUT_DIGEST_BYTES",
    "MODEL_DIGEST_BYTES",
    "SUPPORTED_FORMAT_VERSIONS",
    "SUPPORTED_KEY_ENCODINGS",
    "ChainHash",
    "ChunkExtras",
    "ChunkGroupId",
    "DomainDigest",
    "KVKey",
    "KVLayout",
    "LayoutDigest",
    "MemberId",
    "ModelDigest",
    "ModelFingerprint",
    "ShareDomain",
    "TokenIds",
    "chain_hashes",
    "chain_step",
    "check_format_version",
    "chunk_groups_for_prefix",
    "digest_config",
    "keys_for_prefix",
    "tokens_to_u32",
]

# --- versions and sizes --------------------------------------------------------------------------

FORMAT_VERSION: Final = 1
"""Version of the KV data format (the bytes of an object). Part of every key and chain."""

SUPPORTED_FORMAT_VERSIONS: tuple[int, ...] = (1,)
"""KV data format versions this build reads (dual-read during a migration: old and new)."""

KEY_ENCODING_VERSION: Final = 1
"""Version of the binary/readable key encoding itself (byte 0, and the `kvf1`/`kvg1` prefix)."""

SUPPORTED_KEY_ENCODINGS: Final[tuple[int, ...]] = (1,)

_U16_MAX: Final = 0xFFFF
_U32_MAX: Final = 0xFFFF_FFFF
_MAX_STR_CHARS: Final = 1024
_MAX_TENANT_CHARS: Final = 256
_SALT_MIN_BYTES: Final = 16
_SALT_MAX_BYTES: Final = 64

# The binary layout is defined once, in kvfabric.format.ids (its types, offsets, pack/unpack).
_GROUP_STRUCT: Final = GROUP_ID_STRUCT
_MEMBER_STRUCT: Final = MEMBER_STRUCT
CHUNK_GROUP_BYTES: Final = GROUP_ID_BYTES  # 90
KEY_BYTES: Final = OBJECT_KEY_BYTES  # 96

# BLAKE2b personalization tags (<= 16 bytes). The "1" is the hash scheme generation: a change
# to any encoding below needs new tags and a new FORMAT_VERSION.
_P_DOMAIN: Final = b"kvf1/domain"
_P_MODEL: Final = b"kvf1/model"
_P_LAYOUT: Final = b"kvf1/layout"
_P_ROOT: Final = b"kvf1/root"
_P_CHUNK: Final = b"kvf1/chunk"
_P_SHARD: Final = b"kvf1/shard"
_P_CONFIG: Final = b"kvf1/config"

# --- canonical encoding helpers ------------------------------------------------------------------


def _lp(data: bytes) -> bytes:
    """Length-prefixed field: u32 LE length, then the bytes."""
    if len(data) > _U32_MAX:
        raise ValueError(f"field of {len(data)} bytes is too long to length-prefix")
    return len(data).to_bytes(4, "little") + data


def _lp_str(text: str) -> bytes:
    return _lp(text.encode("utf-8"))


def _check_int(name: str, value: object, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise ValueError(f"{name}={value} out of range {lo}..{hi}")
    return value


def _check_str(name: str, value: object, *, required: bool, max_chars: int = _MAX_STR_CHARS) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    if required and not value:
        raise ValueError(f"{name} must not be empty")
    if len(value) > max_chars:
        raise ValueError(f"{name} is {len(value)} chars, at most {max_chars}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} is not encodable as UTF-8: {e}") from None
    return value


def _check_bytes(name: str, value: object, size: int) -> bytes:
    if not isinstance(value, bytes):
        raise TypeError(f"{name} must be bytes, got {type(value).__name__}")
    if len(value) != size:
        raise ValueError(f"{name} must be {size} bytes, got {len(value)}")
    return value


def check_format_version(version: int) -> int:
    """`version` if this build reads that KV data format, else raise `UnsupportedVersion`."""
    if version not in SUPPORTED_FORMAT_VERSIONS:
        raise UnsupportedVersion("KV data format", version, SUPPORTED_FORMAT_VERSIONS)
    return version


def digest_config(config: Any) -> str:
    """A stable hex digest of a JSON-like config (e.g. attention/RoPE settings) for
    `ModelFingerprint.attn_config_digest`. Keys are sorted, so dict order does not matter."""
    canonical = msgspec.json.encode(config, order="sorted")
    return hashlib.blake2b(canonical, digest_size=16, person=_P_CONFIG).hexdigest()


# --- identity inputs -----------------------------------------------------------------------------


class ShareDomain:
    """A tenant's share domain. Immutable and hashable.

    `salt` is secret: it is not in `repr()`, and this is deliberately not a dataclass or a
    msgspec Struct, so no encoder can put it on the wire by accident (only `digest()` travels).
    """

    __slots__ = ("salt", "tenant_id")
    tenant_id: str
    salt: bytes

    def __init__(self, tenant_id: str, salt: bytes) -> None:
        _check_str("tenant_id", tenant_id, required=True, max_chars=_MAX_TENANT_CHARS)
        if not isinstance(salt, bytes):
            raise TypeError(f"salt must be bytes, got {type(salt).__name__}")
        if not _SALT_MIN_BYTES <= len(salt) <= _SALT_MAX_BYTES:
            raise ValueError(f"salt must be {_SALT_MIN_BYTES}..{_SALT_MAX_BYTES} bytes, got {len(salt)}")
        object.__setattr__(self, "tenant_id", tenant_id)
        object.__setattr__(self, "salt", salt)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"ShareDomain is immutable: cannot set {name}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"ShareDomain is immutable: cannot delete {name}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ShareDomain):
            return NotImplemented
        return self.tenant_id == other.tenant_id and self.salt == other.salt

    def __hash__(self) -> int:
        return hash((self.tenant_id, self.salt))

    def __repr__(self) -> str:
        return f"ShareDomain(tenant_id={self.tenant_id!r})"

    def digest(self) -> DomainDigest:
        """16-byte public identity of the domain (keyed by the salt: unguessable from the id)."""
        h = hashlib.blake2b(
            _lp_str(self.tenant_id), digest_size=DOMAIN_DIGEST_BYTES, key=self.salt, person=_P_DOMAIN
        )
        return DomainDigest(h.digest())


class ModelFingerprint(msgspec.Struct, frozen=True, kw_only=True):
    """Everything about the model that changes the KV bytes.

    - `weights_revision`: a digest or immutable revision of the weights (not a branch name).
    - `lora_id`/`lora_revision`: empty when no adapter; an adapter needs both.
    - `kv_dtype`: e.g. "bfloat16", "fp8_e4m3"; `kv_quant`: scheme and params, "none" if unquantized.
    - `attn_config_digest`: attention/positional config (RoPE scaling, sliding window, head
      dims...); see `digest_config()`.
    """

    model_id: str
    weights_revision: str
    lora_id: str = ""
    lora_revision: str = ""
    kv_dtype: str
    kv_quant: str = "none"
    attn_config_digest: str

    def __post_init__(self) -> None:
        _check_str("model_id", self.model_id, required=True)
        _check_str("weights_revision", self.weights_revision, required=True)
        _check_str("kv_dtype", self.kv_dtype, required=True)
        _check_str("attn_config_digest", self.attn_config_digest, required=True)
        _check_str("lora_id", self.lora_id, required=False)
        _check_str("lora_revision", self.lora_revision, required=False)
        _check_str("kv_quant", self.kv_quant, required=True)
        if bool(self.lora_id) != bool(self.lora_revision):
            raise ValueError("lora_id and lora_revision must be both set or both empty")

    def digest(self) -> ModelDigest:
        fields = (
            self.model_id,
            self.weights_revision,
            self.lora_id,
            self.lora_revision,
            self.kv_dtype,
            self.kv_quant,
            self.attn_config_digest,
        )
        h = hashlib.blake2b(digest_size=MODEL_DIGEST_BYTES, person=_P_MODEL)
        h.update(len(fields).to_bytes(4, "little"))
        for f in fields:
            h.update(_lp_str(f))
        return ModelDigest(h.digest())


class KVLayout(msgspec.Struct, frozen=True, kw_only=True):
    """How one engine worker cuts the KV of a chunk into objects, and which object it holds.

    A chunk group has `tp_size * pp_size * layer_group_count` members; `layer_group` numbers
    groups within a PP stage. `tensor_layout` names the page/tensor layout of an object's bytes
    (e.g. "vllm:NHD:block16") and must also capture any non-default layer partition.
    Keyword-only: seven integers are too easy to swap positionally.
    """

    tp_size: int
    tp_rank: int
    pp_stage: int
    layer_group: int
    layer_group_count: int
    tokens_per_chunk: int
    tensor_layout: str
    pp_size: int = 1

    def __post_init__(self) -> None:
        _check_int("tp_size", self.tp_size, 1, _U16_MAX)
        _check_int("tp_rank", self.tp_rank, 0, self.tp_size - 1)
        _check_int("pp_size", self.pp_size, 1, _U16_MAX)
        _check_int("pp_stage", self.pp_stage, 0, self.pp_size - 1)
        _check_int("layer_group_count", self.layer_group_count, 1, _U16_MAX)
        _check_int("layer_group", self.layer_group, 0, self.layer_group_count - 1)
        _check_int("tokens_per_chunk", self.tokens_per_chunk, 1, _U32_MAX)
        _check_str("tensor_layout", self.tensor_layout, required=True)

    @property
    def member(self) -> MemberId:
        return MemberId(self.tp_rank, self.pp_stage, self.layer_group)

    def digest(self) -> LayoutDigest:
        h = hashlib.blake2b(_lp_str(self.tensor_layout), digest_size=LAYOUT_DIGEST_BYTES, person=_P_LAYOUT)
        return LayoutDigest(h.digest())


# --- chunk group and key -------------------------------------------------------------------------

_DEC = r"(0|[1-9][0-9]{0,9})"
_POS = r"([1-9][0-9]{0,9})"
_HEX_DOMAIN = rf"([0-9a-f]{{{2 * DOMAIN_DIGEST_BYTES}}})"
_HEX_MODEL = rf"([0-9a-f]{{{2 * MODEL_DIGEST_BYTES}}})"
_HEX_LAYOUT = rf"([0-9a-f]{{{2 * LAYOUT_DIGEST_BYTES}}})"
_HEX_CHAIN = rf"([0-9a-f]{{{2 * CHAIN_HASH_BYTES}}})"
_KEY_RE: Final = re.compile(
    rf"kvf1:{_POS}:{_HEX_DOMAIN}:{_HEX_MODEL}:tp{_POS}\.{_DEC}:pp{_POS}\.{_DEC}:lg{_DEC}/{_POS}"
    rf":c{_POS}:{_HEX_LAYOUT}:i{_DEC}:{_HEX_CHAIN}"
)
_GROUP_RE: Final = re.compile(
    rf"kvg1:{_POS}:{_HEX_DOMAIN}:{_HEX_MODEL}:tp{_POS}:pp{_POS}:lg{_POS}"
    rf":c{_POS}:{_HEX_LAYOUT}:i{_DEC}:{_HEX_CHAIN}"
)
_ENCODING_PREFIX_RE: Final = re.compile(r"kv([fg])([0-9]{1,5}):")


def _check_encoding_prefix(text: str, kind: str, what: str) -> None:
    m = _ENCODING_PREFIX_RE.match(text)
    if m is not None and m.group(1) == kind and int(m.group(2)) not in SUPPORTED_KEY_ENCODINGS:
        raise UnsupportedVersion(f"{what} encoding", int(m.group(2)), SUPPORTED_KEY_ENCODINGS)


def _shown(text: str) -> str:
    return repr(text if len(text) <= 200 else text[:200] + "...")


class ChunkGroupId(msgspec.Struct, frozen=True, kw_only=True):
    """One chunk of one prefix, across all its (tp_rank, pp_stage, layer_group) objects.

    The unit of atomic visibility and of directory sharding: one directory shard decides alone
    when all `expected_members()` are confirmed. Binary form: 90 bytes (see module docstring).
    """

    format_version: int
    domain_digest: DomainDigest
    model_digest: ModelDigest
    tp_size: int
    pp_size: int
    layer_group_count: int
    tokens_per_chunk: int
    layout_digest: LayoutDigest
    chunk_index: int
    chain_hash: ChainHash

    def __post_init__(self) -> None:
        _check_int("format_version", self.format_version, 1, _U16_MAX)
        _check_bytes("domain_digest", self.domain_digest, DOMAIN_DIGEST_BYTES)
        _check_bytes("model_digest", self.model_digest, MODEL_DIGEST_BYTES)
        _check_int("tp_size", self.tp_size, 1, _U16_MAX)
        _check_int("pp_size", self.pp_size, 1, _U16_MAX)
        _check_int("layer_group_count", self.layer_group_count, 1, _U16_MAX)
        _check_int("tokens_per_chunk", self.tokens_per_chunk, 1, _U32_MAX)
        _check_bytes("layout_digest", self.layout_digest, LAYOUT_DIGEST_BYTES)
        _check_int("chunk_index", self.chunk_index, 0, _U32_MAX)
        _check_bytes("chain_hash", self.chain_hash, CHAIN_HASH_BYTES)

    def expected_members(self) -> frozenset[MemberId]:
        """Every member that must be confirmed before the chunk group is complete."""
        return frozenset(
            MemberId(r, s, g)
            for r in range(self.tp_size)
            for s in range(self.pp_size)
            for g in range(self.layer_group_count)
        )

    def member_key(self, tp_rank: int, pp_stage: int, layer_group: int) -> KVKey:
        return KVKey(chunk_group=self, tp_rank=tp_rank, pp_stage=pp_stage, layer_group=layer_group)

    def shard(self, n_shards: int) -> int:
        """A stable hash of `to_bytes()` into `0..n_shards-1` (same in every process, build and
        platform; never the builtin `hash()`), pinned by the key vectors. NOT the directory's
        routing: every service routes by `kvfabric.proto.shards.shard_of` (the chain hash's first
        4 bytes, little-endian, mod the shard count); routed by this, a request reached the
        wrong shard for nearly every group (review, stop 68)."""
        _check_int("n_shards", n_shards, 1, _U32_MAX)
        h = hashlib.blake2b(self.to_bytes(), digest_size=8, person=_P_SHARD)
        return int.from_bytes(h.digest(), "little") % n_shards

    def group_key(self) -> GroupKey:
        """The directory's name of this group: domain digest + chain hash (`kvfabric.format.ids`)."""
        return pack_group_key(self.domain_digest, self.chain_hash)

    def group_id(self) -> GroupId:
        """`to_bytes()` typed as a `GroupId` (`kvfabric.format.ids`)."""
        return GroupId(self.to_bytes())

    def namespace(self) -> Namespace:
        """The leading bytes of `to_bytes()` before the chunk index (`kvfabric.format.ids`)."""
        return namespace_in_id(self.group_id())

    def to_bytes(self) -> bytes:
        return _GROUP_STRUCT.pack(
            KEY_ENCODING_VERSION,
            0,
            self.format_version,
            self.domain_digest,
            self.model_digest,
            self.tp_size,
            self.pp_size,
            self.layer_group_count,
            self.tokens_per_chunk,
            self.layout_digest,
            self.chunk_index,
            self.chain_hash,
        )

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> Self:
        data = bytes(data)
        if len(data) != CHUNK_GROUP_BYTES:
            raise BadRequest(
                f"chunk group id must be {CHUNK_GROUP_BYTES} bytes, got {len(data)}", size=len(data)
            )
        return cls._from_fields(_GROUP_STRUCT.unpack(data))

    @classmethod
    def _from_fields(cls, fields: tuple[Any, ...]) -> Self:
        enc, reserved, fmt, domain, model, tp_size, pp_size, lgc, tpc, layout, index, chain = fields
        if enc not in SUPPORTED_KEY_ENCODINGS:
            raise UnsupportedVersion("key encoding", enc, SUPPORTED_KEY_ENCODINGS)
        if reserved != 0:
            raise BadRequest(f"reserved key byte must be 0, got {reserved}")
        check_format_version(fmt)
        try:
            return cls(
                format_version=fmt,
                domain_digest=domain,
                model_digest=model,
                tp_size=tp_size,
                pp_size=pp_size,
                layer_group_count=lgc,
                tokens_per_chunk=tpc,
                layout_digest=layout,
                chunk_index=index,
                chain_hash=chain,
            )
        except (ValueError, TypeError) as e:
            raise BadRequest(f"invalid chunk group id: {e}") from None

    def __repr__(self) -> str:
        return f"ChunkGroupId({str(self)!r})"

    def __str__(self) -> str:
        return (
            f"kvg{KEY_ENCODING_VERSION}:{self.format_version}:{self.domain_digest.hex()}"
            f":{self.model_digest.hex()}:tp{self.tp_size}:pp{self.pp_size}:lg{self.layer_group_count}"
            f":c{self.tokens_per_chunk}:{self.layout_digest.hex()}:i{self.chunk_index}"
            f":{self.chain_hash.hex()}"
        )

    @classmethod
    def parse(cls, text: str) -> Self:
        """Inverse of `str()`. Raises `BadRequest` (or `UnsupportedVersion`) on bad input."""
        _check_encoding_prefix(text, "g", "chunk group id")
        m = _GROUP_RE.fullmatch(text)
        if m is None:
            raise BadRequest(
                f"malformed chunk group id {_shown(text)}: expected "
                "kvg1:<fmt>:<domain>:<model>:tp<size>:pp<size>:lg<count>:c<tpc>:<layout>:i<index>:<chain>"
            )
        fmt, domain, model, tp_size, pp_size, lgc, tpc, layout, index, chain = m.groups()
        if int(fmt) > _U16_MAX:
            raise BadRequest(f"format version {fmt} out of range")
        check_format_version(int(fmt))
        try:
            return cls(
                format_version=int(fmt),
                domain_digest=DomainDigest(bytes.fromhex(domain)),
                model_digest=ModelDigest(bytes.fromhex(model)),
                tp_size=int(tp_size),
                pp_size=int(pp_size),
                layer_group_count=int(lgc),
                tokens_per_chunk=int(tpc),
                layout_digest=LayoutDigest(bytes.fromhex(layout)),
                chunk_index=int(index),
                chain_hash=ChainHash(bytes.fromhex(chain)),
            )
        except (ValueError, TypeError) as e:
            raise BadRequest(f"invalid chunk group id {_shown(text)}: {e}") from None


class KVKey(msgspec.Struct, frozen=True, kw_only=True):
    """The key of one stored object: its chunk group plus its member (rank, stage, group).

    Binary form: fixed `KEY_BYTES` = 96 bytes; readable form `str(key)` / `KVKey.parse()`.
    """

    chunk_group: ChunkGroupId
    tp_rank: int
    pp_stage: int
    layer_group: int

    def __post_init__(self) -> None:
        if not isinstance(self.chunk_group, ChunkGroupId):
            raise TypeError(f"chunk_group must be a ChunkGroupId, got {type(self.chunk_group).__name__}")
        g = self.chunk_group
        _check_int("tp_rank", self.tp_rank, 0, g.tp_size - 1)
        _check_int("pp_stage", self.pp_stage, 0, g.pp_size - 1)
        _check_int("layer_group", self.layer_group, 0, g.layer_group_count - 1)

    @property
    def member(self) -> MemberId:
        return MemberId(self.tp_rank, self.pp_stage, self.layer_group)

    @property
    def chunk_index(self) -> int:
        return self.chunk_group.chunk_index

    @property
    def chain_hash(self) -> ChainHash:
        return self.chunk_group.chain_hash

    @property
    def format_version(self) -> int:
        return self.chunk_group.format_version

    def to_bytes(self) -> bytes:
        return self.chunk_group.to_bytes() + _MEMBER_STRUCT.pack(
            self.tp_rank, self.pp_stage, self.layer_group
        )

    def object_key(self) -> ObjectKey:
        """`to_bytes()` typed as an `ObjectKey` (`kvfabric.format.ids`)."""
        return ObjectKey(self.to_bytes())

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> Self:
        """Inverse of `to_bytes()`. Raises `BadRequest` (or `UnsupportedVersion`) on bad input."""
        data = bytes(data)
        if len(data) != KEY_BYTES:
            raise BadRequest(f"KV key must be {KEY_BYTES} bytes, got {len(data)}", size=len(data))
        group = ChunkGroupId._from_fields(_GROUP_STRUCT.unpack_from(data, 0))
        tp_rank, pp_stage, layer_group = _MEMBER_STRUCT.unpack_from(data, CHUNK_GROUP_BYTES)
        try:
            return cls(chunk_group=group, tp_rank=tp_rank, pp_stage=pp_stage, layer_group=layer_group)
        except (ValueError, TypeError) as e:
            raise BadRequest(f"invalid KV key: {e}") from None

    def __repr__(self) -> str:
        return f"KVKey({str(self)!r})"

    def __str__(self) -> str:
        g = self.chunk_group
        return (
            f"kvf{KEY_ENCODING_VERSION}:{g.format_version}:{g.domain_digest.hex()}:{g.model_digest.hex()}"
            f":tp{g.tp_size}.{self.tp_rank}:pp{g.pp_size}.{self.pp_stage}"
            f":lg{self.layer_group}/{g.layer_group_count}:c{g.tokens_per_chunk}:{g.layout_digest.hex()}"
            f":i{g.chunk_index}:{g.chain_hash.hex()}"
        )

    @classmethod
    def parse(cls, text: str) -> Self:
        """Inverse of `str()`. Raises `BadRequest` (or `UnsupportedVersion`) on bad input."""
        _check_encoding_prefix(text, "f", "key")
        m = _KEY_RE.fullmatch(text)
        if m is None:
            raise BadRequest(
                f"malformed KV key {_shown(text)}: expected kvf1:<fmt>:<domain>:<model>:tp<size>.<rank>"
                ":pp<size>.<stage>:lg<group>/<count>:c<tpc>:<layout>:i<index>:<chain>"
            )
        fmt, domain, model, tp_size, tp_rank, pp_size, pp_stage, lg, lgc, tpc, layout, index, chain = (
            m.groups()
        )
        if int(fmt) > _U16_MAX:
            raise BadRequest(f"format version {fmt} out of range")
        check_format_version(int(fmt))
        try:
            group = ChunkGroupId(
                format_version=int(fmt),
                domain_digest=DomainDigest(bytes.fromhex(domain)),
                model_digest=ModelDigest(bytes.fromhex(model)),
                tp_size=int(tp_size),
                pp_size=int(pp_size),
                layer_group_count=int(lgc),
                tokens_per_chunk=int(tpc),
                layout_digest=LayoutDigest(bytes.fromhex(layout)),
                chunk_index=int(index),
                chain_hash=ChainHash(bytes.fromhex(chain)),
            )
            return cls(chunk_group=group, tp_rank=int(tp_rank), pp_stage=int(pp_stage), layer_group=int(lg))
        except (ValueError, TypeError) as e:
            raise BadRequest(f"invalid KV key {_shown(text)}: {e}") from None


# --- tokens and the chain ------------------------------------------------------------------------


@runtime_checkable
class SupportsToList(Protocol):
    def tolist(self) -> Any: ...


@runtime_checkable
class SupportsArray(Protocol):
    def __array__(self) -> Any: ...


TokenIds: TypeAlias = Sequence[int] | SupportsToList | SupportsArray
"""Token ids: list/tuple/range of int, numpy array, array.array, or anything with `__array__`
or `tolist()` (e.g. a torch tensor: never imported here)."""

ChunkExtras: TypeAlias = Mapping[int, Sequence[bytes]]
"""Extra inputs per chunk index (e.g. image content hashes), as byte strings, in order."""


def _describe_bad_item(items: Iterable[object]) -> str | None:
    for i, v in enumerate(items):
        if isinstance(v, bool) or not isinstance(v, int):
            return f"item {i} is {type(v).__name__} {v!r:.40}, not an int"
        if not 0 <= v <= _U32_MAX:
            return f"item {i} is {v}, outside 0..2**32-1"
    return None


def _as_array(tokens: TokenIds) -> npt.NDArray[Any]:
    if isinstance(tokens, np.ndarray):
        return tokens
    if isinstance(tokens, (list, tuple, range, array.array)):
        return np.asarray(tokens)
    if isinstance(tokens, SupportsArray):
        try:
            return np.asarray(tokens)
        except (TypeError, RuntimeError, ValueError):
            # e.g. a tensor on an accelerator: __array__ refuses, tolist() copies to host.
            if not isinstance(tokens, SupportsToList):
                raise
    if isinstance(tokens, SupportsToList):
        return np.asarray(tokens.tolist())
    return np.asarray(tokens)


def tokens_to_u32(tokens: TokenIds) -> npt.NDArray[np.uint32]:
    """Token ids as a contiguous little-endian u32 array (one conversion, no per-token Python).

    Raises `ValueError` for anything but a 1-D sequence of integers in 0..2**32-1.
    """
    if isinstance(tokens, (str, bytes, bytearray, memoryview)):
        raise ValueError(f"token ids must be a 1-D sequence of ints, got {type(tokens).__name__}")
    try:
        arr = _as_array(tokens)
    except (TypeError, ValueError, OverflowError, RuntimeError) as e:
        raise ValueError(f"token ids must be a 1-D sequence of ints: {e}") from e
    if arr.ndim != 1:
        raise ValueError(f"token ids must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype="<u4")
    if arr.dtype.kind not in "iu":
        source = tokens if isinstance(tokens, (list, tuple, range)) else arr.tolist()
        detail = _describe_bad_item(source) or f"dtype {arr.dtype}"
        raise ValueError(f"token ids must be integers in 0..2**32-1: {detail}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi > _U32_MAX:
        bad = lo if lo < 0 else hi
        raise ValueError(f"token id {bad} outside 0..2**32-1")
    return np.ascontiguousarray(arr, dtype="<u4")


def _root_hash(domain: ShareDomain, model: ModelFingerprint, layout: KVLayout, format_version: int) -> bytes:
    h = hashlib.blake2b(digest_size=CHAIN_HASH_BYTES, key=domain.salt, person=_P_ROOT)
    h.update(format_version.to_bytes(2, "little"))
    h.update(domain.digest())
    h.update(model.digest())
    h.update(
        struct.pack(
            "<HHHI", layout.tp_size, layout.pp_size, layout.layer_group_count, layout.tokens_per_chunk
        )
    )
    h.update(_lp_str(layout.tensor_layout))
    return h.digest()


def _encode_extras(chunk_index: int, items: Sequence[bytes]) -> bytes:
    if isinstance(items, (bytes, bytearray, memoryview, str)):
        raise TypeError(
            f"extras[{chunk_index}] must be a sequence of bytes, not a single {type(items).__name__}"
        )
    parts = [len(items).to_bytes(4, "little")]
    for j, item in enumerate(items):
        if not isinstance(item, (bytes, bytearray, memoryview)):
            raise TypeError(f"extras[{chunk_index}][{j}] must be bytes, got {type(item).__name__}")
        parts.append(_lp(bytes(item)))
    return b"".join(parts)


def chain_hashes(
    domain: ShareDomain,
    model: ModelFingerprint,
    layout: KVLayout,
    tokens: TokenIds,
    extras: ChunkExtras | None = None,
    *,
    format_version: int = FORMAT_VERSION,
) -> list[ChainHash]:
    """`h_1..h_N` for the N full chunks of `tokens` (module docstring). A trailing partial chunk
    is not hashed. `extras` maps a chunk index (0-based) to its extra inputs; entries for chunks
    past the last full one are ignored, so one mapping serves every prefix of a request.
    `format_version` other than the current one is for dual-read migrations."""
    check_format_version(format_version)
    u32 = tokens_to_u32(tokens)
    tpc = layout.tokens_per_chunk
    n_chunks = len(u32) // tpc
    if n_chunks - 1 > _U32_MAX:
        raise ValueError(f"{n_chunks} chunks exceed the u32 chunk index")
    encoded_extras: dict[int, bytes] = {}
    for index, items in (extras or {}).items():
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index <= _U32_MAX:
            raise ValueError(f"extras key {index!r} is not a chunk index")
        if index < n_chunks:  # extras of chunks past the last full one do not affect its hashes
            encoded_extras[index] = _encode_extras(index, items)
    no_extras = (0).to_bytes(4, "little")
    header = tpc.to_bytes(4, "little")
    base = hashlib.blake2b(digest_size=CHAIN_HASH_BYTES, key=domain.salt, person=_P_CHUNK)
    prev = _root_hash(domain, model, layout, format_version)
    out: list[ChainHash] = []
    for i in range(n_chunks):
        h = base.copy()
        h.update(prev)
        h.update(header)
        h.update(u32[i * tpc : (i + 1) * tpc].data)
        h.update(encoded_extras.get(i, no_extras))
        prev = h.digest()
        out.append(ChainHash(prev))
    return out


def chain_step(
    domain: ShareDomain,
    model: ModelFingerprint,
    layout: KVLayout,
    prev: bytes | None,
    chunk_tokens: TokenIds,
    *,
    format_version: int = FORMAT_VERSION,
) -> ChainHash:
    """The chain hash of one full chunk of `chunk_tokens` after the chunk whose chain hash is
    `prev` (None: the prompt's first chunk), with no extras: `chain_hashes` one chunk at a time,
    for whoever learns chunks one by one (an engine's KV events name a block by its parent's hash
    and its own tokens: `kvfabric.core.routing_engine_cache`)."""
    check_format_version(format_version)
    u32 = tokens_to_u32(chunk_tokens)
    tpc = layout.tokens_per_chunk
    if len(u32) != tpc:
        raise ValueError(f"a chunk holds {tpc} tokens, got {len(u32)}")
    h = hashlib.blake2b(digest_size=CHAIN_HASH_BYTES, key=domain.salt, person=_P_CHUNK)
    h.update(prev if prev is not None else _root_hash(domain, model, layout, format_version))
    h.update(tpc.to_bytes(4, "little"))
    h.update(u32.data)
    h.update((0).to_bytes(4, "little"))  # no extras
    return ChainHash(h.digest())


def chunk_groups_for_prefix(
    domain: ShareDomain,
    model: ModelFingerprint,
    layout: KVLayout,
    tokens: TokenIds,
    extras: ChunkExtras | None = None,
    *,
    format_version: int = FORMAT_VERSION,
) -> list[ChunkGroupId]:
    """One `ChunkGroupId` per full chunk of `tokens` (the member fields of `layout` are unused)."""
    hashes = chain_hashes(domain, model, layout, tokens, extras, format_version=format_version)
    domain_digest = domain.digest()
    model_digest = model.digest()
    layout_digest = layout.digest()
    return [
        ChunkGroupId(
            format_version=format_version,
            domain_digest=domain_digest,
            model_digest=model_digest,
            tp_size=layout.tp_size,
            pp_size=layout.pp_size,
            layer_group_count=layout.layer_group_count,
            tokens_per_chunk=layout.tokens_per_chunk,
            layout_digest=layout_digest,
            chunk_index=i,
            chain_hash=h,
        )
        for i, h in enumerate(hashes)
    ]


def keys_for_prefix(
    domain: ShareDomain,
    model: ModelFingerprint,
    layout: KVLayout,
    tokens: TokenIds,
    extras: ChunkExtras | None = None,
    *,
    format_version: int = FORMAT_VERSION,
) -> list[KVKey]:
    """The keys of this worker's objects (`layout`'s rank/stage/group), one per full chunk."""
    groups = chunk_groups_for_prefix(domain, model, layout, tokens, extras, format_version=format_version)
    return [
        KVKey(chunk_group=g, tp_rank=layout.tp_rank, pp_stage=layout.pp_stage, layer_group=layout.layer_group)
        for g in groups
    ]
