"""`EvictionCore.tenants()` is read by the eviction policy's metrics thread (`EvictionCollector`
→ `EvictionShell.status()`) while the event loop inserts groups of new tenants: walking the live
tenants dict in Python then raised "dictionary changed size during iteration" (a failed scrape;
1,398 of 2,032 scrapes in a stress run with the walk of before). It copies the dict whole first."""

from __future__ import annotations

import sys
import threading

from kvfabric.core.eviction import EvictionConfig, EvictionCore


def test_tenants_can_be_read_while_the_loop_adds_tenants() -> None:
    core = EvictionCore(EvictionConfig(policy="lru"))
    core.set_capacity("s1", 1 << 40)
    errors: list[BaseException] = []
    reads = 0
    done = threading.Event()

    def scrape() -> None:
        nonlocal reads
        while not done.is_set():
            try:
                core.tenants()
                reads += 1
            except RuntimeError as exc:
                errors.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        for i in range(5_000):
            core.insert(i, tenant=i, pool="s1", size=1, parent=None, chunk_index=0, now_ms=i)
    finally:
        done.set()
        scraper.join(10)
        sys.setswitchinterval(interval)
    assert reads > 0 and not errors, errors[:1]
    assert len(core.tenants()) == 5_000
