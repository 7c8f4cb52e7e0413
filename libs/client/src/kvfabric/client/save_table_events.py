"""The events of `SaveTable.step(event, now_ms)` (the shape of `kvfabric.core.step`): one per
entry point of `kvfabric.client.save_table`, each the method of the same meaning.

    Open -> open(now_ms)    Prepared -> prepared(now_ms)    ShardMapUnknown -> shard_map_unknown
    BeginAnswered -> begin_answered(now_ms)    WritesDone -> writes_done(now_ms)
    EndAnswered -> end_answered: [PrepareBegins | SendBegin | WriteReplicas | ... | Finished, ...]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    from kvfabric.client.save_table import Effect, SaveTable
    from kvfabric.proto import directory as m

__all__ = [
    "BeginAnswered",
    "EndAnswered",
    "Open",
    "Prepared",
    "SaveEvent",
    "ShardMapUnknown",
    "WritesDone",
    "dispatch",
]


@dataclass(frozen=True, slots=True)
class Open:
    """The save starts (`open`)."""


@dataclass(frozen=True, slots=True)
class Prepared:
    """The shard map is known; `digests`: the checksum each object names at put_begin, in the
    plan's key order (empty: its segment's hash gives it; what `AsyncKvClient` sends)."""

    digests: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class ShardMapUnknown:
    """No directory instance answered the shard map (`shard_map_unknown`)."""


@dataclass(frozen=True, slots=True)
class BeginAnswered:
    """A `put_begin` request's answer: the reply, or a cause string; the request's trace id."""

    request: int
    reply: object
    trace_id: str


@dataclass(frozen=True, slots=True)
class WritesDone:
    """Every write of `WriteReplicas` answered, in its order: (outcome, receipt or None)."""

    outcomes: tuple[tuple[str, m.WriteReceipt | None], ...]


@dataclass(frozen=True, slots=True)
class EndAnswered:
    """A `put_abort` or `put_commit` request's answer: the reply, or a cause string."""

    request: int
    reply: object


SaveEvent: TypeAlias = Open | Prepared | ShardMapUnknown | BeginAnswered | WritesDone | EndAnswered


def dispatch(table: SaveTable, event: SaveEvent, now_ms: int) -> list[Effect]:
    """`event` as the method of the same meaning (`SaveTable.step` checked the time)."""
    if isinstance(event, Open):
        return table.open(now_ms)
    if isinstance(event, Prepared):
        return table.prepared(event.digests, now_ms)
    if isinstance(event, ShardMapUnknown):
        return table.shard_map_unknown()
    if isinstance(event, BeginAnswered):
        return table.begin_answered(event.request, event.reply, event.trace_id, now_ms)
    if isinstance(event, WritesDone):
        return table.writes_done(event.outcomes, now_ms)
    return table.end_answered(event.request, event.reply, now_ms)
