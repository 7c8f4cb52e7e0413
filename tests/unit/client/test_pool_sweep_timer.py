"""The client lets go of idle connections to removed arenas on a timer too (review, stop 68): run
only when a transfer asked for a connection, a dead incarnation's map stayed while none came (a
lone segment restarting: nothing to look up or save until it is back), and its tmpfs pages kept
the new incarnation's arena from fitting. The timer starts with the client, sweeps on a transfer
thread (closing a map unmaps what it read: never on the loop; review of the fix) and stops at
`close`."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from kvfabric.client import aio as aio_module
from kvfabric.client.aio import AsyncKvClient
from kvfabric.client.settings import ClientSettings
from kvfabric.format.errors import Unavailable
from kvfabric.testing.clientkit import SPEC


def test_the_pool_is_swept_off_the_loop_from_start_until_close(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aio_module, "POOL_SWEEP_S", 0.05)

    async def connected(settings: ClientSettings) -> tuple[Any, Any]:
        return object(), object()  # (closing it: its drain fails, suppressed)

    monkeypatch.setattr(aio_module, "open_nats", connected)
    client = AsyncKvClient(ClientSettings(nats_url="nats://unused:1"), SPEC)
    swept_on: list[int] = []
    monkeypatch.setattr(client.pool, "sweep", lambda: swept_on.append(threading.get_ident()))

    async def main() -> None:
        await client.start()
        await asyncio.sleep(0.3)
        assert len(swept_on) >= 3  # no transfer asked for a connection meanwhile
        assert threading.get_ident() not in swept_on  # never on the loop's thread
        await client.close()
        assert client._sweep_timer is None
        before = len(swept_on)
        await asyncio.sleep(0.2)
        assert len(swept_on) == before  # stopped

    asyncio.run(main())


def test_a_start_that_fails_arms_no_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    async def refused(settings: ClientSettings) -> tuple[Any, Any]:
        raise Unavailable("no server")

    monkeypatch.setattr(aio_module, "open_nats", refused)
    client = AsyncKvClient(ClientSettings(nats_url="nats://unused:1"), SPEC)

    async def main() -> None:
        with pytest.raises(Unavailable):
            await client.start()
        assert client._sweep_timer is None
        await client.close()

    asyncio.run(main())
