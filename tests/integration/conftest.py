"""Integration fixtures: the echo service as a subprocess against the test's nats-server."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest

from kvfabric.testing import NatsServer, ServiceProcess

STARTUP_TIMEOUT_S = 15.0

StartEcho = Callable[..., Awaitable[tuple[ServiceProcess, dict[str, Any]]]]


@pytest.fixture
def start_echo(nats_server: NatsServer) -> Iterator[StartEcho]:
    """`await start_echo("--inflight-max", "2")` -> (process, its `service_started` log record).

    The service runs as `sys.executable -m kvfabric.runtime.echo_service` with JSON logs and a
    free metrics port; it is stopped (SIGTERM, then SIGKILL) after the test.
    """
    started: list[ServiceProcess] = []

    async def start(*args: str) -> tuple[ServiceProcess, dict[str, Any]]:
        proc = ServiceProcess.python_module(
            "kvfabric.runtime.echo_service",
            "--nats-url",
            nats_server.url,
            "--metrics-port",
            "0",
            "--log-json",
            *args,
        )
        proc.start()
        started.append(proc)
        record = await proc.wait_for_event_async("service_started", STARTUP_TIMEOUT_S)
        return proc, record

    yield start
    for proc in started:
        proc.stop(timeout_s=10.0)
