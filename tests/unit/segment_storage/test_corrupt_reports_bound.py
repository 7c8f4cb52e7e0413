"""Reports of disk reads found corrupt (or unreadable) are bounded in flight (review, 2026-12-06):
each started its own report task with retries; a failing device read across its objects started
one per object at once, unbounded. Past `CORRUPT_REPORTS_INFLIGHT_MAX` a report is counted
`replica_corrupt_unreported` (the slot is freed locally already)."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from typing import Any, cast

from kvfabric.runtime.logs import get_logger
from kvfabric.segment_storage.shell_repair import CORRUPT_REPORTS_INFLIGHT_MAX, ShellRepair


class Backend:
    def __init__(self) -> None:
        self.counters: Counter[str] = Counter()

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] += n


class Shell:
    """What `_disk_read_corrupt` uses: its loop, a log, the backend's counters, the semaphore,
    and a report that never finishes (a directory that never answers)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._log = get_logger("test")
        self.backend = Backend()
        self._corrupt_reports = threading.BoundedSemaphore(CORRUPT_REPORTS_INFLIGHT_MAX)
        self.running = 0
        self.running_max = 0

    async def _report_corrupt(self, found: Any) -> None:
        self.running += 1
        self.running_max = max(self.running_max, self.running)
        try:
            await asyncio.sleep(3600)
        finally:
            self.running -= 1

    _report_corrupt_then_release = ShellRepair._report_corrupt_then_release


async def test_a_failing_device_starts_at_most_the_bound_of_reports() -> None:
    shell = Shell(asyncio.get_running_loop())

    def reads() -> None:  # a transport thread: 1,000 objects found unreadable
        for slot in range(1000):
            ShellRepair._disk_read_corrupt(cast(Any, shell), b"k%d" % slot, (1 << 40) + slot, 1, 4096)

    await asyncio.to_thread(reads)
    await asyncio.sleep(0.1)
    assert shell.running_max == CORRUPT_REPORTS_INFLIGHT_MAX
    assert shell.backend.counters["replica_corrupt_unreported_total"] == 1000 - CORRUPT_REPORTS_INFLIGHT_MAX
    for task in asyncio.all_tasks() - {asyncio.current_task()}:
        task.cancel()
    await asyncio.sleep(0.05)
    assert shell._corrupt_reports.acquire(blocking=False)  # cancelled reports gave their slots back
