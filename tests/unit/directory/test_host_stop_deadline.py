"""`ShardHost.stop` ends every task of the host within its deadline, or names those it could not
end (the service then exits at once, `kvfabric.directory.__main__`): a shell task that swallowed
its first cancellation is cancelled again; one that never ends is reported, not waited for."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, cast

from kvfabric.core.directory import DirectoryConfig, DirectoryCore
from kvfabric.directory.shard_host import ShardHost
from kvfabric.directory.shell import DirectoryShell

CONFIG = DirectoryConfig(ticket_secret=b"s" * 32)


def shell_with(*tasks: asyncio.Task[None]) -> DirectoryShell:
    shell = DirectoryShell(
        DirectoryCore(CONFIG, epoch=3, shard=0),
        tick_ms=100,
        events_outbox_max=10,
        events_max_age_s=60,
        free_timeout_s=1.0,
    )
    shell._tasks = list(tasks)
    return shell


def host_with(shell: DirectoryShell) -> ShardHost:
    host = ShardHost("dir-a", 1, CONFIG, registry=cast(Any, None), make_shell=cast(Any, None))
    host.shells[0] = shell
    return host


async def swallows_first_cancel() -> None:
    with contextlib.suppress(asyncio.CancelledError):  # as wait_for (3.11) does when a reply
        await asyncio.sleep(60)  # lands in the same loop iteration as the cancel
    await asyncio.sleep(60)


async def test_a_swallowed_cancellation_does_not_hold_the_stop() -> None:
    task = asyncio.create_task(swallows_first_cancel(), name="directory-publisher-0")
    await asyncio.sleep(0)
    host = host_with(shell_with(task))
    started_s = time.monotonic()
    assert await host.stop(timeout_s=2.0) == []
    assert task.cancelled() and time.monotonic() - started_s < 1.0
    assert host.shells == {}


async def test_a_task_that_never_ends_is_named_at_the_deadline() -> None:
    release = asyncio.Event()

    async def immortal() -> None:
        while not release.is_set():
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                continue

    stuck = asyncio.create_task(immortal(), name="directory-publisher-0")
    ticker = asyncio.create_task(asyncio.sleep(60), name="directory-ticker-0")
    await asyncio.sleep(0)
    host = host_with(shell_with(stuck, ticker))
    started_s = time.monotonic()
    assert await host.stop(timeout_s=0.5) == ["directory-publisher-0"]
    assert 0.4 < time.monotonic() - started_s < 1.5
    assert ticker.cancelled()
    release.set()
    stuck.cancel()
    await asyncio.wait({stuck}, timeout=1.0)
