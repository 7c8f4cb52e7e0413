"""The events of `DirectoryCore.step(event, now_ms)` (the shape of `kvfabric.core.step`): one per
entry point of `kvfabric.core.directory.dispatch`, each the method of the same meaning. (These
are what the shell feeds the core; the events the core publishes are `EmitEvent` effects.)

    Request(request) -> handle(request, now_ms): [Effect..., Reply(reply)]
    LookupMore -> lookup_more(now_ms): [Effect..., Reply(LookupReply)]
    ChargeDomains -> charge_domains(now_ms): []    SetAdmissionFilter -> set_admission_filter
        (now_ms): [Reply(installed?)]
    Adopt -> adopt(now_ms): [Effect...]    Tick -> tick(now_ms): [Effect...]

A `handle` or `lookup_more` answers an `Outcome` (a reply and its effects): `step` returns its
effects, in order, then its reply as the `Reply`. A request the core refuses raises the same
`KvfError` as `handle` (nothing applied).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

import msgspec

from kvfabric.core.directory.base import Effect, Outcome
from kvfabric.core.directory.rebuild import SegmentHolding
from kvfabric.core.eviction_admission import AdmissionView
from kvfabric.core.step import Reply, Tick
from kvfabric.proto import directory as m

if TYPE_CHECKING:
    from kvfabric.core.directory.dispatch import DirectoryCore

__all__ = [
    "Adopt",
    "ChargeDomains",
    "DirectoryCoreEvent",
    "DirectoryOutput",
    "LookupMore",
    "Request",
    "SetAdmissionFilter",
    "Tick",
    "dispatch",
]


@dataclass(frozen=True, slots=True)
class Request:
    """A decoded service-plane request (`handle`): `reply_bytes_max` lowers a lookup's reply
    bound, `groups_max` folds only a lookup's first groups (see `DirectoryCore.handle`)."""

    request: msgspec.Struct
    reply_bytes_max: int | None = None
    groups_max: int | None = None


@dataclass(frozen=True, slots=True)
class LookupMore:
    """The next slice of a lookup run in slices (`lookup_more`)."""

    request: m.Lookup
    lease_id: int
    first: int
    reply_bytes_max: int
    groups_max: int


@dataclass(frozen=True, slots=True)
class ChargeDomains:
    """Charge one request to these share domains' rate limits (`charge_domains`; raises
    `RateLimited`, charging nothing, when one is out of tokens)."""

    domain_digests: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class SetAdmissionFilter:
    """The eviction policy's latest admission filter arrived (`set_admission_filter`: answers
    `Reply(False)` when it is older than the one held)."""

    view: AdmissionView


@dataclass(frozen=True, slots=True)
class Adopt:
    """Become the index of what these segments store (`adopt`: a new leader's rebuild)."""

    holdings: Sequence[SegmentHolding]


DirectoryCoreEvent: TypeAlias = Request | LookupMore | ChargeDomains | SetAdmissionFilter | Adopt | Tick
DirectoryOutput: TypeAlias = "Effect | Reply[msgspec.Struct] | Reply[bool]"


def _answer(outcome: Outcome) -> list[DirectoryOutput]:
    return [*outcome.effects, Reply(outcome.reply)]


def dispatch(core: DirectoryCore, event: DirectoryCoreEvent, now_ms: int) -> list[DirectoryOutput]:
    """`event` as the method of the same meaning (`DirectoryCore.step` checked the time)."""
    if isinstance(event, Request):
        return _answer(
            core.handle(
                event.request, now_ms, reply_bytes_max=event.reply_bytes_max, groups_max=event.groups_max
            )
        )
    if isinstance(event, Tick):
        return list(core.tick(now_ms))
    if isinstance(event, LookupMore):
        return _answer(
            core.lookup_more(
                event.request,
                event.lease_id,
                event.first,
                now_ms,
                reply_bytes_max=event.reply_bytes_max,
                groups_max=event.groups_max,
            )
        )
    if isinstance(event, SetAdmissionFilter):
        return [Reply(core.set_admission_filter(event.view, now_ms))]
    if isinstance(event, Adopt):
        return list(core.adopt(event.holdings, now_ms))
    core.charge_domains(event.domain_digests, now_ms)
    return []
