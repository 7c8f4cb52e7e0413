"""Checked-in vectors pin the hash chain, the key encodings, the shard function and the manifest
v1 encoding forever. If one of these fails, stored data and running peers would disagree with
this build: do not regenerate the vectors; change FORMAT_VERSION / MANIFEST_VERSION instead."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvfabric.format import (
    ChunkGroupId,
    KVKey,
    KVLayout,
    Manifest,
    ModelFingerprint,
    ShareDomain,
    chain_hashes,
    chunk_groups_for_prefix,
    complete_prefix_len,
    decode_manifest,
    encode_manifest,
    keys_for_prefix,
    verify_checksum,
)

VECTORS = Path(__file__).parent / "vectors"
KEY_VECTORS: list[dict[str, Any]] = json.loads((VECTORS / "key_vectors.json").read_text("utf-8"))["vectors"]


def _inputs(
    v: dict[str, Any],
) -> tuple[ShareDomain, ModelFingerprint, KVLayout, list[int], dict[int, list[bytes]]]:
    domain = ShareDomain(v["tenant_id"], bytes.fromhex(v["salt_hex"]))
    model = ModelFingerprint(**v["model"])
    layout = KVLayout(**v["layout"])
    extras = {int(k): [bytes.fromhex(x) for x in items] for k, items in v["extras"].items()}
    return domain, model, layout, list(v["tokens"]), extras


def test_vectors_cover_the_interesting_cases() -> None:
    assert len(KEY_VECTORS) >= 3
    assert any(v["extras"] for v in KEY_VECTORS)
    assert any(v["model"].get("lora_id") for v in KEY_VECTORS)
    assert any(v["layout"].get("pp_size", 1) > 1 for v in KEY_VECTORS)
    assert any(4294967295 in v["tokens"] for v in KEY_VECTORS)
    assert all(v["expected"]["keys"] for v in KEY_VECTORS)


def test_first_chain_hash_is_pinned_here_too() -> None:
    # A second pin, independent of the JSON file: regenerating the file would not hide a change.
    assert KEY_VECTORS[0]["expected"]["chain_hex"][0] == (
        "18a5aa2ac8e201bb10b1a972c6d49cd374b3ed9171166778890eeb5ba5a65258"
    )


@pytest.mark.parametrize("vector", KEY_VECTORS, ids=[v["name"] for v in KEY_VECTORS])
def test_key_vector(vector: dict[str, Any]) -> None:
    domain, model, layout, tokens, extras = _inputs(vector)
    expected = vector["expected"]
    fv = vector["format_version"]
    assert [h.hex() for h in chain_hashes(domain, model, layout, tokens, extras, format_version=fv)] == (
        expected["chain_hex"]
    )
    keys = keys_for_prefix(domain, model, layout, tokens, extras, format_version=fv)
    assert [str(k) for k in keys] == expected["keys"]
    assert [k.to_bytes().hex() for k in keys] == expected["keys_hex"]
    groups = chunk_groups_for_prefix(domain, model, layout, tokens, extras, format_version=fv)
    assert [str(g) for g in groups] == expected["groups"]
    assert [g.shard(1024) for g in groups] == expected["shard_1024"]
    # The stored forms decode back, without the inputs.
    for text, raw in zip(expected["keys"], expected["keys_hex"], strict=True):
        assert KVKey.parse(text) == KVKey.from_bytes(bytes.fromhex(raw))
    for text in expected["groups"]:
        assert str(ChunkGroupId.parse(text)) == text


def test_golden_manifest_v1_decodes_and_reencodes_byte_for_byte() -> None:
    golden = (VECTORS / "manifest_v1.msgpack").read_bytes()
    expected = msgspec.json.decode((VECTORS / "manifest_v1.expected.json").read_bytes(), type=Manifest)
    decoded = decode_manifest(golden)
    assert decoded == expected
    assert encode_manifest(decoded) == golden
    assert decoded.manifest_version == 1
    assert decoded.format_version == 1
    assert [c.chunk_index for c in decoded.chunks] == [0, 1, 2, 3]
    # Chunk 2 misses member (1, 0, 1): the fold stops there although chunk 3 is complete.
    assert complete_prefix_len(decoded) == 2
    assert complete_prefix_len(decoded, {(0, 0, 0), (0, 0, 1)}) == 4
    first = decoded.chunks[0].objects[0]
    assert verify_checksum(b"chunk 0 rank 0 group 0", first.checksum, first.checksum_algo)
    # A second pin of the chain, independent of the files.
    assert decoded.chunks[0].chain_hash.hex() == (
        "0958790bc785f8c6cf49098aaeb86997102d2a53a1429bfe29391a110962feb3"
    )
