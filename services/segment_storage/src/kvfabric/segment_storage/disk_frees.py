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
(decremented on the loop when each ends, whatever the caller did).
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
        self.pending = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvf-disk-free")

    async def free(self, pairs: Pairs) -> Pairs:
        """The pairs freed (durably) within `wait_s`; none when the disk is busy or late."""
        if not pairs:
            return []
        if self.pending >= self.queued_max:
            self._on_event("disk_free_busy_total")
            return []
        self.pending += 1
        running = asyncio.get_running_loop().run_in_executor(self._pool, self._free, pairs)
        running.add_done_callback(self._ended)
        try:
            return await asyncio.wait_for(asyncio.shield(running), self.wait_s)
        except TimeoutError:  # it goes on; the directory asks again
            self._on_event("disk_free_late_total")
            return []

    def _ended(self, _: object) -> None:
        self.pending -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
