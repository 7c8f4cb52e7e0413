"""A segment's heartbeats reach every shard leader on time even when one instance never answers.

An instance killed with a heartbeat in flight gives no reply and no "no responders": the request
runs into its timeout. If a heartbeat round waited that long (5 s) for it, the next round to the
other instances came too late, they declared the segment down (heartbeat timeout), and it
restarted empty: every shard's objects on it lost by one directory kill (seen in the
leader-failover drill). A "ghost" instance here claims one of two shards in the map and swallows
heartbeats; the real directory must keep the segment up.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

import nats
from nats.aio.msg import Msg

from kvfabric.proto import directory as m
from kvfabric.proto.codec import encode
from kvfabric.proto.subjects import Service, endpoint_subject, instance_subject
from kvfabric.testing import NatsServer
from tests.integration.cluster import directory_call, directory_process, segment_process

GHOST_EPOCH = 1 << 40  # newer than any real epoch: routers send shard 1's traffic to the ghost
SWALLOW_WANTED = 6  # heartbeats the ghost must swallow: 6 s of it, past the 4 s heartbeat timeout
WATCH_S_MAX = 60.0  # the segment finds the ghost at a map refresh (every 10 beats); the real
# directory can answer the map first and alone cover both shards, so a refresh may miss the ghost


async def ghost_instance(url: str, seconds_max: float, ready: threading.Event) -> int:
    """Claims shard 1 (`ready` once it answers) until it swallowed `SWALLOW_WANTED` heartbeats, at
    most `seconds_max`; returns the heartbeats it swallowed."""
    nc = await nats.connect(url)
    swallowed = 0
    enough = asyncio.Event()

    async def shard_map(msg: Msg) -> None:
        leaders = [m.ShardLeader(1, "ghost", GHOST_EPOCH)]
        await nc.publish(msg.reply, encode(m.ShardMapReply(shards=2, instance="ghost", leaders=leaders)))

    async def heartbeat(msg: Msg) -> None:
        nonlocal swallowed
        swallowed += 1  # no reply: as an instance killed with the request in flight
        if swallowed >= SWALLOW_WANTED:
            enough.set()

    try:
        await nc.subscribe(endpoint_subject(Service.DIRECTORY, "shard_map"), cb=shard_map)
        await nc.subscribe(instance_subject(Service.DIRECTORY, "heartbeat", "ghost"), cb=heartbeat)
        await nc.flush()
        ready.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(enough.wait(), seconds_max)
        return swallowed
    finally:
        await nc.close()


async def segments_up(url: str) -> list[tuple[str, bool]]:
    nc = await nats.connect(url)
    try:
        reply = await directory_call(nc, "list_segments", m.ListSegments(shard=0))
        assert isinstance(reply, m.SegmentList)
        return [(s.segment_id, s.up) for s in reply.segments]
    finally:
        await nc.close()


def test_a_silent_instance_does_not_hold_back_heartbeats_to_the_others(nats_server: NatsServer) -> None:
    with directory_process(
        nats_server,
        KVF_DIRECTORY_SHARDS="2",
        KVF_DIRECTORY_HEARTBEAT_INTERVAL_MS="1000",
        KVF_DIRECTORY_HEARTBEAT_TIMEOUT_MS="4000",
    ) as directory:
        swallowed: list[int] = []
        ready = threading.Event()
        ghost = threading.Thread(
            target=lambda: swallowed.append(asyncio.run(ghost_instance(nats_server.url, WATCH_S_MAX, ready))),
            daemon=True,
        )
        ghost.start()
        assert ready.wait(30.0)  # the ghost is in the map before the segment first asks for it
        with segment_process(nats_server, "seg-hb") as segment:
            ghost.join(WATCH_S_MAX + 10)
            got = swallowed[0] if swallowed else None
            assert got is not None and got >= SWALLOW_WANTED, f"the ghost swallowed {got}: proves nothing"
            assert "segment_declared_down" not in segment.output_tail(200)
            assert segment.returncode is None, segment.output_tail(20)
            assert asyncio.run(segments_up(nats_server.url)) == [("seg-hb", True)]
        assert directory.returncode is None
