"""`kvfabric.runtime.ticker.every`, the one periodic loop of the shells: runs now (or one interval
from now with `delay_first`) and after each run, a `KvfError` of one run goes to `failed` and
the loop goes on, without `failed` (or for any other exception) the loop ends with it; and
`CoreDriver.start_ticker(then=)` runs the shell's follow-up after each tick."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from kvfabric.core.step import Reply
from kvfabric.format.errors import KvfError, Unavailable
from kvfabric.runtime.core_driver import CoreDriver
from kvfabric.runtime.ticker import every

DEADLINE_S = 10.0  # generous: only a broken loop waits this long


async def test_a_failed_run_is_reported_and_the_loop_goes_on() -> None:
    runs: list[int] = []
    failures: list[str] = []
    fourth = asyncio.Event()

    async def step() -> None:
        runs.append(len(runs))
        if len(runs) == 4:
            fourth.set()
        if len(runs) in (1, 2):
            raise Unavailable(f"directory down ({len(runs)})")

    task = asyncio.create_task(every(0.001, step, lambda exc: failures.append(exc.message)))
    await asyncio.wait_for(fourth.wait(), DEADLINE_S)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert failures == ["directory down (1)", "directory down (2)"]
    assert runs[:4] == [0, 1, 2, 3]


async def test_without_failed_an_error_ends_the_loop() -> None:
    runs = 0

    async def step() -> None:
        nonlocal runs
        runs += 1
        raise Unavailable("down")

    with pytest.raises(Unavailable):
        await asyncio.wait_for(every(0.001, step), DEADLINE_S)
    assert runs == 1


async def test_an_unexpected_exception_ends_the_loop_even_with_failed() -> None:
    failures: list[KvfError] = []

    async def step() -> None:
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        await asyncio.wait_for(every(0.001, step, failures.append), DEADLINE_S)
    assert failures == []


async def test_the_first_run_is_at_once_and_runs_never_overlap() -> None:
    running = 0
    overlapped = False
    started = asyncio.Event()
    third = asyncio.Event()
    count = 0

    async def step() -> None:
        nonlocal running, overlapped, count
        started.set()
        running += 1
        overlapped = overlapped or running > 1
        try:
            await asyncio.sleep(0.005)  # a slow run: the next waits for it
        finally:
            running -= 1
        count += 1
        if count == 3:
            third.set()

    task = asyncio.create_task(every(3600.0, step))  # an hour: only the first run can be seen
    await asyncio.wait_for(started.wait(), DEADLINE_S)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    task = asyncio.create_task(every(0.0, step))
    await asyncio.wait_for(third.wait(), DEADLINE_S)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not overlapped


async def test_delay_first_waits_one_interval_before_the_first_run() -> None:
    loop = asyncio.get_running_loop()
    first_run = asyncio.Event()
    ran_at: list[float] = []

    async def step() -> None:
        ran_at.append(loop.time())
        first_run.set()

    started = loop.time()
    task = asyncio.create_task(every(0.2, step, delay_first=True))
    await asyncio.wait_for(first_run.wait(), DEADLINE_S)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ran_at[0] - started >= 0.2 - 0.001  # a sleep never ends early (only late, under load)


class Counter:
    """A core that counts its ticks and answers the count."""

    def __init__(self) -> None:
        self.ticks = 0

    def step(self, event: str, now_ms: int) -> Sequence[Reply[int]]:
        self.ticks += 1
        return [Reply(self.ticks)]

    def check_invariants(self) -> None:
        """Nothing to check: a count."""


async def test_the_drivers_ticker_runs_then_after_each_tick() -> None:
    core = Counter()
    seen: list[int] = []
    three = asyncio.Event()

    async def then() -> None:
        seen.append(core.ticks)  # the tick it follows has been stepped
        if len(seen) == 3:
            three.set()

    driver: CoreDriver[str, Reply[int]] = CoreDriver(core)
    driver.start_ticker("tick", interval_ms=1, then=then)
    await asyncio.wait_for(three.wait(), DEADLINE_S)
    await driver.stop(deadline_s=DEADLINE_S)
    assert seen[:3] == [1, 2, 3]
