"""The directory's frees of disk-tier slots, on a thread of their own (bounded).

A disk free writes a free record and syncs it before it is answered (a slot the directory
forgets must be free on disk after a crash), so a hung or very slow disk blocks it. They ran on
the default executor with the arena's frees and the reports' disk walks: each free request that
named a disk slot pinned one of its few threads (`min(32, cpus + 4)`), then arena frees queued
behind them and the arena stopped reclaiming space (review, 2026-12-06).

Now: one thread, at most `queued_max` batches on it (running or waiting), each awaited at most
`wait_s`. A batch past either bound is answered with none of its slots freed, so the directory
asks again later (a free that completes meanwhile is then "freed already"); the arena's frees
never wait for the disk.

Invariants: at most one thread; `pending` counts the batches handed to it and not finished
(whatever the caller did); `wait_idle` lets the segment's stop keep the disk tier open while
one runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Final

__all__ = ["DISK_FREES_QUEUED_MAX", "DISK_FREE_WAIT_S", "DiskFrees"]

DISK_FREES_QUEUED_MAX: Final = 4
DISK_FREE_WAIT_S: Final = 5.0  # under the directory's free request timeout: it gets an answer

Pairs = list[tuple[int, int]]


class DiskFrees:
    def __init__(
        self,
        free: Callable[[Pairs], Pairs],
        count: Callable[[str], None],
        *,
        queued_max: int = DISK_FREES_QUEUED_MAX,
        wait_s: float = DISK_FREE_WAIT_S,
    ) -> None:
        self._free = free  # the backend's `free_slots` (durable when it returns)
        self._on_event = count  # the backend's `count` (takes its lock)
        self.queued_max = queued_max
        self.wait_s = wait_s
        self._running: set[concurrent.futures.Future[Pairs]] = set()  # handed to the thread, not ended
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvf-disk-free")

    @property
    def pending(self) -> int:
        return len(self._running)

    async def free(self, pairs: Pairs) -> Pairs:
        """The pairs freed (durably) within `wait_s`; none when the disk is busy or late."""
        if not pairs:
            return []
        if self.pending >= self.queued_max:
            self._on_event("disk_free_busy_total")
            return []
        running = self._pool.submit(self._free, pairs)
        self._running.add(running)
        running.add_done_callback(self._running.discard)
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(running)), self.wait_s)
        except TimeoutError:  # it goes on; the directory asks again
            self._on_event("disk_free_late_total")
            return []

    def wait_idle(self, timeout_s: float) -> bool:
        """Blocks until no free runs (at most `timeout_s`): the disk tier's files must stay open
        while one may still write or sync them (review, 2026-12-06). Whether it is idle."""
        _, running = concurrent.futures.wait(list(self._running), timeout_s)
        return not running

    def close(self) -> None:
        """No more frees (those waiting are dropped: the directory asks the next incarnation)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
