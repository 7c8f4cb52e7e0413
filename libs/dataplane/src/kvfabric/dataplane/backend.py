"""What a segment offers its data-plane transports. Transports move bytes; the backend decides.

Ownership, per call (`conn` is an opaque per-connection token; everything it holds is released by
`close_connection(conn)`, so a client that dies mid-transfer leaks nothing):

- `begin_put(ticket, conn, claim)` validates the ticket (signature, segment, incarnation,
  deadline, size; for a ticket that carries no checksum, the PUT's `claim_of`), allocates a slot
  and returns a writable `memoryview` of exactly `size_bytes` inside the arena. The transport
  owns that view until it calls `finish_put` or `abort_put`.
- `finish_put(put, conn)` checksums the bytes, checks them against the ticket's checksum (or,
  for a ticket that carries none, the PUT's own: `put.claimed`, `check_claimed`), confirms the
  replica to the directory and returns the (slot, generation); on mismatch it frees the slot
  and raises `ChecksumMismatch`.
- `begin_get(reads, conn)` takes a transfer reference on every ok slot (a free arriving meanwhile
  is deferred) and returns, per read, a status, the stored checksum and a read-only view. The
  transport sends the views, then calls `end_get(grant, conn)`; the views are invalid after.
- `begin_get_streamed(reads, conn)` (optional; a backend without it is always `begin_get`): the
  same grant, for a GET whose client takes verdicts after the bytes (`GetRequest.verdicts_after`),
  where a view may still be filling (a disk read in flight). `filling[i](n)` blocks until the
  first `n` bytes of view i are in place and returns how many are (n or more); once every view was
  sent, `verdicts()` gives each read's
  final result (an `ok` object whose bytes turned out bad is no longer `ok`).
- `pin_local` / `unpin_local`: the same references, for a co-located client that copies from its
  own read-only map of the arena; offsets instead of views.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvfabric.format.checksum import CHECKSUM_BYTES, checksum
from kvfabric.format.errors import BadRequest
from kvfabric.proto.codec import encode
from kvfabric.proto.dataplane import (
    LocalGrants,
    MapReply,
    ObjectResult,
    ObjectStatus,
    PutReply,
    PutRequest,
    ReadRef,
    StagedBytes,
)
from kvfabric.proto.directory import WriteTicket
from kvfabric.proto.tickets import CLAIM_PROOF_BYTES, claim_proof, sealed_ticket

# What a PUT under a checksum-less ticket proves, and its proof (`claim_of`): checked by the
# backend's `begin_put` with the secret before a slot is taken.
PutClaim = tuple[bytes, bytes]

__all__ = [
    "GetGrant",
    "PutClaim",
    "PutSlot",
    "SegmentBackend",
    "check_claimed",
    "claim_of",
    "claim_subject",
    "new_connection_id",
    "put_claim",
    "sent_checksum",
]


# Connection ids (`conn`) from one source for every transport of the process: a TCP server and a
# UCX server over one backend each counted from 1, so one transport's close released the other's
# connection of the same number (its PUT's slot aborted and reused under a write still arriving,
# its GET's references dropped while sent; review, 2026-12-06). `next` on a count is atomic.
_connection_ids = itertools.count(1)


def new_connection_id() -> int:
    """A connection id no transport of this process has used."""
    return next(_connection_ids)


@dataclass(slots=True)
class PutSlot:
    slot: int
    slot_generation: int
    view: memoryview  # writable, exactly the object's size; valid until finish/abort
    ticket: WriteTicket
    offset: int  # where `view` starts in the arena (published on the slot board when stored)
    # Set by a transport that hashed the bytes as they arrived; else `finish_put` hashes the slot.
    checksum: bytes | None = None
    trace_id: str = ""  # the writer's trace id (PUT meta): the segment's confirm carries it on
    save_writes: int = 0  # PUT meta: writes of the same save for this segment and shard (confirms)
    receipt_wanted: bool = False  # PUT meta: answer with a write receipt, confirm in the background
    receipt: bytes = b""  # set by `finish_put` when it signed one (the reply carries it)
    # PUT meta: the writer's checksum of the bytes it sent, for a ticket that carries none (its
    # proof was checked by `begin_put`).
    claimed: bytes = b""
    # Set by `finish_put` for a ticket that carried no checksum: what it stored (the reply
    # carries it; the receipt and the confirm name it).
    stored: bytes = b""

    def take_meta(self, meta: PutRequest) -> None:
        """What the PUT's meta asks of this write (every transport: a field one of them did not
        take was lost, as UCX's receipt ask was until 2026-12-05)."""
        self.trace_id = meta.trace_id
        self.save_writes = meta.save_writes
        self.receipt_wanted = meta.receipt
        self.claimed = meta.checksum

    def reply(self, slot: int, slot_generation: int) -> PutReply:
        """The PUT's answer once `finish_put` stored it as (`slot`, `slot_generation`)."""
        return PutReply(
            slot=slot,
            slot_generation=slot_generation,
            confirmed=not self.receipt,
            receipt=self.receipt,
            checksum=self.stored,
        )


@dataclass(slots=True)
class GetGrant:
    grant_id: int
    statuses: list[ObjectStatus]
    checksums: list[bytes]
    views: list[memoryview | None]  # read-only; None where status is not ok
    # `begin_get_streamed` only: per view, None when complete, else a wait for its first n bytes
    # (returns the bytes in place); with any, `verdicts` gives the final results after the bytes.
    filling: list[Callable[[int], int] | None] | None = None
    verdicts: Callable[[], list[ObjectResult]] | None = None


class SegmentBackend(Protocol):
    def begin_put(self, ticket: WriteTicket, conn: int, claim: PutClaim | None = None) -> PutSlot: ...

    def finish_put(self, put: PutSlot, conn: int) -> tuple[int, int]: ...

    def abort_put(self, put: PutSlot, conn: int) -> None: ...

    def begin_get(self, reads: list[ReadRef], conn: int) -> GetGrant: ...

    def end_get(self, grant: GetGrant, conn: int) -> None: ...

    def map_info(self) -> MapReply: ...

    def pin_local(self, reads: list[ReadRef], conn: int) -> LocalGrants: ...

    def unpin_local(self, grant_id: int, conn: int) -> int: ...

    def close_connection(self, conn: int) -> None: ...

    # A connection whose transport may still use its buffers (a stuck UCX link): what it holds
    # stays held (leaked on purpose), but it no longer counts as serving a GET.
    def connection_leaked(self, conn: int) -> None: ...


def check_claimed(meta: PutRequest, *, staged: bool) -> None:
    """A PUT under a ticket that carries no checksum: it must ask for a write receipt (only the
    writer's commit of that receipt gives the object its checksum and slot), sent bytes must name
    their hash (`PutRequest.checksum`: what arrived is checked against it; a staged put's bytes
    are read from the writer's own pages), and it must carry the writer's proof of that hash
    (`PutRequest.claim_proof`, checked with the secret by the backend's `begin_put`). A PUT's own
    checksum is 16 bytes or none. Checked before a slot is taken."""
    if len(meta.checksum) not in (0, CHECKSUM_BYTES):
        raise BadRequest(f"a PUT's checksum must be {CHECKSUM_BYTES} bytes (xxh3-128) or none")
    if meta.ticket.checksum:
        return
    if not meta.receipt:
        raise BadRequest("a PUT whose ticket carries no checksum must ask for a write receipt")
    if not staged and not meta.checksum:
        raise BadRequest("a PUT whose ticket carries no checksum must name the checksum of its bytes")
    if len(meta.claim_proof) != CLAIM_PROOF_BYTES:
        raise BadRequest("a PUT whose ticket carries no checksum must prove the checksum it names")


def sent_checksum(ticket: WriteTicket, view: memoryview, staged: StagedBytes | None) -> bytes:
    """The checksum a PUT names (`PutRequest.checksum`): the hash of the bytes it sends when its
    ticket carries none, so the segment checks what arrived against what left; none when the
    ticket has one (the segment checks that) or the bytes are staged (the segment reads the
    writer's own pages and its hash becomes the object's)."""
    return checksum(view) if staged is None and not ticket.checksum else b""


def claim_subject(claimed: bytes, staged: StagedBytes | None) -> bytes:
    """What a PUT under a checksum-less ticket proves: the checksum of the bytes it sends, or a
    staged PUT's whole reference (file, offset, nonce): replayed by whoever read it off the wire,
    it could only name the very bytes the writer named, not another place of its memory."""
    return claimed if staged is None else b"staged:" + encode(staged)


def claim_of(meta: PutRequest) -> PutClaim | None:
    """A PUT's claim for the backend's `begin_put`: None under a ticket with a checksum."""
    if meta.ticket.checksum:
        return None
    return claim_subject(meta.checksum, meta.staged), meta.claim_proof


def put_claim(
    ticket: WriteTicket, view: memoryview, staged: StagedBytes | None
) -> tuple[WriteTicket, bytes, bytes]:
    """What a PUT carries for `ticket` (as the directory signed it): the ticket as it travels
    (`sealed_ticket`: a checksum-less one's signature never crosses the data plane), the checksum
    it names (`sent_checksum`) and, under a checksum-less ticket, the writer's proof of what it
    names (`claim_subject`)."""
    claimed = sent_checksum(ticket, view, staged)
    if ticket.checksum:
        return ticket, claimed, b""
    return sealed_ticket(ticket), claimed, claim_proof(ticket, claim_subject(claimed, staged))
