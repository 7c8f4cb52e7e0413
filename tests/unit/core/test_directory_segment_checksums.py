"""Objects whose writer named no checksum at put_begin (issue 20: the client hashes nothing
before it): the segment hashes what it stored, the first confirm or receipt gives the object its
checksum, every other replica must match it, and a lookup hands out that checksum."""

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


def test_a_confirm_gives_the_checksum_and_a_replica_of_other_bytes_is_a_mismatch() -> None:
    core, keys = setup(segments=2)
    first, second = begin(core, keys, replicas=2)
    assert confirm(core, first, 7, STORED) == "ok"
    assert confirm(core, second, 9, OTHER) == "mismatch"  # not what the first replica stored
    assert confirm(core, second, 9, STORED) == "ok"
    assert commit(core, keys, []) == ["published"]
    (loc,) = lookup(core, groups(1)).objects
    assert loc.checksum == STORED and len(loc.replicas) == 2


def test_a_receipt_after_a_confirm_must_match_what_the_confirm_gave() -> None:
    core, keys = setup(segments=2)
    first, second = begin(core, keys, replicas=2)
    assert confirm(core, first, 7, STORED) == "ok"
    assert commit(core, keys, [stored_receipt(second, 9, OTHER)]) == ["degraded"]
    assert core.counters["receipt_invalid_total"] == 1
    (loc,) = lookup(core, groups(1)).objects
    assert loc.checksum == STORED and [r.slot for r in loc.replicas] == [7]


def test_a_confirm_without_a_whole_checksum_is_a_mismatch() -> None:
    core, keys = setup()
    (ticket,) = begin(core, keys)
    assert confirm(core, ticket, 7, b"") == "mismatch"
    assert commit(core, keys, []) == ["missing"]


def test_a_checksum_of_another_length_is_refused_at_put_begin() -> None:
    core, keys = setup()
    spec = m.ObjectSpec(key=keys[0], size_bytes=4096, checksum=b"\1" * 8)
    with pytest.raises(BadRequest, match="16 bytes"):
        core.handle(m.PutBegin(writer_id="w1", request_id="r1", objects=[spec], write_ttl_ms=WRITE_TTL_MS), 0)
