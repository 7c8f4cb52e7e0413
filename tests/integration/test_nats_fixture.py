"""The `NatsServer` harness: free ports, readiness, clear start errors, and JetStream data that
survives a restart or a crash (SIGKILL) on the same ports and store dir."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

import pytest
from nats.aio.client import Client as NatsClient

from kvfabric.testing import NatsServer, NatsServerError, wait_until

pytestmark = pytest.mark.integration

RECONNECT_TIMEOUT_S = 10.0


async def wait_reconnected(nc: NatsClient, reconnects_before: int) -> None:
    """`is_connected` alone can be stale right after a restart: wait for a new reconnect."""
    await wait_until(
        lambda: nc.is_connected and nc.stats["reconnects"] > reconnects_before,
        RECONNECT_TIMEOUT_S,
        what="client reconnected",
    )


def healthz_status(server: NatsServer) -> int:
    with urllib.request.urlopen(f"{server.monitor_url}/healthz?js-enabled-only=true", timeout=2) as r:
        status: int = r.status
        return status


async def test_fixture_server_is_ready_on_free_ports(
    nats_server: NatsServer, nats_client: NatsClient
) -> None:
    assert nats_server.running
    assert nats_server.url == f"nats://127.0.0.1:{nats_server.port}"
    assert nats_server.port != 4222
    assert nats_server.monitor_port not in (8222, nats_server.port)
    assert await asyncio.to_thread(healthz_status, nats_server) == 200

    sub = await nats_client.subscribe("t.ping")
    await nats_client.publish("t.ping", b"x")
    msg = await sub.next_msg(timeout=2.0)
    assert msg.data == b"x"
    account = await nats_client.jetstream().account_info()
    assert account.streams == 0


@pytest.mark.parametrize("crash", [False, True], ids=["stop", "kill"])
async def test_jetstream_kv_survives_restart(
    nats_server: NatsServer, nats_client: NatsClient, crash: bool
) -> None:
    kv = await nats_client.jetstream().create_key_value(bucket="shard_map")
    revision = await kv.put("shard.0", b"instance-a")
    port, monitor_port = nats_server.port, nats_server.monitor_port
    reconnects = nats_client.stats["reconnects"]

    await asyncio.to_thread(nats_server.restart, kill=crash)

    assert (nats_server.port, nats_server.monitor_port, nats_server.starts) == (port, monitor_port, 2)
    await wait_reconnected(nats_client, reconnects)
    kv = await nats_client.jetstream().key_value("shard_map")
    entry = await asyncio.wait_for(kv.get("shard.0"), 5.0)
    assert (entry.value, entry.revision) == (b"instance-a", revision)


async def test_clients_see_the_server_go_and_come_back(
    nats_server: NatsServer, nats_client: NatsClient
) -> None:
    reconnects = nats_client.stats["reconnects"]
    nats_server.kill()
    assert not nats_server.running

    await wait_until(lambda: not nats_client.is_connected, RECONNECT_TIMEOUT_S, what="client disconnected")
    await asyncio.to_thread(nats_server.start)
    await wait_reconnected(nats_client, reconnects)
    await asyncio.wait_for(nats_client.flush(), 5.0)


def test_start_failure_names_the_cause(nats_server: NatsServer, tmp_path: Path) -> None:
    clash = NatsServer(tmp_path / "clash", port=nats_server.port, ready_timeout_s=5.0)
    with pytest.raises(NatsServerError, match="exited with code") as failed:
        clash.start()
    assert "address already in use" in str(failed.value)
    assert not clash.running


def test_context_manager_stops_the_server(tmp_path: Path) -> None:
    with NatsServer(tmp_path / "cm") as server:
        assert server.running
        pid = server.pid
    assert not server.running
    assert pid is not None
    assert server.stop() is not None  # idempotent
