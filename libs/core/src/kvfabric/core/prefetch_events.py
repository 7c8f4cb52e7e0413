"""The events of `PrefetchCore.step(event, now_ms)` (the shape of `kvfabric.core.step`): one per
entry point of `kvfabric.core.prefetch`, each the method of the same meaning.

    AddHint -> add_hint(now_ms): [Reply(Accepted | Deduped | Busy | Refused)]
    CancelHint -> cancel_hint: [Reply(cancelled)]
    Tick -> tick(now_ms), CopyFinished -> copy_finished(now_ms): [StartCopy | PublishReplica | ReleaseCopy]
    Read -> read(now_ms)    SetSegments -> set_segments
    ReplicaAdded -> replica_added    ReplicaRemoved -> replica_removed
    ColdExtraReplicas -> cold_extra_replicas(now_ms): [Reply([ExtraReplica, ...])] (it moves the
        core's clock, so it is an event, not a query)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

from kvfabric.core.step import Reply, Tick

if TYPE_CHECKING:
    from collections.abc import Mapping

    from kvfabric.core.prefetch import (
        AddResult,
        Effect,
        ExtraReplica,
        Hint,
        HintId,
        ObjectId,
        PrefetchCore,
        SegmentId,
    )

__all__ = [
    "AddHint",
    "CancelHint",
    "ColdExtraReplicas",
    "CopyFinished",
    "PrefetchEvent",
    "PrefetchOutput",
    "Read",
    "ReplicaAdded",
    "ReplicaRemoved",
    "SetSegments",
    "Tick",
    "dispatch",
]


@dataclass(frozen=True, slots=True)
class AddHint:
    """A scheduler's hint (`add_hint`; answers `Reply(AddResult)`)."""

    hint: Hint


@dataclass(frozen=True, slots=True)
class CancelHint:
    """The request of `tenant`'s `hint_id` finished (`cancel_hint`; answers `Reply(cancelled)`).
    No tenant (an older sender): the one live hint with that id, none when two tenants hold it."""

    hint_id: HintId
    tenant: str | None = None


@dataclass(frozen=True, slots=True)
class CopyFinished:
    """A StartCopy ended, stored or not (`copy_finished`)."""

    copy_id: int
    ok: bool
    # False: the replica was there already (`already_there`: repair's, say): satisfied, but not
    # an extra of this service's, so never dropped as a cold one (review, 2026-12-05)
    made: bool = True
    # the destination had no copy slot free (`busy`): nothing was tried there; not counted as an
    # attempt, nor against its source (review, stop 68)
    busy: bool = False


@dataclass(frozen=True, slots=True)
class Read:
    """`reads` reads of an object served from `served_from` (`read`)."""

    object_id: ObjectId
    size_bytes: int
    served_from: SegmentId
    replicas: tuple[SegmentId, ...] = ()
    reads: int = 1
    domain: bytes = b""  # its share domain (a domain's share of the hot budget)


@dataclass(frozen=True, slots=True)
class SetSegments:
    """The free bytes of every segment a copy may go to (`set_segments`)."""

    segments_free: Mapping[SegmentId, int]


@dataclass(frozen=True, slots=True)
class ReplicaAdded:
    """A replica appeared (`replica_added`)."""

    object_id: ObjectId
    segment: SegmentId


@dataclass(frozen=True, slots=True)
class ReplicaRemoved:
    """A replica is gone (`replica_removed`)."""

    object_id: ObjectId
    segment: SegmentId


@dataclass(frozen=True, slots=True)
class ColdExtraReplicas:
    """Which stored extra replicas went cold (`cold_extra_replicas`; answers `Reply([...])`)."""


PrefetchEvent: TypeAlias = (
    AddHint
    | CancelHint
    | CopyFinished
    | Read
    | SetSegments
    | ReplicaAdded
    | ReplicaRemoved
    | ColdExtraReplicas
    | Tick
)
PrefetchOutput: TypeAlias = "Effect | Reply[AddResult] | Reply[bool] | Reply[list[ExtraReplica]]"


def dispatch(core: PrefetchCore, event: PrefetchEvent, now_ms: int) -> list[PrefetchOutput]:
    """`event` as the method of the same meaning (`PrefetchCore.step` checked the time)."""
    if isinstance(event, Tick):
        return list(core.tick(now_ms))
    if isinstance(event, CopyFinished):
        return list(core.copy_finished(event.copy_id, event.ok, now_ms, made=event.made, busy=event.busy))
    if isinstance(event, AddHint):
        return [Reply(core.add_hint(event.hint, now_ms))]
    if isinstance(event, CancelHint):
        return [Reply(core.cancel_hint(event.hint_id, event.tenant))]
    if isinstance(event, ColdExtraReplicas):
        return [Reply(core.cold_extra_replicas(now_ms))]
    if isinstance(event, Read):
        core.read(
            event.object_id,
            size_bytes=event.size_bytes,
            served_from=event.served_from,
            replicas=event.replicas,
            now_ms=now_ms,
            reads=event.reads,
            domain=event.domain,
        )
    elif isinstance(event, SetSegments):
        core.set_segments(event.segments_free)
    elif isinstance(event, ReplicaAdded):
        core.replica_added(event.object_id, event.segment)
    else:
        core.replica_removed(event.object_id, event.segment)
    return []
