"""A member record holds at most `MEMBER_REPLICAS_MAX` (255) replicas. Replica tickets were
checked against it when granted, not when confirmed, and a rebuild adopted every stored copy of
a key: past the bound, packing the record raised InvariantViolation half-way through a confirm
batch, or in every instance adopting the shard, and the directory stopped (review, stop 67; the
copies a tenant can leave with begin / PUT / abort loops). Now a confirm past the bound is
`unknown_ticket` (the segment frees its copy) and a rebuild keeps the rest as orphans."""

from __future__ import annotations

from kvfabric.core.directory import DirectoryConfig, DirectoryCore
from kvfabric.core.directory.rebuild import SegmentHolding
from kvfabric.core.directory.records import MEMBER_REPLICAS_MAX
from kvfabric.proto import directory as m
from kvfabric.proto.segment import HeldObject
from tests.unit.core.dirkit import SECRET, checksum_of, groups, key, new_core, put, register


def test_replica_confirms_past_the_bound_are_refused_not_fatal() -> None:
    core = new_core(replicas_default=1)
    segments = [f"s{i:03d}" for i in range(MEMBER_REPLICAS_MAX + 5)]
    for seg in segments:
        register(core, seg, capacity=10_000)
    k = key(groups(1, seed=71)[0])
    assert put(core, [k]).results[0].status == "published"
    tickets = []
    for i, seg in enumerate(segments):  # every ticket granted before any confirm: room for each
        begun = core.handle(
            m.ReplicateBegin(writer_id="prefetch", request_id=str(i), key=k, segment_id=seg), 1
        ).reply
        if isinstance(begun, m.ReplicateBeginReply) and begun.status == "placed" and begun.ticket:
            tickets.append(begun.ticket)
    assert len(tickets) > MEMBER_REPLICAS_MAX - 1
    statuses = []
    for t in tickets:
        confirm = m.ReplicaConfirm(
            ticket_id=t.ticket_id,
            key=k,
            slot=50,
            slot_generation=1,
            size_bytes=t.size_bytes,
            checksum=t.checksum,
        )
        reply = core.handle(
            m.ConfirmReplicas(segment_id=t.segment_id, incarnation=t.incarnation, confirms=[confirm]), 2
        ).reply
        assert isinstance(reply, m.ConfirmReply)
        statuses.append(reply.results[0].status)
    assert statuses.count("ok") == MEMBER_REPLICAS_MAX - 1  # with the original: the bound
    assert set(statuses[MEMBER_REPLICAS_MAX - 1 :]) == {"unknown_ticket"}
    core.check_invariants()  # the refused tickets' reservations went back


def test_a_rebuild_adopts_at_most_the_bound_and_orphans_the_rest() -> None:
    k = key(groups(1, seed=72)[0])
    reg = m.RegisterSegment(
        segment_id="s1",
        incarnation=1,
        capacity_bytes=1 << 30,
        domain=m.FailureDomain(host="h", rack="r", zone="z"),
        data_addr="tcp://s1",
    )
    held = [HeldObject(k, slot, 1, 100, checksum_of(k)) for slot in range(MEMBER_REPLICAS_MAX + 10)]
    core = DirectoryCore(DirectoryConfig(ticket_secret=SECRET), epoch=2)
    core.adopt([SegmentHolding(reg, held)], now_ms=0)
    shown = core.handle(m.ShowGroup(group=k[:90]), 1).reply
    assert isinstance(shown, m.GroupList)
    assert len(shown.groups[0].objects[0].replicas) == MEMBER_REPLICAS_MAX
    core.check_invariants()
