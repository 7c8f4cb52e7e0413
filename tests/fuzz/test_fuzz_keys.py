"""Fuzz: binary and readable key parsing (`KVKey`, `ChunkGroupId`, the directory's fast path).

Contract: any bytes (or text) parse to a value that encodes back to exactly the input, or raise
`BadRequest` (`UnsupportedVersion` is one) — never another exception. The directory's
`parse_key`/`parse_group` agree with the full parsers on what they accept (`parse_key` also when
it parses a key it remembers), except that the directory refuses a group of more than
`GROUP_MEMBERS_MAX` members (tp x pp x layer groups), which the format allows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfabric.core.directory.keys import GROUP_MEMBERS_MAX, chain_of, parse_group, parse_key
from kvfabric.format.errors import BadRequest
from kvfabric.format.key import CHUNK_GROUP_BYTES, KEY_BYTES, ChunkGroupId, KVKey

from .fuzzkit import corpus, corpus_params, fuzz_settings, mutated, saving_crash

SEEDS: Final = [p.read_bytes() for p in corpus("keys")]
BINARY_SEEDS: Final = [s for s in SEEDS if len(s) in (KEY_BYTES, CHUNK_GROUP_BYTES)]


def members(group: ChunkGroupId) -> int:
    return group.tp_size * group.pp_size * group.layer_group_count


def check_binary(data: bytes) -> None:
    try:
        key: KVKey | None = KVKey.from_bytes(data)
    except BadRequest:
        key = None
    if key is not None and members(key.chunk_group) > GROUP_MEMBERS_MAX:
        key = None  # the directory refuses it
    try:
        info = parse_key(data)
    except BadRequest:
        info = None
    assert (key is None) == (info is None), "parse_key and KVKey.from_bytes disagree"
    if info is not None:
        assert parse_key(data) == info, "a remembered key answers what its first parse did"
    if key is not None and info is not None:
        assert key.to_bytes() == data
        assert info.member == tuple(key.member)
        assert chain_of(info.group.group_id) == key.chain_hash and info.group.group_id[:16] == data[4:20]
        assert info.group.chunk_index == key.chunk_index

    try:
        group: ChunkGroupId | None = ChunkGroupId.from_bytes(data)
    except BadRequest:
        group = None
    if group is not None and members(group) > GROUP_MEMBERS_MAX:
        group = None  # the directory refuses it
    try:
        ginfo = parse_group(data)
    except BadRequest:
        ginfo = None
    assert (group is None) == (ginfo is None), "parse_group and ChunkGroupId.from_bytes disagree"
    if group is not None and ginfo is not None:
        assert group.to_bytes() == data
        assert ginfo.expected_members == group.tp_size * group.pp_size * group.layer_group_count


def check_text(data: bytes) -> None:
    text = data.decode("utf-8", errors="surrogateescape")
    for parse in (KVKey.parse, ChunkGroupId.parse):
        try:
            value = parse(text)
        except BadRequest:
            continue
        assert str(value) == text


def check(data: bytes) -> None:
    check_binary(data)
    check_text(data)


@pytest.mark.parametrize("path", corpus_params("keys"))
def test_keys_corpus(path: Path) -> None:
    check(path.read_bytes())


@fuzz_settings(300)
@given(st.binary(max_size=120) | st.binary(min_size=KEY_BYTES, max_size=KEY_BYTES))
def test_keys_take_any_bytes(data: bytes) -> None:
    with saving_crash("keys", data):
        check(data)


@fuzz_settings(600)
@given(mutated(SEEDS, rounds_max=2) | mutated(BINARY_SEEDS, rounds_max=1))
def test_keys_take_mutated_keys(data: bytes) -> None:
    with saving_crash("keys", data):
        check(data)


@fuzz_settings(300)
@given(st.text(max_size=300))
def test_key_text_takes_any_text(text: str) -> None:
    data = text.encode("utf-8", errors="surrogateescape")
    with saving_crash("keys", data):
        check_text(data)
