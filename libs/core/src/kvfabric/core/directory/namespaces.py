"""Interned namespaces: the (domain, model, layout-sans-rank) fields of a chunk group, kept once
and named by a u32 index in every published record (`records`) and evicting record (`frees`).

The namespace is chosen by the tenant (a fresh model id each save makes a new one), so an index
is counted by the records that name it (`acquire` / `release`) and dropped at zero; its index is
reused by the next new namespace (a free list), so the table and the indexes stay bounded by the
records held. Before (found in review) nothing was ever dropped: a tenant saving and evicting
1-byte groups under a fresh model id each time grew the table by ~6 MB per 10,000 groups.

## Invariants (`check`)
1. Each interned namespace's count is the number of records naming its index (the published
   table recounts them); none is zero.
2. A free index names no namespace; the free list and the interned indexes cover the table.
"""

from __future__ import annotations

from kvfabric.format.ids import Namespace
from kvfabric.format.invariant import invariant

__all__ = ["NamespaceTable"]


class NamespaceTable:
    def __init__(self) -> None:
        self._names: list[Namespace | None] = []  # index -> namespace (None: free)
        self._refs: list[int] = []  # index -> records naming it
        self._index: dict[Namespace, int] = {}
        self._free: list[int] = []  # indexes to reuse

    def __len__(self) -> int:
        return len(self._index)

    def acquire(self, namespace: Namespace) -> int:
        """The index of `namespace`, counted once more (a record that names it was added)."""
        idx = self._index.get(namespace)
        if idx is None:
            if self._free:
                idx = self._free.pop()
                self._names[idx] = namespace
            else:
                idx = len(self._names)
                self._names.append(namespace)
                self._refs.append(0)
            self._index[namespace] = idx
        self._refs[idx] += 1
        return idx

    def release(self, idx: int) -> None:
        """A record naming `idx` is gone: the namespace goes with its last one."""
        left = self._refs[idx] - 1
        invariant(left >= 0, "namespace released more often than acquired", index=idx)
        self._refs[idx] = left
        if left:
            return
        name = self._names[idx]
        assert name is not None
        del self._index[name]
        self._names[idx] = None
        self._free.append(idx)

    def find(self, namespace: Namespace) -> int | None:
        """The index of `namespace` if interned (nothing counted)."""
        return self._index.get(namespace)

    def get(self, idx: int) -> Namespace:
        name = self._names[idx]
        invariant(name is not None, "a record names a freed namespace", index=idx)
        assert name is not None
        return name

    def check(self, refs: dict[int, int]) -> None:
        """`refs`: index -> records naming it, as recounted from the records themselves."""
        counted = {i: n for i, n in enumerate(self._refs) if n}
        invariant(counted == refs, "namespace counts differ from the records naming them")
        interned = {i: name for i, name in enumerate(self._names) if name is not None}
        invariant(interned.keys() == refs.keys(), "an interned namespace no record names")
        invariant({name: i for i, name in interned.items()} == self._index, "namespace index drift")
        free = [i for i, name in enumerate(self._names) if name is None]
        invariant(sorted(self._free) == free, "namespace free list drift")
