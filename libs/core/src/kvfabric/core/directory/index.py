"""Ordered indexes of the directory's published chunk groups, one per share domain (pure).

A listing pages through groups in group-key order (domain digest, then chain hash) from an
`after` cursor. Without an index each page sorted every published group of every tenant: a
tenant's listing of its own (even empty) domain cost time in proportion to the other tenants'
groups (75 ms at 20,000 groups, issue 21 rows 1 and 10), and told them how many there were.
Here each domain has its own `SortedKeys`, and the domains themselves are one, so a page costs
O(log n + page) of its own domain only, and an admin page (every domain) the same plus the
domains it crosses.

`SortedKeys` holds the group keys the caller's dict already holds (the same `bytes` objects:
one pointer more per group, ~10 bytes with the chunks' headers) in sorted chunks of at most
`CHUNK_KEYS_MAX`, with the last key of each chunk in `_maxes` (the layout of
`sortedcontainers.SortedList`, without the positional index this does not need): insert and
remove are a bisection and the rebuild of one chunk, `iter_after` a bisection and a walk.
Chunks that shrink below `CHUNK_KEYS_MIN` are merged into a neighbour, so there are at most
n / CHUNK_KEYS_MIN + 1. The chunks are tuples, not lists: a tuple of `bytes` is untracked by
the cyclic GC (kvfabric.runtime.gcpolicy), so a full collection walks two lists of
~n / 100 entries, not n keys (lists of keys: +27 ms a full collection at 1,000,000 groups,
measured; tuples of 128: a rebuild per insert, as cheap as a list's insort at this size).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterator, Sequence
from typing import Final, Generic, TypeVar

from kvfabric.format.ids import DOMAIN_DIGEST_BYTES, DomainDigest, GroupKey
from kvfabric.format.invariant import invariant

__all__ = ["CHUNK_KEYS_MAX", "CHUNK_KEYS_MIN", "DomainIndex", "SortedKeys"]

CHUNK_KEYS_MAX: Final = 128  # a chunk that grows past this splits in two
CHUNK_KEYS_MIN: Final = 32  # a chunk that shrinks below this merges into a neighbour
DOMAIN_BYTES: Final = DOMAIN_DIGEST_BYTES  # a group key's leading bytes: its share domain's digest

K = TypeVar("K", bound=bytes)  # the keys of one `SortedKeys`: group keys or domain digests
FIRST: Final = GroupKey(b"")  # the `after` cursor before every group key


class SortedKeys(Generic[K]):
    """A sorted set of distinct keys, each a `bytes` (or a `NewType` of it: `K`; see the module
    docstring)."""

    __slots__ = ("_chunk_max", "_chunk_min", "_chunks", "_len", "_maxes")

    def __init__(self, chunk_max: int = CHUNK_KEYS_MAX, chunk_min: int = CHUNK_KEYS_MIN) -> None:
        invariant(1 <= chunk_min <= chunk_max // 2, "chunk bounds: 1 <= min <= max / 2")
        self._chunk_max = chunk_max  # parameters for tests (small chunks split and merge often)
        self._chunk_min = chunk_min
        self._chunks: list[tuple[K, ...]] = []
        self._maxes: list[K] = []
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __contains__(self, key: K) -> bool:
        i = bisect_left(self._maxes, key)
        if i == len(self._maxes):
            return False
        chunk = self._chunks[i]
        j = bisect_left(chunk, key)
        return j < len(chunk) and chunk[j] == key

    def add(self, key: K) -> None:
        """Insert `key`, which must not be present (the caller's dict says so)."""
        maxes, chunks = self._maxes, self._chunks
        if not chunks:
            chunks.append((key,))
            maxes.append(key)
            self._len = 1
            return
        i = bisect_left(maxes, key)
        if i == len(maxes):  # past the last key: append to the last chunk
            i -= 1
            chunk = chunks[i] + (key,)
            maxes[i] = key
        else:
            chunk = chunks[i]
            j = bisect_left(chunk, key)
            invariant(chunk[j] != key, "key indexed twice")
            chunk = (*chunk[:j], key, *chunk[j:])
        self._len += 1
        if len(chunk) > self._chunk_max:
            half = len(chunk) // 2
            chunks[i : i + 1] = [chunk[:half], chunk[half:]]
            maxes.insert(i, chunk[half - 1])
        else:
            chunks[i] = chunk

    def remove(self, key: K) -> None:
        """Remove `key`, which must be present."""
        maxes, chunks = self._maxes, self._chunks
        i = bisect_left(maxes, key)
        invariant(i < len(maxes), "key not indexed")
        chunk = chunks[i]
        j = bisect_left(chunk, key)
        invariant(j < len(chunk) and chunk[j] == key, "key not indexed")
        chunk = chunk[:j] + chunk[j + 1 :]
        self._len -= 1
        if not chunk:
            del chunks[i], maxes[i]
            return
        chunks[i] = chunk
        maxes[i] = chunk[-1]
        if len(chunk) < self._chunk_min and len(chunks) > 1:
            k = i if i + 1 < len(chunks) else i - 1  # merge chunk k + 1 into chunk k
            merged = chunks[k] + chunks[k + 1]
            del chunks[k + 1], maxes[k + 1]
            if len(merged) > self._chunk_max:  # split again, evenly
                half = len(merged) // 2
                chunks[k : k + 1] = [merged[:half], merged[half:]]
                maxes[k : k + 1] = [merged[half - 1], merged[-1]]
            else:
                chunks[k] = merged
                maxes[k] = merged[-1]

    def iter_after(self, after: K) -> Iterator[K]:
        """The keys greater than `after`, in order: O(log n) to the first, then O(1) each. The
        caller must not change the set while it iterates."""
        return self._iter(after, bisect_right)

    def iter_from(self, first: K) -> Iterator[K]:
        """The keys from `first` on (greater or equal), in order; as `iter_after`."""
        return self._iter(first, bisect_left)

    def _iter(self, bound: K, bisect: Callable[[Sequence[K], K], int]) -> Iterator[K]:
        maxes, chunks = self._maxes, self._chunks
        i = bisect(maxes, bound)
        if i == len(maxes):
            return
        chunk = chunks[i]
        yield from chunk[bisect(chunk, bound) :]
        for k in range(i + 1, len(chunks)):
            yield from chunks[k]

    def __iter__(self) -> Iterator[K]:
        for chunk in self._chunks:
            yield from chunk

    def check(self) -> None:
        """The layout holds (tests call this)."""
        keys = list(self)
        invariant(keys == sorted(set(keys)), "index keys not sorted and distinct")
        invariant(len(keys) == self._len, "index length drift")
        invariant(self._maxes == [c[-1] for c in self._chunks], "index chunk maxima drift")
        invariant(all(0 < len(c) <= self._chunk_max for c in self._chunks), "index chunk out of bounds")
        invariant(len(self._chunks) <= 2 * self._len // self._chunk_min + 1, "index chunks too many")


class DomainIndex:
    """The published group keys by share domain (each key's first `DOMAIN_BYTES`), each domain's
    sorted, and the domains sorted. A domain with no group has no entry."""

    __slots__ = ("_by_domain", "_chunk_max", "_chunk_min", "_domains")

    def __init__(self, chunk_max: int = CHUNK_KEYS_MAX, chunk_min: int = CHUNK_KEYS_MIN) -> None:
        self._chunk_max, self._chunk_min = chunk_max, chunk_min
        self._by_domain: dict[DomainDigest, SortedKeys[GroupKey]] = {}
        self._domains: SortedKeys[DomainDigest] = SortedKeys(chunk_max, chunk_min)

    def __len__(self) -> int:
        return sum(len(keys) for keys in self._by_domain.values())

    def add(self, group_key: GroupKey) -> None:
        domain = DomainDigest(group_key[:DOMAIN_BYTES])
        keys = self._by_domain.get(domain)
        if keys is None:
            keys = self._by_domain[domain] = SortedKeys(self._chunk_max, self._chunk_min)
            self._domains.add(domain)
        keys.add(group_key)

    def remove(self, group_key: GroupKey) -> None:
        domain = DomainDigest(group_key[:DOMAIN_BYTES])
        keys = self._by_domain.get(domain)
        invariant(keys is not None, "group key of a domain not indexed")
        assert keys is not None
        keys.remove(group_key)
        if not keys:
            del self._by_domain[domain]
            self._domains.remove(domain)

    def __contains__(self, group_key: GroupKey) -> bool:
        keys = self._by_domain.get(DomainDigest(group_key[:DOMAIN_BYTES]))
        return keys is not None and group_key in keys

    def domains(self) -> Iterator[DomainDigest]:
        """Every domain holding a published group, in order."""
        return iter(self._domains)

    def groups(self, domain: DomainDigest, after: GroupKey = FIRST) -> Iterator[GroupKey]:
        """One domain's group keys greater than `after`, in order; no other domain is touched."""
        keys = self._by_domain.get(domain)
        return keys.iter_after(after) if keys is not None else iter(())

    def all_groups(self, after: GroupKey = FIRST) -> Iterator[GroupKey]:
        """Every group key greater than `after`, in order: the domains from `after`'s on (a
        domain before it holds only smaller keys, since a key starts with its domain)."""
        for domain in self._domains.iter_from(DomainDigest(after[:DOMAIN_BYTES])):
            yield from self._by_domain[domain].iter_after(after)

    def check(self, group_keys: set[GroupKey]) -> None:
        """The index holds exactly `group_keys` (tests call this after every step)."""
        self._domains.check()
        invariant(list(self._domains) == sorted(self._by_domain), "index domains drift")
        indexed: set[GroupKey] = set()
        for domain, keys in self._by_domain.items():
            keys.check()
            invariant(len(keys) > 0, "empty domain kept in the index")
            invariant(all(k[:DOMAIN_BYTES] == domain for k in keys), "group key under another domain")
            indexed.update(keys)
        invariant(indexed == group_keys, "published groups and their index differ")
