"""`EvictionCore.drop_pool` (a segment lost): the objects left with no pool are removed and
returned, the others keep their other pools and are listed in `kept` when asked (the policy's
records drop the pool from those only, not from every record); a pool no object was ever in
costs no walk and returns nothing."""

from __future__ import annotations

from kvfabric.core.eviction import EvictionCore
from kvfabric.core.eviction_model import EvictionConfig


def core_with_three_objects() -> EvictionCore:
    core = EvictionCore(EvictionConfig())
    for pool in ("s1", "s2"):
        core.set_capacity(pool, 1_000)
    core.insert("a", tenant="t", pool="s1", size=10, parent=None, chunk_index=0, now_ms=1)
    core.insert("b", tenant="t", pools={"s1": 10, "s2": 10}, parent=None, chunk_index=0, now_ms=1)
    core.insert("c", tenant="t", pool="s2", size=10, parent=None, chunk_index=0, now_ms=1)
    return core


def test_the_objects_kept_are_listed_and_lose_only_that_pool() -> None:
    core = core_with_three_objects()
    kept: list[object] = []
    assert core.drop_pool("s1", kept) == ["a"]
    assert kept == ["b"] and "a" not in core and "b" in core and "c" in core
    assert core.used_bytes("s1") == 0 and core.used_bytes("s2") == 20 and core.tenant_bytes("t") == 20
    assert core.drop_pool("s2") == ["b", "c"] and len(core) == 0
    core.check_invariants()


def test_a_pool_no_object_was_in_drops_nothing() -> None:
    core = core_with_three_objects()
    kept: list[object] = []
    assert core.drop_pool("s1#ssd", kept) == [] and kept == [] and len(core) == 3
    assert core.counters["pools_dropped_total"] == 1
    core.check_invariants()


def test_a_victim_under_way_lost_with_its_segment_is_not_counted_evicted() -> None:
    """A victim chosen, then lost with its segment before the directory's answer, was counted
    `evicted` (and raised gdsf's clock; review, stop 67): now `evicting_lost`."""
    core = EvictionCore(EvictionConfig(high_watermark=0.5, low_watermark=0.25))
    core.set_capacity("s1", 100)
    for i in range(6):
        core.insert(f"o{i}", tenant="t", pool="s1", size=10, parent=None, chunk_index=0, now_ms=i)
    assert core.tick(10)  # over its high watermark: victims chosen, under way
    assert core.drop_pool("s1")
    assert core.counters.get("evicted_total", 0) == 0 and core.counters["evicting_lost_total"] >= 1
    core.check_invariants()
