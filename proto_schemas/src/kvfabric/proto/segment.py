"""Messages addressed to one segment (subjects `kvf.v1.segment.<verb>.<segment_id>`).

Verbs: `free`, sent by the directory when it reclaims a slot (dead writer, abort, eviction,
lost chunk group). The segment frees each named (slot, generation) — deferring the free while
a transfer holds the slot — bumps the generation and answers which it freed (or had already
freed: a slot whose generation moved on counts as freed, the free is idempotent).
"""

from __future__ import annotations

import msgspec

from kvfabric.proto.codec import FamilyDecoder
from kvfabric.proto.directory import FreedSlot

__all__ = [
    "DrainRequest",
    "FreeSlotsReply",
    "FreeSlotsRequest",
    "SegmentMessage",
    "SegmentState",
    "segment_decoder",
]


class FreeSlotsRequest(msgspec.Struct, frozen=True, kw_only=True, tag="seg.free.v1", tag_field="t"):
    segment_id: str
    incarnation: int
    slots: list[FreedSlot]
    epoch: int = 0


class FreeSlotsReply(msgspec.Struct, frozen=True, kw_only=True, tag="seg.freed.v1", tag_field="t"):
    incarnation: int
    freed: list[FreedSlot]


class DrainRequest(msgspec.Struct, frozen=True, kw_only=True, tag="seg.drain.v1", tag_field="t"):
    """`kvf.v1.segment.drain.<segment_id>`: refuse new writes (keep serving reads), or undo it."""

    draining: bool = True


class SegmentState(msgspec.Struct, frozen=True, kw_only=True, tag="seg.state.v1", tag_field="t"):
    incarnation: int
    draining: bool
    used_bytes: int


SegmentMessage = FreeSlotsRequest | FreeSlotsReply | DrainRequest | SegmentState

segment_decoder: FamilyDecoder[SegmentMessage] = FamilyDecoder(SegmentMessage, "segment")
