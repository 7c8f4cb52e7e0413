"""`parse_key` parses a key once and remembers accepted keys (issue 20: a save names each key in
its put_begin, its confirms and its put_commit). A remembered key must answer exactly what a full
parse answers, and a key that a full parse refuses is refused with the same typed error, also
next to remembered keys in one batch (`kvfabric.core.directory.keys`)."""

from __future__ import annotations

import gc
from unittest import mock

import pytest

from kvfabric.core.directory import keys as keys_mod
from kvfabric.core.directory.keys import KEY_CACHE_MAX, parse_group, parse_key
from kvfabric.format import key as key_mod
from kvfabric.format.errors import BadRequest, UnsupportedVersion
from kvfabric.format.ids import ObjectKey
from kvfabric.format.key import CHUNK_GROUP_BYTES, KVKey
from kvfabric.proto import directory as m

from .dirkit import groups, key, lookup, new_core, put, register, spec


def _with_byte(raw: bytes, offset: int, value: int) -> ObjectKey:
    return ObjectKey(raw[:offset] + bytes([value]) + raw[offset + 1 :])


def test_a_key_parsed_again_answers_what_a_full_parse_answers() -> None:
    gs = groups(3, seed=41, tp_size=2, layer_group_count=3)
    for g in gs:
        for rank in range(2):
            for lg in range(3):
                raw = key(g, rank, lg)
                first, again = parse_key(raw), parse_key(raw)
                full = KVKey.from_bytes(raw)
                assert first == again
                assert first.member == (rank, 0, lg) == tuple(full.member)
                assert first.group == parse_group(raw[:CHUNK_GROUP_BYTES])
                assert first.group.chunk_index == full.chunk_index
                assert first.group.expected_members == 6


def test_a_remembered_key_is_refused_once_its_format_version_is_no_longer_read() -> None:
    (g,) = groups(1, seed=42)
    v2 = _with_byte(key(g), 2, 2)  # KV data format version (u16 LE at offset 2) = 2
    with mock.patch.object(key_mod, "SUPPORTED_FORMAT_VERSIONS", (1, 2)):
        assert parse_key(v2) == parse_key(v2)  # accepted, and remembered
    with pytest.raises(UnsupportedVersion):
        parse_key(v2)


@pytest.mark.parametrize(
    ("offset", "value", "error"),
    [
        (0, 2, UnsupportedVersion),  # key encoding version
        (1, 1, BadRequest),  # reserved byte
        (90, 1, BadRequest),  # tp_rank 1 of tp_size 1
        (94, 1, BadRequest),  # layer_group 1 of 1
    ],
)
def test_a_malformed_key_next_to_remembered_keys_is_still_refused(
    offset: int, value: int, error: type[BadRequest]
) -> None:
    core = new_core()
    register(core, "s1")
    gs = groups(3, seed=43)
    good = [key(g) for g in gs]
    put(core, good[:2])  # every key of these requests parsed and remembered
    bad = _with_byte(good[2], offset, value)
    with pytest.raises(error):
        parse_key(bad)
    with pytest.raises(error):
        core.handle(m.PutBegin(writer_id="w", request_id="b", objects=[spec(good[0]), spec(bad)]), 0)
    with pytest.raises(error):
        core.handle(m.PutCommit(writer_id="w1", request_id="c", keys=[good[0], good[1], bad]), 0)
    with pytest.raises(error):
        core.handle(m.PutAbort(writer_id="w1", request_id="a", keys=[good[1], bad]), 0)
    assert lookup(core, gs[:2]).hit_chunks == 2  # the refused requests changed nothing
    assert lookup(core, gs[2:]).hit_chunks == 0


def test_the_remembered_keys_are_bounded_and_not_tracked_by_the_gc() -> None:
    gs = groups(KEY_CACHE_MAX + 10, seed=44)
    for g in gs:
        parse_key(key(g))
    assert 0 < len(keys_mod._key_cache) <= KEY_CACHE_MAX
    gc.collect()
    assert not any(gc.is_tracked(entry) for entry in keys_mod._key_cache.values())
    assert parse_key(key(gs[0])).member == (0, 0, 0)  # forgotten: parsed again in full
