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
