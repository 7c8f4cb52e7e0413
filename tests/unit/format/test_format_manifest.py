"""Manifest: round trips, version gate before schema, malformed input, the fold never skips a gap."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvfabric.format.key as key_mod
from kvfabric.format import (
    BadRequest,
    ChainHash,
    ChunkEntry,
    DomainDigest,
    KVLayout,
    LayoutDigest,
    Manifest,
    MemberId,
    ModelDigest,
    ModelFingerprint,
    ObjectEntry,
    ShareDomain,
    UnsupportedVersion,
    checksum,
    complete_prefix_len,
    decode_manifest,
    encode_manifest,
    keys_for_prefix,
)

# ---- strategies ---------------------------------------------------------------------------------


def _obj(m: tuple[int, int, int], size: int = 4096, payload: bytes = b"") -> ObjectEntry:
    return ObjectEntry(
        tp_rank=m[0], pp_stage=m[1], layer_group=m[2], size_bytes=size, checksum=checksum(payload)
    )


@st.composite
def manifests(draw: st.DrawFn) -> Manifest:
    tp, pp, lgc = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    all_members = [(r, s, g) for r in range(tp) for s in range(pp) for g in range(lgc)]
    indices = sorted(draw(st.sets(st.integers(0, 12), max_size=8)))
    chunks = []
    for i in indices:
        members = draw(st.lists(st.sampled_from(all_members), unique=True))
        objects = tuple(
            ObjectEntry(
                tp_rank=r,
                pp_stage=s,
                layer_group=g,
                size_bytes=draw(st.integers(1, 2**63 - 1)),
                checksum=draw(st.binary(min_size=16, max_size=16)),
            )
            for r, s, g in members
        )
        chunks.append(
            ChunkEntry(
                chunk_index=i,
                chain_hash=ChainHash(draw(st.binary(min_size=32, max_size=32))),
                objects=objects,
            )
        )
    return Manifest(
        format_version=1,
        domain_digest=DomainDigest(draw(st.binary(min_size=16, max_size=16))),
        model_digest=ModelDigest(draw(st.binary(min_size=16, max_size=16))),
        tp_size=tp,
        pp_size=pp,
        layer_group_count=lgc,
        tokens_per_chunk=draw(st.integers(1, 2**32 - 1)),
        layout_digest=LayoutDigest(draw(st.binary(min_size=8, max_size=8))),
        chunks=tuple(chunks),
    )


def _manifest(chunks: list[tuple[int, list[tuple[int, int, int]]]], *, tp: int = 2, lgc: int = 2) -> Manifest:
    return Manifest(
        format_version=1,
        domain_digest=DomainDigest(bytes(16)),
        model_digest=ModelDigest(bytes(16)),
        tp_size=tp,
        pp_size=1,
        layer_group_count=lgc,
        tokens_per_chunk=16,
        layout_digest=LayoutDigest(bytes(8)),
        chunks=tuple(
            ChunkEntry(
                chunk_index=i, chain_hash=ChainHash(bytes([i]) * 32), objects=tuple(_obj(m) for m in members)
            )
            for i, members in chunks
        ),
    )


FULL = [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)]

# ---- round trip ---------------------------------------------------------------------------------


@given(manifests())
def test_manifest_round_trips(m: Manifest) -> None:
    raw = encode_manifest(m)
    assert decode_manifest(raw) == m
    assert decode_manifest(memoryview(raw)) == m
    assert hash(decode_manifest(raw)) == hash(m)


def test_manifest_is_a_map_with_v_first_and_compact_entries() -> None:
    m = _manifest([(0, FULL)])
    as_obj = msgspec.msgpack.decode(encode_manifest(m))
    assert next(iter(as_obj)) == "v"
    assert as_obj["v"] == 1
    assert as_obj["chunks"][0][2][0] == [0, 0, 0, 4096, checksum(b""), "xxh3-128"]


def test_manifest_keys_match_the_keys_the_writers_computed() -> None:
    d = ShareDomain("acme", bytes(range(16)))
    model = ModelFingerprint(model_id="m", weights_revision="r", kv_dtype="bf16", attn_config_digest="a")
    tokens = list(range(40))
    keys = {
        (r, g): keys_for_prefix(
            d,
            model,
            KVLayout(
                tp_size=2,
                tp_rank=r,
                pp_stage=0,
                layer_group=g,
                layer_group_count=2,
                tokens_per_chunk=8,
                tensor_layout="x",
            ),
            tokens,
        )
        for r in range(2)
        for g in range(2)
    }
    groups = [k.chunk_group for k in keys[0, 0]]
    m = Manifest.for_group(
        groups[3],
        [
            ChunkEntry(
                chunk_index=g.chunk_index, chain_hash=g.chain_hash, objects=tuple(_obj(x) for x in FULL)
            )
            for g in groups
        ],
    )
    assert len(m.chunks) == 5
    for chunk, group in zip(m.chunks, groups, strict=True):
        assert m.chunk_group(chunk) == group
        for obj in chunk.objects:
            assert m.object_key(chunk, obj) == keys[obj.tp_rank, obj.layer_group][chunk.chunk_index]
    assert m.expected_members() == groups[0].expected_members()


# ---- versions and malformed input ---------------------------------------------------------------


def _as_dict(m: Manifest) -> dict[str, Any]:
    out: dict[str, Any] = msgspec.msgpack.decode(encode_manifest(m))
    return out


def test_unknown_manifest_version_is_rejected_naming_found_and_supported() -> None:
    future = {**_as_dict(_manifest([(0, FULL)])), "v": 2}
    with pytest.raises(UnsupportedVersion) as e:
        decode_manifest(msgspec.msgpack.encode(future))
    assert str(e.value) == "unsupported manifest format version 2; this build reads 1"
    assert e.value.found == 2
    assert e.value.supported == (1,)
    assert e.value.details == {"what": "manifest format", "found": 2, "supported": [1]}


def test_version_is_read_before_the_schema() -> None:
    # A v3 manifest whose other fields a v1 reader could not decode at all still gets the clear error.
    future = {"v": 3, "chunks": "a new shape", "tp_size": [1, 2], "something_new": {"x": 1}}
    with pytest.raises(UnsupportedVersion, match="manifest format version 3"):
        decode_manifest(msgspec.msgpack.encode(future))


def test_unknown_kv_data_format_version_is_rejected() -> None:
    newer = {**_as_dict(_manifest([(0, FULL)])), "format_version": 5}
    with pytest.raises(UnsupportedVersion, match="unsupported KV data format version 5; this build reads 1"):
        decode_manifest(msgspec.msgpack.encode(newer))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(key_mod, "SUPPORTED_FORMAT_VERSIONS", (1, 5))
        assert decode_manifest(msgspec.msgpack.encode(newer)).format_version == 5


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\xc1",  # never used in msgpack
        b"\x01",  # an int, not a map
        msgspec.msgpack.encode([1, 2, 3]),
        msgspec.msgpack.encode({"format_version": 1}),  # no version
        msgspec.msgpack.encode({"v": "1"}),
        msgspec.msgpack.encode({"v": 1}),  # version only
        msgspec.msgpack.encode({"v": 1}) + b"\x00",  # trailing bytes
        b"\x8f\xa1v\x01",  # truncated map
    ],
)
def test_malformed_manifest_is_bad_request(raw: bytes) -> None:
    with pytest.raises(BadRequest) as e:
        decode_manifest(raw)
    assert type(e.value) is BadRequest
    assert "malformed manifest" in str(e.value)


def _replace_first_object(m: Manifest, obj: list[Any]) -> bytes:
    d = _as_dict(m)
    d["chunks"][0][2][0] = obj
    return msgspec.msgpack.encode(d)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda d: d["chunks"].reverse(), "chunk indices must strictly increase"),
        (lambda d: d["chunks"][0][2].append(d["chunks"][0][2][0]), "lists a .* twice"),
        (lambda d: d["chunks"][0][2][0].__setitem__(0, 2), "outside tp_size=2"),
        (lambda d: d["chunks"][0][2][0].__setitem__(2, 2), "outside layer_group_count=2"),
        (lambda d: d["chunks"][0][2][0].__setitem__(3, 0), "size_bytes=0 out of range"),
        (lambda d: d["chunks"][0][2][0].__setitem__(4, b"short"), "checksum must be 16 bytes"),
        (lambda d: d["chunks"][0][2][0].__setitem__(5, "crc32"), "unknown checksum algorithm 'crc32'"),
        (lambda d: d["chunks"][0].__setitem__(1, b"x" * 31), "chain_hash must be 32 bytes"),
        (lambda d: d.__setitem__("domain_digest", b"x" * 15), "domain_digest must be 16 bytes"),
        (lambda d: d.__setitem__("tp_size", 0), "tp_size=0"),
        (lambda d: d.__setitem__("tp_size", True), "Expected `int`, got `bool`"),
    ],
)
def test_invalid_manifest_content_is_bad_request(mutate: Any, match: str) -> None:
    d = _as_dict(_manifest([(0, FULL), (1, FULL)]))
    mutate(d)
    with pytest.raises(BadRequest, match=match):
        decode_manifest(msgspec.msgpack.encode(d))


@settings(max_examples=300)
@given(st.binary(max_size=200))
def test_random_bytes_decode_or_raise_bad_request(raw: bytes) -> None:
    try:
        m = decode_manifest(raw)
    except BadRequest:
        return
    assert isinstance(m, Manifest)


@given(manifests(), st.data())
def test_corrupted_manifest_decodes_or_raises_bad_request(m: Manifest, data: st.DataObject) -> None:
    raw = bytearray(encode_manifest(m))
    pos = data.draw(st.integers(0, len(raw) - 1))
    raw[pos] = data.draw(st.integers(0, 255))
    try:
        out = decode_manifest(bytes(raw))
    except BadRequest:
        return
    assert isinstance(out, Manifest)


def test_encoding_an_unsupported_manifest_version_is_refused() -> None:
    m = msgspec.structs.replace(_manifest([]), manifest_version=9)
    with pytest.raises(ValueError, match="cannot encode manifest version 9"):
        encode_manifest(m)


# ---- the fold -----------------------------------------------------------------------------------


def test_fold_counts_all_complete_chunks() -> None:
    assert complete_prefix_len(_manifest([(0, FULL), (1, FULL), (2, FULL)])) == 3
    assert complete_prefix_len(_manifest([])) == 0


def test_fold_stops_at_a_missing_member_and_never_skips_it() -> None:
    m = _manifest([(0, FULL), (1, FULL), (2, FULL[:3]), (3, FULL), (4, FULL)])
    assert complete_prefix_len(m) == 2
    # A reader that only needs the members chunk 2 has (e.g. rank 0's own objects) goes further.
    assert complete_prefix_len(m, {(0, 0, 0), (0, 0, 1)}) == 5
    assert complete_prefix_len(m, [MemberId(1, 0, 1)]) == 2


def test_fold_stops_at_a_missing_chunk_index() -> None:
    assert complete_prefix_len(_manifest([(0, FULL), (1, FULL), (3, FULL), (4, FULL)])) == 2
    assert complete_prefix_len(_manifest([(1, FULL), (2, FULL)])) == 0


def test_fold_with_an_incomplete_first_chunk_is_zero() -> None:
    assert complete_prefix_len(_manifest([(0, []), (1, FULL)])) == 0


def test_fold_rejects_empty_or_impossible_requirements() -> None:
    m = _manifest([(0, FULL)])
    with pytest.raises(ValueError, match="must not be empty"):
        complete_prefix_len(m, set())
    with pytest.raises(ValueError, match="outside tp_size=2"):
        complete_prefix_len(m, {(2, 0, 0)})
    with pytest.raises(ValueError, match="outside layer_group_count=2"):
        complete_prefix_len(m, {(0, 0, 5)})


@given(manifests(), st.data())
def test_fold_is_the_longest_gapless_complete_run(m: Manifest, data: st.DataObject) -> None:
    expected = sorted(m.expected_members())
    required = set(data.draw(st.lists(st.sampled_from(expected), min_size=1, unique=True)))
    n = complete_prefix_len(m, required)
    by_index = {c.chunk_index: c for c in m.chunks}
    # Every chunk 0..n-1 is present and complete ...
    for i in range(n):
        assert i in by_index
        assert required <= by_index[i].members()
    # ... and chunk n is missing or incomplete (the first gap), whatever follows it.
    assert n not in by_index or not required <= by_index[n].members()


# ---- construction checks ------------------------------------------------------------------------


def test_object_entry_validates() -> None:
    ok = _obj((0, 0, 0))
    assert ok.checksum_algo == "xxh3-128"
    assert ok.member == (0, 0, 0)
    with pytest.raises(ValueError, match="checksum must be 16 bytes"):
        ObjectEntry(tp_rank=0, pp_stage=0, layer_group=0, size_bytes=1, checksum=b"x")
    with pytest.raises(ValueError, match="unknown checksum algorithm"):
        ObjectEntry(
            tp_rank=0, pp_stage=0, layer_group=0, size_bytes=1, checksum=bytes(16), checksum_algo="md5"
        )
    with pytest.raises(TypeError, match="size_bytes must be an int"):
        ObjectEntry(tp_rank=0, pp_stage=0, layer_group=0, size_bytes=1.5, checksum=bytes(16))  # type: ignore[arg-type]


def test_manifest_validates_members_and_order_on_construction() -> None:
    with pytest.raises(ValueError, match="strictly increase: 1 after 1"):
        _manifest([(1, FULL), (1, FULL)])
    with pytest.raises(ValueError, match="outside tp_size=1"):
        _manifest([(0, FULL)], tp=1)
    with pytest.raises(ValueError, match="twice"):
        ChunkEntry(chunk_index=0, chain_hash=ChainHash(bytes(32)), objects=(_obj((0, 0, 0)), _obj((0, 0, 0))))
