"""PUTs under a ticket that carries no checksum (issue 20: the writer hashes nothing before
put_begin): such a PUT must ask for a receipt, the segment checks sent bytes against the PUT's
own checksum, answers with the checksum it stored, and signs its receipt and sends its
background confirm over that checksum. The ticket travels sealed and the PUT proves its checksum
with the ticket's signature (the writer's key): whoever reads a PUT off the wire can store
nothing of its own under that ticket."""

from __future__ import annotations

from unittest.mock import patch

import msgspec
import pytest

from kvfabric.dataplane import backend as dataplane_backend
from kvfabric.dataplane import tcp_client
from kvfabric.dataplane.backend import check_claimed, claim_of, put_claim, sent_checksum
from kvfabric.dataplane.tcp import TcpDataServer
from kvfabric.format.checksum import checksum
from kvfabric.format.errors import BadRequest, ChecksumMismatch, Unauthorized
from kvfabric.proto.codec import encode
from kvfabric.proto.dataplane import PutRequest, StagedBytes
from kvfabric.proto.directory import WriteTicket
from kvfabric.proto.tickets import claim_proof, sealed_ticket, ticket_signature_valid, write_receipt
from kvfabric.segment_storage.backend import ArenaBackend
from tests.unit.segment_storage.test_write_receipts import SECRET, SIZE, Directory, client, segment, ticket

__all__ = ["segment"]  # the fixture, shared

Segment = tuple[ArenaBackend, Directory, TcpDataServer]


class RecordingDirectory(Directory):
    """Also keeps the checksum each confirm names."""

    def __init__(self) -> None:
        super().__init__()
        self.checksums: list[bytes] = []

    def confirm(self, t: WriteTicket, slot: int, generation: int, trace_id: str, save_writes: int) -> str:
        self.checksums.append(t.checksum)
        return super().confirm(t, slot, generation, trace_id, save_writes)

    def confirm_later(self, t: WriteTicket, slot: int, generation: int, trace_id: str) -> None:
        self.checksums.append(t.checksum)
        super().confirm_later(t, slot, generation, trace_id)


def recording(backend: ArenaBackend) -> RecordingDirectory:
    directory = RecordingDirectory()
    backend.confirm, backend.confirm_later = directory.confirm, directory.confirm_later
    return directory


def test_a_sent_put_without_a_ticket_checksum_is_answered_with_what_was_stored(segment: Segment) -> None:
    backend, _, server = segment
    directory = recording(backend)
    data = bytes(range(256)) * (SIZE // 256)
    t = ticket(backend, data, claimed=b"")
    with client(server) as c:
        reply = c.put(t, data, receipt=True)
    assert reply.checksum == checksum(data)
    assert directory.checksums == [checksum(data)]  # the background confirm names it
    stored = msgspec.structs.replace(t, checksum=checksum(data))
    assert reply.receipt == write_receipt(SECRET, stored, reply.slot, reply.slot_generation)


def test_a_put_without_a_ticket_checksum_must_ask_for_a_receipt(segment: Segment) -> None:
    """Only the writer's commit of its receipt gives such an object its checksum: a PUT that would
    be confirmed at once (no receipt) is refused before anything is stored."""
    backend, directory, server = segment
    data = b"q" * SIZE
    with client(server) as c, pytest.raises(BadRequest, match="write receipt"):
        c.put(ticket(backend, data, claimed=b""), data)
    assert directory.confirmed == [] and backend.slots.used_bytes == 0


def test_a_put_under_a_ticket_with_a_checksum_answers_none(segment: Segment) -> None:
    backend, _, server = segment
    data = b"t" * SIZE
    with client(server) as c:
        reply = c.put(ticket(backend, data), data, receipt=True)
    assert reply.checksum == b""


def test_sent_bytes_that_differ_from_the_puts_checksum_are_refused(segment: Segment) -> None:
    """The PUT names the hash of what left the writer; what arrived must match it."""
    backend, directory, server = segment
    data = b"s" * SIZE
    with (
        patch.object(dataplane_backend, "sent_checksum", lambda *a: checksum(b"other")),
        client(server) as c,
        pytest.raises(ChecksumMismatch),
    ):
        c.put(ticket(backend, data, claimed=b""), data, receipt=True)
    assert directory.later == [] and backend.slots.used_bytes == 0


def test_a_sent_put_must_name_a_checksum_when_its_ticket_has_none(segment: Segment) -> None:
    backend, directory, server = segment
    data = b"n" * SIZE
    with (
        patch.object(dataplane_backend, "sent_checksum", lambda *a: b""),
        client(server) as c,
        pytest.raises(BadRequest, match="must name the checksum"),
    ):
        c.put(ticket(backend, data, claimed=b""), data, receipt=True)
    assert directory.later == [] and backend.slots.used_bytes == 0
    with client(server) as c:  # the connection skipped the payload: the next PUT goes on
        reply = c.put(ticket(backend, data, ticket_id=2, claimed=b""), data, receipt=True)
        assert reply.checksum == checksum(data)


def test_the_puts_checksum_rule(segment: Segment) -> None:
    backend, _, _ = segment
    data = b"r" * 64
    bare, signed = ticket(backend, data, claimed=b""), ticket(backend, data)
    staged = StagedBytes(path="/proc/1/fd/3", offset=4096, nonce=b"\0" * 16)
    proof = bytes(16)  # its length is checked here, its value with the secret in finish_put
    check_claimed(
        PutRequest(ticket=bare, checksum=checksum(data), receipt=True, claim_proof=proof), staged=False
    )
    check_claimed(PutRequest(ticket=signed), staged=False)
    check_claimed(PutRequest(ticket=bare, staged=staged, receipt=True, claim_proof=proof), staged=True)
    with pytest.raises(BadRequest, match="16 bytes"):
        check_claimed(PutRequest(ticket=bare, checksum=b"\1" * 4, receipt=True), staged=True)
    with pytest.raises(BadRequest, match="must name"):
        check_claimed(PutRequest(ticket=bare, receipt=True, claim_proof=proof), staged=False)
    with pytest.raises(BadRequest, match="write receipt"):  # staged or sent
        check_claimed(PutRequest(ticket=bare, staged=staged, claim_proof=proof), staged=True)
    with pytest.raises(BadRequest, match="must prove"):
        check_claimed(PutRequest(ticket=bare, checksum=checksum(data), receipt=True), staged=False)
    with pytest.raises(BadRequest, match="must prove"):
        check_claimed(PutRequest(ticket=bare, staged=staged, receipt=True, claim_proof=b"p"), staged=True)
    assert sent_checksum(bare, memoryview(data), None) == checksum(data)
    assert sent_checksum(signed, memoryview(data), None) == b""
    assert sent_checksum(bare, memoryview(data), staged) == b""


def test_a_checksum_less_ticket_crosses_the_data_plane_sealed_and_its_put_proves_its_checksum(
    segment: Segment,
) -> None:
    """What a PUT sends under a checksum-less ticket holds neither the ticket's signature (the
    writer's key) nor anything else keyed by it but the proof of the checksum it names; a ticket
    with a checksum is sent as it is."""
    backend, _, _ = segment
    data = b"w" * 64
    bare = ticket(backend, data, claimed=b"")
    view = memoryview(data)
    as_sent, claimed, proof = put_claim(bare, view, None)
    assert claimed == checksum(data) and proof == claim_proof(bare, claimed)
    assert as_sent == sealed_ticket(bare) and as_sent.signature != bare.signature
    wire = encode(PutRequest(ticket=as_sent, checksum=claimed, claim_proof=proof, receipt=True))
    assert bare.signature not in wire
    assert ticket_signature_valid(as_sent, SECRET) and not ticket_signature_valid(bare, SECRET)
    signed = ticket(backend, data)
    assert put_claim(signed, view, None) == (signed, b"", b"")
    assert ticket_signature_valid(signed, SECRET)


def test_bytes_put_by_whoever_read_the_sealed_ticket_off_the_wire_are_refused(segment: Segment) -> None:
    """An eavesdropper has the sealed ticket and the writer's proof of the writer's checksum. Its
    own bytes with its own checksum and any proof it can make, or with the writer's proof, or
    the ticket unsealed with a guessed signature: refused, nothing stored, nothing confirmed.
    The writer's own PUT under the same ticket is then stored."""
    backend, directory, server = segment
    mine = b"m" * SIZE
    theirs = b"e" * SIZE
    t = ticket(backend, mine, claimed=b"")
    sealed, _, writers_proof = put_claim(t, memoryview(mine), None)
    attempts = [
        (sealed, checksum(theirs), bytes(16)),
        (sealed, checksum(theirs), writers_proof),
        (sealed, checksum(theirs), claim_proof(sealed, checksum(theirs))),  # keyed by the seal
    ]
    for as_sent, claimed, proof in attempts:
        with (
            patch.object(tcp_client, "put_claim", lambda *a, r=(as_sent, claimed, proof): r),
            client(server) as c,
            pytest.raises(Unauthorized),
        ):
            c.put(t, theirs, receipt=True)
    with (  # unsealed, with a signature of its own: not a ticket the directory signed
        patch.object(tcp_client, "put_claim", lambda *a: (t, checksum(theirs), writers_proof)),
        client(server) as c,
        pytest.raises(Unauthorized),
    ):
        c.put(msgspec.structs.replace(t, signature=bytes(32)), theirs, receipt=True)
    assert directory.later == [] and backend.slots.used_bytes == 0
    assert backend.counters["bad_claim_proof_total"] == 3
    with client(server) as c:
        reply = c.put(t, mine, receipt=True)
    assert reply.checksum == checksum(mine)


def test_a_staged_puts_proof_covers_its_whole_reference(segment: Segment) -> None:
    """A staged PUT names no checksum, so its proof is over its reference (file, offset, nonce):
    replayed with another offset or file of the writer's memory (more of its bytes, not the ones
    it named) it is refused before a slot is taken; as sent, it passes."""
    backend, _, _ = segment
    t = ticket(backend, b"x" * SIZE, claimed=b"")
    named = StagedBytes(path="/proc/1/fd/3", offset=4096, nonce=b"\1" * 16)
    sealed, claimed, proof = put_claim(t, memoryview(b""), named)
    assert claimed == b""

    def put(staged: StagedBytes, conn: int) -> None:
        meta = PutRequest(ticket=sealed, staged=staged, receipt=True, claim_proof=proof)
        check_claimed(meta, staged=True)
        slot = backend.begin_put(meta.ticket, conn, claim_of(meta))
        backend.abort_put(slot, conn)

    for other in (
        msgspec.structs.replace(named, offset=8192),
        msgspec.structs.replace(named, path="/proc/1/fd/4"),
        msgspec.structs.replace(named, nonce=b"\2" * 16),
    ):
        with pytest.raises(Unauthorized):
            put(other, conn=1)
    assert backend.slots.used_bytes == 0 and backend.counters["bad_claim_proof_total"] == 3
    put(named, conn=2)
    with pytest.raises(Unauthorized):  # a checksum-less ticket with no claim at all
        backend.begin_put(sealed, 3)
