"""GDSF's clock L rises to each victim's H as it was ranked (Cherkasova's GreedyDual-Size-
Frequency), so it never passes a resident's H. It was set to the victim's priority recomputed
from the clock at removal, one whole term above: after five evictions of ten equal objects the
clock was 2,560 while five residents still ranked at 512, and every new entry was lifted above
every old one (review, stop 67)."""

from __future__ import annotations

from kvfabric.core.eviction import EvictBatch, EvictionConfig, EvictionCore


def test_the_clock_rises_to_the_victims_rank_never_past_a_residents() -> None:
    core = EvictionCore(EvictionConfig(policy="gdsf", high_watermark=0.9, low_watermark=0.8, batch_max=1))
    core.set_capacity("p", 10)
    for i in range(10):
        core.insert(i, tenant="t", pool="p", size=1, parent=None, chunk_index=0, now_ms=i)
    now = 10
    for turn in range(5):
        now += 1
        (batch,) = core.tick(now)
        assert isinstance(batch, EvictBatch)
        (victim,) = batch.victims
        ranked = core._objects[victim].priority
        core.removed(victim)
        assert core._clock == ranked  # L <- H(victim)
        assert core._clock <= min(obj.priority for obj in core._objects.values())
        core.insert(100 + turn, tenant="t", pool="p", size=1, parent=None, chunk_index=0, now_ms=now)
    core.check_invariants()
