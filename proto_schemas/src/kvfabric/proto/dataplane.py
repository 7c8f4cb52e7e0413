"""Metadata of data-plane frames (msgpack), sent over TCP/UCX, not NATS.

A frame is a fixed binary header (`kvfabric.dataplane.frames`) followed by `meta` (one of these
messages, msgpack) and then `payload` bytes. Payload bytes are never in the meta.

| op | request meta | reply meta | payload |
|---|---|---|---|
| PUT | `PutRequest` (the signed write ticket) | `PutReply` | request: the object's bytes |
| GET | `GetRequest` (slots to read) | `GetReply` (per object: status + checksum) | reply: ok objects' bytes |
| MAP | `MapRequest` (a credential: refs with tokens, or a ticket) | `MapReply` (arena path + size) | none |
| PIN_LOCAL | `GetRequest` | `LocalGrants` (offsets for a local copy; refs held) | none |
| UNPIN_LOCAL | `UnpinLocal` | `UnpinReply` | none |
| ERROR | (reply only) | `kvfabric.proto.common.ErrorReply` (own decoder) | none |
"""

from __future__ import annotations

from typing import Literal

import msgspec

from kvfabric.proto.codec import FamilyDecoder
from kvfabric.proto.directory import WriteTicket

__all__ = [
    "DataplaneMeta",
    "GetReply",
    "GetRequest",
    "LocalGrant",
    "LocalGrants",
    "MapReply",
    "MapRequest",
    "ObjectResult",
    "PutReply",
    "PutRequest",
    "ReadRef",
    "StagedBytes",
    "UnpinLocal",
    "UnpinReply",
    "dataplane_decoder",
]


class ReadRef(msgspec.Struct, frozen=True, array_like=True):
    """One object to read: the directory's (segment incarnation, slot, generation) and its size,
    with the directory's read token for it (see `kvfabric.proto.tickets.read_token`)."""

    incarnation: int
    slot: int
    slot_generation: int
    size_bytes: int
    token: bytes = b""
    expires_ms: int = 0


class StagedBytes(msgspec.Struct, frozen=True, array_like=True):
    """Where a co-located writer put a PUT's bytes instead of sending them: its own staging file
    beside the arena, the nonce in that file's header, the offset (kvfabric.dataplane.staging)."""

    path: str
    nonce: bytes
    offset: int


class PutRequest(msgspec.Struct, frozen=True, kw_only=True, tag="dp.put.v1", tag_field="t"):
    ticket: WriteTicket
    # the writer's engine request; the segment's confirm carries it to the directory when it fits
    # a header (`kvfabric.proto.common.header_trace_id`)
    trace_id: str = ""
    # How many writes of the same save go to this segment for keys of this ticket's shard (0 =
    # unknown): the segment gathers their confirms into one directory request (ConfirmBatcher).
    save_writes: int = 0
    # Set: no payload follows, the bytes are in the writer's staging file (only to a segment whose
    # MapReply said `staged_puts`).
    staged: StagedBytes | None = None
    # Set: answer with a write receipt (`PutReply.receipt`) as soon as the bytes are stored and
    # verified; the writer carries it in put_commit and the segment confirms in the background.
    receipt: bool = False
    # The xxh3-128 of the bytes sent, for a ticket that carries no checksum: the segment checks
    # what it received against it. A sent PUT under such a ticket must name one; a staged one
    # need not (the segment reads the writer's own pages).
    checksum: bytes = b""
    # Under a ticket that carries no checksum (sent sealed, `tickets.sealed_ticket`): the writer's
    # proof that it names `checksum` (`tickets.claim_proof`, keyed by the ticket's signature,
    # which never crosses the data plane). Required there; empty otherwise.
    claim_proof: bytes = b""


class PutReply(msgspec.Struct, frozen=True, kw_only=True, tag="dp.put_reply.v1", tag_field="t"):
    slot: int
    slot_generation: int
    # The directory accepted the replica (ticket confirmed) before this reply was sent.
    confirmed: bool
    # A receipt was asked for: the segment's MAC over what it stored (`tickets.write_receipt`),
    # for put_commit (`WriteReceipt`); empty otherwise.
    receipt: bytes = b""
    # The checksum of what the segment stored, for a ticket that carried none (it goes into the
    # writer's `WriteReceipt`); empty otherwise.
    checksum: bytes = b""


class GetRequest(
    msgspec.Struct, frozen=True, kw_only=True, tag="dp.get.v1", tag_field="t", omit_defaults=True
):
    reads: list[ReadRef]
    # The client takes verdicts after the bytes: a disk replica may be sent as it is read, and
    # its reply then says `verdicts_after` (a second GetReply, the final results, follows the bytes).
    verdicts_after: bool = False


# `unauthorized`: no valid, unexpired read token (segments that require them).
ObjectStatus = Literal[
    "ok", "stale_generation", "not_found", "wrong_size", "stale_incarnation", "unauthorized"
]


class ObjectResult(msgspec.Struct, frozen=True, array_like=True):
    status: ObjectStatus
    checksum: bytes  # the checksum stored at write time (empty unless ok)


class GetReply(
    msgspec.Struct, frozen=True, kw_only=True, tag="dp.get_reply.v1", tag_field="t", omit_defaults=True
):
    results: list[ObjectResult]
    verdicts_after: bool = False  # a GetReply with the final results follows the payload bytes


class MapRequest(msgspec.Struct, frozen=True, kw_only=True, tag="dp.map.v1", tag_field="t"):
    """The arena path goes only to token holders: on a connection that has not yet presented a
    credential, a MAP must carry one (a read reference with its token for a replica on this
    segment, or a write ticket for it); on an authenticated connection both may be empty."""

    reads: list[ReadRef] = []
    ticket: WriteTicket | None = None


class MapReply(msgspec.Struct, frozen=True, kw_only=True, tag="dp.map_reply.v1", tag_field="t"):
    arena_path: str
    arena_bytes: int
    incarnation: int
    # The slot board (kvfabric.dataplane.slotboard): lock-free local reads. "" = pin every read.
    board_path: str = ""
    # This segment takes staged puts (PutRequest.staged) from a staging file beside the arena.
    staged_puts: bool = False


class LocalGrant(msgspec.Struct, frozen=True, array_like=True):
    status: ObjectStatus
    offset: int
    checksum: bytes


class LocalGrants(msgspec.Struct, frozen=True, kw_only=True, tag="dp.local_grants.v1", tag_field="t"):
    # Transfer references are held by the connection until UNPIN_LOCAL or disconnect.
    grant_id: int
    grants: list[LocalGrant]


class UnpinLocal(msgspec.Struct, frozen=True, kw_only=True, tag="dp.unpin_local.v1", tag_field="t"):
    grant_id: int


class UnpinReply(msgspec.Struct, frozen=True, kw_only=True, tag="dp.unpin_reply.v1", tag_field="t"):
    released: int


DataplaneMeta = (
    PutRequest
    | PutReply
    | GetRequest
    | GetReply
    | MapRequest
    | MapReply
    | LocalGrants
    | UnpinLocal
    | UnpinReply
)

dataplane_decoder: FamilyDecoder[DataplaneMeta] = FamilyDecoder(DataplaneMeta, "dataplane")
