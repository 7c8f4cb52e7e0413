"""`ShardHost`'s rebuilds for a missing segment (a segment heartbeating to a shard core that never
saw it, `_introduce`): at once, then 10 s later, doubling to 5 min; never dropped, neither when
the shard is still starting (its shell already serves) nor when a segment is introduced to the
new core while a rebuild's own start runs (a CI run found a shard serving without both segments
for 20 s, docs/directory-ha.md)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, cast

import pytest

from kvfabric.core.directory import DirectoryConfig
from kvfabric.directory import shard_host
from kvfabric.directory.shard_host import ShardHost

SHARD = 3
EPOCH = 7


class FakeShell:
    def __init__(self) -> None:
        self.holds = 0  # `hold_orphans` calls: every rebuild asked for holds the core's orphans
        self.core = SimpleNamespace(
            epoch=EPOCH,
            shard=SHARD,
            free_table=SimpleNamespace(in_grace=False, grace_until_ms=0),
            hold_orphans=self.hold_orphans,
            counters={},  # a stopped shell's are folded into the host's (`ShardHost.retired`)
            quotas=SimpleNamespace(stats=OrderedDict()),
        )
        self.events_published = 0
        self.events_dropped = 0
        self.events_stream = None  # a folded shell's stream is kept (`ShardHost.retired`)
        self.may_act: Callable[[], bool] = lambda: True

    def hold_orphans(self) -> int:
        self.holds += 1
        return 1

    async def drain_events(self, timeout_s: float) -> None:
        await asyncio.sleep(0)

    async def stop(self, timeout_s: float = 0.0) -> set[asyncio.Task[None]]:
        return set()


class Harness:
    """A host whose clock is ours and whose rebuilds run at once, the clock moved to when each
    was due; `restart_shard` records the time (`begun`) and installs a new shell, running
    `during_restart` while the shard counts as starting (as `start_shard` does)."""

    def __init__(self) -> None:
        self.now_s = 1_000.0
        self.begun: list[float] = []
        self.during_restart: Callable[[], None] = lambda: None
        self.host = ShardHost(
            "dir-a",
            8,
            DirectoryConfig(ticket_secret=b"s" * 32),
            registry=cast(Any, None),
            make_shell=cast(Any, None),
            restart_shard=self.restart,
            clock=lambda: self.now_s,
        )
        self.host.shells[SHARD] = cast(Any, FakeShell())
        real_rebuild = self.host._rebuild

        async def due_at_once(shard: int, epoch: int, delay_s: float, *, backoff: bool) -> None:
            self.now_s += delay_s
            await real_rebuild(shard, epoch, 0.0, backoff=backoff)

        self.host._rebuild = due_at_once  # type: ignore[method-assign]

    async def restart(self, shard: int, epoch: int) -> None:
        self.begun.append(self.now_s)
        ended = self.host._starting[shard] = asyncio.Event()
        try:
            self.host.shells[shard] = cast(Any, FakeShell())
            self.during_restart()
            await asyncio.sleep(0)
        finally:
            del self.host._starting[shard]
            ended.set()

    async def introduce(self) -> None:
        """A segment introduced to the shard's core now; returns once no rebuild is left."""
        self.host._rebuild_later(SHARD, EPOCH, "seg-x")
        while self.host._rebuilds:
            await asyncio.gather(*self.host._rebuilds)


def test_rebuilds_wait_10_s_then_double_up_to_5_min_and_start_over_after_a_quiet_spell() -> None:
    h = Harness()

    async def go() -> None:
        for _ in range(8):
            await h.introduce()
            h.now_s += 1.0  # the next introduction comes a second after the last rebuild began
        h.now_s += shard_host.MISSING_SEGMENT_REBUILD_S_MAX + 1.0
        await h.introduce()
        await h.introduce()

    asyncio.run(go())
    gaps = [round(b - a) for a, b in zip(h.begun, h.begun[1:], strict=False)]
    assert gaps[:7] == [10, 20, 40, 80, 160, 300, 300]
    assert gaps[7] > shard_host.MISSING_SEGMENT_REBUILD_S_MAX  # quiet: at once ...
    assert gaps[8] == 10  # ... and the shortest wait again


def test_a_rebuild_asked_for_holds_the_orphans_of_the_core_it_will_replace() -> None:
    """Each rebuild asked for holds the serving core's orphans past its grace (the rebuild, maybe
    backed off past it, may find their groups whole); a request naming another term holds
    nothing of this one."""
    h = Harness()
    first = cast(FakeShell, h.host.shells[SHARD])

    async def go() -> None:
        await h.introduce()
        second = cast(FakeShell, h.host.shells[SHARD])
        assert second is not first and (first.holds, second.holds) == (1, 0)
        h.host._rebuild_later(SHARD, EPOCH + 1, "seg-x")  # not this core's term
        assert second.holds == 0
        await asyncio.gather(*h.host._rebuilds)
        h.now_s += 1.0
        await h.introduce()  # backed off 10 s: held meanwhile
        assert second.holds == 1

    asyncio.run(go())


def test_a_rebuild_pending_from_an_earlier_term_gives_way_to_this_terms() -> None:
    """Term E's rebuild waits out its backoff; the shard is lost and won again (E + 1) and a
    segment misses that start too: E + 1's rebuild runs (before, E's pending one swallowed it,
    then ended on the changed epoch: no rebuild ever ran, the new core's orphans held for good;
    review, stop 66)."""
    h = Harness()

    async def go() -> None:
        waiting = asyncio.Event()  # never set: term E's backoff outlasts the test
        real_rebuild = h.host._rebuild

        async def backed_off(shard: int, epoch: int, delay_s: float, *, backoff: bool) -> None:
            await waiting.wait()

        h.host._rebuild = backed_off  # type: ignore[method-assign]
        h.host._rebuild_later(SHARD, EPOCH, "seg-x")
        stale = h.host._rebuild_pending[SHARD]
        h.host._rebuild = real_rebuild  # type: ignore[method-assign]
        won_again = FakeShell()
        won_again.core.epoch = EPOCH + 1
        h.host.shells[SHARD] = cast(Any, won_again)
        h.host._rebuild_later(SHARD, EPOCH + 1, "seg-x")
        assert won_again.holds == 1
        while h.host._rebuilds:
            await asyncio.gather(*h.host._rebuilds, return_exceptions=True)
        assert stale.cancelled()

    asyncio.run(go())
    assert len(h.begun) == 1  # term E + 1's rebuild ran


def test_a_rebuild_asked_while_the_shard_starts_runs_once_that_start_ends() -> None:
    h = Harness()

    async def go() -> None:
        ended = h.host._starting[SHARD] = asyncio.Event()  # its shell serves: the heartbeat reached it
        h.host._rebuild_later(SHARD, EPOCH, "seg-x")
        for _ in range(5):
            await asyncio.sleep(0.01)
        assert h.begun == []  # waits for the start: no two starts of one shard at once
        del h.host._starting[SHARD]
        ended.set()
        await asyncio.gather(*h.host._rebuilds)

    asyncio.run(go())
    assert len(h.begun) == 1


def test_a_segment_introduced_while_a_rebuild_restarts_the_shard_gets_a_rebuild_of_its_own() -> None:
    h = Harness()
    introduced: list[str] = []

    def heartbeat_of_another_segment() -> None:
        if not introduced:  # the new core missed seg-y in its start's reports (once)
            introduced.append("seg-y")
            h.host._rebuild_later(SHARD, EPOCH, "seg-y")

    h.during_restart = heartbeat_of_another_segment

    async def go() -> None:
        await h.introduce()

    asyncio.run(go())
    assert introduced == ["seg-y"]
    assert len(h.begun) == 2
    assert round(h.begun[1] - h.begun[0]) == shard_host.MISSING_SEGMENT_REBUILD_S_MIN


def test_a_rebuild_of_a_shard_started_again_under_another_epoch_is_dropped() -> None:
    h = Harness()
    shell = FakeShell()
    shell.core.epoch = EPOCH + 1
    h.host.shells[SHARD] = cast(Any, shell)

    async def go() -> None:
        await h.introduce()

    asyncio.run(go())
    assert h.begun == []  # the newer epoch's start asked every segment; its own heartbeats follow


class BlockingShell(FakeShell):
    """Never ends its drain or its start: only a cancellation gets past them."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = asyncio.Event()
        self.stopped = False

    async def drain_events(self, timeout_s: float) -> None:
        self.entered.set()
        await asyncio.Event().wait()

    async def start(self, nc: object) -> None:
        self.entered.set()
        await asyncio.Event().wait()

    async def stop(self, timeout_s: float = 0.0) -> set[asyncio.Task[None]]:
        self.stopped = True
        return set()


def test_a_shell_whose_rebuild_is_cancelled_while_it_drains_is_stopped_by_the_hosts_stop() -> None:
    h = Harness()
    shell = BlockingShell()
    h.host.shells[SHARD] = cast(Any, shell)

    async def go() -> None:
        h.host._rebuild_later(SHARD, EPOCH, "seg-x")
        await asyncio.wait_for(shell.entered.wait(), 5.0)
        assert await h.host.stop(timeout_s=1.0) == []

    asyncio.run(go())
    assert shell.stopped  # its tasks would run on, serving nothing, after the host stopped


def test_a_shell_whose_start_is_cancelled_is_stopped_by_the_hosts_stop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    shell = BlockingShell()

    async def no_holdings(*args: object, **kwargs: object) -> list[object]:
        return []

    async def no_segments() -> list[object]:
        return []

    monkeypatch.setattr(shard_host, "gather_holdings", no_holdings)
    host = ShardHost(
        "dir-a",
        8,
        DirectoryConfig(ticket_secret=b"s" * 32),
        registry=cast(Any, SimpleNamespace(all=no_segments)),
        make_shell=lambda core: cast(Any, shell),
    )
    host._nc = cast(Any, object())

    async def go() -> None:
        start = asyncio.create_task(host.start_shard(SHARD, EPOCH))
        await asyncio.wait_for(shell.entered.wait(), 5.0)
        start.cancel()  # the instance's lifecycle ends the start (it is stopping)
        with contextlib.suppress(asyncio.CancelledError):
            await start
        assert await host.stop(timeout_s=1.0) == []

    asyncio.run(go())
    assert shell.stopped and SHARD not in host.shells


def test_a_new_term_starts_its_rebuild_backoff_over() -> None:
    """The backoff of a shard's rebuilds for a missing segment carried over from the term before:
    the new leader's first such rebuild waited out the old term's doubling (review, stop 65: 39 s,
    past the new core's 30 s grace, whose end frees the orphans a late segment's report would
    have completed). A new term's first one is at once."""
    h = Harness()

    async def go() -> None:
        for _ in range(3):  # backoff: at once, 10 s, 20 s; the next one due 40 s after the last
            await h.introduce()
            h.now_s += 1.0
        h.host.shells[SHARD].core.epoch = EPOCH + 1  # (the shard won again, another term)
        h.host._rebuild_later(SHARD, EPOCH + 1, "seg-x")
        while h.host._rebuilds:
            await asyncio.gather(*h.host._rebuilds)

    asyncio.run(go())
    gaps = [round(b - a) for a, b in zip(h.begun, h.begun[1:], strict=False)]
    assert gaps == [10, 20, 1]  # at once: not the last term's 40 s


def test_a_task_a_retired_shells_stop_could_not_end_is_reported_by_the_hosts_stop() -> None:
    """A handed-over or rebuilt shard's shell whose publisher is stuck: its stop returned the task
    and `_retire` forgot it, so the host's stop reported nothing stuck and the process did not
    exit 79 (review, stop 65)."""
    h = Harness()

    async def go() -> list[str]:
        wedged = True

        async def stuck_publisher() -> None:
            while wedged:  # (ignores its cancellation while wedged: what a stuck call looks like)
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.sleep(0.01)

        task = asyncio.create_task(stuck_publisher(), name="directory-publisher-3")
        shell = FakeShell()

        async def stop(timeout_s: float = 0.0) -> set[asyncio.Task[None]]:
            return {task}

        shell.stop = stop  # type: ignore[method-assign]
        await h.host._retire(cast(Any, shell), 0.0)
        names = await h.host.stop(timeout_s=0.2)
        wedged = False
        await task
        return names

    assert asyncio.run(go()) == ["directory-publisher-3"]
