"""The directory core with replicas in a segment's disk tier (slot ids from SSD_SLOT_BASE): a
rebuild adopts them like arena replicas, lookups return them (the slot says the tier), and they
reserve none of the segment's arena bytes, so placement and the reservation invariant count the
arena alone; evicting one frees its disk slot."""

from __future__ import annotations

from kvfabric.core.directory import EmitEvent, FreeSlots
from kvfabric.core.directory.rebuild import SegmentHolding
from kvfabric.proto import directory as m
from kvfabric.proto.segment import SSD_SLOT_BASE, HeldObject, tier_of_slot
from tests.unit.core.dirkit import groups, key, lookup, new_core, put

CAPACITY = 10_000


def test_disk_replicas_are_adopted_served_and_reserve_no_arena_bytes() -> None:
    core = new_core(lease_ttl_ms_max=500)
    g_dram, g_disk = groups(2)
    registration = m.RegisterSegment(
        segment_id="s1",
        incarnation=7,
        capacity_bytes=CAPACITY,
        domain=m.FailureDomain(host="s1"),
        data_addr="tcp://s1",
        disk_objects=1,
    )
    digest = b"g" * 16
    held = [
        HeldObject(key(g_dram), 1, 3, 100, digest),
        HeldObject(key(g_disk), SSD_SLOT_BASE + 2, 5, 50_000, digest),  # 5x the arena: on disk
    ]
    (republished,) = core.adopt([SegmentHolding(registration, held)], now_ms=1_000)
    core.check_invariants()
    # the group with a disk replica is published again with its disk share (the policy's pools)
    assert isinstance(republished, EmitEvent) and isinstance(republished.event, m.GroupPublished)
    assert republished.event.group == g_disk.chain_hash
    assert republished.event.placements == republished.event.disk_placements == [m.SegmentBytes("s1", 50_000)]
    (seg,) = core.segments.values()
    assert seg.reserved_bytes == 100  # the arena replica only

    hit = lookup(core, [g_dram, g_disk], now=1_000)
    assert hit.hit_chunks == 2
    tiers = [(r.slot, tier_of_slot(r.slot)) for obj in hit.objects for r in obj.replicas]
    assert tiers == [(1, "dram"), (SSD_SLOT_BASE + 2, "ssd")]
    core.handle(m.LeaseRelease(holder_id="reader", lease_id=hit.lease_id), 1_000)

    # The arena has room for new writes: the disk replica's 50,000 bytes do not count there.
    (g_new,) = groups(1, seed=9)
    put(core, [key(g_new)], now=1_000, size=9_000)
    assert seg.reserved_bytes == 9_100
    core.check_invariants()

    # Evicting the disk-resident group frees its disk slot (after the grace period) and gives
    # nothing back to the arena's reservation when the segment confirms the free.
    core.handle(m.Evict(groups=[g_disk.group_id()]), 1_100)
    frees = [e for e in core.tick(1_500) if isinstance(e, FreeSlots)]
    assert [(f.segment_id, s.slot) for f in frees for s in f.slots] == [("s1", SSD_SLOT_BASE + 2)]
    core.handle(
        m.SlotsFreed(segment_id="s1", incarnation=7, freed=[m.FreedSlot(key(g_disk), SSD_SLOT_BASE + 2, 5)]),
        1_600,
    )
    assert seg.reserved_bytes == 9_100
    core.check_invariants()
