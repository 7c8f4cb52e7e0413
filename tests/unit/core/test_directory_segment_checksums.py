"""Objects whose writer named no checksum at put_begin (issue 20: the client hashes nothing
before it): the segment hashes what it stored, the writer's receipt (the segment's MAC over that
checksum) gives the object its checksum, a segment's confirm before it is `pending`, every other
replica must match it, and a lookup hands out that checksum."""

from __future__ import annotations

import msgspec
import pytest

from kvfabric.core.directory import DirectoryCore
from kvfabric.format.errors import BadRequest
from kvfabric.format.ids import ObjectKey
from kvfabric.proto import directory as m
from kvfabric.proto.tickets import write_receipt
from tests.unit.core.dirkit import SECRET, groups, key, lookup, new_core, register
from tests.unit.core.test_directory_receipts import WRITE_TTL_MS, commit

STORED = b"\x5a" * 16  # what a segment hashed
OTHER = b"\xa5" * 16


def begin(core: DirectoryCore, keys: list[ObjectKey], replicas: int = 1) -> list[m.WriteTicket]:
    specs = [m.ObjectSpec(key=k, size_bytes=4096, checksum=b"") for k in keys]
    reply = core.handle(
        m.PutBegin(
            writer_id="w1", request_id="r1", objects=specs, replicas=replicas, write_ttl_ms=WRITE_TTL_MS
        ),
        0,
    ).reply
    assert isinstance(reply, m.PutBeginReply)
    assert [r.status for r in reply.results] == ["placed"] * len(keys)
    return [t for r in reply.results for t in r.tickets]


def stored_receipt(t: m.WriteTicket, slot: int, stored: bytes = STORED) -> m.WriteReceipt:
    """What a segment answers for a ticket without a checksum: its MAC over what it stored."""
    signed = msgspec.structs.replace(t, checksum=stored)
    return m.WriteReceipt(t.ticket_id, slot, 1, write_receipt(SECRET, signed, slot, 1), stored)


def confirm(core: DirectoryCore, t: m.WriteTicket, slot: int, stored: bytes) -> str:
    rc = m.ReplicaConfirm(
        ticket_id=t.ticket_id,
        key=t.key,
        slot=slot,
        slot_generation=1,
        size_bytes=t.size_bytes,
        checksum=stored,
    )
    reply = core.handle(
        m.ConfirmReplicas(segment_id=t.segment_id, incarnation=t.incarnation, confirms=[rc]), 1
    ).reply
    assert isinstance(reply, m.ConfirmReply)
    return reply.results[0].status


def setup(segments: int = 1) -> tuple[DirectoryCore, list[ObjectKey]]:
    core = new_core()
    for i in range(segments):
        register(core, f"s{i + 1}")
    return core, [key(g) for g in groups(1)]


def test_the_ticket_carries_no_checksum_and_a_receipt_gives_the_objects() -> None:
    core, keys = setup()
    (ticket,) = begin(core, keys)
    assert ticket.checksum == b""
    assert commit(core, keys, [stored_receipt(ticket, 7)]) == ["published"]
    (loc,) = lookup(core, groups(1)).objects
    assert loc.checksum == STORED


def test_a_receipt_naming_other_bytes_than_its_mac_is_refused() -> None:
    """The MAC covers the stored checksum: a writer cannot name another one."""
    core, keys = setup()
    (ticket,) = begin(core, keys)
    good = stored_receipt(ticket, 7)
    lied = m.WriteReceipt(good.ticket_id, good.slot, good.slot_generation, good.mac, OTHER)
    assert commit(core, keys, [lied]) == ["missing"]
    assert core.counters["receipt_invalid_total"] == 1


@pytest.mark.parametrize("named", [b"", b"\1" * 15])
def test_a_receipt_without_a_whole_checksum_confirms_nothing(named: bytes) -> None:
    core, keys = setup()
    (ticket,) = begin(core, keys)
    good = stored_receipt(ticket, 7)
    assert commit(core, keys, [m.WriteReceipt(good.ticket_id, 7, 1, good.mac, named)]) == ["missing"]
    assert core.counters["receipt_refused_total"] == 1


def test_a_confirm_before_the_writers_receipt_is_pending_and_gives_nothing() -> None:
    """A segment's confirm cannot give the object its checksum: whoever saw the ticket on the
    wire may have written other bytes under it. It is `pending` (the segment asks again) until
    the writer's receipt does; then it must match."""
    core, keys = setup(segments=2)
    first, _ = begin(core, keys, replicas=2)
    assert confirm(core, first, 7, STORED) == "pending"
    assert confirm(core, first, 7, b"") == "pending"
    assert core.counters["confirm_pending_total"] == 2
    assert commit(core, keys, []) == ["missing"]  # nothing confirmed


def test_a_ticket_seen_on_the_wire_cannot_publish_other_bytes() -> None:
    """Someone who read the writer's ticket off the data plane writes its own bytes under it (no
    receipt asked: its segment confirms at once). The writer's receipt, committed by the writer,
    decides: its bytes are published, the other slot is freed when its confirm is asked again."""
    core, keys = setup()
    (ticket,) = begin(core, keys)
    assert confirm(core, ticket, 3, OTHER) == "pending"  # the eavesdropper's slot 3
    assert commit(core, keys, [stored_receipt(ticket, 7)]) == ["published"]
    (loc,) = lookup(core, groups(1)).objects
    assert (loc.checksum, [r.slot for r in loc.replicas]) == (STORED, [7])
    assert confirm(core, ticket, 3, OTHER) == "unknown_ticket"  # asked again: freed
    assert confirm(core, ticket, 7, STORED) == "ok"  # the writer's slot's background confirm


def test_replicas_of_other_bytes_the_first_receipt_decides() -> None:
    core, keys = setup(segments=2)
    first, second = begin(core, keys, replicas=2)
    receipts = [stored_receipt(first, 7), stored_receipt(second, 9, OTHER)]
    assert commit(core, keys, receipts) == ["degraded"]
    assert core.counters["receipt_invalid_total"] == 1  # its MAC is over OTHER, the object's is STORED
    (loc,) = lookup(core, groups(1)).objects
    assert loc.checksum == STORED and [r.slot for r in loc.replicas] == [7]


def test_a_checksum_of_another_length_is_refused_at_put_begin() -> None:
    core, keys = setup()
    spec = m.ObjectSpec(key=keys[0], size_bytes=4096, checksum=b"\1" * 8)
    with pytest.raises(BadRequest, match="16 bytes"):
        core.handle(m.PutBegin(writer_id="w1", request_id="r1", objects=[spec], write_ttl_ms=WRITE_TTL_MS), 0)
