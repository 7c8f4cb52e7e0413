"""The directory's events stream after a full disk (kvfabric.directory.events, docs/chaos.md "A full
JetStream disk"): a real nats-server with its store on an 8 MiB tmpfs (root), the events stream's
store write fails with ENOSPC, the space comes back, and nats-server (2.15.1) still refuses every
append: the stream keeps its write error (`/healthz` says so). The publisher notices it is stuck,
recreates the stream with its sequences continued, and the event is appended; a follower (an
ephemeral pull consumer, as the eviction policy's and the router's) resumes at the next sequence.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import nats
import nats.js.errors
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StreamConfig

from kvfabric.directory.events import EVENTS_STREAM, EventPublisher, EventsStream
from kvfabric.testing.nats_server import NatsServer
from tests.unit.tools.toolkit import load_tool

pytestmark = [pytest.mark.timeout(120)]

cs = load_tool("chaos_store")
SUBJECT = "kvf.v1.events.directory.published"
BIG = b"e" * (128 << 10)  # an event large enough to need new pages of the full tmpfs
STORE_BYTES = 8 << 20


def healthz(server: NatsServer) -> str:
    """nats-server's health: "ok", or its error (a stream's kept write error among them)."""
    try:
        with urllib.request.urlopen(f"{server.monitor_url}/healthz", timeout=2) as reply:
            body = json.loads(reply.read())
    except urllib.error.HTTPError as err:
        body = json.loads(err.read())
    return str(body.get("error") or body.get("status"))


async def stick_the_stream(js: nats.js.JetStreamContext, store: object, server: NatsServer) -> None:
    """Fill the disk and append until the events stream's store write fails; free the disk."""
    store.fire({"action": "fill_store"})  # type: ignore[attr-defined]
    for _ in range(40):
        if "write error" in healthz(server):
            break
        with contextlib.suppress(TimeoutError, nats.errors.Error):
            await js.publish(SUBJECT, BIG, timeout=0.5)
    store.fire({"action": "free_store"})  # type: ignore[attr-defined]
    assert f"'$G > {EVENTS_STREAM}' write error" in healthz(server)


def test_a_stream_stuck_after_a_full_disk_is_recreated_with_its_sequences_continued() -> None:
    asyncio.run(_stuck_stream_recreated())


async def _stuck_stream_recreated() -> None:
    run = Path(tempfile.mkdtemp(prefix="kvf-events-repair-test-"))
    store = cs.StoreDisk()
    store.prepare(run, {"nats_store_bytes": STORE_BYTES})
    server = NatsServer(run / "nats")
    try:
        server.start()
        nc = await nats.connect(server.url)
        js = nc.jetstream(timeout=2.0)
        config = StreamConfig(name=EVENTS_STREAM, subjects=["kvf.v1.events.directory.>"], max_age=600.0)
        stream = EventsStream(nc, config, stuck_after_failures=3, repair_jitter_s=0.0)
        await stream.ensure()
        publisher = EventPublisher(stream, publish_timeout_s=0.5, retry_s=0.05, name="test")
        assert [await publisher.publish(SUBJECT, b"x") for _ in range(3)] == [1, 2, 3]
        follower = await js.pull_subscribe(
            "kvf.v1.events.directory.>",
            stream=EVENTS_STREAM,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE),
        )
        assert [m.metadata.sequence.stream for m in await follower.fetch(10, timeout=1)] == [1, 2, 3]

        await stick_the_stream(js, store, server)
        last = (await js.stream_info(EVENTS_STREAM)).state.last_seq
        with pytest.raises(TimeoutError):  # sticky: the space is back, the append still fails
            await js.publish(SUBJECT, b"y", timeout=1.0)

        seq = await asyncio.wait_for(publisher.publish(SUBJECT, b"z"), timeout=30)
        assert seq == last + 1  # sequences go on where they stopped
        assert stream.recreated == 1 and stream.repairs_failed == 0
        assert stream.failures["timeout"] >= 3 and not stream.stuck
        assert healthz(server) == "ok"
        assert [await publisher.publish(SUBJECT, b"w") for _ in range(2)] == [last + 2, last + 3]

        # The follower's consumer died with the old stream: its fetch fails, and a consumer
        # created after the last sequence it applied resumes without a gap.
        with pytest.raises(nats.js.errors.Error):
            await follower.fetch(10, timeout=1)
        resumed = await js.pull_subscribe(
            "kvf.v1.events.directory.>",
            stream=EVENTS_STREAM,
            config=ConsumerConfig(
                deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                opt_start_seq=last + 1,
                ack_policy=AckPolicy.NONE,
            ),
        )
        got = [(m.metadata.sequence.stream, m.data) for m in await resumed.fetch(10, timeout=1)]
        assert got == [(last + 1, b"z"), (last + 2, b"w"), (last + 3, b"w")]
        await nc.close()
    finally:
        server.stop()
        assert store.close(run) == []
