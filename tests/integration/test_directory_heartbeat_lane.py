"""Segments' heartbeats are heard while the events stream is stuck (review, 2026-12-06).

When JetStream stops taking events (a full disk), the events outbox fills and every handler
that emits an event (commits, evictions, registrations) waits on it, holding an in-flight slot.
Heartbeats shared those slots: once they were all held, heartbeats were refused `busy` before
the core saw them, and the next tick (the loop not stalled, NATS connected) declared every
segment down; each then restarted empty. Now heartbeats are answered from the give-back lane
(they emit no event where their segment is known)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import nats
import pytest

from kvfabric.cluster.requests import request
from kvfabric.core.directory import EmitEvent
from kvfabric.directory.shard_host import ShardHost
from kvfabric.directory.shell import DirectoryShell
from kvfabric.format.clock import now_ms
from kvfabric.proto import directory as m
from kvfabric.proto.subjects import Service
from kvfabric.runtime.config import RuntimeSettings
from kvfabric.runtime.service import ServiceRuntime
from kvfabric.testing import NatsServer
from tests.unit.core.dirkit import new_core, register

pytestmark = pytest.mark.integration


class NoRegistry:
    async def put(self, registration: Any) -> None:
        return None

    async def get(self, segment_id: str) -> None:
        return None

    async def all(self) -> list[Any]:
        return []


def registration(segment_id: str) -> m.RegisterSegment:
    return m.RegisterSegment(
        segment_id=segment_id,
        incarnation=1,
        capacity_bytes=10_000,
        domain=m.FailureDomain(host=segment_id, rack="r", zone="z"),
        data_addr=f"tcp://{segment_id}",
    )


async def test_heartbeats_pass_a_service_full_of_writes_stuck_on_the_events_stream(
    nats_server: NatsServer,
) -> None:
    core = new_core(heartbeat_timeout_ms=5_000)
    started_ms = now_ms()
    register(core, "seg-a", now=started_ms)
    shell = DirectoryShell(core, tick_ms=100, events_outbox_max=1, events_max_age_s=60, free_timeout_s=1.0)
    host = ShardHost("d1", 1, core.config, registry=NoRegistry(), make_shell=lambda c: shell)  # type: ignore[arg-type]
    host.shells[0] = shell
    runtime = ServiceRuntime(
        Service.DIRECTORY,
        RuntimeSettings(
            nats_url=nats_server.url, instance_id="d1", inflight_max=4, metrics_port=-1, shutdown_grace_ms=100
        ),
        version="0.0.1",
        description="t",
    )
    host.attach(runtime)
    await runtime.start()
    nc = await nats.connect(nats_server.url)
    stuck: list[asyncio.Task[Any]] = []
    try:
        # JetStream stuck: no publisher takes the outbox's one event, so it stays full
        down = m.SegmentDown(segment_id="x", incarnation=1, reason="t")
        await shell.perform([EmitEvent("segment_down", down)])
        for i in range(4):  # registrations emit `segment_up`: each waits, holding a slot
            stuck.append(
                asyncio.create_task(
                    request(nc, "kvf.v1.directory.register.d1", registration(f"seg-{i}"), m.reply_decoder, 30)
                )
            )
        deadline = time.monotonic() + 10.0  # (a fixed 0.3 s was a guess at nats-server's speed)
        while runtime.inflight_count < 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert runtime.inflight_count == 4  # every slot of the work lane is held
        beat = m.Heartbeat(segment_id="seg-a", incarnation=1, used_bytes=0)
        for _ in range(3):  # seg-a heartbeats on: each must reach the core
            reply = await request(nc, "kvf.v1.directory.heartbeat.d1", beat, m.reply_decoder, 1)
            assert isinstance(reply, m.HeartbeatAck)
            await asyncio.sleep(0.5)
        assert core.segments["seg-a"].last_heartbeat_ms >= started_ms + 1_000  # heard, not refused
    finally:
        for task in stuck:
            task.cancel()
        await nc.close()
        await runtime.stop()


async def test_a_shard_that_must_be_introduced_does_not_hold_the_heartbeat_from_the_others() -> None:
    """A heartbeat to a shard that never saw its segment registers it there (`segment_up`: an
    event), which waits while that shard's events outbox is full; the shards after it in the
    broadcast did not hear the heartbeat meanwhile (review, 2026-12-06). Known shards go first."""
    heard: list[int] = []

    class Core:
        def __init__(self, knows: bool) -> None:
            self.segments = {"seg-a": object()} if knows else {}
            self.epoch = 1

    class Shell:
        def __init__(self, shard: int, knows: bool) -> None:
            self.shard, self.core = shard, Core(knows)

        def may_act(self) -> bool:
            return True

        async def handle(self, message: Any, **_: Any) -> Any:
            if isinstance(message, m.RegisterSegment):
                await asyncio.sleep(3600)  # its outbox is full: `segment_up` waits
            heard.append(self.shard)
            return m.HeartbeatAck(epoch=1)

    class Registry(NoRegistry):
        async def get(self, segment_id: str) -> Any:
            return registration(segment_id)

    core = new_core()
    host = ShardHost("d1", 2, core.config, registry=Registry(), make_shell=lambda c: None)  # type: ignore[arg-type,return-value]
    host.shells = {0: Shell(0, knows=False), 1: Shell(1, knows=True)}  # type: ignore[dict-item]
    beat = m.Heartbeat(segment_id="seg-a", incarnation=1, used_bytes=0)
    broadcast = asyncio.create_task(host._broadcast(beat))
    try:
        await asyncio.sleep(0.2)
        assert heard == [1]  # shard 1 heard it while shard 0 waits on its introduction
    finally:
        broadcast.cancel()
        await asyncio.gather(broadcast, return_exceptions=True)
