"""Write tickets' MACs cover an explicit field list (`kvfabric.proto.tickets`), so a build whose
`WriteTicket` has a defaulted field another lacks still verifies the other's tickets (a rolling
upgrade). The MAC was over the receiver's re-encoding of what it decoded: the field added or
dropped there changed the bytes, and every PUT between the two builds was refused (review,
stop 69). Tickets signed by a directory of the build before keep verifying at upgraded segments."""

from __future__ import annotations

import hashlib

import msgspec
import pytest

from kvfabric.format.ids import ObjectKey
from kvfabric.proto.codec import encode
from kvfabric.proto.directory import WriteTicket
from kvfabric.proto.tickets import (
    TICKET_FIELDS_OUTSIDE_MAC,
    TICKET_MAC_FIELDS,
    claim_proof,
    claim_proof_valid,
    sealed_ticket,
    sign_ticket,
    ticket_signature_valid,
)

SECRET = b"s" * 32


class WriteTicketNext(msgspec.Struct, frozen=True, kw_only=True):
    """`WriteTicket` as a later build might have it: one defaulted field more."""

    ticket_id: int
    key: bytes
    segment_id: str
    incarnation: int
    size_bytes: int
    checksum: bytes
    writer_id: str
    deadline_ms: int
    epoch: int
    data_addr: str = ""
    signature: bytes = b""
    shard: int = 0
    priority_class: int = 3


def _ticket(checksum: bytes = b"c" * 16) -> WriteTicket:
    return WriteTicket(
        ticket_id=7,
        key=ObjectKey(b"k" * 40),
        segment_id="seg-1",
        incarnation=3,
        size_bytes=4096,
        checksum=checksum,
        writer_id="w",
        deadline_ms=1_000,
        epoch=2,
        data_addr="tcp://127.0.0.1:1",
        shard=5,
    )


def test_every_ticket_field_is_in_the_mac_or_named_outside_it() -> None:
    """A field added to `WriteTicket` is a decision: outside the MAC, or in it with a new MAC
    version (the known-answer vectors below then change: segments must learn it first)."""
    assert set(TICKET_MAC_FIELDS) | set(TICKET_FIELDS_OUTSIDE_MAC) == set(WriteTicket.__struct_fields__)
    assert not set(TICKET_MAC_FIELDS) & set(TICKET_FIELDS_OUTSIDE_MAC)


@pytest.mark.parametrize(
    ("checksum", "signature"),
    [
        (b"c" * 16, "6d7420921c35b0c8afa45986a75e28661848e9efc80c97b752485d9d28328eb2"),
        (b"", "0f4f3a504ea0c252d1d4c2455c6ab0bc536381522d4f0b6421d823eb9c486c4b"),
    ],
)
def test_the_ticket_mac_is_the_one_every_segment_of_kvf2_verifies(checksum: bytes, signature: str) -> None:
    """Known-answer vectors: a change of what the MAC covers (a field added to the list, another
    order, another encoding) fails here before it fails every PUT between two builds."""
    assert sign_ticket(_ticket(checksum), SECRET).signature.hex() == signature


@pytest.mark.parametrize("checksum", [b"c" * 16, b""])
def test_a_ticket_of_a_build_with_one_field_more_verifies_here_and_back(checksum: bytes) -> None:
    here = sign_ticket(_ticket(checksum), SECRET)
    # a later segment decodes this build's ticket (its new field defaulted) and verifies it ...
    later = msgspec.msgpack.decode(encode(sealed_ticket(here)), type=WriteTicketNext)
    assert ticket_signature_valid(later, SECRET)  # type: ignore[arg-type]  # duck-typed: its fields
    # ... and a later directory's ticket (the new field set) verifies at this build's segment
    signed_later = msgspec.structs.replace(later, signature=here.signature)
    on_wire = msgspec.structs.replace(signed_later, priority_class=1)
    received = msgspec.msgpack.decode(encode(sealed_ticket(on_wire)), type=WriteTicket)  # type: ignore[arg-type]
    assert ticket_signature_valid(received, SECRET)
    if not checksum:
        proof = claim_proof(here, b"x" * 16)
        assert claim_proof_valid(received, SECRET, b"x" * 16, proof)


@pytest.mark.parametrize("field", TICKET_MAC_FIELDS)
def test_a_ticket_with_any_field_changed_is_refused(field: str) -> None:
    signed = sign_ticket(_ticket(), SECRET)
    value = getattr(signed, field)
    changed = value + 1 if isinstance(value, int) else value + (b"x" if isinstance(value, bytes) else "x")
    assert not ticket_signature_valid(msgspec.structs.replace(signed, **{field: changed}), SECRET)


@pytest.mark.parametrize("checksum", [b"c" * 16, b""])
def test_a_ticket_signed_by_a_directory_of_the_build_before_still_verifies(checksum: bytes) -> None:
    """Segments are upgraded first: the old directory's MAC (over the whole encoding) is accepted."""
    ticket = _ticket(checksum)
    body = encode(msgspec.structs.replace(ticket, signature=b""))
    old_mac = hashlib.blake2b(body, key=SECRET, digest_size=32, person=b"kvf1/ticket").digest()
    signed = msgspec.structs.replace(ticket, signature=old_mac)
    assert ticket_signature_valid(sealed_ticket(signed), SECRET)
    assert not ticket_signature_valid(sealed_ticket(signed), b"t" * 32)
    if not checksum:
        proof = claim_proof(signed, b"")
        assert claim_proof_valid(sealed_ticket(signed), SECRET, b"", proof)
        assert not claim_proof_valid(sealed_ticket(signed), SECRET, b"y", proof)
