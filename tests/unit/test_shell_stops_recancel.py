"""A service shell's `stop` cancels its tasks again while they run, for a bounded time
(`kvfabric.runtime.deadline.stop_tasks`): Python 3.11's `asyncio.wait_for` can swallow a
cancellation that lands in the same loop iteration as the awaited result, and the task runs on.
The eviction policy, repair, prefetch and segment shells cancelled once and then waited with a
bare `gather`: a task that swallowed the cancel (the eviction policy's adopter waits on an event
with `wait_for`) held `stop` for good (review, 2026-12-07). The segment shell calls the same
`stop_tasks` (its stop is tested through the helper here)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvfabric.core.eviction import EvictionConfig, EvictionCore
from kvfabric.core.prefetch import PrefetchConfig, PrefetchCore
from kvfabric.core.repair import RepairConfig, RepairCore
from kvfabric.eviction_policy.shell import EvictionShell
from kvfabric.prefetch.shell import PrefetchShell
from kvfabric.repair.shell import RepairShell
from kvfabric.runtime.deadline import stop_tasks
from kvfabric.testing.logs import RecordingLog


def swallows_one_cancel(cancels: list[int]) -> Any:
    """A task body that swallows the first cancellation (as a `wait_for` whose result landed with
    it does) and ends at the second; left alone it would wait 60 s more."""

    async def body() -> None:
        while True:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancels.append(1)
                if len(cancels) > 1:
                    raise

    return body()


def eviction_shell() -> Any:
    core = EvictionCore(EvictionConfig(policy="lru", high_watermark=0.9, low_watermark=0.5), {})
    return EvictionShell(core, tick_ms=10, segments_refresh_ms=100, request_timeout_s=1.0, demote=False)


def repair_shell() -> Any:
    return RepairShell(
        RepairCore(RepairConfig()),
        replicas_target=3,
        scan_ms=1000,
        tick_ms=100,
        request_timeout_s=1.0,
        copy_timeout_s=1.0,
    )


def prefetch_shell() -> Any:
    return PrefetchShell(
        PrefetchCore(PrefetchConfig()),
        holder_id="prefetch-test",
        tick_ms=10,
        scan_ms=10,
        resolving_max=4,
        hot_groups_per_event_max=8,
        request_timeout_s=1.0,
        copy_timeout_s=1.0,
    )


@pytest.mark.parametrize(
    "make", [eviction_shell, repair_shell, prefetch_shell], ids=["eviction_policy", "repair", "prefetch"]
)
async def test_stop_cancels_again_a_task_that_swallowed_its_cancel(make: Any) -> None:
    shell = make()
    cancels: list[int] = []
    task = asyncio.create_task(swallows_one_cancel(cancels))
    await asyncio.sleep(0)  # (running: inside its sleep)
    shell._tasks.append(task)
    await asyncio.wait_for(shell.stop(), 10)  # a bare gather after one cancel: ~60 s, then more
    assert task.cancelled() and len(cancels) == 2


async def test_stop_tasks_leaves_a_task_that_swallows_every_cancel_and_names_it() -> None:
    cancels: list[int] = []

    async def never_ends() -> None:
        while len(cancels) < 1000:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancels.append(1)

    task = asyncio.create_task(never_ends(), name="stubborn")
    await asyncio.sleep(0)
    log = RecordingLog()
    stuck = await asyncio.wait_for(stop_tasks([task], log, timeout_s=0.5), 10)
    assert stuck == {task} and len(cancels) >= 2  # cancelled again, not once
    assert log.lines == [("warning", "stop_tasks_left", {"tasks": ["stubborn"]})]
    cancels.extend([1] * 1000)  # (let it end)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_prefetch_stop_cancels_again_a_release_that_swallowed_its_cancel() -> None:
    """Its releases at stop (after the rounds) went the same way: one cancel, a bare gather."""
    shell = prefetch_shell()
    cancels: list[int] = []
    task = asyncio.create_task(swallows_one_cancel(cancels))
    await asyncio.sleep(0)
    shell._releases.add(task)
    await asyncio.wait_for(shell.stop(), 10)
    assert task.cancelled() and len(cancels) == 2
