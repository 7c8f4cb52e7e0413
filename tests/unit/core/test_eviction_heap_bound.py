"""Every hit pushes a heap entry; the heap policies (lru, gdsf, lru2, reuse) compacted their
heap only inside an eviction pass, so with hits and no pool pressed it grew by one entry a hit
(200,000 hits on 1,000 objects: 201,000 entries) and the next pass popped them all (1.6 s at
850,000; review, stop 67). Now a push past the bound compacts, as density's class heaps did."""

from __future__ import annotations

import pytest

from kvfabric.core.eviction import EvictionConfig, EvictionCore
from kvfabric.core.eviction_model import PolicyName
from kvfabric.core.eviction_ranking import HEAP_ENTRIES_PER_OBJECT, HEAP_ENTRIES_SLACK


@pytest.mark.parametrize("policy", ["lru", "gdsf", "lru2", "reuse"])
def test_a_heap_policys_heap_stays_bounded_without_evictions(policy: PolicyName) -> None:
    core = EvictionCore(EvictionConfig(policy=policy, high_watermark=1.0, low_watermark=0.75, batch_max=64))
    core.set_capacity("p", 1 << 30)  # never pressed: no pass ever runs
    for i in range(100):
        core.insert(
            f"o{i}", tenant="t", pool="p", size=1, parent=None, chunk_index=0, now_ms=0, prompt_chunks=1
        )
    bound = HEAP_ENTRIES_PER_OBJECT * 100 + HEAP_ENTRIES_SLACK
    for t in range(1, 20_001):
        core.access(f"o{t % 100}", t)
        assert len(core._heap) <= bound
    core.check_invariants()
    core.set_capacity("p", 50)  # now pressed: a pass examines live leaves, not 20,000 stale entries
    batches = core.tick(30_000)
    assert batches and core.counters["candidates_examined_total"] <= bound
