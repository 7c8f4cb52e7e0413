"""A request waiting for room in a shard's events outbox when the shard's shell stops ends
`wrong_shard` (review, 2026-12-05): nothing reads the outbox after `stop`, and such a request
never returned, holding its in-flight slot and its tenant's fair turn until the process restarted."""

from __future__ import annotations

import asyncio

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
