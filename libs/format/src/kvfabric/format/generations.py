"""Generations: monotone counters that fence stale actors (docs/design.md invariant 4).

Four kinds, as distinct types that cannot be mixed up, neither by mypy nor at run time:

- `DirectoryEpoch`: bumped on every directory leader change (per shard). A message carrying an
  older epoch comes from a deposed leader or a client that has not seen the new one.
- `SegmentIncarnation`: chosen anew at every segment process start. Placements record it; a
  segment that comes back with a new incarnation invalidates everything it held before.
- `SlotGeneration`: bumped by the segment on every free of a slot. Every read/write names
  (slot, generation); an old generation means the memory may have been reused.
- `RequestGeneration`: chosen by a client per load; a late completion carrying an old one never
  writes into a buffer that has been handed to a newer load.

Comparing two generations of different kinds raises `TypeError`: that is a bug, not a fence.
On the wire a generation is a plain unsigned integer (u64); wrap it at the boundary.
"""

from __future__ import annotations

from typing import Final, Self, TypeVar

__all__ = [
    "GENERATION_MAX",
    "DirectoryEpoch",
    "Generation",
    "RequestGeneration",
    "SegmentIncarnation",
    "SlotGeneration",
    "is_stale",
]

GENERATION_MAX: Final = 2**64 - 1


class Generation:
    """A value of one generation kind. Immutable, hashable, ordered only within its kind."""

    __slots__ = ("_value",)
    kind: str = "generation"

    def __init__(self, value: int) -> None:
        if type(self) is Generation:
            raise TypeError("Generation is abstract: use one of its kinds")
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{self.kind} must be an int, got {type(value).__name__}")
        if not 0 <= value <= GENERATION_MAX:
            raise ValueError(f"{self.kind} {value} out of range 0..2**64-1")
        self._value = value

    @property
    def value(self) -> int:
        return self._value

    def next(self) -> Self:
        """The following generation of the same kind."""
        return type(self)(self._value + 1)

    def _same_kind(self, other: object) -> Generation:
        if type(other) is not type(self):
            raise TypeError(f"cannot compare {self.kind} with {type(other).__name__}")
        assert isinstance(other, Generation)
        return other

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Generation):
            return NotImplemented
        return self._value == self._same_kind(other)._value

    def __hash__(self) -> int:
        return hash((self.kind, self._value))

    def __lt__(self, other: Self) -> bool:
        return self._value < self._same_kind(other)._value

    def __le__(self, other: Self) -> bool:
        return self._value <= self._same_kind(other)._value

    def __gt__(self, other: Self) -> bool:
        return self._value > self._same_kind(other)._value

    def __ge__(self, other: Self) -> bool:
        return self._value >= self._same_kind(other)._value

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._value})"

    def __int__(self) -> int:
        return self._value


class DirectoryEpoch(Generation):
    __slots__ = ()
    kind = "directory_epoch"


class SegmentIncarnation(Generation):
    __slots__ = ()
    kind = "segment_incarnation"


class SlotGeneration(Generation):
    __slots__ = ()
    kind = "slot_generation"


class RequestGeneration(Generation):
    __slots__ = ()
    kind = "request_generation"


G = TypeVar("G", bound="Generation")


def is_stale(seen: G, current: G) -> bool:
    """True when `seen` is older than `current`: the carrier must be rejected, not applied.

    A `seen` newer than `current` is not stale (the receiver is the one behind, e.g. a segment
    that has not yet heard of a new directory epoch); callers decide what that means.
    """
    return seen < current
