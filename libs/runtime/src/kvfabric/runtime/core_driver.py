"""The generic shell driver: runs any protocol core of the one shape (`kvfabric.core.step`).

A shell holds a `CoreDriver(core, perform, clock=...)` and feeds it events: `await feed(event)`
reads the clock, steps the core with it and performs the returned effects in order (each
`await perform(effect)`; a `Reply` is the feeder's answer, returned, not performed). Feeds are
serialized: the effects of one step are all performed before the next step, so the order the
core chose is the order the world sees. `perform` must therefore never feed the same driver (it
would wait for itself); it may start tasks that do.

Time: `clock` is the shell's clock in integer ms (`kvfabric.format.clock.monotonic_ms` by
default; a shell whose core compares times with other processes' passes `now_ms`). The driver
never hands the core an earlier time than it already gave (a wall clock stepped back reads as
no time passed), so the core's "time never goes backwards" holds whatever the clock does, as
long as the core gets its time from the driver only.
`now_ms()` is that time, for the shell's queries of the core between steps.

Ticker: `start_ticker(event, interval_ms)` feeds `event` (the core's `Tick`) now and then every
`interval_ms` after the previous feed returned (`kvfabric.runtime.ticker.every`); `then`, if
given, is awaited after each such feed (the shell's follow-up on the core's new state).
`stop(deadline_s)` cancels it and waits at most `deadline_s`: a ticker still running then is a
liveness bug (`InvariantViolation`), never a hang.
(A ticker that died of an exception meanwhile, as a shell's own ticker loop could, is not
restarted; `stop` retrieves the exception without raising it.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Final, Generic, TypeVar

from kvfabric.core.step import Core, Reply
from kvfabric.format.clock import monotonic_ms
from kvfabric.format.invariant import invariant, unreachable
from kvfabric.runtime.deadline import cancel_and_wait
from kvfabric.runtime.ticker import every

__all__ = ["TICKER_STOP_DEADLINE_S", "CoreDriver", "perform_nothing"]

TICKER_STOP_DEADLINE_S: Final = 5.0  # how long `stop` waits for a cancelled ticker by default

EventT = TypeVar("EventT")
EffectT = TypeVar("EffectT")


async def perform_nothing(effect: object) -> None:
    """The `perform` of a core whose only outputs are replies: any effect is a bug."""
    unreachable("this core has no effects to perform", effect=effect)


class CoreDriver(Generic[EventT, EffectT]):
    """See the module docstring."""

    def __init__(
        self,
        core: Core[EventT, EffectT],
        perform: Callable[[EffectT], Awaitable[None]] = perform_nothing,
        *,
        clock: Callable[[], int] = monotonic_ms,
    ) -> None:
        self.core = core
        self._perform = perform
        self._clock = clock
        self._last_ms: int | None = None
        self._lock = asyncio.Lock()
        self._ticker: asyncio.Task[None] | None = None

    def now_ms(self) -> int:
        """The shell's clock, never earlier than a time already given to the core."""
        now = self._clock()
        if self._last_ms is not None and now < self._last_ms:
            now = self._last_ms
        self._last_ms = now
        return now

    async def feed(self, event: EventT) -> Sequence[EffectT]:
        """Step the core with `event` at the clock's time, perform its effects in order, and
        return them all (the `Reply`, if the event has one, included: `kvfabric.core.step.reply_of`)."""
        async with self._lock:
            effects = self.core.step(event, self.now_ms())
            for effect in effects:
                if not isinstance(effect, Reply):
                    await self._perform(effect)
        return effects

    def start_ticker(
        self, event: EventT, interval_ms: int, *, then: Callable[[], Awaitable[None]] | None = None
    ) -> asyncio.Task[None]:
        """Feed `event` now and every `interval_ms` after each feed (and `then`) returned, until
        `stop`. Returns the ticker's task, for the service to watch (`ServiceRuntime.watch`: a
        ticker that dies of an exception stops the service, which is restarted)."""
        invariant(interval_ms > 0, "a ticker needs a positive interval", interval_ms=interval_ms)
        invariant(self._ticker is None or self._ticker.done(), "one ticker per driver")

        async def tick() -> None:
            await self.feed(event)
            if then is not None:
                await then()

        self._ticker = asyncio.create_task(every(interval_ms / 1000, tick))
        return self._ticker

    @property
    def ticking(self) -> bool:
        return self._ticker is not None and not self._ticker.done()

    async def stop(self, deadline_s: float = TICKER_STOP_DEADLINE_S) -> None:
        """Cancel the ticker and wait for it, at most `deadline_s` (liveness: it must end by then)."""
        if self._ticker is None:
            return
        ticker = self._ticker
        left = await cancel_and_wait([ticker], deadline_s)
        invariant(not left, "the ticker did not stop within its deadline", deadline_s=deadline_s)
        if not ticker.cancelled():
            ticker.exception()  # retrieved, as the shells' `gather(return_exceptions=True)` did
        self._ticker = None
