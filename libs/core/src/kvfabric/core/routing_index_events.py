"""The events of `RoutingIndex.step(event, now_ms)` (the shape of `kvfabric.core.step`): one per
entry point of `kvfabric.core.routing_index`, each the method of the same meaning. The index
decides nothing by time and has no effects: its answers are replies.

    Apply -> apply: [Reply("applied" | "duplicate" | "gap" | "fenced")]
    CheckStream -> check_stream: [Reply(resync needed)]    Resync -> resync
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

from kvfabric.core.step import Reply

if TYPE_CHECKING:
    from kvfabric.core.routing_index import ApplyResult, ListedGroup, ListedSegment, RoutingIndex
    from kvfabric.proto import directory as m

__all__ = ["Apply", "CheckStream", "Resync", "RoutingIndexEvent", "RoutingIndexOutput", "dispatch"]


@dataclass(frozen=True, slots=True)
class Apply:
    """The directory event at stream sequence `seq` (`apply`; answers `Reply(ApplyResult)`);
    `origin` the (shard, epoch) its header names (None: none)."""

    seq: int
    event: m.DirectoryEvent
    origin: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class CheckStream:
    """The stream's bounds and creation time when the shell (re)subscribes (`check_stream`; answers
    `Reply(True)` when a resync is needed)."""

    first_seq: int
    last_seq: int
    created: object = None  # the stream's creation time (None: not known)


@dataclass(frozen=True, slots=True)
class Resync:
    """A listing taken after stream sequence `at_seq` replaces everything (`resync`)."""

    segments: Iterable[ListedSegment]
    groups: Iterable[ListedGroup]
    at_seq: int


RoutingIndexEvent: TypeAlias = Apply | CheckStream | Resync
RoutingIndexOutput: TypeAlias = "Reply[ApplyResult] | Reply[bool]"


def dispatch(index: RoutingIndex, event: RoutingIndexEvent) -> list[RoutingIndexOutput]:
    """`event` as the method of the same meaning (`RoutingIndex.step` checked the time)."""
    if isinstance(event, Apply):
        return [Reply(index.apply(event.seq, event.event, event.origin))]
    if isinstance(event, CheckStream):
        return [Reply(index.check_stream(event.first_seq, event.last_seq, event.created))]
    index.resync(event.segments, event.groups, at_seq=event.at_seq)
    return []
