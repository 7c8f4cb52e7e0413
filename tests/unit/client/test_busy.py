"""`busy` from the directory is backed off and asked again (issue 20): within an attempt budget and
the caller's deadline; saves keep a client-wide bound on their directory requests in flight."""

from __future__ import annotations

import asyncio

import pytest

from kvfabric.client import AsyncKvClient, ClientSettings
from kvfabric.client.aio import SAVE_DIRECTORY_CALLS_MAX
from kvfabric.client.busy import BUSY_WAIT_MS_MAX, BUSY_WAIT_MS_MIN, retry_busy
from kvfabric.format.errors import Busy
from kvfabric.proto import directory as m
from tests.integration.clientkit import SPEC


class Flaky:
    def __init__(self, busy_times: int) -> None:
        self.busy_times = busy_times
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.busy_times:
            raise Busy("tenant share full")
        return "reply"


async def test_busy_is_asked_again_after_growing_jittered_waits() -> None:
    slept: list[float] = []

    async def sleep(s: float) -> None:
        slept.append(s)

    flaky = Flaky(busy_times=7)
    assert await retry_busy(flaky, attempts_max=8, sleep=sleep) == "reply"
    assert flaky.calls == 8
    for k, s in enumerate(slept):
        base = min(BUSY_WAIT_MS_MIN * 2**k, BUSY_WAIT_MS_MAX) / 1000
        assert base <= s <= base * 1.5


async def test_the_budget_and_the_deadline_bound_the_retries() -> None:
    async def sleep(s: float) -> None:
        pass

    with pytest.raises(Busy):
        await retry_busy(Flaky(busy_times=10), attempts_max=3, sleep=sleep)
    now = [100.0]
    flaky = Flaky(busy_times=10)
    with pytest.raises(Busy):  # the first wait would end past the deadline: give up at once
        await retry_busy(flaky, attempts_max=8, deadline_s=100.01, sleep=sleep, clock=lambda: now[0])
    assert flaky.calls == 1


async def test_save_requests_are_bounded_client_wide_and_busy_is_retried() -> None:
    kv = AsyncKvClient(ClientSettings(nats_url="nats://unused:1"), SPEC)
    kv.nc = object()  # type: ignore[assignment]  # "connected": _directory only checks it is set
    in_flight = 0
    peak = 0
    refused: set[int] = set()

    async def ask(verb: str, message: object, timeout_s: float, trace_id: str, shard: int) -> object:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            await asyncio.sleep(0.01)
            if shard not in refused:  # every request is refused once, as by a full tenant share
                refused.add(shard)
                raise Busy("tenant share full")
            return m.PutCommitReply(epoch=1, results=[])
        finally:
            in_flight -= 1

    kv._ask_directory = ask  # type: ignore[method-assign, assignment]
    message = m.PutCommit(writer_id="w", request_id="r", keys=[])
    replies = await asyncio.gather(*(kv._directory("t", "put_commit", message, shard) for shard in range(20)))
    assert all(isinstance(r, m.PutCommitReply) for r in replies)  # none lost to busy
    assert peak == SAVE_DIRECTORY_CALLS_MAX
    assert kv.metrics.busy_retries._value.get() == 20
