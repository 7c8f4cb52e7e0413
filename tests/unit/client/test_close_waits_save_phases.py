"""`AsyncKvClient.close` waits for a running save until the deadlines of its phases have passed
(`SAVE_PHASES` × `save_timeout_ms`: put_begin, writes, put_commit or put_abort) before NATS
drains. It waited one `save_timeout_ms`, cancelled the queued writes, then one more: a save
whose begin was answered as the first wait ended had its writes running (running writes are
not cancelled) and its commit ahead, up to 2 × `save_timeout_ms` more, so NATS drained under its
commit (failed, the keys reserved until the write TTL) and the save went on after `close`
(2026-12-07). The save here ends by its deadlines but after two `save_timeout_ms` of close's
wait: timers on one loop fire in deadline order, so this does not depend on the machine's load."""

from __future__ import annotations

import asyncio

from kvfabric.client import AsyncKvClient
from kvfabric.client.aio_saves import SAVE_PHASES
from kvfabric.client.settings import ClientSettings
from kvfabric.testing.clientkit import SPEC

SAVE_TIMEOUT_S = 0.4


class Nats:
    """Records whether a save still ran when the client drained it."""

    def __init__(self, kv: AsyncKvClient) -> None:
        self.kv = kv
        self.saves_at_drain: int | None = None

    async def drain(self) -> None:
        self.saves_at_drain = len(self.kv._tasks)


async def running_save(kv: AsyncKvClient, lasts_s: float) -> None:
    """A save as `AsyncKvClient.save` runs it (in `_tasks` while it runs) that ends after
    `lasts_s`: its phases each within their deadline, its commit answered last."""
    task = asyncio.current_task()
    assert task is not None
    kv._tasks.add(task)
    kv._no_saves.clear()
    try:
        await asyncio.sleep(lasts_s)
    finally:
        kv._tasks.discard(task)
        if not kv._tasks:
            kv._no_saves.set()


def test_close_waits_for_a_save_until_its_phases_deadlines_before_nats_drains() -> None:
    assert SAVE_PHASES == 3
    kv = AsyncKvClient(
        ClientSettings(nats_url="nats://unused:1", save_timeout_ms=int(SAVE_TIMEOUT_S * 1000)), SPEC
    )
    nats = Nats(kv)
    kv.nc = nats  # type: ignore[assignment]

    async def run() -> bool:
        save = asyncio.ensure_future(running_save(kv, 2.5 * SAVE_TIMEOUT_S))
        await asyncio.sleep(0)  # it runs: close begins right after the save started
        await kv.close()
        return save.done()

    assert asyncio.run(run())  # the save had ended when close returned
    assert nats.saves_at_drain == 0  # and before NATS drained (1 before: drained under it)
