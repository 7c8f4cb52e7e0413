"""Messages addressed to one segment (subjects `kvf.v1.segment.<verb>.<segment_id>`).

Verbs:
- `free`, sent by the directory when it reclaims a slot (dead writer, abort, eviction, lost
  chunk group). The segment frees each named (slot, generation) — deferring the free while a
  transfer holds the slot — bumps the generation and answers which it freed (or had already
  freed: a slot whose generation moved on counts as freed, the free is idempotent).
- `drain`: refuse new writes, keep serving reads (or undo it).
- `report`: a directory leader rebuilding its index asks what is stored (see `ReportRequest`).
- `copy`: write a ticket's object by reading it from another segment (see `CopyRequest`).
- `verify`: re-hash named slots now (a reader saw a checksum mismatch: `VerifyRequest`).
- `demote`: move arena objects into the segment's own disk tier (`DemoteRequest`).
"""

from __future__ import annotations

from typing import Final, Literal

import msgspec

from kvfabric.format.ids import DomainDigest, ObjectKey
from kvfabric.proto.codec import FamilyDecoder
from kvfabric.proto.directory import FreedSlot, WriteTicket

__all__ = [
    "DEMOTE_BATCH_MAX",
    "REPORT_PAGE_MAX",
    "SSD_SLOT_BASE",
    "CopyReply",
    "CopyRequest",
    "DemoteObject",
    "DemoteReply",
    "DemoteRequest",
    "DemoteResult",
    "DemoteStatus",
    "DrainRequest",
    "FreeSlotsReply",
    "FreeSlotsRequest",
    "HeldObject",
    "ReportRequest",
    "SegmentMessage",
    "SegmentReport",
    "SegmentState",
    "Tier",
    "VerifyReply",
    "VerifyRequest",
    "segment_decoder",
    "tier_of_slot",
]

# A segment's slot ids name the tier that holds the object: below this, its DRAM arena; from
# here up, its disk tier (local slot i is SSD_SLOT_BASE + i). So a replica's (segment,
# incarnation, slot, generation) says where its bytes are, and every verb that names slots
# (reads and their tokens, frees, reports, verify, corruption reports) works for both tiers.
# Below 2**32: the directory's published records keep a slot in 32 bits.
SSD_SLOT_BASE: Final = 1 << 31
Tier = Literal["dram", "ssd"]


def tier_of_slot(slot: int) -> Tier:
    return "ssd" if slot >= SSD_SLOT_BASE else "dram"


class FreeSlotsRequest(msgspec.Struct, frozen=True, kw_only=True, tag="seg.free.v1", tag_field="t"):
    segment_id: str
    incarnation: int
    slots: list[FreedSlot]
    epoch: int = 0
    shard: int = 0  # `epoch` is this shard's; every slot's key is of this shard


class FreeSlotsReply(msgspec.Struct, frozen=True, kw_only=True, tag="seg.freed.v1", tag_field="t"):
    incarnation: int
    freed: list[FreedSlot]


class DrainRequest(msgspec.Struct, frozen=True, kw_only=True, tag="seg.drain.v1", tag_field="t"):
    """`kvf.v1.segment.drain.<segment_id>`: refuse new writes (keep serving reads), or undo it."""

    draining: bool = True


class ReportRequest(msgspec.Struct, frozen=True, kw_only=True, tag="seg.report.v1", tag_field="t"):
    """`kvf.v1.segment.report.<segment_id>`, from a directory leader rebuilding its index: what
    the segment stores, paged by slot id. Carries the leader's epoch: from then on the segment
    refuses tickets and frees of older epochs (the old leader is fenced)."""

    epoch: int
    after_slot: int = -1
    limit: int = 4096
    shard: int = 0  # `epoch` is this shard's leader's (the report itself covers every shard)


class HeldObject(msgspec.Struct, frozen=True, array_like=True):
    key: ObjectKey
    slot: int
    slot_generation: int
    size_bytes: int
    checksum: bytes


class SegmentReport(msgspec.Struct, frozen=True, kw_only=True, tag="seg.report_reply.v1", tag_field="t"):
    incarnation: int
    capacity_bytes: int
    used_bytes: int
    draining: bool
    objects: list[HeldObject]
    next_after_slot: int = -1  # -1: no more pages


class CopyRequest(msgspec.Struct, frozen=True, kw_only=True, tag="seg.copy.v1", tag_field="t"):
    """`kvf.v1.segment.copy.<segment_id>`: write `ticket`'s object into this segment by reading
    it from another segment (`source_addr`, the replica named by incarnation/slot/generation)
    over the data plane — no payload through NATS. The destination verifies the bytes against the
    ticket's checksum and confirms the replica to the directory like any write."""

    ticket: WriteTicket
    source_addr: str
    source_incarnation: int
    source_slot: int
    source_slot_generation: int
    source_read_token: bytes = b""  # the directory's read token for the source (replicate_begin)
    source_read_expires_ms: int = 0


class CopyReply(msgspec.Struct, frozen=True, kw_only=True, tag="seg.copied.v1", tag_field="t"):
    slot: int
    slot_generation: int


class SegmentState(msgspec.Struct, frozen=True, kw_only=True, tag="seg.state.v1", tag_field="t"):
    incarnation: int
    draining: bool
    used_bytes: int


class VerifyRequest(msgspec.Struct, frozen=True, kw_only=True, tag="seg.verify.v1", tag_field="t"):
    """`kvf.v1.segment.verify.<segment_id>`, relayed by the directory from a reader that saw a
    checksum mismatch (`ReplicaSuspect`): re-hash the slot now, ahead of the scrubber; a corrupt
    one is freed and reported (`replica_corrupt`). Nothing else happens to a slot that is fine
    or was freed or reused meanwhile."""

    incarnation: int
    slot: int
    slot_generation: int
    # The reporting tenant's share domains (16-byte digests): a slot holding an object of none of
    # them is left alone. Empty: a service's report, any object.
    domains: list[DomainDigest] = msgspec.field(default_factory=list)


class VerifyReply(msgspec.Struct, frozen=True, kw_only=True, tag="seg.verify_reply.v1", tag_field="t"):
    queued: bool  # false: another check of it is pending, or the segment's queue is full


class DemoteObject(msgspec.Struct, frozen=True, array_like=True):
    key: ObjectKey
    slot: int  # its arena replica on this segment (from the directory's `show_group`)
    slot_generation: int
    # Copy only: the arena replica stays (no `replica_corrupt`), the result is `copied`. The
    # policy copies a demoted tail's DRAM-only ancestors so that the disk holds whole prefixes
    # (a power cycle loses the arena: a tail without its head on disk is never found again).
    keep_arena: bool = False


class DemoteRequest(msgspec.Struct, frozen=True, kw_only=True, tag="seg.demote.v1", tag_field="t"):
    """`kvf.v1.segment.demote.<segment_id>` (from the eviction policy): move these objects from
    the arena into this segment's disk tier, up to 8 at once (the segment's
    `DEMOTE_CONCURRENCY_MAX`; results in request order). Per object the segment asks the
    directory for a disk replica (`replicate_begin`, tier `ssd`), copies its arena bytes to disk
    (verified first; data, sync, commit record, sync), confirms the disk replica like any write,
    then asks the directory to drop the arena replica (`replica_corrupt`, reason `demoted`:
    refused while a lease or pin holds the group), which frees it; an object with `keep_arena`
    keeps its arena replica (a copy: `copied`). At most `DEMOTE_BATCH_MAX` objects; one request
    at a time per segment (another is `busy`)."""

    objects: list[DemoteObject]


# demoted: on disk, the arena replica dropped; copied: on disk, the arena replica kept (a lease
# or pin holds the group: a later demote drops it; or `keep_arena` asked it); no_capacity: the
# disk tier is full, nothing written (and the rest of the request is not tried); not_found: not
# published, or that arena replica is not this segment's (any more); failed: another error (the
# object keeps its arena replica).
DemoteStatus = Literal["demoted", "copied", "no_capacity", "not_found", "failed"]


class DemoteResult(msgspec.Struct, frozen=True, array_like=True):
    status: DemoteStatus
    slot: int = -1  # the disk replica (demoted, copied)
    slot_generation: int = -1


class DemoteReply(msgspec.Struct, frozen=True, kw_only=True, tag="seg.demoted.v1", tag_field="t"):
    results: list[DemoteResult]  # one per object, in order
    ssd_capacity_bytes: int  # the disk tier's figures after the request (its pool, for the policy)
    ssd_used_bytes: int


SegmentMessage = (
    FreeSlotsRequest
    | FreeSlotsReply
    | DrainRequest
    | SegmentState
    | ReportRequest
    | SegmentReport
    | CopyRequest
    | CopyReply
    | VerifyRequest
    | VerifyReply
    | DemoteRequest
    | DemoteReply
)
DEMOTE_BATCH_MAX: Final = 64
REPORT_PAGE_MAX: Final = 4096  # objects per report page (≈ 140 B each: well under 1 MiB)

segment_decoder: FamilyDecoder[SegmentMessage] = FamilyDecoder(SegmentMessage, "segment")
