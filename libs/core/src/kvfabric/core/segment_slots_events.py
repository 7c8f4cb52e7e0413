"""The events of `SlotTable.step(event, now_ms)` (the shape of `kvfabric.core.step`): one per
entry point of `kvfabric.core.segment_slots`, each the method of the same meaning. The table
has no effects: every answer is a reply, and a refused request raises as the method does.

    AllocSlot -> alloc(now_ms): [Reply(Alloc)]    Stored -> stored    Abort -> abort
    Acquire -> acquire: [Reply(ReadGrant)]    Release -> release    Free -> free: [Reply(FreeResult)]
    Tick -> expire_writes(now_ms): [Reply([slot ids fenced])]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

from kvfabric.core.step import Reply, Tick

if TYPE_CHECKING:
    from kvfabric.core.segment_slots import Alloc, FreeResult, ReadGrant, SlotTable

__all__ = [
    "Abort",
    "Acquire",
    "AllocSlot",
    "Free",
    "Release",
    "SlotEvent",
    "SlotOutput",
    "Stored",
    "Tick",
    "dispatch",
]


@dataclass(frozen=True, slots=True)
class AllocSlot:
    """Room for an object of `size` bytes, written by `deadline_ms` (`alloc`; answers `Reply(Alloc)`)."""

    size: int
    deadline_ms: int
    key: bytes = b""


@dataclass(frozen=True, slots=True)
class Stored:
    """The write of (slot, generation) finished with `checksum` (`stored`)."""

    slot: int
    generation: int
    checksum: bytes


@dataclass(frozen=True, slots=True)
class Abort:
    """The transport let go of a write (`abort`)."""

    slot: int
    generation: int


@dataclass(frozen=True, slots=True)
class Acquire:
    """A reader reference on a stored slot (`acquire`; answers `Reply(ReadGrant)`)."""

    slot: int
    generation: int
    size: int


@dataclass(frozen=True, slots=True)
class Release:
    """A reader reference given back (`release`)."""

    slot: int
    generation: int


@dataclass(frozen=True, slots=True)
class Free:
    """The directory freed (slot, generation) (`free`; answers `Reply(FreeResult)`)."""

    slot: int
    generation: int


SlotEvent: TypeAlias = AllocSlot | Stored | Abort | Acquire | Release | Free | Tick
SlotOutput: TypeAlias = "Reply[Alloc] | Reply[ReadGrant] | Reply[FreeResult] | Reply[list[int]]"


def dispatch(table: SlotTable, event: SlotEvent, now_ms: int) -> list[SlotOutput]:
    """`event` as the method of the same meaning (`SlotTable.step` checked the time)."""
    if isinstance(event, AllocSlot):
        return [Reply(table.alloc(event.size, now_ms, event.deadline_ms, event.key))]
    if isinstance(event, Acquire):
        return [Reply(table.acquire(event.slot, event.generation, event.size))]
    if isinstance(event, Free):
        return [Reply(table.free(event.slot, event.generation))]
    if isinstance(event, Tick):
        return [Reply(table.expire_writes(now_ms))]
    if isinstance(event, Stored):
        table.stored(event.slot, event.generation, event.checksum)
    elif isinstance(event, Abort):
        table.abort(event.slot, event.generation)
    else:
        table.release(event.slot, event.generation)
    return []
