"""Backing off when the directory answers `busy` (issue 20, docs/design.md 3.6).

A tenant has a share of the directory's in-flight slots (a quarter by default: 16). Several
engines of one tenant pipelining saves can fill it; the directory then answers `busy` at once
rather than queueing. A `busy` request was refused before it ran, so asking again is safe for
every verb. Callers keep below the share themselves (a client-wide bound on requests in flight)
and, on `busy`, wait a jittered `BUSY_WAIT_MS_MIN` doubling up to `BUSY_WAIT_MS_MAX` and ask
again: at most `attempts_max` attempts and never past the caller's deadline, so a saturated
directory costs a bounded delay, then the usual fallback (a dropped save, an expiring lease).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import Final, TypeVar

from kvfabric.format.errors import Busy

__all__ = ["BUSY_WAIT_MS_MAX", "BUSY_WAIT_MS_MIN", "retry_busy"]

BUSY_WAIT_MS_MIN: Final = 20
BUSY_WAIT_MS_MAX: Final = 500  # waits 20, 40, 80, 160, 320, 500 ... ms (+0-50 %)

T = TypeVar("T")
Sleep = Callable[[float], Awaitable[None]]


async def retry_busy(
    call: Callable[[], Awaitable[T]],
    *,
    attempts_max: int,
    deadline_s: float | None = None,
    on_retry: Callable[[], None] = lambda: None,
    sleep: Sleep = asyncio.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """`call()`, asked again after a backoff while it raises `Busy` (see the module doc). The
    last attempt's `Busy` (or any other error) propagates. `deadline_s` is on `clock`."""
    wait_ms = BUSY_WAIT_MS_MIN
    for _ in range(attempts_max - 1):
        try:
            return await call()
        except Busy:  # jittered: clients refused together do not retry in step
            pause_s = wait_ms / 1000 * random.uniform(1.0, 1.5)
            if deadline_s is not None and clock() + pause_s >= deadline_s:
                raise
            on_retry()
            await sleep(pause_s)
            wait_ms = min(wait_ms * 2, BUSY_WAIT_MS_MAX)
    return await call()
