"""Pure parsing of what an operator types for a key or chunk group (no I/O).

Accepted forms: the readable `kvf1:...` key or `kvg1:...` chunk group id, or hex of the binary
key (96 bytes), chunk group id (90 bytes) or, where a chain hash will do, the chain hash (32 bytes).
Bad input raises `BadRequest`.
"""

from __future__ import annotations

from typing import Any

from kvfabric.format.errors import BadRequest
from kvfabric.format.ids import NAMESPACE_BYTES, ChainHash, GroupId, Namespace, pack_group_id
from kvfabric.format.key import CHAIN_HASH_BYTES, CHUNK_GROUP_BYTES, KEY_BYTES, ChunkGroupId, KVKey

__all__ = ["decode_key", "group_from_summary", "group_id_of", "group_of", "key_fields"]


def _hex(text: str) -> bytes:
    cleaned = text.strip().removeprefix("0x")
    try:
        return bytes.fromhex(cleaned)
    except ValueError:
        raise BadRequest(f"not a kvf1:/kvg1: form nor hex: {text[:40]!r}") from None


def decode_key(text: str) -> KVKey | ChunkGroupId:
    """A key or chunk group id from its readable form or the hex of its binary form."""
    text = text.strip()
    if text.startswith("kvf"):
        return KVKey.parse(text)
    if text.startswith("kvg"):
        return ChunkGroupId.parse(text)
    raw = _hex(text)
    if len(raw) == KEY_BYTES:
        return KVKey.from_bytes(raw)
    if len(raw) == CHUNK_GROUP_BYTES:
        return ChunkGroupId.from_bytes(raw)
    raise BadRequest(
        f"hex of {len(raw)} bytes: want a key ({KEY_BYTES}) or chunk group id ({CHUNK_GROUP_BYTES})"
    )


def group_id_of(text: str) -> GroupId:
    """The binary chunk group id that `text` (a key or chunk group id) names."""
    value = decode_key(text.strip())
    group = value.chunk_group if isinstance(value, KVKey) else value
    return group.group_id()


def group_of(text: str, *, allow_chain_hash: bool = False) -> GroupId | ChainHash:
    """The binary chunk group id (or, if allowed, a 32-byte chain hash) that `text` names."""
    stripped = text.strip()
    if allow_chain_hash and not stripped.startswith(("kvf", "kvg")):
        raw = _hex(stripped)
        if len(raw) == CHAIN_HASH_BYTES:
            return ChainHash(raw)
    return group_id_of(stripped)


def group_from_summary(namespace: bytes, chunk_index: int, chain_hash: bytes) -> ChunkGroupId | None:
    """The chunk group id a directory summary describes (None if the parts do not form one)."""
    if len(namespace) != NAMESPACE_BYTES or len(chain_hash) != CHAIN_HASH_BYTES:
        return None
    try:
        return ChunkGroupId.from_bytes(
            pack_group_id(Namespace(namespace), chunk_index, ChainHash(chain_hash))
        )
    except BadRequest:
        return None


def key_fields(value: KVKey | ChunkGroupId) -> dict[str, Any]:
    """Every field of a key or chunk group id, as JSON-ready values (digests as hex)."""
    group = value.chunk_group if isinstance(value, KVKey) else value
    fields: dict[str, Any] = {
        "kind": "key" if isinstance(value, KVKey) else "chunk_group",
        "readable": str(value),
        "hex": value.to_bytes().hex(),
        "format_version": group.format_version,
        "domain_digest": group.domain_digest.hex(),
        "model_digest": group.model_digest.hex(),
        "tp_size": group.tp_size,
        "pp_size": group.pp_size,
        "layer_group_count": group.layer_group_count,
        "tokens_per_chunk": group.tokens_per_chunk,
        "layout_digest": group.layout_digest.hex(),
        "chunk_index": group.chunk_index,
        "chain_hash": group.chain_hash.hex(),
        "chunk_group": str(group),
        # the typed ids (kvfabric.format.ids): how events and listings (namespace) and the
        # directory, the eviction policy and the router (group key) name this group
        "namespace": group.namespace().hex(),
        "group_key": group.group_key().hex(),
    }
    if isinstance(value, KVKey):
        fields.update(tp_rank=value.tp_rank, pp_stage=value.pp_stage, layer_group=value.layer_group)
    return fields
