"""The directory core's part of demotion and promotion (issue 23): one replica per (segment,
tier), so a segment may get a disk replica of an object its arena holds (`ReplicateBegin` with
`tier="ssd"`, confirmed with a disk slot) and the other way round; a disk ticket reserves no
arena bytes; the arena replica is then dropped (`ReplicaCorrupt` reason `demoted`), never while
a lease or pin holds the group and never the last replica. `check_invariants` after each step."""

from __future__ import annotations

import pytest

from kvfabric.core.directory import DirectoryCore, EmitEvent, FreeSlots, Outcome
from kvfabric.format.errors import BadRequest
from kvfabric.format.ids import ObjectKey
from kvfabric.proto import directory as m
from kvfabric.proto.segment import SSD_SLOT_BASE, Tier, tier_of_slot
from tests.unit.core.dirkit import groups, key, lookup, new_core, put, register

DISK_SLOT = SSD_SLOT_BASE + 4


def replicate(core: DirectoryCore, k: ObjectKey, tier: Tier, now: int = 10) -> m.ReplicateBeginReply:
    reply = core.handle(
        m.ReplicateBegin(
            writer_id="demote:s1", request_id=f"rb-{tier}-{now}", key=k, segment_id="s1", tier=tier
        ),
        now,
    ).reply
    assert isinstance(reply, m.ReplicateBeginReply)
    core.check_invariants()
    return reply


def confirm_many(core: DirectoryCore, stored: list[tuple[m.WriteTicket, int]], now: int = 10) -> Outcome:
    """s1 confirms each (ticket, slot) in one request; the invariants hold after it."""
    out = core.handle(
        m.ConfirmReplicas(
            segment_id="s1",
            incarnation=1,
            confirms=[
                m.ReplicaConfirm(
                    ticket_id=t.ticket_id,
                    key=t.key,
                    slot=slot,
                    slot_generation=1,
                    size_bytes=t.size_bytes,
                    checksum=t.checksum,
                )
                for t, slot in stored
            ],
        ),
        now,
    )
    assert isinstance(out.reply, m.ConfirmReply)
    core.check_invariants()
    return out


def confirm(core: DirectoryCore, ticket: m.WriteTicket, slot: int, now: int = 10) -> m.ConfirmStatus:
    reply = confirm_many(core, [(ticket, slot)], now).reply
    assert isinstance(reply, m.ConfirmReply)
    return reply.results[0].status


def drop(core: DirectoryCore, k: ObjectKey, slot: int, now: int = 10) -> tuple[bool, list[FreeSlots]]:
    out = core.handle(
        m.ReplicaCorrupt(
            segment_id="s1", incarnation=1, key=k, slot=slot, slot_generation=1, reason="demoted"
        ),
        now,
    )
    assert isinstance(out.reply, m.ReplicaCorruptReply)
    core.check_invariants()
    return out.reply.dropped, [e for e in out.effects if isinstance(e, FreeSlots)]


def _copy_begin(core: DirectoryCore, k: ObjectKey, tag: str, keep_source: bool = True) -> m.WriteTicket:
    """A disk ticket on s1 for `k` through `replicate_begin_many`, as the demoter asks it."""
    reply = core.handle(
        m.ReplicateBeginMany(
            writer_id="demote:s1",
            segment_id="s1",
            items=[m.ReplicateItem(key=k, request_id=f"rb-{tag}", keep_source=keep_source)],
            tier="ssd",
        ),
        10,
    ).reply
    assert isinstance(reply, m.ReplicateBeginManyReply) and reply.replies[0].ticket is not None
    core.check_invariants()
    return reply.replies[0].ticket


def test_demote_then_promote_an_object_on_its_own_segment() -> None:
    core = new_core()
    register(core, "s1", capacity=1_000)
    (g,) = groups(1)
    k = key(g)
    put(core, [k], size=100)
    seg = core.segments["s1"]
    assert seg.reserved_bytes == 100

    placed = replicate(core, k, "ssd")
    assert placed.status == "placed" and placed.ticket is not None
    assert [r.slot for r in placed.sources] == [0]  # its own arena replica: the bytes to copy
    assert seg.reserved_bytes == 100  # a disk ticket reserves no arena bytes
    assert replicate(core, k, "dram").status == "already_there"  # the arena holds it already
    assert confirm(core, placed.ticket, DISK_SLOT) == "ok"
    again = replicate(core, k, "ssd")
    assert again.status == "already_there"  # one disk replica per segment
    # ... naming the live replicas: the demoting segment checks it still holds the disk one
    assert sorted((r.slot, r.slot_generation) for r in again.sources) == sorted(
        [(0, placed.sources[0].slot_generation), (DISK_SLOT, 1)]
    )

    hit = lookup(core, [g], now=10)
    assert [tier_of_slot(r.slot) for r in hit.objects[0].replicas] == ["dram", "ssd"]
    assert drop(core, k, 0) == (False, [])  # leased: a reader may hold only the arena replica
    core.handle(m.LeaseRelease(holder_id="reader", lease_id=hit.lease_id), 10)

    out = core.handle(
        m.ReplicaCorrupt(segment_id="s1", incarnation=1, key=k, slot=0, slot_generation=1, reason="demoted"),
        10,
    )
    core.check_invariants()
    assert isinstance(out.reply, m.ReplicaCorruptReply) and out.reply.dropped
    frees = [e for e in out.effects if isinstance(e, FreeSlots)]
    assert [(f.segment_id, [s.slot for s in f.slots]) for f in frees] == [("s1", [0])]
    # published again with its bytes on disk now: the eviction policy moves it to the disk pool
    (event,) = [e.event for e in out.effects if isinstance(e, EmitEvent)]
    assert isinstance(event, m.GroupPublished) and event.group == g.chain_hash
    assert event.placements == event.disk_placements == [m.SegmentBytes("s1", 100)]
    core.handle(m.SlotsFreed(segment_id="s1", incarnation=1, freed=[m.FreedSlot(k, 0, 1)]), 11)
    core.check_invariants()
    assert seg.reserved_bytes == 0
    hit = lookup(core, [g], now=12)
    assert [r.slot for r in hit.objects[0].replicas] == [DISK_SLOT]
    core.handle(m.LeaseRelease(holder_id="reader", lease_id=hit.lease_id), 12)
    assert drop(core, k, DISK_SLOT) == (False, [])  # never the last replica

    # Promotion: an arena replica again, reserved like any arena write.
    promoted = replicate(core, k, "dram", now=20)
    assert promoted.status == "placed" and promoted.ticket is not None
    assert [r.slot for r in promoted.sources] == [DISK_SLOT]
    assert seg.reserved_bytes == 100
    assert confirm(core, promoted.ticket, 7, now=20) == "ok"
    hit = lookup(core, [g], now=21)
    assert sorted(r.slot for r in hit.objects[0].replicas) == [7, DISK_SLOT]


def test_a_disk_ticket_confirmed_with_an_arena_slot_is_a_mismatch_and_expiry_releases_it() -> None:
    core = new_core()
    register(core, "s1", capacity=1_000)
    g1, g2 = groups(2)
    put(core, [key(g1), key(g2)], size=100)
    seg = core.segments["s1"]
    placed = replicate(core, key(g1), "ssd")
    assert placed.ticket is not None
    assert confirm(core, placed.ticket, 9) == "mismatch"  # the tier its slot says is not the ticket's
    assert seg.reserved_bytes == 200
    unused = replicate(core, key(g2), "ssd")
    assert unused.status == "placed"
    core.handle(m.Heartbeat(segment_id="s1", incarnation=1, used_bytes=200), 30_000)
    core.tick(10 + 30_001)  # never confirmed: its tenant bytes go back, no arena bytes to give
    core.check_invariants()
    assert seg.reserved_bytes == 200


def test_a_full_arena_does_not_stop_a_disk_ticket() -> None:
    core = new_core()
    register(core, "s1", capacity=100)
    (g,) = groups(1)
    put(core, [key(g)], size=100)
    assert replicate(core, key(g), "ssd").status == "placed"


def test_a_copy_that_keeps_its_source_publishes_its_group_again_on_confirm() -> None:
    """A head copied to disk with its arena replica kept (`keep_source`): no drop follows to
    publish the group again, so the confirm does, once per group of the request; a demotion's
    copy (a drop follows) does not, so a demotion still publishes once, at its drop."""
    core = new_core()
    register(core, "s1", capacity=1_000)
    g_copy, g_demote = groups(2)
    put(core, [key(g_copy), key(g_demote)], size=100)
    tickets = [
        _copy_begin(core, key(g_copy), "copy"),
        _copy_begin(core, key(g_demote), "demote", keep_source=False),
    ]
    out = confirm_many(core, [(t, DISK_SLOT + i) for i, t in enumerate(tickets)], now=11)
    assert isinstance(out.reply, m.ConfirmReply) and [r.status for r in out.reply.results] == ["ok", "ok"]
    (event,) = [e.event for e in out.effects if isinstance(e, EmitEvent)]
    assert isinstance(event, m.GroupPublished) and event.group == g_copy.chain_hash
    # both replicas on s1: 200 bytes there, 100 of them on its disk (the policy's two pools)
    assert event.placements == [m.SegmentBytes("s1", 200)]
    assert event.disk_placements == [m.SegmentBytes("s1", 100)]
    assert event.group_bytes == 100  # one copy (the placement counts both replicas)


def _confirm_events(core: DirectoryCore, ticket: m.WriteTicket, slot: int) -> list[m.GroupPublished]:
    out = confirm_many(core, [(ticket, slot)], now=11)
    assert isinstance(out.reply, m.ConfirmReply) and [r.status for r in out.reply.results] == ["ok"]
    events = [e.event for e in out.effects if isinstance(e, EmitEvent)]
    return [e for e in events if isinstance(e, m.GroupPublished)]


def test_a_kept_source_copy_is_published_again_only_once_every_member_is_on_that_disk() -> None:
    """A group of two members (two TP ranks) copied one member at a time: the first confirm
    leaves the group partly on disk and publishes nothing (a consumer would count a head on
    disk that a power cycle would not bring back whole); the second publishes it, once."""
    core = new_core()
    register(core, "s1", capacity=1_000)
    (g,) = groups(1, tp_size=2)
    first, second = key(g, rank=0), key(g, rank=1)
    put(core, [first, second], size=100)
    assert _confirm_events(core, _copy_begin(core, first, "a"), DISK_SLOT) == []
    (event,) = _confirm_events(core, _copy_begin(core, second, "b"), DISK_SLOT + 1)
    assert event.group == g.chain_hash
    assert event.placements == [m.SegmentBytes("s1", 400)]
    assert event.disk_placements == [m.SegmentBytes("s1", 200)]
    assert event.group_bytes == 200


def test_a_disk_tier_victim_held_in_an_arena_too_loses_only_its_disk_replica() -> None:
    """`evict` with tier "ssd" (a disk pool's victims): a head copied to disk keeps its arena
    replica and stays published (`disk_dropped`, its disk slot freed, published again without
    a disk share); a group on disk only is evicted as ever; a leased one stays whole."""
    core = new_core()
    register(core, "s1", capacity=1_000)
    g_copy, g_disk, g_leased, g_corrupt = groups(4)
    put(core, [key(g_copy), key(g_disk), key(g_leased), key(g_corrupt)], size=100)
    for i, g in enumerate((g_copy, g_leased, g_corrupt)):
        assert _confirm_events(core, _copy_begin(core, key(g), f"c{i}"), DISK_SLOT + i)
    # g_corrupt's disk copy is found corrupt: no disk replica left, no event the policy follows
    core.handle(
        m.ReplicaCorrupt(
            segment_id="s1", incarnation=1, key=key(g_corrupt), slot=DISK_SLOT + 2, slot_generation=1
        ),
        10,
    )
    core.check_invariants()
    demoted = replicate(core, key(g_disk), "ssd")
    assert demoted.ticket is not None and confirm(core, demoted.ticket, DISK_SLOT + 3) == "ok"
    listed = lookup(core, [g_disk], now=10, holder="lister")
    (arena_slot,) = [r.slot for r in listed.objects[0].replicas if tier_of_slot(r.slot) == "dram"]
    core.handle(m.LeaseRelease(holder_id="lister", lease_id=listed.lease_id), 10)
    assert drop(core, key(g_disk), arena_slot)[0]  # g_disk: on disk only now
    lease = lookup(core, [g_leased], now=10, holder="reader-2")
    victims = [g_copy.group_id(), g_disk.group_id(), g_leased.group_id(), g_corrupt.group_id()]
    out = core.handle(m.Evict(groups=victims, tier="ssd"), 12)
    core.check_invariants()
    assert isinstance(out.reply, m.EvictReply)
    assert [r.status for r in out.reply.results] == ["disk_dropped", "evicting", "leased", "disk_dropped"]
    frees = sorted(s.slot for e in out.effects if isinstance(e, FreeSlots) for s in e.slots)
    assert frees == [DISK_SLOT, DISK_SLOT + 3]  # the copy's disk slot and the disk-only group's
    events = [e.event for e in out.effects if isinstance(e, EmitEvent)]
    republished = [e for e in events if isinstance(e, m.GroupPublished)]
    # g_corrupt stays in its arena (nothing to free) and is published again: the policy learns
    assert [e.group for e in republished] == [g_copy.chain_hash, g_corrupt.chain_hash]
    assert all(e.placements == [m.SegmentBytes("s1", 100)] and e.disk_placements == [] for e in republished)
    assert [e.group for e in events if isinstance(e, m.GroupEvicted)] == [g_disk.chain_hash]
    hit = lookup(core, [g_copy], now=13)
    assert [tier_of_slot(r.slot) for r in hit.objects[0].replicas] == ["dram"]  # still readable
    assert lease.objects and hit.objects


def test_an_unreadable_group_is_evicted_whole_under_tier_ssd() -> None:
    """A member whose last replica was found corrupt leaves the group unreadable; that replica
    stays in its record until the sweep, but it is no arena copy to keep: `evict` tier "ssd"
    evicts the group (review of fe59409: it answered disk_dropped and kept it)."""
    core = new_core()
    register(core, "s1", capacity=1_000)
    (g,) = groups(1)
    put(core, [key(g)], size=100)
    assert _confirm_events(core, _copy_begin(core, key(g), "c"), DISK_SLOT)
    for slot in (DISK_SLOT, 0):  # the disk copy, then the arena replica: found corrupt
        core.handle(
            m.ReplicaCorrupt(segment_id="s1", incarnation=1, key=key(g), slot=slot, slot_generation=1), 10
        )
        core.check_invariants()
    out = core.handle(m.Evict(groups=[g.group_id()], tier="ssd"), 11)
    core.check_invariants()
    assert isinstance(out.reply, m.EvictReply) and [r.status for r in out.reply.results] == ["evicting"]


def test_a_group_whose_tail_in_the_same_evict_stays_stays_too() -> None:
    """`Evict.tails` names each group's tails earlier in the request: a head whose tail stays
    (leased) is answered `tail_stays` and kept, up the chain; a malformed list is refused whole."""
    core = new_core()
    register(core, "s1", capacity=1_000)
    head, middle, tail = groups(3)
    put(core, [key(head), key(middle), key(tail)], size=100)
    lookup(core, [tail], now=10, holder="reader")  # leases the tail
    ids = [tail.group_id(), middle.group_id(), head.group_id()]
    with pytest.raises(BadRequest):
        core.handle(m.Evict(groups=ids, tails=[[], [1], [1]]), 11)  # index not earlier
    out = core.handle(m.Evict(groups=ids, tails=[[], [0], [1]]), 11)
    core.check_invariants()
    assert isinstance(out.reply, m.EvictReply)
    assert [r.status for r in out.reply.results] == ["leased", "tail_stays", "tail_stays"]
    assert len(lookup(core, [head, middle, tail], now=12, holder="r2").objects) == 3  # all there
