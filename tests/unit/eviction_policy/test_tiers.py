"""Two tiers in the eviction policy: the demote-or-drop rule, the disk pool's capacity, and the
shell's bookkeeping when a group moves from a segment's arena pool to its disk pool."""

from __future__ import annotations

import msgspec

from kvfabric.core.eviction import EvictBatch
from kvfabric.eviction_policy.shell import EvictionShell, _disk_bytes_after_copy
from kvfabric.eviction_policy.tiers import (
    demote_or_drop,
    is_ssd_pool,
    on_disk_whole,
    ssd_pool,
    ssd_pool_capacity,
    tiered_pools,
)
from kvfabric.format.ids import ObjectKey
from kvfabric.proto import directory as m
from kvfabric.proto.segment import SSD_SLOT_BASE
from tests.unit.eviction_policy.test_shell import A, chain, published, shell


def test_demote_or_drop_by_hits() -> None:
    assert demote_or_drop(0, 0) == "demote"  # 0: every arena victim goes to disk
    assert demote_or_drop(0, 1) == "drop"
    assert demote_or_drop(3, 2) == "demote"


def test_a_published_group_s_pools_by_tier() -> None:
    assert tiered_pools({"s1": 100, "s2": 50}, {"s1": 100}) == {"s1#ssd": 100, "s2": 50}
    assert tiered_pools({"s1": 150}, {"s1": 50}) == {"s1": 100, "s1#ssd": 50}


def test_a_republished_group_moves_pools_and_an_adopted_one_lands_in_the_disk_pool() -> None:
    sh = shell()
    sh.apply(published(1, s1=30), 1)
    sh.apply(m.GroupsAccessed(groups=[m.GroupHits(chain(1), 2, A)]), 2)
    moved = msgspec.structs.replace(published(1, s1=30), disk_placements=[m.SegmentBytes("s1", 30)])
    sh.apply(moved, 3)  # the directory dropped its arena replica after a demotion
    assert sh.core.used_bytes("s1") == 0 and sh.core.used_bytes("s1#ssd") == 30
    assert sh._hits == {A + chain(1): 2}  # the same group: its history stays
    sh.apply(moved, 4)  # again (a replay): nothing changes
    assert sh.core.used_bytes("s1#ssd") == 30 and len(sh.core) == 1
    adopted = msgspec.structs.replace(published(2, s1=40), disk_placements=[m.SegmentBytes("s1", 40)])
    sh.apply(adopted, 5)  # a restarted cluster's rebuild adopted it from disk
    assert sh.core.used_bytes("s1#ssd") == 70 and sh.core.used_bytes("s1") == 0


def test_a_head_copied_to_disk_republished_keeps_its_rank_in_the_arena_pool() -> None:
    """The directory publishes a copied head again on the copy's confirm (its arena replica
    kept): the group gains the disk pool and nothing else moves — its place in the arena
    pool's order included (a re-insert would make the oldest group the newest)."""
    sh = shell()
    sh.apply(m.SegmentUp(segment_id="s1", incarnation=1, capacity_bytes=100), 0)
    sh.apply(published(1, s1=20), 1)
    sh.apply(published(2, s1=20), 2)
    copied = msgspec.structs.replace(
        published(1, s1=40), disk_placements=[m.SegmentBytes("s1", 20)]
    )  # both replicas on s1, one on its disk
    sh.apply(copied, 3)
    assert sh.core.used_bytes("s1") == 40 and sh.core.used_bytes("s1#ssd") == 20
    assert sh._held[A + chain(1)][2] == {"s1": 20, "s1#ssd": 20}
    sh._copied(A + chain(1), "s1", 20)  # the policy's own outcome after the event: no change
    assert sh.core.used_bytes("s1#ssd") == 20
    sh.apply(published(3, s1=20), 4)  # 60 > 50 % of 100: the arena pool's victims, oldest first
    (batch,) = [b for b in sh.core.tick(5) if isinstance(b, EvictBatch) and b.pool == "s1"]
    assert batch.victims[0] == A + chain(1)


def test_a_copied_heads_republish_that_shows_an_unannounced_arena_copy_keeps_its_rank() -> None:
    """A prefetch's arena copy is never announced; the copy's republish then shows it too: the
    group gains both pools, its rank kept."""
    sh = shell()
    sh.apply(m.SegmentUp(segment_id="s1", incarnation=1, capacity_bytes=100), 0)
    sh.apply(m.SegmentUp(segment_id="s2", incarnation=1, capacity_bytes=1000), 0)
    sh.apply(published(1, s1=20), 1)
    sh.apply(published(2, s1=20), 2)
    copied = msgspec.structs.replace(published(1, s1=40, s2=20), disk_placements=[m.SegmentBytes("s1", 20)])
    sh.apply(copied, 3)
    assert sh._held[A + chain(1)][2] == {"s1": 20, "s2": 20, "s1#ssd": 20}
    assert sh.core.used_bytes("s2") == 20 and sh.core.used_bytes("s1#ssd") == 20
    sh.apply(published(3, s1=20), 4)
    (batch,) = [b for b in sh.core.tick(5) if isinstance(b, EvictBatch) and b.pool == "s1"]
    assert batch.victims[0] == A + chain(1)


def test_a_tail_on_disk_given_an_arena_copy_again_takes_its_parent_back() -> None:
    """A tail on disk only has no parent in the core (`_core_parent`); a republish that adds an
    arena pool to it (a promotion, a rebuild) is a move, not an addition: its parent comes back,
    so its head is no arena victim before it (review of 5301453)."""
    sh = shell()
    sh.apply(m.SegmentUp(segment_id="s1", incarnation=1, capacity_bytes=100), 0)
    sh.apply(published(1, s1=20), 1)
    sh.apply(published(2, parent=1, s1=20), 2)
    tail = A + chain(2)
    on_disk = msgspec.structs.replace(
        published(2, parent=1, s1=20), disk_placements=[m.SegmentBytes("s1", 20)]
    )
    sh.apply(on_disk, 3)  # demoted
    both = msgspec.structs.replace(published(2, parent=1, s1=40), disk_placements=[m.SegmentBytes("s1", 20)])
    sh.apply(both, 4)  # an arena copy again
    assert sh._held[tail][2] == {"s1": 20, "s1#ssd": 20}
    sh.apply(published(3, s1=20), 5)
    sh.apply(published(4, s1=20), 6)  # 80 > 50 % of 100: the arena pool's victims
    (batch,) = [b for b in sh.core.tick(7) if isinstance(b, EvictBatch) and b.pool == "s1"]
    assert batch.victims.index(tail) < batch.victims.index(A + chain(1))


def test_disk_pools_and_their_watermark() -> None:
    assert ssd_pool("s1") == "s1#ssd" and is_ssd_pool("s1#ssd") and not is_ssd_pool("s1")
    # the core's high watermark (0.5) of this capacity is 90 % of the disk's bytes
    assert ssd_pool_capacity(1_000, 0.9, 0.5) * 0.5 == 900


def test_a_demoted_group_moves_to_the_disk_pool_and_its_victims_are_dropped() -> None:
    sh = shell()
    sh.apply(m.SegmentUp(segment_id="s1", incarnation=1, capacity_bytes=100), 0)
    sh.apply(published(1, s1=30), 1)
    sh.apply(published(2, s1=30), 2)
    sh.apply(m.GroupsAccessed(groups=[m.GroupHits(chain(2), 3, A)]), 3)
    assert sh._hits == {A + chain(2): 3}
    (batch,) = sh.core.tick(4)
    assert isinstance(batch, EvictBatch) and batch.pool == "s1"
    sh._moved(A + chain(1), "s1", 4)
    assert sh.core.used_bytes("s1") == 30 and sh.core.used_bytes("s1#ssd") == 30
    assert not sh.core.is_evicting(A + chain(1))  # resident again, in its new pool
    sh.core.set_capacity("s1#ssd", 40)  # 30 > 50 % of 40: the disk pool's own victims
    batches = [b for b in sh.core.tick(5) if isinstance(b, EvictBatch)]
    assert [(b.pool, b.victims) for b in batches] == [("s1#ssd", (A + chain(1),))]
    sh.apply(m.SegmentDown(segment_id="s1", incarnation=1, reason="heartbeat_timeout"), 6)
    assert len(sh.core) == 0 and not sh._held and not sh._hits


def test_a_tier_move_is_no_eviction_and_keeps_the_groups_rank() -> None:
    """A demotion (`_moved`), a disk copy dropped (`_disk_dropped`) and a republish that moves a
    group are the same group in other pools: `evicted_total` and `inserts_total` do not move
    (a demotion counted as an eviction inflated the metric), and its recency stays, so a group
    read before a newer one is still the older one's victim order (a re-insert made the moved
    group the newest)."""
    sh = shell()
    sh.apply(m.SegmentUp(segment_id="s1", incarnation=1, capacity_bytes=1000), 0)
    sh.apply(published(1, s1=30), 1)
    sh.apply(published(2, s1=30), 2)
    sh.apply(published(3, s1=30), 3)
    before = dict(sh.core.counters)
    moved = msgspec.structs.replace(published(3, s1=30), disk_placements=[m.SegmentBytes("s1", 30)])
    sh.apply(moved, 10)  # a republish: demoted by an earlier policy
    sh.core.set_capacity("s1", 100)  # 60 > 50 %: chain 1 is the arena's victim
    (batch,) = [b for b in sh.core.tick(11) if isinstance(b, EvictBatch)]
    assert batch.pool == "s1" and batch.victims[0] == A + chain(1)
    sh.core.set_capacity("s1", 1000)
    sh._moved(A + chain(1), "s1", 11)  # the victim demoted after chain 3: still last read at t=1
    assert not sh.core.is_evicting(A + chain(1))
    sh._copied(A + chain(2), "s1", 30)
    sh._disk_dropped(A + chain(2), 12)  # its disk copy dropped, its arena replica kept
    assert sh.core.counters.get("evicted_total", 0) == before.get("evicted_total", 0)
    assert sh.core.counters["inserts_total"] == before["inserts_total"] == 3
    assert sh.core.counters["retiered_total"] == 3
    assert sh._held[A + chain(1)][2] == {"s1#ssd": 30} and sh._held[A + chain(2)][2] == {"s1": 30}
    sh.core.set_capacity("s1#ssd", 100)  # 60 > 50 %: the disk pool's victims, by their reads
    (batch,) = [b for b in sh.core.tick(13) if isinstance(b, EvictBatch) and b.pool == "s1#ssd"]
    assert batch.victims[0] == A + chain(1)  # read at 1, before chain 3 (read at 3)


def test_a_dropped_head_takes_its_tails_on_disk_with_it() -> None:
    """A tail moved to a disk pool lost its parent in the core; the shell drops it before its
    head (no lookup could find it without the head)."""
    sh = shell()
    sh.apply(m.SegmentUp(segment_id="s1", incarnation=1, capacity_bytes=1000), 0)
    sh.apply(published(1, s1=30), 1)
    sh.apply(published(2, parent=1, s1=30), 2)
    sh.apply(published(3, parent=2, s1=30), 3)
    sh._moved(A + chain(3), "s1", 4)
    sh._moved(A + chain(2), "s1", 5)
    assert sh._with_disk_tails([A + chain(1)]) == [A + chain(3), A + chain(2), A + chain(1)]
    assert sh.demotions == {"tails_dropped": 2}
    sh.apply(m.GroupEvicted(group=chain(3), reason="policy", domain=A), 6)
    assert sh._with_disk_tails([A + chain(1)]) == [A + chain(2), A + chain(1)]
    assert sh._children == {A + chain(1): {A + chain(2)}}


def test_a_partially_demoted_head_is_no_head_on_disk() -> None:
    """A group whose disk pools hold part of its bytes (a demote request that moved one member
    and failed for the other; a rebuild after a kill mid-demotion) is no whole head on disk: a
    tail demoted under it would be unfindable after a power cycle, so it is copied first. Known
    as on disk before (any disk pool counted)."""
    assert on_disk_whole({"s1#ssd": 20}, 20) and on_disk_whole({"s1": 20, "s1#ssd": 20}, 20)
    assert not on_disk_whole({"s1": 10, "s1#ssd": 10}, 20) and not on_disk_whole({"s1": 20}, 20)
    assert on_disk_whole({"s1": 10, "s1#ssd": 10}, 0)  # a directory too old to say its bytes: as before
    # Two replicas, each partly demoted (the same member moved on both): not whole on any disk.
    assert not on_disk_whole({"s1": 10, "s1#ssd": 10, "s2": 10, "s2#ssd": 10}, 20)
    assert on_disk_whole({"s1#ssd": 20, "s2": 20}, 20)  # one replica moved whole
    sh = shell()
    sh.apply(m.SegmentUp(segment_id="s1", incarnation=1, capacity_bytes=40), 0)
    head = msgspec.structs.replace(
        published(1, s1=20), disk_placements=[m.SegmentBytes("s1", 10)], members=2, group_bytes=20
    )
    sh.apply(head, 1)  # two members of 10 bytes, one on s1's disk only
    sh.apply(published(2, parent=1, s1=20), 2)  # 30 > 50 % of 40: the tail is the arena's victim
    (batch,) = [b for b in sh.core.tick(3) if isinstance(b, EvictBatch)]
    assert A + chain(2) in batch.victims
    heads = sh._ancestors_off_disk([A + chain(2)])
    assert heads.needed == [A + chain(1)] and heads.nearest == {A + chain(2): A + chain(1)}


def _location(size: int, *replicas: tuple[str, int]) -> m.ObjectLocation:
    return m.ObjectLocation(
        chunk_index=0, member=m.Member(0, 0, 0), size_bytes=size, checksum=b"",
        replicas=[m.Replica(segment_id=s, incarnation=1, slot=n, slot_generation=1) for s, n in replicas],
    )  # fmt: skip


def test_a_partial_heads_copy_takes_only_its_members_on_no_disk_and_completes_its_disk_pool() -> None:
    """The copy of a partially demoted head sends only the members on no disk (the moved one has
    no arena replica left, so asking for all of them found no source: `spread`, and the tail went
    to disk without its head); its disk pool then counts the whole group on that segment."""
    on_disk = (ObjectKey(b"k1"), _location(10, ("s1", SSD_SLOT_BASE + 3)))
    in_arena = (ObjectKey(b"k2"), _location(10, ("s1", 4), ("s2", 5)))
    elsewhere = (ObjectKey(b"k3"), _location(10, ("s2", SSD_SLOT_BASE + 6), ("s1", 7)))
    listing = [on_disk, in_arena, elsewhere]
    where = EvictionShell._copy_sources("s1", listing)
    assert where is not None
    seg, objects = where
    assert seg == "s1" and [(o.key, o.slot, o.keep_arena) for o in objects] == [(b"k2", 4, True)]
    assert _disk_bytes_after_copy("s1", listing) == 20  # k1 there already, k2 copied; k3 on s2's disk
    sh = shell()
    head = msgspec.structs.replace(
        published(1, s1=20), disk_placements=[m.SegmentBytes("s1", 10)], members=2, group_bytes=20
    )
    sh.apply(head, 1)
    sh._copied(A + chain(1), "s1", 20)  # the copy's outcome: the disk pool tops up to the group
    assert sh._held[A + chain(1)][2] == {"s1": 10, "s1#ssd": 20}
    assert sh.core.used_bytes("s1#ssd") == 20
    assert sh._ancestors_off_disk([]).needed == []
    assert on_disk_whole(sh._held[A + chain(1)][2], 20)
    sh._copied(A + chain(1), "s1", 20)  # again: known with as many, nothing changes
    assert sh.core.used_bytes("s1#ssd") == 20


def test_a_partial_groups_rest_demoted_counts_its_whole_bytes_on_disk() -> None:
    """`_moved` of a group whose other members a partial demotion moved before adds the bytes
    (the disk pool holds the whole group); of a copied head it counts the same replica once.
    A republish carrying `group_bytes` is kept even when it changes no pool."""
    sh = shell()
    partial = msgspec.structs.replace(
        published(1, s1=20), disk_placements=[m.SegmentBytes("s1", 10)], members=2, group_bytes=20
    )
    sh.apply(partial, 1)
    sh._moved(A + chain(1), "s1", 2)
    assert sh._held[A + chain(1)][2] == {"s1#ssd": 20} and sh.core.used_bytes("s1#ssd") == 20
    copied = msgspec.structs.replace(
        published(2, s1=40), disk_placements=[m.SegmentBytes("s1", 20)], members=2, group_bytes=20
    )
    sh.apply(copied, 3)
    sh._moved(A + chain(2), "s1", 4)
    assert sh._held[A + chain(2)][2] == {"s1#ssd": 20}
    sh.apply(published(3, s1=20), 5)  # an old directory's event: no group bytes
    assert sh._held[A + chain(3)][3] == 0
    sh.apply(msgspec.structs.replace(published(3, s1=20), group_bytes=20), 6)  # the same pools
    assert sh._held[A + chain(3)][3] == 20
