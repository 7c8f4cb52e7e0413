"""A best-fit extent allocator over one linear region (an arena, a disk file's data area).

Synchronous and I/O-free. The region is `[0, region_bytes)`; extents start at a multiple of
`alignment` and their lengths are multiples of it. `take(length)` hands out the smallest free
extent that fits (lowest offset on a tie), carved from its start; `take_at(offset, length)` hands
out a given extent (a restart recovering what a disk index names); `give(offset, length)` returns
one, merged at once with the free neighbours it touches.

The free list is kept twice: offsets sorted (with the length by offset) and (length, offset)
sorted, so a search is O(log n) plus a list move.

Invariants (`check()`): the two orders hold the same extents; free extents never overlap, never
touch (they are merged) and stay inside the region; `free_bytes` is their sum. Who holds what is
the caller's business: giving back an extent that overlaps a free one is a bug
(`InvariantViolation`).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from typing import Final

from kvfabric.format.invariant import invariant

__all__ = ["ExtentAllocator", "round_up"]


def round_up(size: int, alignment: int) -> int:
    return -(-size // alignment) * alignment


class ExtentAllocator:
    def __init__(self, region_bytes: int, alignment: int) -> None:
        invariant(
            alignment >= 1 and alignment & (alignment - 1) == 0,
            "alignment must be a power of two",
            alignment=alignment,
        )
        invariant(
            region_bytes > 0 and region_bytes % alignment == 0,
            "region size must be a positive multiple of the alignment",
            region_bytes=region_bytes,
            alignment=alignment,
        )
        self.region_bytes: Final = region_bytes
        self.alignment: Final = alignment
        self._offsets: list[int] = [0]
        self._length: dict[int, int] = {0: region_bytes}
        self._by_length: list[tuple[int, int]] = [(region_bytes, 0)]
        self._free_bytes = region_bytes

    @property
    def free_bytes(self) -> int:
        return self._free_bytes

    @property
    def largest_free_bytes(self) -> int:
        return self._by_length[-1][0] if self._by_length else 0

    def extents(self) -> list[tuple[int, int]]:
        """The free extents as (offset, length), by offset."""
        return [(o, self._length[o]) for o in self._offsets]

    def take(self, length: int) -> int | None:
        """The offset of a best-fit extent of `length` (a positive multiple of the alignment), now
        held by the caller; None when no free extent is that long."""
        invariant(length > 0 and length % self.alignment == 0, "unaligned length", length=length)
        i = bisect_left(self._by_length, (length, -1))
        if i == len(self._by_length):
            return None
        free_length, offset = self._by_length[i]
        self._carve(i, offset, free_length, offset, length)
        return offset

    def take_at(self, offset: int, length: int) -> bool:
        """Hold exactly `[offset, offset + length)` if it lies inside one free extent; False (and
        nothing changes) otherwise."""
        if length <= 0 or offset < 0 or offset % self.alignment or length % self.alignment:
            return False
        j = bisect_right(self._offsets, offset) - 1
        if j < 0:
            return False
        start = self._offsets[j]
        free_length = self._length[start]
        if offset + length > start + free_length:
            return False
        i = bisect_left(self._by_length, (free_length, start))
        self._carve(i, start, free_length, offset, length)
        return True

    def give(self, offset: int, length: int) -> None:
        """Return a held extent, merged with the free neighbours it touches."""
        invariant(
            length > 0 and offset >= 0 and offset + length <= self.region_bytes,
            "extent outside the region",
            offset=offset,
            length=length,
        )
        self._free_bytes += length
        i = bisect_left(self._offsets, offset)
        if i > 0:
            left = self._offsets[i - 1]
            left_end = left + self._length[left]
            invariant(left_end <= offset, "given extent overlaps a free one", offset=offset)
            if left_end == offset:
                self._drop(i - 1, left)
                offset, length, i = left, length + (left_end - left), i - 1
        if i < len(self._offsets):
            right = self._offsets[i]
            invariant(offset + length <= right, "given extent overlaps a free one", offset=offset)
            if offset + length == right:
                length += self._length[right]
                self._drop(i, right)
        self._offsets.insert(i, offset)
        self._length[offset] = length
        insort(self._by_length, (length, offset))

    def _carve(self, i: int, start: int, free_length: int, offset: int, length: int) -> None:
        """Take `[offset, offset + length)` out of the free extent `(start, free_length)` that is
        `_by_length[i]`; what is left on either side stays free."""
        del self._by_length[i]
        j = bisect_left(self._offsets, start)
        del self._offsets[j]
        del self._length[start]
        self._free_bytes -= length
        if offset > start:
            self._offsets.insert(j, start)
            self._length[start] = offset - start
            insort(self._by_length, (offset - start, start))
            j += 1
        end, free_end = offset + length, start + free_length
        if end < free_end:
            self._offsets.insert(j, end)
            self._length[end] = free_end - end
            insort(self._by_length, (free_end - end, end))

    def _drop(self, i: int, offset: int) -> None:
        length = self._length.pop(offset)
        del self._offsets[i]
        j = bisect_left(self._by_length, (length, offset))
        invariant(self._by_length[j] == (length, offset), "free list drift", offset=offset)
        del self._by_length[j]

    def check(self) -> None:
        invariant(self._offsets == sorted(self._length), "free offsets unsorted or drifted")
        invariant(self._by_length == sorted((n, o) for o, n in self._length.items()), "free lengths drifted")
        end = -1
        for offset in self._offsets:
            length = self._length[offset]
            invariant(offset > end, "free extents overlap or touch", offset=offset)
            invariant(
                length > 0 and offset % self.alignment == 0 and length % self.alignment == 0,
                "bad free extent",
                offset=offset,
                length=length,
            )
            end = offset + length
        invariant(end <= self.region_bytes, "free extent outside the region", end=end)
        invariant(self._free_bytes == sum(self._length.values()), "free bytes drift")
