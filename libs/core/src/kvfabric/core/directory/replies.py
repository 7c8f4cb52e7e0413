"""Reply bounds of the directory core: encoded sizes of reply parts (so a put_begin, lookup or
listing reply is known to fit `reply_bytes_max` before it is built) and the bounded cache of
replies kept for retried requests.

## The reply cache
States of an entry: (absent) --remember--> CACHED --evicted (least recently remembered first)
or remembered again--> (absent / replaced). Invariant: `objects` is the sum of the entries'
object counts and never exceeds `objects_max` after a call (an empty reply counts as one, so
the number of entries is bounded too). Replies are kept msgpack-encoded: bytes are never
walked by the cyclic GC, a Struct with its lists would be (kvfabric.runtime.gcpolicy).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from kvfabric.core.directory.keys import GROUP_KEY_BYTES
from kvfabric.format.ids import GroupKey, ObjectKey
from kvfabric.format.invariant import invariant
from kvfabric.proto import directory as m
from kvfabric.proto.tickets import read_token, sign_ticket

__all__ = [
    "ARRAY_HEADER_BYTES",
    "LIST_ENVELOPE_BYTES",
    "ReplyCache",
    "ReplySizes",
    "encode",
    "str_bytes",
]

_U64: Final = 2**64 - 1  # the widest integer msgpack encodes (9 bytes): reply size bounds
_CHECKSUM_BYTES: Final = 16
_NO_KEY: Final = ObjectKey(b"")  # sizes are measured keyless; a request adds its keys' bytes
ARRAY_HEADER_BYTES: Final = 5  # msgpack array32 header: the widest a list's length takes
encode: Final = msgspec.msgpack.Encoder().encode
LIST_ENVELOPE_BYTES: Final = (
    len(encode(m.GroupList(epoch=_U64, groups=[], next_after=GroupKey(bytes(GROUP_KEY_BYTES)))))
    + ARRAY_HEADER_BYTES
)


def str_bytes(n: int) -> int:
    """The most bytes a msgpack str or bin of `n` bytes takes: its header (up to 5) and itself."""
    return n + 5


@dataclass(frozen=True, slots=True)
class ReplySizes:
    """Encoded sizes of a put_begin reply's and a lookup reply's parts with every string and
    byte field empty and every integer at its widest; the put_begin reply check and the lookup
    fold add the strings' lengths."""

    ticket: int
    result: int
    envelope: int
    # a lookup reply: its envelope, an object's location without replicas, a replica with a token
    lookup_envelope: int
    location: int
    replica: int

    @classmethod
    def measure(cls, secret: bytes) -> ReplySizes:
        ticket = m.WriteTicket(
            ticket_id=_U64,
            key=_NO_KEY,
            segment_id="",
            incarnation=_U64,
            size_bytes=_U64,
            checksum=bytes(_CHECKSUM_BYTES),
            writer_id="",
            deadline_ms=_U64,
            epoch=_U64,
            shard=_U64,
        )
        return cls(
            ticket=len(encode(sign_ticket(ticket, secret))),
            result=len(encode(m.BeginResult(key=_NO_KEY, status="quota_exceeded", deadline_ms=_U64))),
            envelope=len(encode(m.PutBeginReply(epoch=_U64, results=[]))) + ARRAY_HEADER_BYTES,
            lookup_envelope=len(
                encode(
                    m.LookupReply(
                        epoch=_U64, hit_chunks=_U64, lease_id=_U64, lease_expires_ms=_U64, objects=[]
                    )
                )
            )
            + ARRAY_HEADER_BYTES,
            location=len(
                encode(
                    m.ObjectLocation(
                        chunk_index=_U64,
                        member=m.Member(_U64, _U64, _U64),
                        size_bytes=_U64,
                        checksum=bytes(_CHECKSUM_BYTES),
                        replicas=[],
                    )
                )
            )
            + ARRAY_HEADER_BYTES,
            replica=len(
                encode(
                    m.Replica(
                        segment_id="",
                        incarnation=_U64,
                        slot=_U64,
                        slot_generation=_U64,
                        read_token=read_token(secret, "", _U64, _U64, _U64, _U64, _U64),
                        read_expires_ms=_U64,
                    )
                )
            ),
        )


# Replies kept for retried requests, by verb: decoded again on a retry.
_REPLY_DECODERS: Final[Mapping[str, msgspec.msgpack.Decoder[Any]]] = {
    "begin": msgspec.msgpack.Decoder(m.PutBeginReply),
}


class ReplyCache:
    """(verb, writer id, request id) -> the reply, msgpack-encoded, and the objects it answers
    for; at most `objects_max` objects held (see the module docstring)."""

    def __init__(self, objects_max: int, count: Callable[[str], None]) -> None:
        self.objects_max = objects_max
        self.entries: OrderedDict[tuple[str, str, str], tuple[bytes, int]] = OrderedDict()
        self.objects = 0
        self._count = count

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, verb: str, writer_id: str, request_id: str) -> msgspec.Struct | None:
        cached = self.entries.get((verb, writer_id, request_id))
        if cached is None:
            return None
        self._count("retried_request_total")
        reply: msgspec.Struct = _REPLY_DECODERS[verb].decode(cached[0])
        return reply

    def remember(
        self, verb: str, writer_id: str, request_id: str, reply: msgspec.Struct, n_objects: int
    ) -> None:
        invariant(verb in _REPLY_DECODERS, "no decoder for cached replies of this verb", verb=verb)
        n_objects = max(1, n_objects)  # an empty reply is an entry too: counted, so entries are bounded
        old = self.entries.pop((verb, writer_id, request_id), None)
        self.objects += n_objects - (old[1] if old else 0)
        self.entries[(verb, writer_id, request_id)] = (msgspec.msgpack.encode(reply), n_objects)
        while self.objects > self.objects_max:
            _, (_, n) = self.entries.popitem(last=False)
            self.objects -= n

    def check_invariants(self) -> None:
        invariant(self.objects == sum(n for _, n in self.entries.values()), "reply cache count drift")
        invariant(self.objects <= self.objects_max, "reply cache over its bound")
