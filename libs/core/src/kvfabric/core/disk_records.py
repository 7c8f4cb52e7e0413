"""The disk tier's on-disk encodings: the file header and the index records (pure, no I/O).

One file per segment holds the disk tier: `header | index | data`.

- **Header** (`HEADER_BYTES`, at offset 0): magic, format version, the geometry (record size,
  block size, slot ids, data bytes, where index and data start), a random file id, the segment id
  and the creation time, then an XXH3-128 of all of it. A file whose header does not decode, is
  of another version, another segment or another geometry, or is shorter than the header says is
  never served (`HeaderError`, with what differs).
- **Index**: `slots_max` records of `RECORD_BYTES` (one disk sector each), record i for local
  slot i. A record is a *commit* (generation, data offset, size, the object's checksum, its key)
  or a *free* (the slot's next generation). It ends with an XXH3-128 of its bytes and the file
  id: a torn, zeroed or foreign record does not decode (`decode_record` answers None), and a
  slot whose record does not decode is free.

The write protocol that makes these crash-consistent is the disk slot table's
(`kvfabric.core.disk_slots`): a commit record is written only after its data is durable, and an
extent is reused only after the free record that released it is durable.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final, Literal

import xxhash

from kvfabric.format.generations import GENERATION_MAX
from kvfabric.format.invariant import invariant

__all__ = [
    "BLOCK_BYTES",
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "KEY_BYTES_MAX",
    "RECORD_BYTES",
    "DiskGeometry",
    "DiskHeader",
    "HeaderError",
    "Record",
    "decode_header",
    "decode_record",
    "encode_header",
    "encode_record",
    "geometry",
]

MAGIC: Final = b"KVFSSD\x00\x01"
RECORD_MAGIC: Final = b"KVFR"
FORMAT_VERSION: Final = 1
HEADER_BYTES: Final = 4096
RECORD_BYTES: Final = 512  # one sector: a record is written (and torn, if ever) on its own
BLOCK_BYTES: Final = 4096  # data extents start at and are multiples of this (O_DIRECT-aligned)
DIGEST_BYTES: Final = 16
FILE_ID_BYTES: Final = 16
SEGMENT_ID_BYTES_MAX: Final = 64
# magic, version, record bytes, block bytes, slots, data bytes, index offset, data offset,
# file id, created ms, segment id length, segment id
_HEADER = struct.Struct("<8sIIIIQQQ16sQH64s")
# magic, kind, slot, generation, offset, size, checksum, key length
_RECORD = struct.Struct("<4sB3xIQQQ16sH")
KEY_BYTES_MAX: Final = RECORD_BYTES - DIGEST_BYTES - _RECORD.size
_KIND_CODE: Final = {"commit": 1, "free": 2}
_KIND_NAME: Final = {1: "commit", 2: "free"}

RecordKind = Literal["commit", "free"]


class HeaderError(ValueError):
    """The file is not this segment's disk tier as configured (or is damaged): never served."""


@dataclass(frozen=True, slots=True)
class DiskGeometry:
    slots_max: int
    data_bytes: int
    index_offset: int
    data_offset: int

    @property
    def file_bytes(self) -> int:
        return self.data_offset + self.data_bytes


def geometry(slots_max: int, data_bytes: int) -> DiskGeometry:
    invariant(slots_max >= 1, "slots_max must be at least 1", slots_max=slots_max)
    invariant(
        data_bytes > 0 and data_bytes % BLOCK_BYTES == 0,
        "data bytes must be a positive multiple of the block size",
        data_bytes=data_bytes,
    )
    index_bytes = -(-slots_max * RECORD_BYTES // BLOCK_BYTES) * BLOCK_BYTES
    return DiskGeometry(slots_max, data_bytes, HEADER_BYTES, HEADER_BYTES + index_bytes)


@dataclass(frozen=True, slots=True)
class DiskHeader:
    geometry: DiskGeometry
    file_id: bytes
    segment_id: str
    created_ms: int


@dataclass(frozen=True, slots=True)
class Record:
    """One index record. `commit`: local slot `slot` holds the object (`generation`, data extent
    at `offset`, `size` bytes, `checksum`, `key`). `free`: the slot holds nothing; `generation`
    is the one its next object gets."""

    kind: RecordKind
    slot: int
    generation: int
    offset: int = 0
    size: int = 0
    checksum: bytes = b""
    key: bytes = b""


def _digest(data: bytes | memoryview, file_id: bytes) -> bytes:
    h = xxhash.xxh3_128()
    h.update(data)
    h.update(file_id)
    return h.digest()


def encode_header(header: DiskHeader) -> bytes:
    g = header.geometry
    segment_id = header.segment_id.encode()
    invariant(len(segment_id) <= SEGMENT_ID_BYTES_MAX, "segment id too long for the header")
    invariant(len(header.file_id) == FILE_ID_BYTES, "file id must be 16 bytes")
    body = _HEADER.pack(
        MAGIC,
        FORMAT_VERSION,
        RECORD_BYTES,
        BLOCK_BYTES,
        g.slots_max,
        g.data_bytes,
        g.index_offset,
        g.data_offset,
        header.file_id,
        header.created_ms,
        len(segment_id),
        segment_id,
    )
    out = bytearray(HEADER_BYTES)
    out[: len(body)] = body
    out[HEADER_BYTES - DIGEST_BYTES :] = _digest(bytes(out[: HEADER_BYTES - DIGEST_BYTES]), b"")
    return bytes(out)


def decode_header(data: bytes | memoryview) -> DiskHeader:
    """The header at the start of `data` (at least `HEADER_BYTES`), or `HeaderError` saying why not."""
    if len(data) < HEADER_BYTES:
        raise HeaderError(f"shorter than its header ({len(data)} of {HEADER_BYTES} bytes)")
    if bytes(data[: len(MAGIC)]) != MAGIC:
        raise HeaderError("not a kvfabric disk tier file (bad magic)")
    head = bytes(data[:HEADER_BYTES])
    if _digest(head[: HEADER_BYTES - DIGEST_BYTES], b"") != head[HEADER_BYTES - DIGEST_BYTES :]:
        raise HeaderError("header checksum mismatch (damaged header)")
    (_, version, record_bytes, block_bytes, slots, data_bytes, index_offset, data_offset, file_id,
     created_ms, id_len, segment_id) = _HEADER.unpack_from(head, 0)  # fmt: skip
    if version != FORMAT_VERSION:
        raise HeaderError(f"format version {version}, this build reads {FORMAT_VERSION}")
    if record_bytes != RECORD_BYTES or block_bytes != BLOCK_BYTES:
        raise HeaderError(
            f"record/block size {record_bytes}/{block_bytes}, expected {RECORD_BYTES}/{BLOCK_BYTES}"
        )
    g = (
        geometry(slots, data_bytes)
        if slots >= 1 and data_bytes > 0 and data_bytes % BLOCK_BYTES == 0
        else None
    )
    if g is None or (g.index_offset, g.data_offset) != (index_offset, data_offset):
        raise HeaderError("inconsistent geometry in the header")
    return DiskHeader(g, file_id, segment_id[:id_len].decode(errors="replace"), created_ms)


def encode_record(record: Record, file_id: bytes) -> bytes:
    invariant(len(record.key) <= KEY_BYTES_MAX, "key too long for a record", key_bytes=len(record.key))
    invariant(record.kind == "free" or len(record.checksum) == DIGEST_BYTES, "commit without checksum")
    body = _RECORD.pack(
        RECORD_MAGIC,
        _KIND_CODE[record.kind],
        record.slot,
        record.generation,
        record.offset,
        record.size,
        record.checksum.ljust(DIGEST_BYTES, b"\0"),
        len(record.key),
    )
    out = bytearray(RECORD_BYTES)
    out[: len(body)] = body
    out[len(body) : len(body) + len(record.key)] = record.key
    end = RECORD_BYTES - DIGEST_BYTES
    out[end:] = _digest(bytes(out[:end]), file_id)
    return bytes(out)


def decode_record(data: bytes | memoryview, file_id: bytes, slot: int) -> Record | None:
    """Record `slot` from its `RECORD_BYTES`, or None when they are not a whole record of this
    file for this slot (never written, zeroed, torn, foreign)."""
    if len(data) != RECORD_BYTES or bytes(data[:4]) != RECORD_MAGIC:
        return None
    raw = bytes(data)
    end = RECORD_BYTES - DIGEST_BYTES
    if _digest(raw[:end], file_id) != raw[end:]:
        return None
    _, kind, rslot, generation, offset, size, digest, key_len = _RECORD.unpack_from(raw, 0)
    # A generation at its maximum is none a table wrote (it bumps below it): recovery freeing
    # such a commit wrote generation 2**64 and crashed, a free of it made the slot's next
    # object unfreeable (a crafted record; review, stop 70).
    if (
        rslot != slot
        or kind not in _KIND_NAME
        or key_len > KEY_BYTES_MAX
        or not 1 <= generation < GENERATION_MAX
    ):
        return None
    if kind == _KIND_CODE["free"]:
        return Record("free", slot, generation)
    key = raw[_RECORD.size : _RECORD.size + key_len]
    return Record("commit", slot, generation, offset, size, digest, key)
