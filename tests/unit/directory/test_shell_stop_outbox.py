"""A request waiting for room in a shard's events outbox when the shard's shell stops ends
`wrong_shard` (review, 2026-12-05): nothing reads the outbox after `stop`, and such a request
never returned, holding its in-flight slot and its tenant's fair turn until the process restarted."""

from __future__ import annotations

import asyncio
import contextlib

import msgspec
import pytest

from kvfabric.core.directory import EmitEvent
from kvfabric.directory.shell import DirectoryShell
from kvfabric.format.errors import WrongShard
from kvfabric.proto import directory as m
from tests.unit.core.dirkit import new_core


def test_a_request_waiting_on_a_full_outbox_ends_when_the_shell_stops() -> None:
    shell = DirectoryShell(
        new_core(), tick_ms=100, events_outbox_max=1, events_max_age_s=60, free_timeout_s=1.0
    )
    event = EmitEvent("segment_down", m.SegmentDown(segment_id="s1", incarnation=1, reason="test"))

    async def main() -> None:
        await shell.perform([event])  # fits
        waiting = asyncio.create_task(shell.perform([event]))  # the outbox is full: it waits
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await shell.stop(1.0)
        with pytest.raises(WrongShard):
            await asyncio.wait_for(waiting, 1.0)
        with pytest.raises(WrongShard):  # and any later one, at once
            await asyncio.wait_for(shell.perform([event]), 1.0)

    asyncio.run(main())


def test_events_leave_a_full_outbox_in_the_order_they_were_queued() -> None:
    """A slot freed for the oldest waiter was taken by a newer event before that waiter ran:
    drained e0, e2, e1, an eviction published before the publication it follows (review,
    stop 68)."""
    shell = DirectoryShell(
        new_core(), tick_ms=100, events_outbox_max=1, events_max_age_s=60, free_timeout_s=1.0
    )

    def event(n: int) -> EmitEvent:
        return EmitEvent("segment_down", m.SegmentDown(segment_id=f"s{n}", incarnation=1, reason="test"))

    async def main() -> list[str]:
        await shell.perform([event(0)])  # fits
        waiting = asyncio.create_task(shell.perform([event(1)]))  # full: waits its turn
        await asyncio.sleep(0.01)
        newer = asyncio.create_task(shell.perform([event(2)]))  # runs before e1's waiter resumes
        drained = [shell._outbox.get_nowait()]  # the publisher takes e0: room for e1, not e2
        await asyncio.sleep(0.01)
        drained.append(shell._outbox.get_nowait())
        await asyncio.sleep(0.01)
        drained.append(shell._outbox.get_nowait())
        await asyncio.gather(waiting, newer)
        return [msgspec.msgpack.decode(d, type=m.SegmentDown).segment_id for _, d, _ in drained]

    assert asyncio.run(main()) == ["s0", "s1", "s2"]


def test_a_newer_event_waits_behind_every_waiter_and_a_cancelled_one_gives_its_turn_back() -> None:
    """A released turn reads unlocked before its next waiter runs: a newer event slipped in ahead
    of that waiter; and a waiter cancelled as its turn came kept the lock for good, every later
    event of the shard waiting on it (review of stop 68)."""
    shell = DirectoryShell(
        new_core(), tick_ms=100, events_outbox_max=2, events_max_age_s=60, free_timeout_s=1.0
    )

    def event(name: str) -> EmitEvent:
        return EmitEvent("segment_down", m.SegmentDown(segment_id=name, incarnation=1, reason="test"))

    def names() -> list[str]:
        out = []
        while not shell._outbox.empty():
            _, data, _ = shell._outbox.get_nowait()
            out.append(msgspec.msgpack.decode(data, type=m.SegmentDown).segment_id)
        return out

    async def order() -> list[str]:
        await shell.perform([event("a"), event("b")])  # full
        w1 = asyncio.create_task(shell.perform([event("w1")]))
        w2 = asyncio.create_task(shell.perform([event("w2")]))
        await asyncio.sleep(0.01)
        first = [names()[0]]  # the publisher takes a and b: room for w1 ... and one more
        shell._outbox.put_nowait(
            ("x", msgspec.msgpack.encode(m.SegmentDown(segment_id="b", incarnation=1, reason="t")), 1)
        )
        while not w1.done():  # noqa: ASYNC110 (a step at a time: the window is one turn of the loop)
            await asyncio.sleep(0)
        newer = asyncio.create_task(shell.perform([event("new")]))  # w2 still waits its turn
        await asyncio.sleep(0.01)
        drained = first + names()
        await asyncio.sleep(0.01)
        drained += names()
        await asyncio.gather(w2, newer)
        return drained + names()

    drained = asyncio.run(order())
    assert drained.index("w2") < drained.index("new"), drained

    async def cancelled() -> None:
        shell2 = DirectoryShell(
            new_core(), tick_ms=100, events_outbox_max=1, events_max_age_s=60, free_timeout_s=1.0
        )
        await shell2.perform([event("a")])
        w0 = asyncio.create_task(shell2.perform([event("w0")]))
        await asyncio.sleep(0.01)
        w1 = asyncio.create_task(shell2.perform([event("w1")]))
        await asyncio.sleep(0.01)
        shell2._outbox.get_nowait()  # room for w0: w1's turn comes next
        while not w0.done():  # noqa: ASYNC110
            await asyncio.sleep(0)
        shell2._outbox.get_nowait()
        while not shell2._outbox_turn.locked():  # noqa: ASYNC110
            await asyncio.sleep(0)
        w1.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await w1
        if not shell2._outbox.empty():
            shell2._outbox.get_nowait()
        await asyncio.wait_for(shell2.perform([event("later")]), 1.0)  # was: waited for ever
        assert not shell2._outbox_turn.locked()

    asyncio.run(cancelled())
