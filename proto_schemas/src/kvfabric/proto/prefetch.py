"""Messages of the `prefetch` service (subjects `kvf.v1.prefetch.<verb>`).

| verb | request | reply |
|---|---|---|
| `hint` | `PrefetchHint` | `HintReply` |
| `cancel` | `CancelHint` | `CancelReply` |
| `status` | `PrefetchStatusRequest` | `PrefetchStatus` |

A scheduler or router that knows which prefix a request will load, and on which engine host,
sends a hint ahead: the service copies the prefix's objects that are not yet on the engine's
local segment there (segment to segment), so the later load is local. Hints are best effort:
`busy` (queues full) and `refused` (malformed) answers are normal; a hint past its deadline or
cancelled is dropped and its partial work released.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

import msgspec

from kvfabric.format.ids import GroupId
from kvfabric.proto.codec import FamilyDecoder
from kvfabric.proto.directory import Member

__all__ = [
    "HINT_GROUPS_MAX",
    "HINT_ID_CHARS_MAX",
    "TENANT_CHARS_MAX",
    "CancelHint",
    "CancelReply",
    "HintReply",
    "PrefetchHint",
    "PrefetchMessage",
    "PrefetchStatus",
    "PrefetchStatusRequest",
    "prefetch_decoder",
]

HINT_GROUPS_MAX: Final = 1024  # chunks per hint
# A live hint keeps its id and tenant (up to 1,024 hints): unbounded, 1 MiB ids held ~1 GiB
# (review, stop 70). An engine request id fits (the router cuts its trace ids at 96).
HINT_ID_CHARS_MAX: Final = 256
TENANT_CHARS_MAX: Final = 128
HintId = Annotated[str, msgspec.Meta(max_length=HINT_ID_CHARS_MAX)]
TenantName = Annotated[str, msgspec.Meta(max_length=TENANT_CHARS_MAX)]


class PrefetchHint(msgspec.Struct, frozen=True, kw_only=True, tag="prefetch.hint.v1", tag_field="t"):
    hint_id: HintId  # e.g. the engine request id; cancel with it
    tenant: TenantName
    groups: list[GroupId]  # chunk group ids (90 bytes) of the prefix, head first
    members: list[Member] = msgspec.field(default_factory=list)  # empty: every member
    target_segment: str  # the segment on the engine's host
    deadline_ms: int  # wall-clock ms: the copies are useless after it


HintStatus = Literal["accepted", "deduped", "busy", "refused"]


class HintReply(msgspec.Struct, frozen=True, kw_only=True, tag="prefetch.hint_reply.v1", tag_field="t"):
    hint_id: str
    status: HintStatus
    reason: str = ""  # busy / refused: why
    objects_queued: int = 0  # accepted: objects to copy (0: already local, nothing to do)


class CancelHint(msgspec.Struct, frozen=True, kw_only=True, tag="prefetch.cancel.v1", tag_field="t"):
    hint_id: HintId
    # the hint's tenant (as in its `PrefetchHint`): a hint id is its tenant's. Empty (an older
    # sender): the one live hint with that id, none when two tenants hold it
    tenant: TenantName = ""


class CancelReply(msgspec.Struct, frozen=True, kw_only=True, tag="prefetch.cancel_reply.v1", tag_field="t"):
    cancelled: bool


class PrefetchStatusRequest(
    msgspec.Struct, frozen=True, kw_only=True, tag="prefetch.status.v1", tag_field="t"
):
    """Ask the service for its queues and counters (no fields)."""


class PrefetchStatus(
    msgspec.Struct, frozen=True, kw_only=True, tag="prefetch.status_reply.v1", tag_field="t"
):
    gauges: dict[str, int]
    counters: dict[str, int]


PrefetchMessage = PrefetchHint | HintReply | CancelHint | CancelReply | PrefetchStatusRequest | PrefetchStatus

prefetch_decoder: FamilyDecoder[PrefetchMessage] = FamilyDecoder(PrefetchMessage, "prefetch")
