"""The directory's per-domain group index against a sorted set (Hypothesis), with small chunks so
that splits and merges happen in every example."""

from __future__ import annotations

import gc

from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric.core.directory.index import DOMAIN_BYTES, DomainIndex, SortedKeys
from kvfabric.format.ids import DomainDigest, GroupKey

# Keys over a small alphabet collide and interleave; short ones test prefixes of longer ones.
small_keys = st.binary(min_size=0, max_size=3).map(lambda b: bytes(x % 4 for x in b))
# Group keys: one of three domains, then a short "chain hash".
group_keys = st.tuples(st.integers(0, 2), st.binary(min_size=1, max_size=2)).map(
    lambda t: GroupKey(bytes([t[0]]) * DOMAIN_BYTES + t[1])
)
ops = st.lists(st.tuples(st.booleans(), small_keys), max_size=300)


@settings(max_examples=300, deadline=None)
@given(ops=ops, probes=st.lists(small_keys, max_size=8))
def test_sorted_keys_is_a_sorted_set(ops: list[tuple[bool, bytes]], probes: list[bytes]) -> None:
    index: SortedKeys[bytes] = SortedKeys(chunk_max=4, chunk_min=2)
    model: set[bytes] = set()
    for add, k in ops:
        if add and k not in model:
            index.add(k)
            model.add(k)
        elif not add and k in model:
            index.remove(k)
            model.discard(k)
        index.check()
        assert len(index) == len(model)
    assert list(index) == sorted(model)
    for p in [*probes, b""]:
        assert list(index.iter_after(p)) == sorted(k for k in model if k > p)
        assert list(index.iter_from(p)) == sorted(k for k in model if k >= p)
        assert (p in index) == (p in model)


@settings(max_examples=300, deadline=None)
@given(
    ops=st.lists(st.tuples(st.booleans(), group_keys), max_size=200),
    afters=st.lists(
        st.binary(max_size=DOMAIN_BYTES + 3).map(lambda b: GroupKey(bytes(x % 4 for x in b))), max_size=6
    ),
)
def test_domain_index_pages_like_a_sorted_scan(
    ops: list[tuple[bool, GroupKey]], afters: list[GroupKey]
) -> None:
    """`groups(domain, after)` is the old filtered sort of every key, restricted to one domain;
    `all_groups(after)` the old sort of every key: the same pages, without the scan."""
    index = DomainIndex(chunk_max=4, chunk_min=2)
    model: set[GroupKey] = set()
    for add, k in ops:
        if add and k not in model:
            index.add(k)
            model.add(k)
        elif not add and k in model:
            index.remove(k)
            model.discard(k)
    index.check(model)
    assert list(index.domains()) == sorted({k[:DOMAIN_BYTES] for k in model})
    edges = [b"", bytes([1]) * DOMAIN_BYTES, bytes([1]) * DOMAIN_BYTES + b"\x00\x01"]
    for after in [*afters, *map(GroupKey, edges)]:
        assert list(index.all_groups(after)) == sorted(k for k in model if k > after)
        for d in range(4):
            domain = DomainDigest(bytes([d]) * DOMAIN_BYTES)
            want = sorted(k for k in model if k > after and k[:DOMAIN_BYTES] == domain)
            assert list(index.groups(domain, after)) == want


def test_chunks_stay_few_after_mass_removal() -> None:
    """Evicting most of a domain leaves no trail of near-empty chunks (merged on the way)."""
    index: SortedKeys[bytes] = SortedKeys(chunk_max=8, chunk_min=4)
    keys = [i.to_bytes(4, "big") for i in range(1000)]
    for k in keys:
        index.add(k)
    for k in keys[::3] + keys[1::3]:
        index.remove(k)
    index.check()
    assert list(index) == keys[2::3]


def test_the_cyclic_gc_does_not_walk_the_keys() -> None:
    """Chunks are tuples of bytes: untracked after a collection, so a full collection walks two
    lists of ~n / 100 entries, not the n keys (lists of keys cost +27 ms a collection at 1 M)."""
    index = DomainIndex()
    for i in range(20_000):
        index.add(GroupKey(bytes([i % 3]) * DOMAIN_BYTES + i.to_bytes(4, "big")))
    gc.collect()
    chunks = [c for keys in index._by_domain.values() for c in keys._chunks]
    assert len(chunks) >= 20_000 // 128 and not any(gc.is_tracked(c) for c in chunks)
