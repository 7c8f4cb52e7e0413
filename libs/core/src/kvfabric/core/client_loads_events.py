"""The events of `LoadTable.step(event, now_ms)` (the shape of `kvfabric.core.step`): one per
entry point of `kvfabric.core.client_loads`, each the method of the same meaning.

    Want -> want(now_ms)    TransferDone -> transfer_done    Delivered -> delivered
    Cancel -> cancel    Tick -> expire(now_ms): [StartTransfer | CancelTransfer | ... , ...]
    ForgetDest -> forget_dest
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

from kvfabric.core.step import Tick

if TYPE_CHECKING:
    from kvfabric.core.client_loads import DestId, Effect, LoadId, LoadTable, ObjectId, TransferId
    from kvfabric.format.generations import RequestGeneration

__all__ = [
    "Cancel",
    "Delivered",
    "ForgetDest",
    "LoadEvent",
    "Tick",
    "TransferDone",
    "Want",
    "dispatch",
]


@dataclass(frozen=True, slots=True)
class Want:
    """An engine load asks for one object's bytes in its buffer `dest_id` (`want`)."""

    load_id: LoadId
    generation: RequestGeneration
    object_id: ObjectId
    dest_id: DestId
    deadline_ms: int
    size_bytes: int = 0


@dataclass(frozen=True, slots=True)
class TransferDone:
    """A transfer ended (`transfer_done`)."""

    transfer_id: TransferId
    ok: bool
    cause: str = "error"


@dataclass(frozen=True, slots=True)
class Delivered:
    """The shell copied a waiter's bytes into its buffer (`delivered`)."""

    load_id: LoadId
    generation: RequestGeneration
    dest_id: DestId


@dataclass(frozen=True, slots=True)
class Cancel:
    """The engine gave up a load (`cancel`)."""

    load_id: LoadId


@dataclass(frozen=True, slots=True)
class ForgetDest:
    """An anonymous buffer will never be named again (`forget_dest`)."""

    dest_id: DestId


LoadEvent: TypeAlias = Want | TransferDone | Delivered | Cancel | ForgetDest | Tick


def dispatch(table: LoadTable, event: LoadEvent, now_ms: int) -> list[Effect]:
    """`event` as the method of the same meaning (`LoadTable.step` checked the time)."""
    if isinstance(event, Tick):
        return table.expire(now_ms)
    if isinstance(event, Want):
        return table.want(
            event.load_id,
            event.generation,
            event.object_id,
            event.dest_id,
            now_ms=now_ms,
            deadline_ms=event.deadline_ms,
            size_bytes=event.size_bytes,
        )
    if isinstance(event, TransferDone):
        return table.transfer_done(event.transfer_id, event.ok, event.cause)
    if isinstance(event, Delivered):
        return table.delivered(event.load_id, event.generation, event.dest_id)
    if isinstance(event, Cancel):
        return table.cancel(event.load_id)
    table.forget_dest(event.dest_id)
    return []
