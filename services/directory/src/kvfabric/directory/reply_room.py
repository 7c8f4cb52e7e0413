"""Room left in a `lookup_many` reply for its parts (issue 21: replies over NATS's max payload).

A `LookupManyReply` holds every part's `LookupReply`; a lookup of 4,096 groups alone can come
close to `REPLY_BYTES_MAX`, and the sum of several parts can exceed it (NATS drops the reply,
the leases stay). So the instance runs each part with what is left (`ManyReplyRoom.for_part`):
the core folds that part's hit short before its reply could be larger
(`DirectoryCore.handle(reply_bytes_max=)`), and a shorter hit is always correct (the reader
folds to the longest complete run anyway). Room is kept back for each part still to come: a
miss or an error (its message cut to `PART_MESSAGE_CHARS_MAX`) takes at most
`PART_RESERVE_BYTES`. So the whole reply fits whatever the parts answer.
"""

from __future__ import annotations

from typing import Final

from kvfabric.format.errors import KvfError
from kvfabric.proto import directory as m
from kvfabric.proto.codec import encode

__all__ = ["PART_MESSAGE_CHARS_MAX", "PART_RESERVE_BYTES", "ManyReplyRoom", "part_error"]

_U64: Final = 2**64 - 1  # integers at their widest
_ARRAY_HEADER_BYTES: Final = 5
PART_MESSAGE_CHARS_MAX: Final = 128  # an error part's message is cut to this
_ERROR_CODE_CHARS_MAX: Final = 32  # wire codes are short snake_case words
_ENVELOPE_BYTES: Final = len(encode(m.LookupManyReply(epoch=_U64, parts=[]))) + _ARRAY_HEADER_BYTES
# A part's own fields around its LookupReply (no error).
_PART_WRAPPER_BYTES: Final = len(encode(m.LookupPartReply(shard=_U64, reply=None)))
# The most a part that hit nothing, or failed, takes (a message of 4-byte characters).
PART_RESERVE_BYTES: Final = max(
    len(encode(m.LookupPartReply(shard=_U64, reply=m.LookupReply(epoch=_U64, hit_chunks=0)))),
    len(
        encode(
            m.LookupPartReply(
                shard=_U64, error="x" * _ERROR_CODE_CHARS_MAX, message="\U0001f600" * PART_MESSAGE_CHARS_MAX
            )
        )
    ),
)


def part_error(shard: int, err: KvfError) -> m.LookupPartReply:
    """A failed part's answer (its message cut: the room kept for it is bounded)."""
    return m.LookupPartReply(shard=shard, error=err.code, message=err.message[:PART_MESSAGE_CHARS_MAX])


class ManyReplyRoom:
    """What is left of `reply_bytes_max` as the parts of one `lookup_many` are answered."""

    def __init__(self, parts: int, reply_bytes_max: int = m.REPLY_BYTES_MAX) -> None:
        self._left = reply_bytes_max - _ENVELOPE_BYTES
        self._parts_left = parts

    def for_part(self) -> int:
        """The largest `LookupReply` the next part may answer (negative: none fits; the core
        then answers a miss, which the room kept for it holds)."""
        return self._left - _PART_WRAPPER_BYTES - (self._parts_left - 1) * PART_RESERVE_BYTES

    def took(self, answer: m.LookupPartReply) -> None:
        """A part was answered with `answer` (encoded to know its size)."""
        self._left -= len(encode(answer))
        self._parts_left -= 1
