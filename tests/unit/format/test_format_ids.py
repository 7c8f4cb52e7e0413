"""Typed ids (`kvfabric.format.ids`): every pack/unpack agrees with the structured `ChunkGroupId`
and `KVKey`, round trips exactly, and the layout table in `kvfabric.format.key` is the one `ids`
defines (a change of one without the other fails here)."""

from __future__ import annotations

import re
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvfabric.format.key as key_mod
from kvfabric.format import ids
from kvfabric.format.key import ChainHash, ChunkGroupId, DomainDigest, KVKey, LayoutDigest, ModelDigest

U16 = 0xFFFF
U32 = 0xFFFF_FFFF

chunk_groups = st.builds(
    ChunkGroupId,
    format_version=st.just(1),
    domain_digest=st.binary(min_size=16, max_size=16).map(DomainDigest),
    model_digest=st.binary(min_size=16, max_size=16).map(ModelDigest),
    tp_size=st.integers(1, U16),
    pp_size=st.integers(1, U16),
    layer_group_count=st.integers(1, U16),
    tokens_per_chunk=st.integers(1, U32),
    layout_digest=st.binary(min_size=8, max_size=8).map(LayoutDigest),
    chunk_index=st.integers(0, U32),
    chain_hash=st.binary(min_size=32, max_size=32).map(ChainHash),
)


@st.composite
def keys(draw: st.DrawFn) -> KVKey:
    g = draw(chunk_groups)
    return KVKey(
        chunk_group=g,
        tp_rank=draw(st.integers(0, g.tp_size - 1)),
        pp_stage=draw(st.integers(0, g.pp_size - 1)),
        layer_group=draw(st.integers(0, g.layer_group_count - 1)),
    )


def test_sizes() -> None:
    assert (ids.OBJECT_KEY_BYTES, ids.GROUP_ID_BYTES, ids.NAMESPACE_BYTES) == (96, 90, 54)
    assert (ids.GROUP_KEY_BYTES, ids.CHAIN_HASH_BYTES, ids.DOMAIN_DIGEST_BYTES) == (48, 32, 16)
    assert (key_mod.KEY_BYTES, key_mod.CHUNK_GROUP_BYTES) == (ids.OBJECT_KEY_BYTES, ids.GROUP_ID_BYTES)


@given(keys())
def test_object_key_round_trip(key: KVKey) -> None:
    raw = key.to_bytes()
    g = key.chunk_group
    gid = ids.group_id_in_key(ids.ObjectKey(raw))
    assert gid == g.to_bytes() == g.group_id()
    assert ids.member_in_key(ids.ObjectKey(raw)) == key.member
    assert ids.pack_object_key(gid, key.tp_rank, key.pp_stage, key.layer_group) == raw == key.object_key()
    assert gid + ids.pack_member(*key.member) == raw
    assert KVKey.from_bytes(ids.pack_object_key(gid, *key.member)) == key


@given(chunk_groups)
def test_group_id_round_trip(g: ChunkGroupId) -> None:
    raw = g.group_id()
    namespace = ids.namespace_in_id(raw)
    assert len(namespace) == ids.NAMESPACE_BYTES and namespace == g.namespace()
    assert ids.chunk_index_in_id(raw) == g.chunk_index
    assert ids.chain_in_id(raw) == g.chain_hash
    assert ids.pack_group_id(namespace, g.chunk_index, g.chain_hash) == raw
    assert ChunkGroupId.from_bytes(ids.pack_group_id(namespace, g.chunk_index, g.chain_hash)) == g


@given(keys())
def test_fields_read_alike_from_every_form(key: KVKey) -> None:
    g = key.chunk_group
    raw_key, raw_group = key.object_key(), g.group_id()
    namespace = g.namespace()
    for raw in (raw_key, raw_group, namespace):
        assert ids.domain_in_id(raw) == g.domain_digest
    for raw in (raw_key, raw_group):
        assert ids.namespace_in_id(raw) == namespace
        assert ids.chunk_index_in_id(raw) == g.chunk_index
        assert ids.chain_in_id(raw) == g.chain_hash
        assert ids.group_key_of_id(raw) == g.group_key() == g.domain_digest + g.chain_hash


@given(chunk_groups)
def test_group_key_round_trip(g: ChunkGroupId) -> None:
    gk = ids.pack_group_key(g.domain_digest, g.chain_hash)
    assert gk == g.group_key() and len(gk) == ids.GROUP_KEY_BYTES
    assert ids.domain_in_group_key(gk) == g.domain_digest
    assert ids.chain_in_group_key(gk) == g.chain_hash


@given(keys())
def test_chain_in_any_form(key: KVKey) -> None:
    g = key.chunk_group
    for raw in (key.to_bytes(), g.to_bytes(), g.group_key(), g.chain_hash):
        assert ids.chain_in_any(raw) == g.chain_hash
    for size in (0, 16, 54, 89):
        with pytest.raises(ValueError, match="no chain hash"):
            ids.chain_in_any(bytes(size))


def test_key_docstring_table_is_the_ids_layout() -> None:
    """The offset table in kvfabric.format.key's docstring is what `ids` packs."""
    doc = key_mod.__doc__ or ""
    rows = re.findall(r"^\|\s+(\d+) \|\s+(\d+) \| ([^|]+?)\s+\|$", doc, re.MULTILINE)
    fields = [*ids.GROUP_ID_FIELDS, *ids.MEMBER_FIELDS]
    assert len(rows) == len(fields)
    at = 0
    for (offset, size, text), (name, code) in zip(rows, fields, strict=True):
        width = struct.calcsize("<" + code)
        assert (int(offset), int(size)) == (at, width), (name, text)
        at += width
    assert at == ids.OBJECT_KEY_BYTES
    got = (ids.DOMAIN_SLICE, ids.CHUNK_INDEX_SLICE, ids.CHAIN_SLICE, ids.NAMESPACE_SLICE)
    assert got == (slice(4, 20), slice(54, 58), slice(58, 90), slice(0, 54))


def test_typed_ids_are_plain_bytes_at_run_time() -> None:
    """NewTypes: no wrapper object, so hashing, dict keys and msgspec see plain bytes."""
    gk = ids.pack_group_key(DomainDigest(b"d" * 16), ChainHash(b"c" * 32))
    table: dict[bytes, int] = {gk: 1}
    assert type(gk) is bytes and table[b"d" * 16 + b"c" * 32] == 1
