"""The generic shell driver (`kvfabric.runtime.core_driver`): it steps its core with the shell's
clock, never backwards, performs the effects in the order the core returned them (a step's
effects all before the next step's, even when `perform` awaits), hands replies back unperformed,
and its ticker stops within its deadline when cancelled (liveness), or the stop says it did not."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from kvfabric.core.repair import RepairConfig, RepairCore, StartCopy
from kvfabric.core.repair_events import CopyOk, RepairEvent, RepairOutput, SegmentUp
from kvfabric.core.step import Reply, Tick, reply_of
from kvfabric.format.invariant import InvariantViolation
from kvfabric.runtime.core_driver import CoreDriver


@dataclass(frozen=True)
class Say:
    word: str


class Echo:
    """A core whose every event says what it was told, in three effects, then answers."""

    def __init__(self) -> None:
        self.times: list[int] = []

    def step(self, event: str, now_ms: int) -> Sequence[Say | Reply[int]]:
        self.times.append(now_ms)
        return [Say(f"{event}.1"), Say(f"{event}.2"), Say(f"{event}.3"), Reply(now_ms)]

    def check_invariants(self) -> None:
        """Nothing to check: the echo keeps only the times it was given."""


async def test_effects_are_performed_in_order_one_step_after_another() -> None:
    performed: list[str] = []

    async def perform(effect: Say | Reply[int]) -> None:
        assert isinstance(effect, Say), "a reply is not performed"
        performed.append(effect.word)
        await asyncio.sleep(0)  # another feed may run meanwhile: it must wait for this step

    clock = iter([10, 20, 15, 30])  # a wall clock that steps back once
    driver: CoreDriver[str, Say | Reply[int]] = CoreDriver(Echo(), perform, clock=lambda: next(clock))
    answers = await asyncio.gather(driver.feed("a"), driver.feed("b"), driver.feed("c"))
    assert performed == ["a.1", "a.2", "a.3", "b.1", "b.2", "b.3", "c.1", "c.2", "c.3"]
    assert [reply_of(a) for a in answers] == [10, 20, 20]  # never earlier than a time already given
    assert driver.now_ms() == 30


async def test_a_real_core_through_the_driver() -> None:
    core = RepairCore(RepairConfig(retry_backoff_ms=0))
    started: list[StartCopy] = []

    async def perform(effect: RepairOutput) -> None:
        assert isinstance(effect, StartCopy)
        started.append(effect)

    now = {"ms": 1_000}
    driver: CoreDriver[RepairEvent, RepairOutput] = CoreDriver(core, perform, clock=lambda: now["ms"])
    for seg, zone in (("a", "z1"), ("b", "z2")):
        await driver.feed(SegmentUp(seg, incarnation=1, zone=zone, rack="r", host="h", free_bytes=1 << 20))
    core.object_known(b"o", size_bytes=10, replica_target=2, segments=["a"])
    assert await driver.feed(Tick()) == started and len(started) == 1
    assert reply_of(await driver.feed(CopyOk(started[0].copy_id))) is True
    core.check_invariants()


async def test_the_ticker_feeds_tick_and_stops_within_its_deadline() -> None:
    fed: list[str] = []
    hung, six = asyncio.Event(), asyncio.Event()

    async def perform(effect: Say | Reply[int]) -> None:
        assert isinstance(effect, Say)
        fed.append(effect.word)
        if len(fed) >= 6:
            six.set()
            await hung.wait()  # an effect that never finishes: only the cancel ends the ticker

    driver: CoreDriver[str, Say | Reply[int]] = CoreDriver(Echo(), perform)
    driver.start_ticker("tick", interval_ms=1)
    await asyncio.wait_for(six.wait(), 5.0)
    assert driver.ticking
    started = time.monotonic()
    await driver.stop(deadline_s=2.0)
    assert time.monotonic() - started < 1.0 and not driver.ticking
    assert fed[:6] == ["tick.1", "tick.2", "tick.3", "tick.1", "tick.2", "tick.3"]


async def test_a_ticker_that_ignores_its_cancel_breaks_the_liveness_invariant() -> None:
    release = asyncio.Event()

    async def perform(effect: Say | Reply[int]) -> None:
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue  # swallows every cancel: a liveness bug

    driver: CoreDriver[str, Say | Reply[int]] = CoreDriver(Echo(), perform)
    driver.start_ticker("tick", interval_ms=1)
    await asyncio.sleep(0.01)
    started = time.monotonic()
    with pytest.raises(InvariantViolation, match="did not stop within its deadline"):
        await driver.stop(deadline_s=0.2)
    assert time.monotonic() - started < 1.0  # the stop itself never hangs
    release.set()  # the bug fixed: the next stop ends it
    await driver.stop(deadline_s=1.0)


async def test_a_core_ahead_of_the_clock_refuses_the_step() -> None:
    core = RepairCore(RepairConfig(), now_ms=5_000)
    driver: CoreDriver[RepairEvent, RepairOutput] = CoreDriver(core, clock=lambda: 4_000)
    with pytest.raises(InvariantViolation, match="time went backwards"):
        await driver.feed(Tick())  # a core that already saw later than the clock: a shell bug
