"""The events of `DiskSlotTable.step(event, now_ms)` (the shape of `kvfabric.core.step`): one per
entry point of `kvfabric.core.disk_slots`, each the method of the same meaning. The table
decides nothing by time and has no effects: every answer is a reply (the index record to write
is one), and a refused request raises as the method does. (`recover` builds a table: no event.)

    AllocSlot -> alloc: [Reply(DiskAlloc)]    BeginCommit / EndCommit -> [Reply(record or None)]
    Abort -> abort    Free -> free: [Reply(DiskFree)]    Unlinked -> unlinked
    Acquire -> acquire: [Reply(DiskGrant)]    Release -> release
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

from kvfabric.core.step import Reply

if TYPE_CHECKING:
    from kvfabric.core.disk_records import Record
    from kvfabric.core.disk_slots import DiskAlloc, DiskFree, DiskGrant, DiskSlotTable

__all__ = [
    "Abort",
    "Acquire",
    "AllocSlot",
    "BeginCommit",
    "DiskSlotEvent",
    "DiskSlotOutput",
    "EndCommit",
    "Free",
    "Release",
    "Unlinked",
    "dispatch",
]


@dataclass(frozen=True, slots=True)
class AllocSlot:
    """Room for an object of `size` bytes named `key` (`alloc`; answers `Reply(DiskAlloc)`)."""

    size: int
    key: bytes


@dataclass(frozen=True, slots=True)
class BeginCommit:
    """The data of (slot, generation) is written with `checksum` (`begin_commit`; answers
    `Reply(the index record to write, or None)`)."""

    slot: int
    generation: int
    checksum: bytes


@dataclass(frozen=True, slots=True)
class EndCommit:
    """The index record's write ended, durable or not (`end_commit`; answers `Reply(record or None)`)."""

    slot: int
    generation: int
    durable: bool


@dataclass(frozen=True, slots=True)
class Abort:
    """A write was given up (`abort`)."""

    slot: int
    generation: int


@dataclass(frozen=True, slots=True)
class Free:
    """The directory freed (slot, generation) (`free`; answers `Reply(DiskFree)`)."""

    slot: int
    generation: int


@dataclass(frozen=True, slots=True)
class Unlinked:
    """A free record is durable (`unlinked`)."""

    slot: int
    record_generation: int


@dataclass(frozen=True, slots=True)
class Acquire:
    """A reader reference on a stored slot (`acquire`; answers `Reply(DiskGrant)`)."""

    slot: int
    generation: int
    size: int


@dataclass(frozen=True, slots=True)
class Release:
    """A reader reference given back (`release`)."""

    slot: int
    generation: int


DiskSlotEvent: TypeAlias = AllocSlot | BeginCommit | EndCommit | Abort | Free | Unlinked | Acquire | Release
DiskSlotOutput: TypeAlias = "Reply[DiskAlloc] | Reply[Record | None] | Reply[DiskFree] | Reply[DiskGrant]"


def dispatch(table: DiskSlotTable, event: DiskSlotEvent) -> list[DiskSlotOutput]:
    """`event` as the method of the same meaning (`DiskSlotTable.step` checked the time)."""
    if isinstance(event, AllocSlot):
        return [Reply(table.alloc(event.size, event.key))]
    if isinstance(event, BeginCommit):
        return [Reply(table.begin_commit(event.slot, event.generation, event.checksum))]
    if isinstance(event, EndCommit):
        return [Reply(table.end_commit(event.slot, event.generation, event.durable))]
    if isinstance(event, Free):
        return [Reply(table.free(event.slot, event.generation))]
    if isinstance(event, Acquire):
        return [Reply(table.acquire(event.slot, event.generation, event.size))]
    if isinstance(event, Abort):
        table.abort(event.slot, event.generation)
    elif isinstance(event, Unlinked):
        table.unlinked(event.slot, event.record_generation)
    else:
        table.release(event.slot, event.generation)
    return []
