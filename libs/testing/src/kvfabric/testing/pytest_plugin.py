"""pytest fixtures for a real nats-server.

Register with `pytest_plugins = ["kvfabric.testing.pytest_plugin"]`.

- `nats_server`: a fresh `NatsServer` (JetStream, free ports, store dir under `tmp_path`) per test.
- `nats_client`: a connected nats-py client to it, closed after the test. It reconnects quickly
  (`RECONNECT_TIME_WAIT_S`) and boundedly, so tests that restart the server can keep using it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Final

import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client as NatsClient

from kvfabric.testing.nats_server import NatsServer

__all__ = ["connect_test_client", "nats_client", "nats_server"]

CONNECT_TIMEOUT_S: Final = 2
RECONNECT_TIME_WAIT_S: Final = 0.1
RECONNECT_ATTEMPTS_MAX: Final = 100
CLOSE_TIMEOUT_S: Final = 5.0


async def connect_test_client(url: str) -> NatsClient:
    """A nats-py client with short, bounded connect and reconnect settings for tests."""
    return await nats.connect(
        url,
        name="kvfabric-test",
        connect_timeout=CONNECT_TIMEOUT_S,
        reconnect_time_wait=RECONNECT_TIME_WAIT_S,
        max_reconnect_attempts=RECONNECT_ATTEMPTS_MAX,
    )


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path / "nats")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest_asyncio.fixture
async def nats_client(nats_server: NatsServer) -> AsyncIterator[NatsClient]:
    nc = await asyncio.wait_for(connect_test_client(nats_server.url), timeout=CONNECT_TIMEOUT_S * 2)
    try:
        yield nc
    finally:
        if not nc.is_closed:
            await asyncio.wait_for(nc.close(), timeout=CLOSE_TIMEOUT_S)
