"""KV identity: round trips, every identity field separates keys, the chain is prefix-stable,
token inputs of every shape hash alike, bad input is rejected clearly, processes agree."""

from __future__ import annotations

import array
import dataclasses
import os
import re
import struct
import subprocess
import sys
from collections.abc import Callable
from typing import Any
from unittest import mock

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvfabric.format.key as key_mod
from kvfabric.format import (
    CHUNK_GROUP_BYTES,
    KEY_BYTES,
    BadRequest,
    ChainHash,
    ChunkGroupId,
    DomainDigest,
    KVKey,
    KVLayout,
    LayoutDigest,
    MemberId,
    ModelDigest,
    ModelFingerprint,
    ShareDomain,
    UnsupportedVersion,
    chain_hashes,
    chunk_groups_for_prefix,
    digest_config,
    ids,
    keys_for_prefix,
    tokens_to_u32,
)

U16 = 0xFFFF
U32 = 0xFFFF_FFFF

# ---- strategies ---------------------------------------------------------------------------------

texts = st.text(alphabet=st.characters(exclude_categories=["Cs"]), min_size=1, max_size=12)

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
def kv_keys(draw: st.DrawFn) -> KVKey:
    g = draw(chunk_groups)
    return KVKey(
        chunk_group=g,
        tp_rank=draw(st.integers(0, g.tp_size - 1)),
        pp_stage=draw(st.integers(0, g.pp_size - 1)),
        layer_group=draw(st.integers(0, g.layer_group_count - 1)),
    )


@dataclasses.dataclass(frozen=True)
class Ident:
    """Every input of a prefix's keys."""

    domain: ShareDomain
    model: ModelFingerprint
    layout: KVLayout
    tokens: tuple[int, ...]
    extras: dict[int, list[bytes]]
    format_version: int = 1

    def keys(self) -> list[KVKey]:
        return keys_for_prefix(
            self.domain, self.model, self.layout, self.tokens, self.extras, format_version=self.format_version
        )

    def chain(self) -> list[ChainHash]:
        return chain_hashes(
            self.domain, self.model, self.layout, self.tokens, self.extras, format_version=self.format_version
        )


@st.composite
def idents(draw: st.DrawFn, *, multi: bool = True) -> Ident:
    """Base identities; with `multi`, every size is >= 2 and a LoRA is set, so that every field
    has a valid different value to mutate to."""
    lo = 2 if multi else 1
    tp_size = draw(st.integers(lo, 8))
    pp_size = draw(st.integers(lo, 4))
    lgc = draw(st.integers(lo, 4))
    tpc = draw(st.integers(lo, 8))
    has_lora = multi or draw(st.booleans())
    model = ModelFingerprint(
        model_id=draw(texts),
        weights_revision=draw(texts),
        lora_id=draw(texts) if has_lora else "",
        lora_revision=draw(texts) if has_lora else "",
        kv_dtype=draw(texts),
        kv_quant=draw(texts),
        attn_config_digest=draw(texts),
    )
    layout = KVLayout(
        tp_size=tp_size,
        tp_rank=draw(st.integers(0, tp_size - 1)),
        pp_size=pp_size,
        pp_stage=draw(st.integers(0, pp_size - 1)),
        layer_group_count=lgc,
        layer_group=draw(st.integers(0, lgc - 1)),
        tokens_per_chunk=tpc,
        tensor_layout=draw(texts),
    )
    n_chunks = draw(st.integers(1, 4))
    tokens = draw(st.lists(st.integers(0, U32), min_size=n_chunks * tpc, max_size=n_chunks * tpc + tpc - 1))
    extras = draw(
        st.dictionaries(st.integers(0, n_chunks - 1), st.lists(st.binary(max_size=8), max_size=3), max_size=2)
    )
    domain = ShareDomain(draw(texts), draw(st.binary(min_size=16, max_size=64)))
    return Ident(domain, model, layout, tuple(tokens), extras)


# ---- round trips --------------------------------------------------------------------------------


@given(kv_keys())
def test_key_round_trips_in_binary_and_readable_form(key: KVKey) -> None:
    raw = key.to_bytes()
    assert len(raw) == KEY_BYTES == 96
    assert KVKey.from_bytes(raw) == key
    assert KVKey.from_bytes(memoryview(bytearray(raw))) == key
    text = str(key)
    assert KVKey.parse(text) == key
    assert str(KVKey.parse(text)) == text
    assert repr(key) == f"KVKey({text!r})"
    # Binary: the group is the first 90 bytes; the member follows.
    assert raw[:CHUNK_GROUP_BYTES] == key.chunk_group.to_bytes()
    assert raw[:2] == b"\x01\x00"
    assert int.from_bytes(raw[2:4], "little") == key.format_version
    assert int.from_bytes(raw[90:92], "little") == key.tp_rank
    assert key.member == (key.tp_rank, key.pp_stage, key.layer_group)
    # msgspec can carry a key too (e.g. inside a test record), and it stays hashable.
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(key), type=KVKey) == key
    assert {key: 1}[KVKey.from_bytes(raw)] == 1


@given(chunk_groups)
def test_chunk_group_round_trips(group: ChunkGroupId) -> None:
    raw = group.to_bytes()
    assert len(raw) == CHUNK_GROUP_BYTES == 90
    assert ChunkGroupId.from_bytes(raw) == group
    assert ChunkGroupId.parse(str(group)) == group
    assert 0 <= group.shard(7) < 7
    assert group.shard(1) == 0


@settings(max_examples=50)
@given(idents(multi=False))
def test_computed_keys_round_trip_and_share_their_group(ident: Ident) -> None:
    keys = ident.keys()
    groups = chunk_groups_for_prefix(ident.domain, ident.model, ident.layout, ident.tokens, ident.extras)
    assert [k.chunk_group for k in keys] == groups
    assert [k.chain_hash for k in keys] == ident.chain()
    for i, k in enumerate(keys):
        assert k.chunk_index == i
        assert k.member == ident.layout.member
        assert KVKey.parse(str(k)) == k == KVKey.from_bytes(k.to_bytes())
        assert k.chunk_group.expected_members() >= {k.member}
        assert k.chunk_group.member_key(*k.member) == k


def test_expected_members_are_the_full_cross_product() -> None:
    g = ChunkGroupId(
        format_version=1,
        domain_digest=DomainDigest(bytes(16)),
        model_digest=ModelDigest(bytes(16)),
        tp_size=1,
        pp_size=1,
        layer_group_count=1,
        tokens_per_chunk=16,
        layout_digest=LayoutDigest(bytes(8)),
        chunk_index=0,
        chain_hash=ChainHash(bytes(32)),
    )
    assert g.expected_members() == {MemberId(0, 0, 0)}
    big = msgspec.structs.replace(g, tp_size=2, pp_size=3, layer_group_count=4)
    members = big.expected_members()
    assert len(members) == 24
    assert (1, 2, 3) in members
    assert (2, 0, 0) not in members


# ---- every identity field separates keys --------------------------------------------------------


def _model(i: Ident, **kw: str) -> Ident:
    return dataclasses.replace(i, model=msgspec.structs.replace(i.model, **kw))


def _layout(i: Ident, **kw: Any) -> Ident:
    return dataclasses.replace(i, layout=msgspec.structs.replace(i.layout, **kw))


def _domain(i: Ident, *, tenant_id: str | None = None, salt: bytes | None = None) -> Ident:
    d = ShareDomain(
        i.domain.tenant_id if tenant_id is None else tenant_id, i.domain.salt if salt is None else salt
    )
    return dataclasses.replace(i, domain=d)


def _flip_first(b: bytes) -> bytes:
    return bytes([b[0] ^ 1]) + b[1:]


# Mutations that change what the bytes are (chain hash must change too).
CHAIN_MUTATIONS: dict[str, Callable[[Ident], Ident]] = {
    "tenant_id": lambda i: _domain(i, tenant_id=i.domain.tenant_id + "x"),
    "salt": lambda i: _domain(i, salt=_flip_first(i.domain.salt)),
    "model_id": lambda i: _model(i, model_id=i.model.model_id + "x"),
    "weights_revision": lambda i: _model(i, weights_revision=i.model.weights_revision + "x"),
    "lora_id": lambda i: _model(i, lora_id=i.model.lora_id + "x"),
    "lora_revision": lambda i: _model(i, lora_revision=i.model.lora_revision + "x"),
    "no_lora": lambda i: _model(i, lora_id="", lora_revision=""),
    "kv_dtype": lambda i: _model(i, kv_dtype=i.model.kv_dtype + "x"),
    "kv_quant": lambda i: _model(i, kv_quant=i.model.kv_quant + "x"),
    "attn_config_digest": lambda i: _model(i, attn_config_digest=i.model.attn_config_digest + "x"),
    "tp_size": lambda i: _layout(i, tp_size=i.layout.tp_size + 1),
    "pp_size": lambda i: _layout(i, pp_size=i.layout.pp_size + 1),
    "layer_group_count": lambda i: _layout(i, layer_group_count=i.layout.layer_group_count + 1),
    "tokens_per_chunk": lambda i: _layout(i, tokens_per_chunk=i.layout.tokens_per_chunk - 1),
    "tensor_layout": lambda i: _layout(i, tensor_layout=i.layout.tensor_layout + "x"),
    "format_version": lambda i: dataclasses.replace(i, format_version=2),
    "first_token": lambda i: dataclasses.replace(i, tokens=((i.tokens[0] + 1) % (U32 + 1), *i.tokens[1:])),
    "extras_of_chunk_0": lambda i: dataclasses.replace(
        i, extras={**i.extras, 0: [*i.extras.get(0, []), b"img"]}
    ),
}

# Mutations that pick another object of the same chunk group (chain hash must NOT change).
MEMBER_MUTATIONS: dict[str, Callable[[Ident], Ident]] = {
    "tp_rank": lambda i: _layout(i, tp_rank=(i.layout.tp_rank + 1) % i.layout.tp_size),
    "pp_stage": lambda i: _layout(i, pp_stage=(i.layout.pp_stage + 1) % i.layout.pp_size),
    "layer_group": lambda i: _layout(i, layer_group=(i.layout.layer_group + 1) % i.layout.layer_group_count),
}


def _with_v2_readable() -> Any:
    """A build that reads format versions 1 and 2 (as during a dual-read migration)."""
    return mock.patch.object(key_mod, "SUPPORTED_FORMAT_VERSIONS", (1, 2))


@pytest.mark.parametrize("field", sorted(CHAIN_MUTATIONS))
@settings(max_examples=25)
@given(base=idents())
def test_changing_any_identity_field_changes_every_key_and_chain_hash(field: str, base: Ident) -> None:
    changed = CHAIN_MUTATIONS[field](base)
    assert changed != base
    with _with_v2_readable():
        before, after = base.keys(), changed.keys()
        chain_before, chain_after = base.chain(), changed.chain()
        for a, b in zip(before, after, strict=False):
            assert a != b
            assert a.to_bytes() != b.to_bytes()
            assert str(a) != str(b)
            assert a.chunk_group != b.chunk_group
        assert after, "the mutation must leave at least one full chunk"
        assert not set(chain_before) & set(chain_after)


@pytest.mark.parametrize("field", sorted(MEMBER_MUTATIONS))
@settings(max_examples=25)
@given(base=idents())
def test_changing_rank_stage_or_group_changes_the_key_but_not_the_chunk_group(
    field: str, base: Ident
) -> None:
    changed = MEMBER_MUTATIONS[field](base)
    assert changed != base
    before, after = base.keys(), changed.keys()
    assert len(before) == len(after) > 0
    for a, b in zip(before, after, strict=True):
        assert a != b
        assert a.to_bytes() != b.to_bytes()
        assert str(a) != str(b)
        assert a.chunk_group == b.chunk_group
        assert a.chunk_group.shard(4096) == b.chunk_group.shard(4096)
    assert base.chain() == changed.chain()


def test_unsupported_format_version_is_refused_when_computing() -> None:
    d = ShareDomain("t", bytes(16))
    m = ModelFingerprint(model_id="m", weights_revision="r", kv_dtype="bf16", attn_config_digest="a")
    lay = KVLayout(
        tp_size=1,
        tp_rank=0,
        pp_stage=0,
        layer_group=0,
        layer_group_count=1,
        tokens_per_chunk=2,
        tensor_layout="x",
    )
    with pytest.raises(UnsupportedVersion, match="KV data format version 2; this build reads 1"):
        keys_for_prefix(d, m, lay, [1, 2], format_version=2)


# ---- the chain ----------------------------------------------------------------------------------


@settings(max_examples=50)
@given(base=idents(multi=False), data=st.data())
def test_chain_of_a_prefix_is_a_prefix_of_the_chain_of_its_extension(
    base: Ident, data: st.DataObject
) -> None:
    full = base.chain()
    cut = data.draw(st.integers(0, len(base.tokens)))
    shorter = dataclasses.replace(base, tokens=base.tokens[:cut])
    n = cut // base.layout.tokens_per_chunk
    assert shorter.chain() == full[:n]
    assert shorter.keys() == base.keys()[:n]
    extra_tokens = data.draw(st.lists(st.integers(0, U32), max_size=20))
    longer = dataclasses.replace(base, tokens=base.tokens + tuple(extra_tokens))
    assert longer.chain()[: len(full)] == full


@settings(max_examples=50)
@given(base=idents(multi=False), data=st.data())
def test_a_token_change_changes_its_chunk_and_every_later_one_only(base: Ident, data: st.DataObject) -> None:
    tpc = base.layout.tokens_per_chunk
    n = len(base.tokens) // tpc
    pos = data.draw(st.integers(0, n * tpc - 1))
    tokens = list(base.tokens)
    tokens[pos] = (tokens[pos] + 1) % (U32 + 1)
    changed = dataclasses.replace(base, tokens=tuple(tokens)).chain()
    full = base.chain()
    k = pos // tpc
    assert changed[:k] == full[:k]
    assert all(a != b for a, b in zip(changed[k:], full[k:], strict=True))


def test_partial_chunk_is_not_hashed_and_its_extras_are_accepted_but_unused() -> None:
    d = ShareDomain("t", bytes(16))
    m = ModelFingerprint(model_id="m", weights_revision="r", kv_dtype="bf16", attn_config_digest="a")
    lay = KVLayout(
        tp_size=1,
        tp_rank=0,
        pp_stage=0,
        layer_group=0,
        layer_group_count=1,
        tokens_per_chunk=4,
        tensor_layout="x",
    )
    assert chain_hashes(d, m, lay, [1, 2, 3]) == []
    assert chain_hashes(d, m, lay, []) == []
    two = chain_hashes(d, m, lay, list(range(10)))
    assert len(two) == 2
    assert chain_hashes(d, m, lay, list(range(10)), {2: [b"image"]}) == two
    assert chain_hashes(d, m, lay, list(range(10)), {2: [b"image"], 99: [b"later"]}) == two
    with pytest.raises(ValueError, match="extras key -1 is not a chunk index"):
        chain_hashes(d, m, lay, list(range(10)), {-1: [b"image"]})
    with pytest.raises(ValueError, match="extras key '0' is not a chunk index"):
        chain_hashes(d, m, lay, list(range(10)), {"0": [b"image"]})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="sequence of bytes"):
        chain_hashes(d, m, lay, list(range(10)), {0: b"image"})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match=r"extras\[0\]\[1\] must be bytes"):
        chain_hashes(d, m, lay, list(range(10)), {0: [b"a", "b"]})  # type: ignore[list-item]


def test_extras_encoding_is_unambiguous() -> None:
    d = ShareDomain("t", bytes(16))
    m = ModelFingerprint(model_id="m", weights_revision="r", kv_dtype="bf16", attn_config_digest="a")
    lay = KVLayout(
        tp_size=1,
        tp_rank=0,
        pp_stage=0,
        layer_group=0,
        layer_group_count=1,
        tokens_per_chunk=2,
        tensor_layout="x",
    )
    variants = [None, {0: [b"ab"]}, {0: [b"a", b"b"]}, {0: [b"ab", b""]}, {0: [b""]}, {1: [b"ab"]}]
    hashes = [tuple(chain_hashes(d, m, lay, [5, 6, 7, 8], v)) for v in variants]
    assert len(set(hashes)) == len(variants)
    # No extras and an empty extras list are the same input.
    assert chain_hashes(d, m, lay, [5, 6], {0: []}) == chain_hashes(d, m, lay, [5, 6])


def test_digest_config_ignores_key_order_but_not_values() -> None:
    a = digest_config({"rope_theta": 10000.0, "window": 4096})
    assert a == digest_config({"window": 4096, "rope_theta": 10000.0})
    assert a != digest_config({"window": 4095, "rope_theta": 10000.0})
    assert len(bytes.fromhex(a)) == 16


# ---- token inputs -------------------------------------------------------------------------------


class OnlyToList:
    """Like a tensor on an accelerator: no buffer, no `__array__`, just `tolist()`."""

    def __init__(self, values: list[int]) -> None:
        self._values = values

    def tolist(self) -> list[int]:
        return list(self._values)


class RefusingArray(OnlyToList):
    """Like a CUDA torch tensor: `__array__` raises, `tolist()` works."""

    def __array__(self) -> Any:
        raise TypeError("can't convert cuda:0 device type tensor to numpy")


class OnlyArray:
    def __init__(self, values: list[int]) -> None:
        self._values = values

    def __array__(self) -> Any:
        return np.array(self._values, dtype=np.int64)


TOKENS = [0, 1, 2, 65535, 65536, 128000, 2**31, U32, 7, 8, 9, 10, 11, 12, 13, 14, 15]


@pytest.mark.parametrize(
    "make",
    [
        list,
        tuple,
        lambda t: np.array(t, dtype=np.int64),
        lambda t: np.array(t, dtype=np.uint32),
        lambda t: np.array(t, dtype=np.uint64),
        lambda t: np.array(t, dtype=">i8"),  # big-endian input must hash like the rest
        lambda t: np.array([x - 2**32 if x >= 2**31 else x for x in t], dtype=np.int32).view(np.uint32),
        lambda t: array.array("I", t),
        lambda t: array.array("q", t),
        OnlyToList,
        RefusingArray,
        OnlyArray,
        lambda t: np.array([t, t])[1],  # a row view
        lambda t: np.array([x for v in t for x in (v, 0)], dtype=np.int64)[::2],  # not contiguous
    ],
    ids=[
        "list",
        "tuple",
        "np-int64",
        "np-uint32",
        "np-uint64",
        "np-int64-big-endian",
        "np-int32-view",
        "array-I",
        "array-q",
        "tolist-only",
        "array-refusing",
        "array-only",
        "np-row-view",
        "np-strided",
    ],
)
def test_every_token_container_hashes_identically(make: Callable[[list[int]], Any]) -> None:
    d = ShareDomain("t", bytes(range(16)))
    m = ModelFingerprint(model_id="m", weights_revision="r", kv_dtype="bf16", attn_config_digest="a")
    lay = KVLayout(
        tp_size=1,
        tp_rank=0,
        pp_stage=0,
        layer_group=0,
        layer_group_count=1,
        tokens_per_chunk=4,
        tensor_layout="x",
    )
    expected = chain_hashes(d, m, lay, TOKENS)
    assert len(expected) == 4
    assert chain_hashes(d, m, lay, make(TOKENS)) == expected


def test_small_int_arrays_hash_like_the_list() -> None:
    small = [1, 2, 3, 4, 5, 6, 7, 8]
    d = ShareDomain("t", bytes(range(16)))
    m = ModelFingerprint(model_id="m", weights_revision="r", kv_dtype="bf16", attn_config_digest="a")
    lay = KVLayout(
        tp_size=1,
        tp_rank=0,
        pp_stage=0,
        layer_group=0,
        layer_group_count=1,
        tokens_per_chunk=4,
        tensor_layout="x",
    )
    expected = chain_hashes(d, m, lay, small)
    assert chain_hashes(d, m, lay, np.array(small, dtype=np.int32)) == expected
    assert chain_hashes(d, m, lay, np.array(small, dtype=np.int16)) == expected
    assert chain_hashes(d, m, lay, np.array(small, dtype=np.uint8)) == expected
    assert chain_hashes(d, m, lay, range(1, 9)) == expected


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ([1, -1], "token id -1 outside"),
        ([1, 2**32], "token id 4294967296 outside"),
        (np.array([3, -5], dtype=np.int32), "token id -5 outside"),
        (np.array([2**40], dtype=np.int64), "token id 1099511627776 outside"),
        ([1, 2.0], "item 1 is float"),
        (np.array([1.0, 2.0]), "item 0 is float"),
        ([True, False], "item 0 is bool"),
        ([1, "2"], "item 1 is str"),
        ([-1, 2**63], "item 0 is -1, outside"),
        ([2**64], "outside 0..2\\*\\*32-1"),
        ([[1, 2], [3, 4]], "must be 1-D, got shape \\(2, 2\\)"),
        (np.zeros((2, 2), dtype=np.int64), "must be 1-D"),
        (np.int64(5), "must be 1-D, got shape \\(\\)"),
        ("1234", "got str"),
        (b"1234", "got bytes"),
        (array.array("d", [1.0]), "item 0 is float"),
        (OnlyToList([1, -2]), "token id -2 outside"),
        ([[1], [2, 3]], "1-D sequence of ints"),
        (None, "must be 1-D"),
    ],
)
def test_bad_tokens_are_rejected_clearly(bad: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tokens_to_u32(bad)


def test_tokens_to_u32_is_little_endian_u32_and_empty_is_fine() -> None:
    out = tokens_to_u32([1, U32])
    assert out.dtype == np.dtype("<u4")
    assert out.flags.c_contiguous
    assert out.tobytes() == b"\x01\x00\x00\x00\xff\xff\xff\xff"
    assert tokens_to_u32([]).size == 0
    assert tokens_to_u32(np.zeros(0, dtype=np.float64)).size == 0


# ---- validation of inputs -----------------------------------------------------------------------


def test_share_domain_validates_and_hides_its_salt() -> None:
    with pytest.raises(ValueError, match=r"salt must be 16\.\.64 bytes, got 15"):
        ShareDomain("t", bytes(15))
    with pytest.raises(ValueError, match="got 65"):
        ShareDomain("t", bytes(65))
    with pytest.raises(TypeError, match="salt must be bytes"):
        ShareDomain("t", "0123456789abcdef0123")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tenant_id must not be empty"):
        ShareDomain("", bytes(16))
    with pytest.raises(ValueError, match="UTF-8"):
        ShareDomain("\ud800", bytes(16))
    secret = b"S3cr3t-s4lt-bytes!!"
    d = ShareDomain("acme", secret)
    assert "S3cr3t" not in repr(d)
    assert "acme" in repr(d)
    assert ShareDomain("acme", bytes(16)).digest() != ShareDomain("acme", bytes(15) + b"\x01").digest()
    assert ShareDomain("acme", secret) == d
    assert len({d, ShareDomain("acme", secret), ShareDomain("acme2", secret)}) == 2
    with pytest.raises(AttributeError, match="immutable"):
        d.salt = bytes(16)
    # No encoder can put the salt on the wire by accident.
    with pytest.raises(TypeError):
        msgspec.json.encode(d)
    with pytest.raises(TypeError):
        msgspec.msgpack.encode({"domain": d})
    assert len(d.digest()) == 16


def test_model_fingerprint_validates() -> None:
    ok: dict[str, str] = {
        "model_id": "m",
        "weights_revision": "r",
        "kv_dtype": "bf16",
        "attn_config_digest": "a",
    }
    assert ModelFingerprint(**ok).kv_quant == "none"
    for name in ok:
        with pytest.raises(ValueError, match=f"{name} must not be empty"):
            ModelFingerprint(**{**ok, name: ""})
    with pytest.raises(ValueError, match="kv_quant must not be empty"):
        ModelFingerprint(**ok, kv_quant="")
    with pytest.raises(ValueError, match="lora_id and lora_revision"):
        ModelFingerprint(**ok, lora_id="adapter")
    with pytest.raises(ValueError, match="lora_id and lora_revision"):
        ModelFingerprint(**ok, lora_revision="v1")
    with pytest.raises(TypeError, match="model_id must be a str"):
        ModelFingerprint(**{**ok, "model_id": 3})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at most 1024"):
        ModelFingerprint(**{**ok, "model_id": "x" * 1025})
    with pytest.raises(TypeError):
        ModelFingerprint("m", "r", "bf16", "a")  # type: ignore[call-arg]  # keyword-only


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ({"tp_size": 0}, "tp_size=0 out of range 1..65535"),
        ({"tp_size": 65536}, "tp_size=65536"),
        ({"tp_rank": 2}, "tp_rank=2 out of range 0..1"),
        ({"tp_rank": -1}, "tp_rank=-1"),
        ({"pp_stage": 1}, "pp_stage=1 out of range 0..0"),
        ({"pp_size": 0}, "pp_size=0"),
        ({"layer_group": 3}, "layer_group=3 out of range 0..2"),
        ({"layer_group_count": 0}, "layer_group_count=0"),
        ({"tokens_per_chunk": 0}, "tokens_per_chunk=0"),
        ({"tokens_per_chunk": 2**32}, "tokens_per_chunk=4294967296"),
        ({"tensor_layout": ""}, "tensor_layout must not be empty"),
        ({"tp_rank": True}, "tp_rank must be an int, got bool"),
        ({"tp_size": 2.0}, "tp_size must be an int, got float"),
    ],
)
def test_kv_layout_validates_ranges(override: dict[str, Any], match: str) -> None:
    fields: dict[str, Any] = {
        "tp_size": 2,
        "tp_rank": 1,
        "pp_stage": 0,
        "layer_group": 2,
        "layer_group_count": 3,
        "tokens_per_chunk": 16,
        "tensor_layout": "x",
    }
    KVLayout(**fields)
    with pytest.raises((ValueError, TypeError), match=match):
        KVLayout(**{**fields, **override})


def test_key_member_must_fit_its_group() -> None:
    g = _a_key().chunk_group
    with pytest.raises(ValueError, match=r"tp_rank=4 out of range 0\.\.3"):
        KVKey(chunk_group=g, tp_rank=4, pp_stage=0, layer_group=0)
    with pytest.raises(ValueError, match="chain_hash must be 32 bytes"):
        msgspec.structs.replace(g, chain_hash=ChainHash(bytes(31)))


# ---- decoding external input --------------------------------------------------------------------


def _a_key() -> KVKey:
    d = ShareDomain("acme", bytes(range(16)))
    m = ModelFingerprint(model_id="m", weights_revision="r", kv_dtype="bf16", attn_config_digest="a")
    lay = KVLayout(
        tp_size=4,
        tp_rank=3,
        pp_size=2,
        pp_stage=1,
        layer_group=2,
        layer_group_count=3,
        tokens_per_chunk=2,
        tensor_layout="x",
    )
    return keys_for_prefix(d, m, lay, [1, 2, 3, 4, 5, 6])[2]


def test_from_bytes_rejects_bad_length_versions_and_fields() -> None:
    raw = bytearray(_a_key().to_bytes())
    with pytest.raises(BadRequest, match="must be 96 bytes, got 95"):
        KVKey.from_bytes(bytes(raw[:-1]))
    with pytest.raises(BadRequest, match="must be 96 bytes, got 97"):
        KVKey.from_bytes(bytes(raw) + b"\x00")
    with pytest.raises(BadRequest, match="must be 90 bytes"):
        ChunkGroupId.from_bytes(bytes(raw))

    bad = bytearray(raw)
    bad[0] = 2
    with pytest.raises(
        UnsupportedVersion, match="unsupported key encoding version 2; this build reads 1"
    ) as e:
        KVKey.from_bytes(bytes(bad))
    assert e.value.found == 2
    assert e.value.supported == (1,)

    bad = bytearray(raw)
    bad[2:4] = (7).to_bytes(2, "little")
    with pytest.raises(UnsupportedVersion, match="KV data format version 7; this build reads 1"):
        KVKey.from_bytes(bytes(bad))

    bad = bytearray(raw)
    bad[1] = 1
    with pytest.raises(BadRequest, match="reserved key byte must be 0"):
        KVKey.from_bytes(bytes(bad))

    bad = bytearray(raw)
    bad[90:92] = (4).to_bytes(2, "little")  # tp_rank 4 of tp_size 4
    with pytest.raises(BadRequest, match="invalid KV key: tp_rank=4"):
        KVKey.from_bytes(bytes(bad))

    bad = bytearray(raw)
    bad[36:38] = (0).to_bytes(2, "little")  # tp_size 0
    with pytest.raises(BadRequest, match="tp_size=0"):
        KVKey.from_bytes(bytes(bad))


def test_v2_keys_are_readable_by_a_dual_read_build() -> None:
    raw = bytearray(_a_key().to_bytes())
    raw[2:4] = (2).to_bytes(2, "little")
    with pytest.raises(UnsupportedVersion):
        KVKey.from_bytes(bytes(raw))
    with _with_v2_readable():
        key = KVKey.from_bytes(bytes(raw))
        assert key.format_version == 2
        assert KVKey.parse(str(key)) == key


def test_parse_rejects_malformed_and_non_canonical_text() -> None:
    text = str(_a_key())
    assert KVKey.parse(text) == _a_key()
    head, rest = text.split(":", 1)
    assert head == "kvf1"
    bad_texts = [
        "",
        "kvf1",
        text + ":",
        text + "0",
        " " + text,
        text.upper(),
        text.replace(":tp4.3:", ":tp04.3:"),  # leading zero: not canonical
        text.replace(":tp4.3:", ":tp4.03:"),
        text.replace(":i2:", ":i-2:"),
        text.replace(":i2:", ":i٢:"),  # a non-ASCII digit
        text.replace(":pp2.1:", ":pp1:"),
        text.replace("kvf1:1:", "kvf1:01:"),
        text.replace("kvf1:1:", "kvf1:0:"),
        "kvg1:" + rest,
    ]
    for bad in bad_texts:
        with pytest.raises(BadRequest) as e:
            KVKey.parse(bad)
        assert type(e.value) is BadRequest, bad
    with pytest.raises(BadRequest, match="tp_rank=4 out of range"):
        KVKey.parse(text.replace(":tp4.3:", ":tp4.4:"))
    with pytest.raises(UnsupportedVersion, match="key encoding version 2"):
        KVKey.parse("kvf2:" + rest)
    with pytest.raises(UnsupportedVersion, match="KV data format version 9"):
        KVKey.parse(text.replace("kvf1:1:", "kvf1:9:"))
    with pytest.raises(BadRequest, match="format version 99999 out of range"):
        KVKey.parse(text.replace("kvf1:1:", "kvf1:99999:"))
    long_garbage = "x" * 10_000
    with pytest.raises(BadRequest) as e:
        KVKey.parse(long_garbage)
    assert len(str(e.value)) < 500  # the message never echoes unbounded input


def test_chunk_group_parse_rejects_bad_text() -> None:
    g = _a_key().chunk_group
    text = str(g)
    assert text.startswith("kvg1:1:")
    assert ":tp4:pp2:lg3:c2:" in text
    for bad in ["", text + "x", text.replace(":lg3:", ":lg0:"), str(_a_key())]:
        with pytest.raises(BadRequest):
            ChunkGroupId.parse(bad)
    with pytest.raises(UnsupportedVersion):
        ChunkGroupId.parse(text.replace("kvg1:", "kvg3:"))


def test_shard_is_stable_and_spreads() -> None:
    d = ShareDomain("acme", bytes(range(16)))
    m = ModelFingerprint(model_id="m", weights_revision="r", kv_dtype="bf16", attn_config_digest="a")
    lay = KVLayout(
        tp_size=1,
        tp_rank=0,
        pp_stage=0,
        layer_group=0,
        layer_group_count=1,
        tokens_per_chunk=1,
        tensor_layout="x",
    )
    groups = chunk_groups_for_prefix(d, m, lay, list(range(4096)))
    shards = [g.shard(64) for g in groups]
    counts = np.bincount(shards, minlength=64)
    # ~64 each: the chunk indices of one prefix spread over the shards.
    assert counts.min() > 20
    assert counts.max() < 120
    with pytest.raises(ValueError, match="n_shards=0"):
        groups[0].shard(0)


# ---- determinism across processes ---------------------------------------------------------------

_SUBPROCESS_CODE = """
import numpy as np
from kvfabric.format import KVLayout, ModelFingerprint, ShareDomain, keys_for_prefix
d = ShareDomain("acme", bytes(range(16)))
m = ModelFingerprint(model_id="m", weights_revision="r", lora_id="l", lora_revision="1",
                     kv_dtype="bf16", attn_config_digest="a")
lay = KVLayout(tp_size=2, tp_rank=1, pp_stage=0, layer_group=1, layer_group_count=2,
               tokens_per_chunk=8, tensor_layout="vllm:NHD")
for k in keys_for_prefix(d, m, lay, np.arange(100, dtype=np.int64) * 7919, {1: [b"img"]}):
    print(k, k.to_bytes().hex(), k.chunk_group.shard(1024))
"""


def test_two_processes_compute_identical_keys() -> None:
    outputs = []
    for seed in ("0", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run(
            [sys.executable, "-c", _SUBPROCESS_CODE],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=True,
        )
        outputs.append(proc.stdout)
    assert outputs[0] == outputs[1]
    lines = outputs[0].splitlines()
    assert len(lines) == 12
    d = ShareDomain("acme", bytes(range(16)))
    m = ModelFingerprint(
        model_id="m",
        weights_revision="r",
        lora_id="l",
        lora_revision="1",
        kv_dtype="bf16",
        attn_config_digest="a",
    )
    lay = KVLayout(
        tp_size=2,
        tp_rank=1,
        pp_stage=0,
        layer_group=1,
        layer_group_count=2,
        tokens_per_chunk=8,
        tensor_layout="vllm:NHD",
    )
    here = [
        f"{k} {k.to_bytes().hex()} {k.chunk_group.shard(1024)}"
        for k in keys_for_prefix(d, m, lay, [i * 7919 for i in range(100)], {1: [b"img"]})
    ]
    assert lines == here


# ---- typed ids (kvfabric.format.ids): every pack/unpack agrees with the structured forms, round
# trips exactly, and the layout table in kvfabric.format.key's docstring is the one ids defines --


def test_sizes() -> None:
    assert (ids.OBJECT_KEY_BYTES, ids.GROUP_ID_BYTES, ids.NAMESPACE_BYTES) == (96, 90, 54)
    assert (ids.GROUP_KEY_BYTES, ids.CHAIN_HASH_BYTES, ids.DOMAIN_DIGEST_BYTES) == (48, 32, 16)
    assert (key_mod.KEY_BYTES, key_mod.CHUNK_GROUP_BYTES) == (ids.OBJECT_KEY_BYTES, ids.GROUP_ID_BYTES)


@given(kv_keys())
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


@given(kv_keys())
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


@given(kv_keys())
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
