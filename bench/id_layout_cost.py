"""What the typed ids cost on the directory's per-group fast path (issue 26, typed identities).

Times `kvfabric.core.directory.keys.parse_group` / `parse_key` (through `kvfabric.format.ids`)
against the hand-sliced version they replaced (kept below as the reference, byte for byte the
same answer), interleaved A/B in one process; prints per-call medians and the ratios.
`parse_key` remembers the keys it accepted (issue 20): `key_ids` empties that memo before each
call, so it times a full parse (both sides pay the same empty `dict.clear()`), and
`key_ids_remembered` times a key parsed again.

    .venv/bin/python -m bench.id_layout_cost
"""

from __future__ import annotations

import timeit

from kvfabric.core.directory import keys
from kvfabric.core.directory.keys import GroupInfo, KeyInfo
from kvfabric.format.errors import BadRequest
from kvfabric.format.key import (
    CHUNK_GROUP_BYTES,
    KEY_BYTES,
    ChainHash,
    ChunkGroupId,
    DomainDigest,
    KVKey,
    LayoutDigest,
    ModelDigest,
)

CALLS = 200_000
ROUNDS = 5


def _hand_group_info(raw: bytes) -> GroupInfo:
    """The replaced version: offsets written out (slices 0:54, 54:58, 58:90, 4:20)."""
    gid = ChunkGroupId.from_bytes(raw)
    return GroupInfo(
        group_id=bytes(raw[4:20]) + bytes(raw[58:90]),  # type: ignore[arg-type]
        namespace=bytes(raw[0:54]),  # type: ignore[arg-type]
        chunk_index=int.from_bytes(raw[54:58], "little"),
        expected_members=gid.tp_size * gid.pp_size * gid.layer_group_count,
    )


def hand_parse_group(raw: bytes) -> GroupInfo:
    if len(raw) != CHUNK_GROUP_BYTES:
        raise BadRequest(f"chunk group id must be {CHUNK_GROUP_BYTES} bytes, got {len(raw)}")
    return _hand_group_info(raw)


def hand_parse_key(raw: bytes) -> KeyInfo:
    if len(raw) != KEY_BYTES:
        raise BadRequest(f"key must be {KEY_BYTES} bytes, got {len(raw)}")
    key = KVKey.from_bytes(raw)
    return KeyInfo(
        group=_hand_group_info(raw[:CHUNK_GROUP_BYTES]), member=(key.tp_rank, key.pp_stage, key.layer_group)
    )


def main() -> None:
    g = ChunkGroupId(
        format_version=1,
        domain_digest=DomainDigest(b"d" * 16),
        model_digest=ModelDigest(b"m" * 16),
        tp_size=2,
        pp_size=1,
        layer_group_count=1,
        tokens_per_chunk=256,
        layout_digest=LayoutDigest(b"l" * 8),
        chunk_index=5,
        chain_hash=ChainHash(b"c" * 32),
    )
    raw_group, raw_key = g.to_bytes(), g.member_key(1, 0, 0).to_bytes()
    assert keys.parse_group(raw_group) == hand_parse_group(raw_group)
    assert keys.parse_key(raw_key) == hand_parse_key(raw_key)
    runs: dict[str, list[float]] = {
        "group_hand": [],
        "group_ids": [],
        "key_hand": [],
        "key_ids": [],
        "key_ids_remembered": [],
    }
    memo, empty = keys._key_cache, dict[bytes, object]()

    def key_hand() -> KeyInfo:
        empty.clear()
        return hand_parse_key(raw_key)

    def key_ids() -> KeyInfo:
        memo.clear()  # a full parse, not a remembered key
        return keys.parse_key(raw_key)

    for _ in range(ROUNDS):  # interleaved, so load changes hit both sides alike
        runs["group_hand"].append(timeit.timeit(lambda: hand_parse_group(raw_group), number=CALLS))
        runs["group_ids"].append(timeit.timeit(lambda: keys.parse_group(raw_group), number=CALLS))
        runs["key_hand"].append(timeit.timeit(key_hand, number=CALLS))
        runs["key_ids"].append(timeit.timeit(key_ids, number=CALLS))
        runs["key_ids_remembered"].append(timeit.timeit(lambda: keys.parse_key(raw_key), number=CALLS))
    median = {name: sorted(times)[ROUNDS // 2] for name, times in runs.items()}
    for name, seconds in median.items():
        print(f"{name}: {seconds / CALLS * 1e6:.2f} us/call (median of {ROUNDS})")
    print(f"parse_group ids/hand: {median['group_ids'] / median['group_hand']:.2f}")
    print(f"parse_key ids/hand: {median['key_ids'] / median['key_hand']:.2f}")


if __name__ == "__main__":
    main()
