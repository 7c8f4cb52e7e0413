"""Write receipts in put_commit (issue 20): a segment-signed receipt confirms its replica at commit,
and nothing else does — a forged, moved or foreign receipt publishes nothing."""

from __future__ import annotations

import msgspec
import pytest

from kvfabric.core.directory import DirectoryCore
from kvfabric.format.errors import BatchTooLarge
from kvfabric.format.ids import ObjectKey
from kvfabric.proto import directory as m
from kvfabric.proto.tickets import write_receipt
from tests.unit.core.dirkit import SECRET, groups, key, lookup, new_core, register, spec

WRITE_TTL_MS = 2_000  # below the heartbeat timeout: the segment stays up


def begin(
    core: DirectoryCore, keys: list[ObjectKey], writer: str = "w1", rid: str = "r1"
) -> list[m.WriteTicket]:
    reply = core.handle(
        m.PutBegin(
            writer_id=writer, request_id=rid, objects=[spec(k) for k in keys], write_ttl_ms=WRITE_TTL_MS
        ),
        0,
    ).reply
    assert isinstance(reply, m.PutBeginReply)
    assert all(r.status == "placed" for r in reply.results)
    return [t for r in reply.results for t in r.tickets]


def receipt(t: m.WriteTicket, slot: int, gen: int = 1, secret: bytes = SECRET) -> m.WriteReceipt:
    return m.WriteReceipt(t.ticket_id, slot, gen, write_receipt(secret, t, slot, gen))


def commit(
    core: DirectoryCore, keys: list[ObjectKey], receipts: list[m.WriteReceipt], writer: str = "w1"
) -> list[str]:
    reply = core.handle(m.PutCommit(writer_id=writer, request_id="c", keys=keys, receipts=receipts), 1).reply
    assert isinstance(reply, m.PutCommitReply)
    core.check_invariants()
    return [r.status for r in reply.results]


def confirm(core: DirectoryCore, t: m.WriteTicket, slot: int, gen: int = 1) -> str:
    reply = core.handle(
        m.ConfirmReplicas(
            segment_id=t.segment_id,
            incarnation=t.incarnation,
            confirms=[
                m.ReplicaConfirm(
                    ticket_id=t.ticket_id,
                    key=t.key,
                    slot=slot,
                    slot_generation=gen,
                    size_bytes=t.size_bytes,
                    checksum=t.checksum,
                )
            ],
        ),
        1,
    ).reply
    assert isinstance(reply, m.ConfirmReply)
    return reply.results[0].status


def setup(n: int = 2) -> tuple[DirectoryCore, list[ObjectKey], list[m.WriteTicket]]:
    core = new_core()
    register(core, "s1")
    gs = groups(n)
    keys = [key(g) for g in gs]
    return core, keys, begin(core, keys)


def test_receipts_publish_without_a_segment_confirm() -> None:
    core, keys, tickets = setup()
    assert commit(core, keys, [receipt(t, slot=7 + i) for i, t in enumerate(tickets)]) == ["published"] * 2
    hit = lookup(core, groups(2))
    assert [loc.replicas[0].slot for loc in hit.objects] == [7, 8]
    # the segment's background confirm of the same slot afterwards: ok (published), not freed
    assert confirm(core, tickets[0], slot=7) == "ok"
    assert core.counters["receipts_applied_total"] == 2


def test_a_commit_without_receipts_or_confirms_is_missing() -> None:
    core, keys, _ = setup()
    assert commit(core, keys, []) == ["missing", "missing"]


def test_forged_receipt_publishes_nothing() -> None:
    core, keys, tickets = setup(1)
    forged = [
        m.WriteReceipt(tickets[0].ticket_id, 7, 1, b"\0" * 16),  # no secret
        receipt(tickets[0], 7, secret=b"another-cluster-secret-0123456"),  # another cluster's
    ]
    for r in forged:
        assert commit(core, keys, [r]) == ["missing"]
    assert core.counters["receipt_invalid_total"] == 2
    assert lookup(core, groups(1)).hit_chunks == 0


def test_receipt_moved_to_another_slot_or_object_is_refused() -> None:
    core, keys, tickets = setup()
    good = receipt(tickets[0], 7)
    moved_slot = m.WriteReceipt(good.ticket_id, 8, 1, good.mac)
    moved_gen = m.WriteReceipt(good.ticket_id, 7, 2, good.mac)
    moved_ticket = m.WriteReceipt(tickets[1].ticket_id, 7, 1, good.mac)  # the other object's ticket
    assert commit(core, keys, [moved_slot, moved_gen, moved_ticket]) == ["missing", "missing"]
    assert core.counters["receipt_invalid_total"] == 3


def test_receipt_for_a_ticket_of_other_bytes_is_refused() -> None:
    """A receipt over a ticket whose size or checksum differ from the directory's record (the
    segment stored other bytes) confirms nothing."""
    core, keys, tickets = setup(1)
    other = msgspec.structs.replace(tickets[0], checksum=b"\1" * 16)
    r = m.WriteReceipt(tickets[0].ticket_id, 7, 1, write_receipt(SECRET, other, 7, 1))
    assert commit(core, keys, [r]) == ["missing"]


def test_another_writers_receipt_confirms_nothing() -> None:
    core, keys, tickets = setup(1)
    assert commit(core, keys, [receipt(tickets[0], 7)], writer="w2") == ["not_found"]
    assert core.counters["receipt_refused_total"] == 1
    assert commit(core, keys, []) == ["missing"]  # the holder's commit: still nothing confirmed


def test_first_confirm_names_the_slot() -> None:
    """One ticket, one slot: after a confirm of slot 7, a receipt or a confirm of another slot for
    the same ticket is refused (the segment frees that slot), the same slot again is fine."""
    core, keys, tickets = setup(1)
    assert confirm(core, tickets[0], slot=7) == "ok"
    assert confirm(core, tickets[0], slot=9) == "mismatch"
    assert confirm(core, tickets[0], slot=7) == "ok"
    assert commit(core, keys, [receipt(tickets[0], 9)]) == ["published"]
    assert core.counters["receipt_mismatch_total"] == 1
    hit = lookup(core, groups(1))
    assert hit.objects[0].replicas[0].slot == 7


def test_late_confirm_after_a_receipt_commit_of_an_expired_write_is_unknown() -> None:
    """A receipt whose write expired confirms nothing; the segment's own confirm then gets
    `unknown_ticket` and frees the slot (no leak, nothing published)."""
    core, keys, tickets = setup(1)
    core.tick(WRITE_TTL_MS + 1)
    core.check_invariants()
    assert commit(core, keys, [receipt(tickets[0], 7)]) == ["not_found"]
    assert core.counters["receipt_unknown_ticket_total"] == 1
    assert confirm(core, tickets[0], slot=7) == "unknown_ticket"


def test_receipts_bounded() -> None:
    core, keys, tickets = setup(1)
    r = receipt(tickets[0], 7)
    with pytest.raises(BatchTooLarge):
        core.handle(
            m.PutCommit(
                writer_id="w1", request_id="c", keys=keys, receipts=[r] * (m.PUT_BATCH_OBJECTS_MAX + 1)
            ),
            1,
        )


def test_receipts_are_bounded_by_the_keys_committed_and_must_name_them() -> None:
    """A put_commit is charged by its keys (rate, fair admission): it may carry at most one
    receipt a replica of them (`replicas_max`), and a receipt of a ticket whose key the commit
    does not name confirms nothing. A commit of no key with 4,096 receipts cost the directory
    12-54 ms uncharged (review of stop 33)."""
    core, keys, tickets = setup(2)
    r = receipt(tickets[0], 7)
    with pytest.raises(BatchTooLarge):  # no key: no receipt
        core.handle(m.PutCommit(writer_id="w1", request_id="c", keys=[], receipts=[r]), 1)
    too_many = [r] * (core.config.replicas_max + 1)
    with pytest.raises(BatchTooLarge):
        core.handle(m.PutCommit(writer_id="w1", request_id="c", keys=keys[:1], receipts=too_many), 1)
    # the second key's receipt carried by a commit of the first key only: confirms nothing
    assert commit(core, keys[:1], [receipt(tickets[1], 8), r]) == ["published"]
    assert core.counters["receipt_refused_total"] == 1
    assert commit(core, keys[1:], []) == ["missing"]  # its replica was never confirmed


def test_confirms_bounded() -> None:
    """A confirm is one core call (not run in steps): at most `CONFIRM_BATCH_MAX` replicas a
    request bound its stall of the directory's loop (issue 21; 4,096 were taken before). The
    segments send at most 64."""
    core, _, tickets = setup(1)
    t = tickets[0]
    one = m.ReplicaConfirm(
        ticket_id=t.ticket_id,
        key=t.key,
        slot=7,
        slot_generation=1,
        size_bytes=t.size_bytes,
        checksum=t.checksum,
    )
    with pytest.raises(BatchTooLarge):
        core.handle(
            m.ConfirmReplicas(
                segment_id=t.segment_id, incarnation=t.incarnation, confirms=[one] * (m.CONFIRM_BATCH_MAX + 1)
            ),
            1,
        )
    reply = core.handle(
        m.ConfirmReplicas(
            segment_id=t.segment_id, incarnation=t.incarnation, confirms=[one] * m.CONFIRM_BATCH_MAX
        ),
        1,
    ).reply
    assert isinstance(reply, m.ConfirmReply) and len(reply.results) == m.CONFIRM_BATCH_MAX
    assert m.CONFIRM_BATCH_MAX < m.PUT_BATCH_OBJECTS_MAX
    core.check_invariants()
