"""The client lets go of idle connections to removed arenas on a timer too (review, stop 68): run
only when a transfer asked for a connection, a dead incarnation's map stayed while none came (a
lone segment restarting: nothing to look up or save until it is back), and its tmpfs pages kept
the new incarnation's arena from fitting. `close` stops the timer."""

from __future__ import annotations

import asyncio

import pytest

from kvfabric.client import aio as aio_module
from kvfabric.client.aio import AsyncKvClient
from kvfabric.client.settings import ClientSettings
from kvfabric.testing.clientkit import SPEC


def test_the_pool_is_swept_every_interval_until_close(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aio_module, "POOL_SWEEP_S", 0.05)
    client = AsyncKvClient(ClientSettings(nats_url="nats://unused:1"), SPEC)
    swept: list[float] = []
    monkeypatch.setattr(client.pool, "sweep", lambda: swept.append(0.0))

    async def main() -> None:
        client._sweep_timer = asyncio.get_running_loop().call_later(
            aio_module.POOL_SWEEP_S, client._sweep_pool
        )
        await asyncio.sleep(0.3)
        assert len(swept) >= 3  # no transfer asked for a connection meanwhile
        await client.close()
        assert client._sweep_timer is None
        before = len(swept)
        await asyncio.sleep(0.2)
        assert len(swept) == before  # stopped

    asyncio.run(main())
