"""Signing write tickets: the directory signs, segments verify (pure; no I/O). And the other
way round for write receipts: a segment signs what it stored, the directory verifies.

A ticket is signed with a keyed BLAKE2b MAC (32 bytes) over the msgpack encoding of the ticket
with an empty signature, keyed by the cluster secret that the directory and every segment share
(clients never hold it, so they cannot forge a placement, a size or a checksum).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Final

import msgspec

from kvfabric.proto.codec import encode
from kvfabric.proto.directory import WriteTicket

__all__ = [
    "READ_TOKEN_BYTES",
    "SECRET_BYTES_MIN",
    "WRITE_RECEIPT_BYTES",
    "read_token",
    "read_token_valid",
    "receipt_mac",
    "sign_ticket",
    "ticket_signature_valid",
    "write_receipt",
    "write_receipt_valid",
]

SECRET_BYTES_MIN: Final = 16
_PERSON: Final = b"kvf1/ticket"


def _mac(ticket: WriteTicket, secret: bytes) -> bytes:
    if len(secret) < SECRET_BYTES_MIN:
        raise ValueError(f"cluster secret must be at least {SECRET_BYTES_MIN} bytes")
    body = encode(msgspec.structs.replace(ticket, signature=b""))
    return hashlib.blake2b(body, key=secret[:64], digest_size=32, person=_PERSON).digest()


def sign_ticket(ticket: WriteTicket, secret: bytes) -> WriteTicket:
    return msgspec.structs.replace(ticket, signature=_mac(ticket, secret))


def ticket_signature_valid(ticket: WriteTicket, secret: bytes) -> bool:
    return hmac.compare_digest(ticket.signature, _mac(ticket, secret))


# ---- read tokens: no lease, no bytes ---------------------------------------------------------
# The directory hands every replica of a lookup hit (and every copy source) a token: a keyed
# BLAKE2b MAC over (segment id, incarnation, slot, slot generation, size, expiry). The segment serves
# a read only with a valid, unexpired token, so knowing where bytes lie is not enough to read them.
READ_TOKEN_BYTES: Final = 16
_READ_PERSON: Final = b"kvf1/read"
_U64: Final = (1 << 64) - 1
_READ_FIELDS: Final = struct.Struct("<QQQQQ")


def read_token(
    secret: bytes, segment_id: str, incarnation: int, slot: int, generation: int, size: int, expires_ms: int
) -> bytes:
    if len(secret) < SECRET_BYTES_MIN:
        raise ValueError(f"cluster secret must be at least {SECRET_BYTES_MIN} bytes")
    name = segment_id.encode()
    body = len(name).to_bytes(1, "little") + name  # segment ids are at most 64 ASCII characters
    # Masked to u64: the segment checks references as received, whatever integers they hold.
    body += _READ_FIELDS.pack(
        incarnation & _U64, slot & _U64, generation & _U64, size & _U64, expires_ms & _U64
    )
    return hashlib.blake2b(body, key=secret[:64], digest_size=READ_TOKEN_BYTES, person=_READ_PERSON).digest()


def read_token_valid(
    token: bytes,
    secret: bytes,
    segment_id: str,
    incarnation: int,
    slot: int,
    generation: int,
    size: int,
    expires_ms: int,
) -> bool:
    expected = read_token(secret, segment_id, incarnation, slot, generation, size, expires_ms)
    return len(token) == READ_TOKEN_BYTES and hmac.compare_digest(token, expected)


# ---- write receipts: what a segment stored, for the writer's put_commit ----------------------
# A segment that stored a ticket's bytes and found their checksum equal to the ticket's signs a
# receipt: a keyed BLAKE2b MAC over (ticket id, epoch, shard, segment id, incarnation, slot,
# slot generation, size, checksum, key). The writer cannot forge one (it holds no secret) nor
# move one to another ticket, slot or object; the directory recomputes it from its own record of
# the ticket and the slot the receipt names, so a commit of bytes nobody stored is refused.
WRITE_RECEIPT_BYTES: Final = 16
_RECEIPT_PERSON: Final = b"kvf1/receipt"
_RECEIPT_FIELDS: Final = struct.Struct("<QQQQQQQ")


def write_receipt(
    secret: bytes,
    ticket: WriteTicket,
    slot: int,
    generation: int,
) -> bytes:
    """The receipt of `ticket`'s bytes stored in (slot, generation) (the ticket's own fields)."""
    return receipt_mac(
        secret,
        ticket.ticket_id,
        ticket.epoch,
        ticket.shard,
        ticket.segment_id,
        ticket.incarnation,
        slot,
        generation,
        ticket.size_bytes,
        ticket.checksum,
        ticket.key,
    )


def receipt_mac(
    secret: bytes,
    ticket_id: int,
    epoch: int,
    shard: int,
    segment_id: str,
    incarnation: int,
    slot: int,
    generation: int,
    size: int,
    checksum: bytes,
    key: bytes,
) -> bytes:
    if len(secret) < SECRET_BYTES_MIN:
        raise ValueError(f"cluster secret must be at least {SECRET_BYTES_MIN} bytes")
    name = segment_id.encode()
    body = _RECEIPT_FIELDS.pack(
        ticket_id & _U64,
        epoch & _U64,
        shard & _U64,
        incarnation & _U64,
        slot & _U64,
        generation & _U64,
        size & _U64,
    )
    # length-prefixed variable fields (segment ids are at most 64 ASCII characters, checksums 16
    # bytes, keys bounded by the key format): no two field tuples encode alike
    body += len(name).to_bytes(2, "little") + name + len(checksum).to_bytes(2, "little") + checksum + key
    return hashlib.blake2b(
        body, key=secret[:64], digest_size=WRITE_RECEIPT_BYTES, person=_RECEIPT_PERSON
    ).digest()


def write_receipt_valid(mac: bytes, expected: bytes) -> bool:
    """Whether a receipt's `mac` is the one the directory recomputed (`receipt_mac`)."""
    return len(mac) == WRITE_RECEIPT_BYTES and hmac.compare_digest(mac, expected)
