"""Two tiers in the eviction policy: the demote-or-drop rule, the disk pool's capacity, and the
shell's bookkeeping when a group moves from a segment's arena pool to its disk pool."""

from __future__ import annotations

from kvfabric.core.eviction import EvictBatch
from kvfabric.eviction_policy.tiers import demote_or_drop, is_ssd_pool, ssd_pool, ssd_pool_capacity
from kvfabric.proto import directory as m
from tests.unit.eviction_policy.test_shell import A, chain, published, shell


def test_demote_or_drop_by_hits() -> None:
    assert demote_or_drop(0, 0) == "demote"  # 0: every arena victim goes to disk
    assert demote_or_drop(0, 1) == "drop"
    assert demote_or_drop(3, 2) == "demote"


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
