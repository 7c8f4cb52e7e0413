"""Binary framing shared by every data-plane transport (pure, no I/O).

Every frame, request or reply, starts with a fixed 24-byte header (little-endian):

| offset | size | field |
|---:|---:|---|
| 0 | 4 | magic `b"KVD1"` |
| 4 | 1 | op (`Op`) |
| 5 | 1 | flags (0) |
| 6 | 2 | reserved (0) |
| 8 | 8 | request id (echoed in the reply) |
| 16 | 4 | meta length (bytes of msgpack meta that follow) |
| 20 | 4 | payload count: objects whose bytes follow the meta, each exactly its declared size |

then `meta` (msgpack, `kvfabric.proto.dataplane`), then the payload bytes (sizes come from the
meta: a PUT carries `ticket.size_bytes`, a GET reply carries the `size_bytes` of each `ok` read).
Limits: meta ≤ `META_BYTES_MAX`, one object ≤ `OBJECT_BYTES_MAX`, reads per GET ≤ `READS_MAX`.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Final

from kvfabric.format.errors import BadRequest

__all__ = [
    "GET_BYTES_MAX",
    "HEADER",
    "MAGIC",
    "META_BYTES_MAX",
    "OBJECT_BYTES_MAX",
    "READS_MAX",
    "Header",
    "Op",
    "pack_header",
    "unpack_header",
]

MAGIC: Final = b"KVD1"
HEADER: Final = struct.Struct("<4sBBHQII")
META_BYTES_MAX: Final = 1 << 20
OBJECT_BYTES_MAX: Final = 1 << 30
READS_MAX: Final = 4096
GET_BYTES_MAX: Final = OBJECT_BYTES_MAX  # the bytes one GET reads (a client asks 2 MiB, or one object)


class Op(enum.IntEnum):
    PUT = 1
    GET = 2
    MAP = 3
    PIN_LOCAL = 4
    UNPIN_LOCAL = 5
    REPLY = 64
    ERROR = 65


@dataclass(frozen=True, slots=True)
class Header:
    op: Op
    request_id: int
    meta_bytes: int
    payload_count: int


def pack_header(op: Op, request_id: int, meta_bytes: int, payload_count: int = 0) -> bytes:
    return HEADER.pack(MAGIC, op, 0, 0, request_id, meta_bytes, payload_count)


def unpack_header(data: bytes | bytearray | memoryview) -> Header:
    if len(data) != HEADER.size:
        raise BadRequest(f"frame header must be {HEADER.size} bytes, got {len(data)}")
    magic, op, flags, reserved, request_id, meta_bytes, payload_count = HEADER.unpack(data)
    if magic != MAGIC:
        raise BadRequest(f"bad frame magic {bytes(magic)!r}")
    if flags or reserved:
        raise BadRequest("frame flags/reserved must be 0")
    try:
        kind = Op(op)
    except ValueError:
        raise BadRequest(f"unknown frame op {op}") from None
    if meta_bytes > META_BYTES_MAX:
        raise BadRequest(f"frame meta {meta_bytes} bytes exceeds {META_BYTES_MAX}")
    if payload_count > READS_MAX:
        raise BadRequest(f"frame payload count {payload_count} exceeds {READS_MAX}")
    return Header(kind, request_id, meta_bytes, payload_count)
