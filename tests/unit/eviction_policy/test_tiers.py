"""Two tiers in the eviction policy: the demote-or-drop rule, the disk pool's capacity, and the
shell's bookkeeping when a group moves from a segment's arena pool to its disk pool."""

from __future__ import annotations

import msgspec

from kvfabric.core.eviction import EvictBatch
from kvfabric.eviction_policy.tiers import (
    demote_or_drop,
    is_ssd_pool,
    ssd_pool,
    ssd_pool_capacity,
    tiered_pools,
)
from kvfabric.proto import directory as m
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
