"""What a segment offers its data-plane transports. Transports move bytes; the backend decides.

Ownership, per call (`conn` is an opaque per-connection token; everything it holds is released by
`close_connection(conn)`, so a client that dies mid-transfer leaks nothing):

- `begin_put(ticket, conn)` validates the ticket (signature, segment, incarnation, deadline,
  size), allocates a slot and returns a writable `memoryview` of exactly `size_bytes` inside the
  arena. The transport owns that view until it calls `finish_put` or `abort_put`.
- `finish_put(put, conn)` checksums the bytes, confirms the replica to the directory and
  returns the (slot, generation); on mismatch it frees the slot and raises `ChecksumMismatch`.
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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvfabric.proto.dataplane import LocalGrants, MapReply, ObjectResult, ObjectStatus, ReadRef
from kvfabric.proto.directory import WriteTicket

__all__ = ["GetGrant", "PutSlot", "SegmentBackend"]


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
    def begin_put(self, ticket: WriteTicket, conn: int) -> PutSlot: ...

    def finish_put(self, put: PutSlot, conn: int) -> tuple[int, int]: ...

    def abort_put(self, put: PutSlot, conn: int) -> None: ...

    def begin_get(self, reads: list[ReadRef], conn: int) -> GetGrant: ...

    def end_get(self, grant: GetGrant, conn: int) -> None: ...

    def map_info(self) -> MapReply: ...

    def pin_local(self, reads: list[ReadRef], conn: int) -> LocalGrants: ...

    def unpin_local(self, grant_id: int, conn: int) -> int: ...

    def close_connection(self, conn: int) -> None: ...
