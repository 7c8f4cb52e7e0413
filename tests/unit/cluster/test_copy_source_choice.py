"""Which replica a copy reads (`kvfabric.cluster.replicas.preferred_replica`): the prefetch core
names a disk replica `<segment>#ssd`, which no replica's segment id equals, so it was never the
one read (a promotion whose arena source failed retried that failing source every time); and a
plain segment id could match that segment's disk replica first (review, stop 70)."""

from __future__ import annotations

from kvfabric.cluster.replicas import DISK_SOURCE_SUFFIX, preferred_replica
from kvfabric.proto import directory as m
from kvfabric.proto.segment import SSD_SLOT_BASE


def replica(segment_id: str, slot: int) -> m.Replica:
    return m.Replica(segment_id=segment_id, incarnation=1, slot=slot, slot_generation=1)


def test_a_disk_source_is_read_from_disk_and_a_segment_from_its_arena() -> None:
    r_arena, t_disk, t_arena = replica("r", 1), replica("t", SSD_SLOT_BASE + 2), replica("t", 3)
    sources = [r_arena, t_disk, t_arena]
    assert preferred_replica(sources, "t" + DISK_SOURCE_SUFFIX) is t_disk
    assert preferred_replica(sources, "t") is t_arena  # its arena replica, not the disk one listed first
    assert preferred_replica([r_arena, t_disk], "t") is t_disk  # the segment's only one
    assert preferred_replica([r_arena, t_arena], "t" + DISK_SOURCE_SUFFIX) is t_arena
    assert preferred_replica(sources, "x") is r_arena and preferred_replica(sources, "") is r_arena
