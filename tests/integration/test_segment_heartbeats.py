"""A segment's heartbeats reach every shard leader on time even when one instance never answers.

An instance killed with a heartbeat in flight gives no reply and no "no responders": the request
runs into its timeout. If a heartbeat round waited that long (5 s) for it, the next round to the
other instances came too late, they declared the segment down (heartbeat timeout), and it
restarted empty: every shard's objects on it lost by one directory kill (seen in the
leader-failover drill). A "ghost" instance here holds shard 1's leader lease (taken in the
leaders bucket before the real directory starts, so the real one leads shard 0 only and every
shard map the segment gathers names the ghost) and swallows heartbeats; the real directory must
keep the segment up.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import textwrap
import threading
import time
from pathlib import Path

import nats
from nats.aio.msg import Msg
from nats.js.api import KeyValueConfig, StorageType

from kvfabric.core.leadership import key_of
from kvfabric.directory.kv_buckets import LEADERS_BUCKET
from kvfabric.proto import directory as m
from kvfabric.proto.codec import encode
from kvfabric.proto.subjects import Service, endpoint_subject, instance_subject
from kvfabric.runtime.service import EXIT_SOFTWARE
from kvfabric.testing import NatsServer
from tests.integration.cluster import directory_process, directory_router, segment_process

GHOST_SHARD = 1
LEASE_TTL_S = 3.0  # the directory's leader lease on one nats-server (KVF_DIRECTORY_LEADER_LEASE_TTL_MS)
RENEW_S = 0.5
SWALLOW_WANTED = 6  # heartbeats the ghost must swallow: 6 s of it, past the 4 s heartbeat timeout
WATCH_S_MAX = 60.0


class Ghost:
    """Holds shard 1's leader lease and answers the shard map for it, but swallows every heartbeat
    (no reply: as an instance killed with the request in flight) until `stop`."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.swallowed = 0
        self.ready = threading.Event()  # the lease is held and the shard map answered
        self.stop = threading.Event()
        self.error: BaseException | None = None  # what ended it early (said by the test)

    def run_in_thread(self) -> None:
        try:
            asyncio.run(self.run())
        except BaseException as exc:
            self.error = exc
            raise

    async def run(self) -> None:
        nc = await nats.connect(self.url)
        try:
            kv = await nc.jetstream().create_key_value(
                KeyValueConfig(bucket=LEADERS_BUCKET, history=1, ttl=LEASE_TTL_S, storage=StorageType.FILE)
            )
            epoch = revision = await kv.create(key_of(GHOST_SHARD), b"ghost")

            async def shard_map(msg: Msg) -> None:
                leaders = [m.ShardLeader(GHOST_SHARD, "ghost", epoch)]
                reply = m.ShardMapReply(shards=2, instance="ghost", leaders=leaders)
                await nc.publish(msg.reply, encode(reply))

            async def heartbeat(msg: Msg) -> None:
                self.swallowed += 1

            await nc.subscribe(endpoint_subject(Service.DIRECTORY, "shard_map"), cb=shard_map)
            await nc.subscribe(instance_subject(Service.DIRECTORY, "heartbeat", "ghost"), cb=heartbeat)
            await nc.flush()
            self.ready.set()
            while not self.stop.is_set():
                await asyncio.sleep(RENEW_S)
                revision = await kv.update(key_of(GHOST_SHARD), b"ghost", last=revision)
            with contextlib.suppress(nats.errors.Error):
                await kv.delete(key_of(GHOST_SHARD))
        finally:
            await nc.close()


async def segments_up_on_shard_0(url: str) -> list[tuple[str, bool]]:
    """The real directory's view (the ghost answers no listing)."""
    nc = await nats.connect(url)
    try:
        router = await directory_router(nc)
        reply = await router.ask(0, "list_segments", m.ListSegments(shard=0), 5.0)
        assert isinstance(reply, m.SegmentList)
        return [(s.segment_id, s.up) for s in reply.segments]
    finally:
        await nc.close()


def test_a_silent_instance_does_not_hold_back_heartbeats_to_the_others(nats_server: NatsServer) -> None:
    ghost = Ghost(nats_server.url)
    thread = threading.Thread(target=ghost.run_in_thread, daemon=True)
    thread.start()
    try:
        # shard 1 is the ghost's before the real directory starts
        assert ghost.ready.wait(30.0), f"the ghost did not start: {ghost.error!r}"
        with directory_process(
            nats_server,
            KVF_DIRECTORY_SHARDS="2",
            KVF_DIRECTORY_HEARTBEAT_INTERVAL_MS="1000",
            KVF_DIRECTORY_HEARTBEAT_TIMEOUT_MS="4000",
            KVF_DIRECTORY_LEADER_LEASE_TTL_MS=str(int(LEASE_TTL_S * 1000)),
        ) as directory:
            assert '"shards_led": 1' in directory.output_tail(200), directory.output_tail(20)
            with segment_process(nats_server, "seg-hb") as segment:
                deadline = time.monotonic() + WATCH_S_MAX
                while ghost.swallowed < SWALLOW_WANTED and time.monotonic() < deadline:
                    assert ghost.error is None, f"the ghost stopped: {ghost.error!r}"
                    assert "segment_declared_down" not in segment.output_tail(200), segment.output_tail(20)
                    time.sleep(0.2)
                assert ghost.swallowed >= SWALLOW_WANTED, f"the ghost swallowed {ghost.swallowed}"
                assert "segment_declared_down" not in segment.output_tail(200)
                assert segment.returncode is None, segment.output_tail(20)
                assert asyncio.run(segments_up_on_shard_0(nats_server.url)) == [("seg-hb", True)]
            assert directory.returncode is None
    finally:
        ghost.stop.set()
        thread.join(10.0)


HEARTBEAT_RAISES = textwrap.dedent(
    """
    import os

    if os.environ.get("KVF_SEGMENT_ID") == "seg-broken":
        from kvfabric.segment_storage import shell

        original = shell.SegmentShell._every_leader

        async def every_leader(self, verb, message, *args, **kwargs):
            if verb == "heartbeat":
                raise RuntimeError("an error nobody expected")
            return await original(self, verb, message, *args, **kwargs)

        shell.SegmentShell._every_leader = every_leader
    """
)


def test_a_heartbeat_loop_that_dies_stops_the_segment(nats_server: NatsServer, tmp_path: Path) -> None:
    """The heartbeat loop retried on `KvfError` only; anything else (a NATS error out of the
    shard-map refresh in an outage) ended it silently, and the segment served on, declared down
    by the directory, never re-registering (review, 2026-12-06). Its tasks are now watched: one
    that fails stops the segment with EXIT_SOFTWARE, and its supervisor restarts it."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(HEARTBEAT_RAISES)
    path = os.pathsep.join(p for p in (str(inject), os.environ.get("PYTHONPATH", "")) if p)
    with directory_process(nats_server), segment_process(nats_server, "seg-broken", PYTHONPATH=path) as seg:
        assert seg.wait(20.0) == EXIT_SOFTWARE
        assert seg.wait_for_event("task_failed", 1.0)["task"] == "segment-heartbeats"
