"""The events of `RepairCore.step(event, now_ms)` (the shape of `kvfabric.core.step`): one per
entry point of `kvfabric.core.repair`, each the method of the same meaning.

    SegmentUp -> segment_up        SegmentDraining -> segment_draining    SegmentDown -> segment_down
    ObjectKnown -> object_known    ReplicaLost -> replica_lost            ObjectRemoved -> object_removed
    ScanComplete -> scan_complete
    CopyOk -> copy_ok: [Reply(wanted)]    CopyFailed -> copy_failed(now_ms)
    Tick -> tick(now_ms): [CancelCopy | StartCopy | DrainComplete, ...]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

from kvfabric.core.step import Reply, Tick

if TYPE_CHECKING:
    from kvfabric.core.repair import Effect, ObjectId, RepairCore

__all__ = [
    "CopyFailed",
    "CopyOk",
    "ObjectKnown",
    "ObjectRemoved",
    "RepairEvent",
    "RepairOutput",
    "ReplicaLost",
    "ScanComplete",
    "SegmentDown",
    "SegmentDraining",
    "SegmentUp",
    "Tick",
    "dispatch",
]


@dataclass(frozen=True, slots=True)
class SegmentUp:
    """A segment reported itself (`segment_up`)."""

    segment_id: str
    incarnation: int
    zone: str
    rack: str
    host: str
    free_bytes: int
    draining: bool | None = None


@dataclass(frozen=True, slots=True)
class SegmentDraining:
    """A segment starts or stops draining (`segment_draining`)."""

    segment_id: str
    draining: bool = True


@dataclass(frozen=True, slots=True)
class SegmentDown:
    """A segment is gone (`segment_down`)."""

    segment_id: str


@dataclass(frozen=True, slots=True)
class ObjectKnown:
    """An object below its target as the directory lists it (`object_known`)."""

    object_id: ObjectId
    size_bytes: int
    replica_target: int
    segments: tuple[str, ...]
    hot: int = 0


@dataclass(frozen=True, slots=True)
class ReplicaLost:
    """A replica is gone or corrupt (`replica_lost`)."""

    object_id: ObjectId
    segment_id: str
    corrupt: bool = False


@dataclass(frozen=True, slots=True)
class ObjectRemoved:
    """Deleted, evicted or back at its target (`object_removed`)."""

    object_id: ObjectId


@dataclass(frozen=True, slots=True)
class ScanComplete:
    """The listing of every object below target ended (`scan_complete`)."""


@dataclass(frozen=True, slots=True)
class CopyOk:
    """A copy is stored (`copy_ok`; answers `Reply(True)` when it was still wanted)."""

    copy_id: int


@dataclass(frozen=True, slots=True)
class CopyFailed:
    """A copy failed (`copy_failed`, at the step's `now_ms`)."""

    copy_id: int
    source_failed: bool = False
    busy: bool = False  # the destination had no copy slot free: not counted towards STUCK


RepairEvent: TypeAlias = (
    SegmentUp
    | SegmentDraining
    | SegmentDown
    | ObjectKnown
    | ReplicaLost
    | ObjectRemoved
    | ScanComplete
    | CopyOk
    | CopyFailed
    | Tick
)
RepairOutput: TypeAlias = "Effect | Reply[bool]"


def dispatch(core: RepairCore, event: RepairEvent, now_ms: int) -> list[RepairOutput]:
    """`event` as the method of the same meaning (`RepairCore.step` checked the time)."""
    if isinstance(event, Tick):
        return list(core.tick(now_ms))
    if isinstance(event, SegmentUp):
        core.segment_up(
            event.segment_id,
            incarnation=event.incarnation,
            zone=event.zone,
            rack=event.rack,
            host=event.host,
            free_bytes=event.free_bytes,
            draining=event.draining,
        )
    elif isinstance(event, SegmentDraining):
        core.segment_draining(event.segment_id, event.draining)
    elif isinstance(event, SegmentDown):
        core.segment_down(event.segment_id)
    elif isinstance(event, ObjectKnown):
        core.object_known(
            event.object_id,
            size_bytes=event.size_bytes,
            replica_target=event.replica_target,
            segments=event.segments,
            hot=event.hot,
        )
    elif isinstance(event, ReplicaLost):
        core.replica_lost(event.object_id, event.segment_id, corrupt=event.corrupt)
    elif isinstance(event, ObjectRemoved):
        core.object_removed(event.object_id)
    elif isinstance(event, ScanComplete):
        core.scan_complete()
    elif isinstance(event, CopyOk):
        return [Reply(core.copy_ok(event.copy_id))]
    else:
        core.copy_failed(event.copy_id, now_ms, source_failed=event.source_failed, busy=event.busy)
    return []
