"""Ended hints' leases are given back off the prefetch ticker (review, 2026-12-06): released one
request at a time after each tick, 10 ended hints under a hung leader (each release running to
its timeout) held the ticker: 1 tick in 5 s instead of ~250, no copy started, no hint expired.
`stop` gives back what is left concurrently, within a deadline."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from kvfabric.core.prefetch_events import Tick
from kvfabric.format.errors import Indeterminate
from kvfabric.prefetch import shell as shell_module
from tests.unit.prefetch.test_shell_shards import FakeRouter, make_shell


async def test_a_hung_leader_does_not_hold_the_ticker_back() -> None:
    released: list[int] = []

    async def hung(shard: int, verb: str, message: Any, timeout_s: float, **_: Any) -> Any:
        await asyncio.sleep(timeout_s)  # the request runs to its timeout
        released.append(message.lease_id)
        raise Indeterminate("timeout")

    router = FakeRouter(lambda *a: None)
    router.ask = hung  # type: ignore[method-assign]
    shell = make_shell(router)  # request_timeout_s 1.0, tick_ms 20
    for i in range(40):  # forty ended hints, one lease each
        shell._leases[("t", f"h{i}")] = [(0, 100 + i)]
    ticks = 0
    step = shell.core.step

    def counting(event: Any, now_ms: int) -> Any:
        nonlocal ticks
        ticks += isinstance(event, Tick)
        return step(event, now_ms)

    shell.core.step = counting  # type: ignore[method-assign]
    shell._driver.start_ticker(Tick(), 20, then=shell._release_ended)
    await asyncio.sleep(1.0)
    assert ticks >= 20  # ~50 at 20 ms; 1 while the releases ran on the ticker
    assert not shell._leases
    started = time.monotonic()
    await shell.stop()
    assert time.monotonic() - started < shell_module.RELEASE_STOP_S + 1.0
    # 16 at a time: every one sent within ~3 s, each failed one retried, at most 3 times in all
    assert set(released) == set(range(100, 140))
    assert max(released.count(i) for i in range(100, 140)) <= shell_module.RELEASE_ATTEMPTS_MAX


async def test_the_accessed_subscription_has_a_bounded_backlog() -> None:
    """nats-py's defaults (524,288 messages, 128 MiB) let `accessed` events pile up behind a slow
    directory, and hot-replica decisions ran on reads minutes old (review, 2026-12-06)."""
    subscribed: dict[str, Any] = {}

    class Nats:
        async def subscribe(self, subject: str, **kwargs: Any) -> None:
            subscribed[subject] = kwargs

    shell = make_shell(FakeRouter(lambda *a: None))
    await shell.start(Nats())  # type: ignore[arg-type]
    try:
        (options,) = subscribed.values()
        assert options["pending_msgs_limit"] == shell_module.ACCESSED_PENDING_MSGS_MAX <= 1024
        assert options["pending_bytes_limit"] == shell_module.ACCESSED_PENDING_BYTES_MAX <= 64 << 20
    finally:
        await shell.stop()
