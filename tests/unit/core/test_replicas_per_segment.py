"""A replica target counts segments, not replicas: an arena replica and a disk replica on the
same segment (a head copied to disk keeps its arena copy; a promotion adds an arena copy next to
the disk one) protect against nothing more than one. Review, 2026-12-06: they counted as two, so
a group left on one segment met a target of 2 and was neither degraded nor reported
under-replicated (repair never came), and a group already short left `short` once its own
segment copied it to disk."""

from __future__ import annotations

from kvfabric.core.directory import DirectoryCore, EmitEvent
from kvfabric.format.ids import ObjectKey
from kvfabric.proto import directory as m
from kvfabric.proto.segment import SSD_SLOT_BASE

from .dirkit import groups, key, new_core, put, register


def copy_to_own_disk(core: DirectoryCore, k: ObjectKey, segment: str, now: int) -> None:
    """`segment` copies its replica of `k` to its disk tier, keeping the arena one."""
    begun = core.handle(
        m.ReplicateBeginMany(
            writer_id=f"demote:{segment}",
            segment_id=segment,
            items=[m.ReplicateItem(key=k, request_id="rb", keep_source=True)],
            tier="ssd",
        ),
        now,
    ).reply
    assert isinstance(begun, m.ReplicateBeginManyReply)
    ticket = begun.replies[0].ticket
    assert ticket is not None
    confirmed = core.handle(
        m.ConfirmReplicas(
            segment_id=segment,
            incarnation=1,
            confirms=[
                m.ReplicaConfirm(
                    ticket_id=ticket.ticket_id,
                    key=k,
                    slot=SSD_SLOT_BASE + 1,
                    slot_generation=1,
                    size_bytes=ticket.size_bytes,
                    checksum=ticket.checksum,
                )
            ],
        ),
        now,
    ).reply
    assert isinstance(confirmed, m.ConfirmReply) and confirmed.results[0].status == "ok"


def test_losing_the_other_segment_leaves_an_arena_and_disk_pair_under_replicated() -> None:
    core = new_core(replicas_default=2)
    register(core, "s1", host="h1")
    register(core, "s2", host="h2")
    (g,) = groups(1)
    k = key(g)
    put(core, [k])
    copy_to_own_disk(core, k, "s1", now=10)
    events = []
    for now in range(1_000, 12_001, 1_000):  # s1 heartbeats, s2 stays silent past the timeout
        core.handle(m.Heartbeat(segment_id="s1", incarnation=1, used_bytes=100), now)
        events += [e.event for e in core.tick(now) if isinstance(e, EmitEvent)]
    assert not core.segments["s2"].up
    found = core.published_table.published_member(k)
    assert found is not None and len(found[2].replicas) == 2  # both on s1
    assert any(isinstance(e, m.GroupUnderReplicated) for e in events)
    assert found[1].degraded
    core.check_invariants()


def test_a_short_group_stays_short_after_its_own_segment_copies_it_to_disk() -> None:
    core = new_core(replicas_default=2)
    register(core, "s1", host="h1")  # the only segment: one replica, below the target of 2
    (g,) = groups(1)
    k = key(g)
    put(core, [k])
    table = core.published_table
    (gid,) = table.records
    assert gid in table.short
    copy_to_own_disk(core, k, "s1", now=10)
    assert gid in table.short
    core.check_invariants()
