"""The events of `RoutingCore.step(event, now_ms)` (the shape of `kvfabric.core.step`): one per
entry point of `kvfabric.core.routing`, each the method of the same meaning. The core has no
effects: its answers are replies.

    Health -> health(now_ms)    IndexHeard -> index_heard(now_ms)
    Route -> route(now_ms): [Reply(Decision | Refused)]
    FirstToken -> first_token    PrefillPresumed -> presume_prefilled    Finished -> finished
    Failed -> failed: [Reply(instance or None)]
    EngineStored -> engine_stored    EngineRemoved -> engine_removed    EngineCleared -> engine_cleared

(The index's events, `apply`, `check_stream` and `resync`, are `RoutingIndex.step`'s:
`kvfabric.core.routing_index_events`.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

from kvfabric.core.step import Reply

if TYPE_CHECKING:
    from kvfabric.core.routing import Decision, Refused, RoutingCore

__all__ = [
    "EngineCleared",
    "EngineRemoved",
    "EngineStored",
    "Failed",
    "Finished",
    "FirstToken",
    "Health",
    "IndexHeard",
    "PrefillPresumed",
    "Route",
    "RoutingEvent",
    "RoutingOutput",
    "dispatch",
]


@dataclass(frozen=True, slots=True)
class Health:
    """A health check's outcome (`health`)."""

    instance_id: str
    ok: bool


@dataclass(frozen=True, slots=True)
class IndexHeard:
    """The event stream answered (`index_heard`)."""


@dataclass(frozen=True, slots=True)
class Route:
    """Which instance gets this prompt (`route`; answers `Reply(Decision | Refused)`)."""

    request_id: str
    tenant: str
    keys: Sequence[bytes]
    prompt_tokens: int
    exclude: tuple[str, ...] = ()
    admit: bool = True
    tokens_guessed: bool = False  # `prompt_tokens` is a guess (a text prompt): no refit observation


@dataclass(frozen=True, slots=True)
class FirstToken:
    """The request's first token came back (`first_token`); `ttft_s`: its realised TTFT (an
    observation for the coefficients' refit, at the step's time)."""

    request_id: str
    ttft_s: float | None = None


@dataclass(frozen=True, slots=True)
class PrefillPresumed:
    """A request not streamed whose estimated TTFT passed (`presume_prefilled`)."""

    request_id: str


@dataclass(frozen=True, slots=True)
class Finished:
    """The request ended (`finished`)."""

    request_id: str


@dataclass(frozen=True, slots=True)
class Failed:
    """The instance failed the request before its first byte (`failed`; answers
    `Reply(instance id or None)`)."""

    request_id: str


@dataclass(frozen=True, slots=True)
class EngineStored:
    """The instance's engine stored blocks in its prefix cache (its KV event; `engine_stored`)."""

    instance_id: str
    block_hashes: Sequence[int | bytes]
    parent: int | bytes | None
    token_ids: Sequence[int]
    block_size: int
    plain: bool = True  # no LoRA, no extra keys


@dataclass(frozen=True, slots=True)
class EngineRemoved:
    """The instance's engine evicted blocks (`engine_removed`)."""

    instance_id: str
    block_hashes: Sequence[int | bytes]


@dataclass(frozen=True, slots=True)
class EngineCleared:
    """The engine cleared its cache, or its events had a gap (`engine_cleared`)."""

    instance_id: str


RoutingEvent: TypeAlias = (
    Health
    | IndexHeard
    | Route
    | FirstToken
    | PrefillPresumed
    | Finished
    | Failed
    | EngineStored
    | EngineRemoved
    | EngineCleared
)
RoutingOutput: TypeAlias = "Reply[Decision | Refused] | Reply[str | None]"


def dispatch(core: RoutingCore, event: RoutingEvent, now_ms: int) -> list[RoutingOutput]:
    """`event` as the method of the same meaning (`RoutingCore.step` checked the time)."""
    if isinstance(event, Route):
        decision = core.route(
            event.request_id,
            event.tenant,
            event.keys,
            event.prompt_tokens,
            now_ms,
            exclude=event.exclude,
            admit=event.admit,
            tokens_guessed=event.tokens_guessed,
        )
        return [Reply(decision)]
    if isinstance(event, Failed):
        return [Reply(core.failed(event.request_id))]
    if isinstance(event, Health):
        core.health(event.instance_id, event.ok, now_ms)
    elif isinstance(event, IndexHeard):
        core.index_heard(now_ms)
    elif isinstance(event, FirstToken):
        core.first_token(event.request_id, event.ttft_s, now_ms)
    elif isinstance(event, PrefillPresumed):
        core.presume_prefilled(event.request_id)
    elif isinstance(event, EngineStored):
        core.engine_stored(
            event.instance_id,
            event.block_hashes,
            event.parent,
            event.token_ids,
            event.block_size,
            plain=event.plain,
        )
    elif isinstance(event, EngineRemoved):
        core.engine_removed(event.instance_id, event.block_hashes)
    elif isinstance(event, EngineCleared):
        core.engine_cleared(event.instance_id)
    else:
        core.finished(event.request_id)
    return []
