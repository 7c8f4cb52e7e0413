"""Disk frees on a thread of their own, bounded (`DiskFrees`; review, 2026-12-06): with the disk
hung, a free request naming disk slots pinned a default-executor thread each, and the arena's
frees (and everything else on `to_thread`) queued behind them."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

from kvfabric.segment_storage.disk_frees import DiskFrees


def test_a_hung_disk_holds_one_thread_and_the_arena_frees_go_on() -> None:
    hung = threading.Event()
    counts: Counter[str] = Counter()

    def free(pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        hung.wait(30)  # the disk's sync never returns (until the test lets it)
        return pairs

    frees = DiskFrees(free, lambda name: counts.update([name]), queued_max=2, wait_s=0.2)
    threads_before = threading.active_count()

    async def run() -> None:
        answers = await asyncio.gather(*(frees.free([(1 << 40, i)]) for i in range(40)))
        assert answers == [[]] * 40  # none freed: the directory asks again
        assert frees.pending == 2 and threading.active_count() - threads_before <= 1
        started = time.monotonic()
        await asyncio.wait_for(asyncio.to_thread(lambda: None), 2)  # the default executor is free
        assert time.monotonic() - started < 1
        hung.set()
        while frees.pending:  # noqa: ASYNC110 (the batches end on their thread)
            await asyncio.sleep(0.01)
        assert await frees.free([(1 << 40, 99)]) == [(1 << 40, 99)]  # the disk is back

    asyncio.run(run())
    frees.close()
    assert counts["disk_free_busy_total"] == 38 and counts["disk_free_late_total"] == 2


def test_wait_idle_waits_for_a_free_handed_off_past_its_wait() -> None:
    """The segment's stop closed the disk tier under a free still writing its record."""
    slow = threading.Event()

    def free(pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        slow.wait(30)
        return pairs

    frees = DiskFrees(free, lambda _: None, wait_s=0.05)
    assert asyncio.run(frees.free([(1 << 40, 1)])) == []  # late: handed off, still running
    assert not frees.wait_idle(0.1)
    slow.set()
    assert frees.wait_idle(5) and frees.pending == 0
    frees.close()
