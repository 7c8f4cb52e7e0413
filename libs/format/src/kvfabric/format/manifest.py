"""Manifest of one prefix: its chunk groups in order, and per chunk the objects with size and
checksum (docs/design.md sections 2-3).

Structure (msgpack; `Manifest` is a map so that readers can find `v` without knowing the rest;
`ChunkEntry` and `ObjectEntry` are arrays, for size: a manifest may list thousands of objects):

    Manifest {v, format_version, domain_digest, model_digest, tp_size, pp_size,
              layer_group_count, tokens_per_chunk, layout_digest, chunks}
      chunks: [ChunkEntry [chunk_index, chain_hash, objects]]   strictly increasing chunk_index
        objects: [ObjectEntry [tp_rank, pp_stage, layer_group, size_bytes, checksum, checksum_algo]]

The identity fields of the prefix's chunk groups are stored once; `Manifest.chunk_group()`
rebuilds a chunk's `ChunkGroupId` and `Manifest.object_key()` an object's `KVKey`.

Versions: `v` is the manifest encoding version (`MANIFEST_VERSION`); `format_version` is the KV
data format of the listed objects (`key.FORMAT_VERSION`). `decode_manifest()` reads `v` first
through a lenient header (every other field ignored), so a manifest from a newer writer is
rejected with `UnsupportedVersion` naming both the version found and the versions supported,
never with a confusing schema error. Evolution inside one version: new fields get defaults and
go last; no field ever changes type; anything else (including a new checksum algorithm) bumps
`MANIFEST_VERSION`.

Readers fold a manifest with `complete_prefix_len()`: the number of leading chunks, from chunk
0 on, whose objects cover every required member, stopping at the first gap (a missing chunk
index or a missing member): a gap is never skipped, the rest of the prefix is recomputed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final, Self

import msgspec

from kvfabric.format.checksum import CHECKSUM_ALGO, SUPPORTED_CHECKSUM_ALGOS
from kvfabric.format.errors import BadRequest, UnsupportedVersion
from kvfabric.format.key import (
    CHAIN_HASH_BYTES,
    DOMAIN_DIGEST_BYTES,
    LAYOUT_DIGEST_BYTES,
    MODEL_DIGEST_BYTES,
    ChainHash,
    ChunkGroupId,
    DomainDigest,
    KVKey,
    LayoutDigest,
    MemberId,
    ModelDigest,
    check_format_version,
)

__all__ = [
    "MANIFEST_VERSION",
    "SUPPORTED_MANIFEST_VERSIONS",
    "ChunkEntry",
    "Manifest",
    "ObjectEntry",
    "complete_prefix_len",
    "decode_manifest",
    "encode_manifest",
]

MANIFEST_VERSION: Final = 1
SUPPORTED_MANIFEST_VERSIONS: tuple[int, ...] = (1,)

_U16_MAX: Final = 0xFFFF
_U32_MAX: Final = 0xFFFF_FFFF
_SIZE_MAX: Final = 2**63 - 1


def _check_int(name: str, value: object, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise ValueError(f"{name}={value} out of range {lo}..{hi}")


def _check_len(name: str, value: bytes, size: int) -> None:
    if not isinstance(value, bytes) or len(value) != size:
        raise ValueError(f"{name} must be {size} bytes")


class ObjectEntry(msgspec.Struct, frozen=True, array_like=True):
    """One stored object of a chunk: its member, size and checksum."""

    tp_rank: int
    pp_stage: int
    layer_group: int
    size_bytes: int
    checksum: bytes
    checksum_algo: str = CHECKSUM_ALGO

    def __post_init__(self) -> None:
        _check_int("tp_rank", self.tp_rank, 0, _U16_MAX)
        _check_int("pp_stage", self.pp_stage, 0, _U16_MAX)
        _check_int("layer_group", self.layer_group, 0, _U16_MAX)
        _check_int("size_bytes", self.size_bytes, 1, _SIZE_MAX)
        digest_bytes = SUPPORTED_CHECKSUM_ALGOS.get(self.checksum_algo)
        if digest_bytes is None:
            known = ", ".join(sorted(SUPPORTED_CHECKSUM_ALGOS))
            raise ValueError(f"unknown checksum algorithm {self.checksum_algo!r}; known: {known}")
        _check_len("checksum", self.checksum, digest_bytes)

    @property
    def member(self) -> MemberId:
        return MemberId(self.tp_rank, self.pp_stage, self.layer_group)


class ChunkEntry(msgspec.Struct, frozen=True, array_like=True):
    """One chunk group of the prefix and the objects of it that are listed."""

    chunk_index: int
    chain_hash: ChainHash
    objects: tuple[ObjectEntry, ...] = ()

    def __post_init__(self) -> None:
        _check_int("chunk_index", self.chunk_index, 0, _U32_MAX)
        _check_len("chain_hash", self.chain_hash, CHAIN_HASH_BYTES)
        members = {o.member for o in self.objects}
        if len(members) != len(self.objects):
            raise ValueError(f"chunk {self.chunk_index} lists a (tp_rank, pp_stage, layer_group) twice")

    def members(self) -> frozenset[MemberId]:
        return frozenset(o.member for o in self.objects)


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    """The manifest of one prefix. Build it with `Manifest.for_group()` or field by field."""

    manifest_version: int = msgspec.field(default=MANIFEST_VERSION, name="v")
    format_version: int
    domain_digest: DomainDigest
    model_digest: ModelDigest
    tp_size: int
    pp_size: int
    layer_group_count: int
    tokens_per_chunk: int
    layout_digest: LayoutDigest
    chunks: tuple[ChunkEntry, ...] = ()

    def __post_init__(self) -> None:
        _check_int("manifest_version", self.manifest_version, 1, _U16_MAX)
        _check_int("format_version", self.format_version, 1, _U16_MAX)
        _check_len("domain_digest", self.domain_digest, DOMAIN_DIGEST_BYTES)
        _check_len("model_digest", self.model_digest, MODEL_DIGEST_BYTES)
        _check_int("tp_size", self.tp_size, 1, _U16_MAX)
        _check_int("pp_size", self.pp_size, 1, _U16_MAX)
        _check_int("layer_group_count", self.layer_group_count, 1, _U16_MAX)
        _check_int("tokens_per_chunk", self.tokens_per_chunk, 1, _U32_MAX)
        _check_len("layout_digest", self.layout_digest, LAYOUT_DIGEST_BYTES)
        previous = -1
        for chunk in self.chunks:
            if chunk.chunk_index <= previous:
                raise ValueError(
                    f"chunk indices must strictly increase: {chunk.chunk_index} after {previous}"
                )
            previous = chunk.chunk_index
            for o in chunk.objects:
                self._check_member(o.member, f"chunk {chunk.chunk_index}")

    def _check_member(self, m: MemberId, where: str) -> None:
        if not (0 <= m.tp_rank < self.tp_size and 0 <= m.pp_stage < self.pp_size):
            raise ValueError(
                f"{where}: member {tuple(m)} outside tp_size={self.tp_size} pp_size={self.pp_size}"
            )
        if not 0 <= m.layer_group < self.layer_group_count:
            raise ValueError(f"{where}: member {tuple(m)} outside layer_group_count={self.layer_group_count}")

    @classmethod
    def for_group(cls, group: ChunkGroupId, chunks: Iterable[ChunkEntry] = ()) -> Self:
        """A manifest with the prefix identity of `group` (any chunk of the prefix)."""
        return cls(
            format_version=group.format_version,
            domain_digest=group.domain_digest,
            model_digest=group.model_digest,
            tp_size=group.tp_size,
            pp_size=group.pp_size,
            layer_group_count=group.layer_group_count,
            tokens_per_chunk=group.tokens_per_chunk,
            layout_digest=group.layout_digest,
            chunks=tuple(chunks),
        )

    def chunk_group(self, chunk: ChunkEntry) -> ChunkGroupId:
        return ChunkGroupId(
            format_version=self.format_version,
            domain_digest=self.domain_digest,
            model_digest=self.model_digest,
            tp_size=self.tp_size,
            pp_size=self.pp_size,
            layer_group_count=self.layer_group_count,
            tokens_per_chunk=self.tokens_per_chunk,
            layout_digest=self.layout_digest,
            chunk_index=chunk.chunk_index,
            chain_hash=chunk.chain_hash,
        )

    def object_key(self, chunk: ChunkEntry, obj: ObjectEntry) -> KVKey:
        return self.chunk_group(chunk).member_key(obj.tp_rank, obj.pp_stage, obj.layer_group)

    def expected_members(self) -> frozenset[MemberId]:
        """All members of a complete chunk group: tp_size * pp_size * layer_group_count."""
        return frozenset(
            MemberId(r, s, g)
            for r in range(self.tp_size)
            for s in range(self.pp_size)
            for g in range(self.layer_group_count)
        )


class _Header(msgspec.Struct):
    """Only the version; every other field is skipped unread (forward compatible)."""

    v: int


_ENCODER: Final = msgspec.msgpack.Encoder()
_HEADER_DECODER: Final = msgspec.msgpack.Decoder(_Header)
_DECODER: Final = msgspec.msgpack.Decoder(Manifest)


def encode_manifest(manifest: Manifest) -> bytes:
    if manifest.manifest_version not in SUPPORTED_MANIFEST_VERSIONS:
        raise ValueError(f"cannot encode manifest version {manifest.manifest_version}")
    return _ENCODER.encode(manifest)


def decode_manifest(data: bytes | bytearray | memoryview) -> Manifest:
    """Decode a manifest. Raises `UnsupportedVersion` for a manifest (or KV data) format version
    this build does not read, `BadRequest` for anything malformed."""
    try:
        header = _HEADER_DECODER.decode(data)
    except msgspec.DecodeError as e:
        raise BadRequest(f"malformed manifest (no readable version): {e}") from None
    except RecursionError:  # nested arrays/maps deeper than the recursion limit, even if skipped
        raise BadRequest("malformed manifest: nested too deep") from None
    if header.v not in SUPPORTED_MANIFEST_VERSIONS:
        raise UnsupportedVersion("manifest format", header.v, SUPPORTED_MANIFEST_VERSIONS)
    try:
        manifest = _DECODER.decode(data)
    except msgspec.DecodeError as e:
        raise BadRequest(f"malformed manifest v{header.v}: {e}") from None
    except RecursionError:
        raise BadRequest(f"malformed manifest v{header.v}: nested too deep") from None
    check_format_version(manifest.format_version)
    return manifest


def complete_prefix_len(
    manifest: Manifest, required_members: Iterable[tuple[int, int, int]] | None = None
) -> int:
    """Number of leading chunks (from chunk 0, consecutive) whose objects cover every member in
    `required_members` (default: every expected member). Stops at the first gap, never skips one."""
    required = (
        manifest.expected_members()
        if required_members is None
        else frozenset(MemberId(*m) for m in required_members)
    )
    if not required:
        raise ValueError("required_members must not be empty: an empty set would make any chunk complete")
    for m in required:
        manifest._check_member(m, "required_members")
    n = 0
    for chunk in manifest.chunks:
        if chunk.chunk_index != n or not required <= chunk.members():
            break
        n += 1
    return n
