"""Signing write tickets: the directory signs, segments verify (pure; no I/O). And the other
way round for write receipts: a segment signs what it stored, the directory verifies.

A ticket is signed with a keyed BLAKE2b MAC (32 bytes) over the msgpack encoding of an explicit
list of its fields (`TICKET_MAC_FIELDS`, in that order), keyed by the cluster secret that the
directory and every segment share (clients never hold it, so they cannot forge a placement, a
size or a checksum). Not over the struct's own encoding: a receiver re-encodes what it decoded,
so a field one build has and another lacks (a defaulted field added in a rolling upgrade) broke
every PUT between them. A field added to `WriteTicket` is outside the MAC
(`TICKET_FIELDS_OUTSIDE_MAC`) unless the MAC's version (`_PERSON`) changes with it, after every
segment verifies the new version. Segments still
accept the MAC of builds before 2026-12-07 (over the whole encoding) so that such a build's
directory keeps working while segments are upgraded first.

A ticket that carries no checksum (the writer named none at put_begin: the segment's hash of what
it stores becomes the object's) binds no bytes, so its signature doubles as the writer's key: it
reaches the writer only in the directory's put_begin reply (NATS, the tenant's own inbox), and on
the data plane the ticket travels **sealed** (`sealed_ticket`: its signature replaced by a one-way
hash of it), with a `claim_proof` — a MAC keyed by the signature over the checksum the PUT names
(empty for a staged PUT). A segment accepts a checksum-less ticket only sealed
(`ticket_signature_valid`) and stores its bytes only with a valid proof (`claim_proof_valid`),
so whoever reads a PUT off a plaintext data plane learns neither the key nor a proof for any
other bytes: it cannot store its own bytes under the writer's ticket (before, it could, and a
leader failover could then adopt them, docs/directory.md).
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
    "CLAIM_PROOF_BYTES",
    "READ_TOKEN_BYTES",
    "SECRET_BYTES_MIN",
    "TICKET_FIELDS_OUTSIDE_MAC",
    "TICKET_MAC_FIELDS",
    "WRITE_RECEIPT_BYTES",
    "claim_proof",
    "claim_proof_valid",
    "read_token",
    "read_token_valid",
    "receipt_mac",
    "sealed_ticket",
    "sign_ticket",
    "ticket_signature_valid",
    "write_receipt",
    "write_receipt_valid",
]

SECRET_BYTES_MIN: Final = 16
_PERSON: Final = b"kvf2/ticket"
_LEGACY_PERSON: Final = b"kvf1/ticket"  # builds before 2026-12-07: the whole struct's encoding
# What a ticket's MAC covers, in this order (every field but `signature`, as of kvf2). Frozen:
# a field added to `WriteTicket` goes in `TICKET_FIELDS_OUTSIDE_MAC`, or here with a new
# `_PERSON` once every segment verifies that version (tests/unit/proto/test_ticket_macs.py holds
# a known-answer vector).
TICKET_MAC_FIELDS: Final = (
    "ticket_id",
    "key",
    "segment_id",
    "incarnation",
    "size_bytes",
    "checksum",
    "writer_id",
    "deadline_ms",
    "epoch",
    "data_addr",
    "shard",
)
TICKET_FIELDS_OUTSIDE_MAC: Final = ("signature",)  # fields no MAC covers (the MAC itself)


def _check_secret(secret: bytes) -> None:
    if len(secret) < SECRET_BYTES_MIN:
        raise ValueError(f"cluster secret must be at least {SECRET_BYTES_MIN} bytes")


def _mac(ticket: WriteTicket, secret: bytes) -> bytes:
    _check_secret(secret)
    body = msgspec.msgpack.encode([getattr(ticket, name) for name in TICKET_MAC_FIELDS])
    return hashlib.blake2b(body, key=secret[:64], digest_size=32, person=_PERSON).digest()


def _legacy_mac(ticket: WriteTicket, secret: bytes) -> bytes:
    """The MAC a directory of a build before 2026-12-07 signed with (verified, never signed)."""
    _check_secret(secret)
    body = encode(msgspec.structs.replace(ticket, signature=b""))
    return hashlib.blake2b(body, key=secret[:64], digest_size=32, person=_LEGACY_PERSON).digest()


def _signature_of(ticket: WriteTicket, secret: bytes) -> bytes | None:
    """The MAC that `ticket.signature` is (or seals, for a checksum-less ticket): this build's, or
    an older directory's; None when it is neither."""
    for mac_of in (_mac, _legacy_mac):
        mac = mac_of(ticket, secret)
        if hmac.compare_digest(ticket.signature, _seal(mac) if not ticket.checksum else mac):
            return mac
    return None


def sign_ticket(ticket: WriteTicket, secret: bytes) -> WriteTicket:
    return msgspec.structs.replace(ticket, signature=_mac(ticket, secret))


def ticket_signature_valid(ticket: WriteTicket, secret: bytes) -> bool:
    """A ticket with a checksum: its signature; one without: sealed (`sealed_ticket`) only, so a
    checksum-less ticket's key never has to cross the data plane."""
    return _signature_of(ticket, secret) is not None


# ---- checksum-less tickets on the data plane: sealed, with a proof of the claimed checksum -----
CLAIM_PROOF_BYTES: Final = 16
_SEAL_PERSON: Final = b"kvf1/seal"
_CLAIM_PERSON: Final = b"kvf1/claim"


def _seal(signature: bytes) -> bytes:
    return hashlib.blake2b(signature, digest_size=32, person=_SEAL_PERSON).digest()


def sealed_ticket(ticket: WriteTicket) -> WriteTicket:
    """The form a ticket travels in on the data plane: a checksum-less one with its signature
    sealed (one-way: the seal does not give the signature back), any other as it is."""
    if ticket.checksum:
        return ticket
    return msgspec.structs.replace(ticket, signature=_seal(ticket.signature))


def claim_proof(ticket: WriteTicket, claimed: bytes) -> bytes:
    """The writer's proof that it names `claimed` (a checksum, or b"" for a staged PUT) under its
    checksum-less `ticket` (as the directory signed it: the signature is the key)."""
    return hashlib.blake2b(
        claimed, key=ticket.signature, digest_size=CLAIM_PROOF_BYTES, person=_CLAIM_PERSON
    ).digest()


def claim_proof_valid(ticket: WriteTicket, secret: bytes, claimed: bytes, proof: bytes) -> bool:
    """Whether `proof` is the writer's for `claimed` under `ticket` (sealed or not: the segment
    recomputes the signature from the secret; an older directory's too)."""
    if len(proof) != CLAIM_PROOF_BYTES:
        return False
    for mac_of in (_mac, _legacy_mac):
        signed = msgspec.structs.replace(ticket, signature=mac_of(ticket, secret))
        if hmac.compare_digest(proof, claim_proof(signed, claimed)):
            return True
    return False


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
    _check_secret(secret)
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
