"""The client's NATS connection drains for at most `DRAIN_TIMEOUT_S` at close: nats-py's default
(30 s) was twice what `KvClient.close` allows its steps besides its waits for saves and lookups
(15 s), so a drain that hung took the close past its bound."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from nats.aio.client import Client as NatsClient

from kvfabric.client import connect
from kvfabric.client.settings import ClientSettings
from kvfabric.format.errors import Unavailable


def test_the_connection_drains_within_the_closes_allowance(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    async def refused(self: NatsClient, *args: Any, **kwargs: Any) -> None:
        seen.update(kwargs)
        raise ConnectionRefusedError(111, "refused")

    monkeypatch.setattr(NatsClient, "connect", refused)
    settings = ClientSettings(nats_url="nats://127.0.0.1:1", connect_timeout_ms=200)
    with pytest.raises(Unavailable):  # (the start error: not the point here)
        asyncio.run(connect.open_nats(settings))
    assert seen["drain_timeout"] == connect.DRAIN_TIMEOUT_S
    assert connect.DRAIN_TIMEOUT_S < 15  # `KvClient.close`'s allowance for its other steps
