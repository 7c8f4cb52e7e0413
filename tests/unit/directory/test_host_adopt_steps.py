"""A shard's start adopts the segments' reports in bounded steps, the event loop yielded between
(`ShardHost._adopt`): in one call a shard of ~65,000 objects or more held the loop past the
leader lease (renewals every 1 s, the term ends 2.5 s after the last one sent), so the instance
lost every lease it held, and the next leader did the same (review, stop 71)."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest

from kvfabric.core.directory import DirectoryConfig, DirectoryCore, Effect
from kvfabric.core.directory.rebuild import SegmentHolding
from kvfabric.directory import shard_host
from kvfabric.directory.shard_host import ShardHost
from kvfabric.directory.stalls import CORE_CALLS
from kvfabric.proto import directory as m
from kvfabric.proto.segment import HeldObject
from tests.unit.core.dirkit import SECRET, checksum_of, groups, key

SHARD = 0
EPOCH = 5
OBJECTS = 20_000  # ~0.5-0.9 s in one call here
STALL_MAX_S = 0.1


class FakeShell:
    def __init__(self, core: DirectoryCore) -> None:
        self.core = core
        self.tasks: list[asyncio.Task[None]] = []
        self.performed: list[Effect] = []
        self.may_act: Callable[[], bool] = lambda: True

    async def start(self, nc: Any) -> None:
        await asyncio.sleep(0)

    async def perform(self, effects: list[Effect]) -> None:
        self.performed += effects

    async def stop(self, timeout_s: float = 0.0) -> set[asyncio.Task[None]]:
        return set()


class NoRegistry:
    async def all(self) -> list[m.RegisterSegment]:
        return []


def holdings() -> list[SegmentHolding]:
    found = []
    for name, chunks in (("seg-a", groups(OBJECTS // 2, seed=1)), ("seg-b", groups(OBJECTS // 2, seed=2))):
        reg = m.RegisterSegment(
            segment_id=name,
            incarnation=1,
            capacity_bytes=1 << 40,
            domain=m.FailureDomain(host=name, rack="r", zone="z"),
            data_addr=f"tcp://{name}",
        )
        objects = [HeldObject(key(g), slot, 1, 100, checksum_of(key(g))) for slot, g in enumerate(chunks)]
        found.append(SegmentHolding(reg, objects))
    return found


def make_host(held: list[SegmentHolding], monkeypatch: pytest.MonkeyPatch, may_act: Any = None) -> ShardHost:
    async def gather(*args: Any, **kwargs: Any) -> list[SegmentHolding]:
        return held

    monkeypatch.setattr(shard_host, "gather_holdings", gather)
    host = ShardHost(
        "dir-a",
        1,
        DirectoryConfig(ticket_secret=SECRET),
        registry=cast(Any, NoRegistry()),
        make_shell=cast(Any, FakeShell),
        may_act=may_act,
    )
    host._nc = cast(Any, object())
    return host


@pytest.fixture
def no_gc() -> Iterator[None]:
    """A cyclic-GC pass is a stall of its own (`kvfabric.runtime.gcpolicy`, measured apart):
    here it would land in whichever step allocated last."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.usefixtures("no_gc")
def test_a_big_shard_is_adopted_without_stalling_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    held = holdings()
    began = time.thread_time()
    whole = DirectoryCore(DirectoryConfig(ticket_secret=SECRET), epoch=EPOCH, shard=SHARD)
    whole_effects = whole.adopt(held, 0)
    assert time.thread_time() - began > STALL_MAX_S  # one call would stall the loop
    host = make_host(held, monkeypatch)
    calls_cpu_s: list[float] = []  # CPU, not wall: this 2-core machine is shared (descheduling)
    real_timed = CORE_CALLS.timed

    def timed(what: str, call: Callable[[], Any]) -> Any:
        began = time.thread_time()
        try:
            return real_timed(what, call)
        finally:
            if what == "adopt":
                calls_cpu_s.append(time.thread_time() - began)

    monkeypatch.setattr(CORE_CALLS, "timed", timed)
    woken = 0

    async def ticker(stop: asyncio.Event) -> None:
        """Stands for the lease renewals: wakes every 10 ms while the loop lets it."""
        nonlocal woken
        while not stop.is_set():
            await asyncio.sleep(0.01)
            woken += 1

    async def go() -> None:
        stop = asyncio.Event()
        ticking = asyncio.create_task(ticker(stop))
        await asyncio.sleep(0)
        await host.start_shard(SHARD, EPOCH)
        stop.set()
        await ticking

    asyncio.run(go())
    assert len(calls_cpu_s) > 10 and max(calls_cpu_s) < STALL_MAX_S
    assert woken > 10  # the renewals would have gone on all along (one call: woken once)
    shell = cast(FakeShell, host.shells[SHARD])
    core = shell.core
    core.check_invariants()
    assert len(core.published) == OBJECTS  # every group adopted, as by one call
    assert dict(core.published) == dict(whole.published)
    assert core.counters == whole.counters
    assert shell.performed == whole_effects
    assert {s: g.reserved_bytes for s, g in core.segments.items()} == {
        s: g.reserved_bytes for s, g in whole.segments.items()
    }


def test_a_shard_lost_while_adopting_is_abandoned_between_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Losing the lease mid-adoption ends it at the next step: no core is served, and the
    rest of the adoption is not paid for."""
    steps = 0
    real_timed = CORE_CALLS.timed

    def counting(what: str, call: Callable[[], Any]) -> Any:
        nonlocal steps
        steps += what == "adopt"
        return real_timed(what, call)

    monkeypatch.setattr(CORE_CALLS, "timed", counting)
    host = make_host(holdings(), monkeypatch, may_act=lambda shard, epoch: steps < 3)
    asyncio.run(host.start_shard(SHARD, EPOCH))
    assert SHARD not in host.shells
    assert steps == 3


def test_shards_adopt_one_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Several shards won at once (the default 16, rebalance off): each adopting in its own
    task, one step of every one of them ran per turn of the loop, a step times the shards
    (16 x 13-20 ms: the renewals missed the lease again; review, stop 71). One shard adopts at a
    time: a turn of the loop holds one step."""
    shards = 4
    held = holdings()

    async def gather(*args: Any, **kwargs: Any) -> list[SegmentHolding]:
        return held

    monkeypatch.setattr(shard_host, "gather_holdings", gather)
    host = ShardHost(
        "dir-a",
        shards,
        DirectoryConfig(ticket_secret=SECRET),
        registry=cast(Any, NoRegistry()),
        make_shell=cast(Any, FakeShell),
    )
    host._nc = cast(Any, object())
    adopting: list[int] = []  # the shard of each step, in order
    real_adopt_steps = DirectoryCore.adopt_steps

    def recorded(core: DirectoryCore, *args: Any, **kwargs: Any) -> Any:
        inner = real_adopt_steps(core, *args, **kwargs)
        sent = None
        while True:
            try:
                inner.send(sent) if sent is not None else next(inner)
            except StopIteration as done:
                return done.value
            adopting.append(core.shard)
            sent = yield

    monkeypatch.setattr(DirectoryCore, "adopt_steps", recorded)

    async def go() -> None:
        await asyncio.gather(*(host.start_shard(shard, EPOCH) for shard in range(shards)))

    asyncio.run(go())
    assert sorted(host.shells) == list(range(shards))
    runs = [shard for i, shard in enumerate(adopting) if i == 0 or adopting[i - 1] != shard]
    assert sorted(runs) == list(range(shards))  # each shard's steps one run: never interleaved
