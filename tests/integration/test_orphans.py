"""Nothing leaks: space a segment holds for objects nobody will publish comes back, so segment
usage returns to exactly the bytes of published objects.
- a writer that wrote and confirmed a member but died before `put_commit`: its write deadline
  passes and the directory frees the slot;
- slots the directory does not know at all (a leader died with a half-written group in its
  memory): the new leader's rebuild finds them on the segment, and frees them once its grace
  period has passed (by slot and generation)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time

import nats
import pytest

from kvfabric.dataplane.tcp import TcpDataClient
from kvfabric.format.checksum import checksum
from kvfabric.proto import directory as m
from kvfabric.testing import NatsServer
from tests.integration.clientkit import CHUNK_BYTES, TOKENS_PER_CHUNK, client, objects_for, prompt
from tests.integration.cluster import directory_call, directory_process, segment_process, segment_state
from tests.unit.core.dirkit import groups, key

pytestmark = pytest.mark.integration

# A 2 s leader lease (not 1 s: a spurious failover on a loaded host before the kill would give
# the second doomed write to the standby, which then never loses it).
HA_ENV = {"KVF_DIRECTORY_LEADER_LEASE_TTL_MS": "2000", "KVF_DIRECTORY_LEASE_TTL_MS_MAX": "1500"}
SEGMENT = "seg-o"


async def write_unpublished(url: str, seed: int, write_ttl_ms: int) -> int:
    """Begin a 2-rank group, write and confirm rank 0 only, never commit. Returns bytes written."""
    (g,) = groups(1, seed=seed, tp_size=2)
    data = bytes([seed % 256]) * 4096
    nc = await nats.connect(url)
    try:
        reply = await directory_call(
            nc,
            "put_begin",
            m.PutBegin(
                writer_id=f"doomed-{seed}",
                request_id=f"r{seed}",
                write_ttl_ms=write_ttl_ms,
                objects=[m.ObjectSpec(key=key(g, rank=0), size_bytes=len(data), checksum=checksum(data))],
            ),
        )
        assert isinstance(reply, m.PutBeginReply) and reply.results[0].status == "placed"
        (ticket,) = reply.results[0].tickets
        with TcpDataClient.connect(ticket.data_addr) as data_client:
            await asyncio.to_thread(data_client.put, ticket, data)  # stored and confirmed
        return len(data)
    finally:
        await nc.close()


async def used_bytes(url: str) -> int:
    nc = await nats.connect(url)
    try:
        return (await segment_state(nc, SEGMENT)).used_bytes
    finally:
        await nc.close()


def wait_used(url: str, want: int, timeout_s: float) -> None:
    async def go() -> None:
        while await used_bytes(url) != want:
            await asyncio.sleep(0.1)

    asyncio.run(asyncio.wait_for(go(), timeout_s))


def test_unpublished_writes_are_reclaimed_to_exactly_the_published_bytes(nats_server: NatsServer) -> None:
    tokens = prompt(4 * TOKENS_PER_CHUNK, seed=42)
    published = 4 * CHUNK_BYTES
    with contextlib.ExitStack() as stack:
        leader = stack.enter_context(directory_process(nats_server, **HA_ENV))
        stack.enter_context(segment_process(nats_server, SEGMENT))
        stack.enter_context(directory_process(nats_server, ready_event="directory_standby", **HA_ENV))
        with client(nats_server) as writer:
            assert writer.save(tokens, objects_for(tokens, 0, 4)).chunks_saved == 4
        assert asyncio.run(used_bytes(nats_server.url)) == published

        # A writer dies after confirming, before committing: its deadline reclaims the slot.
        # (3 s: the deadline runs from put_begin, and the check below must come before it.)
        extra = asyncio.run(write_unpublished(nats_server.url, seed=1, write_ttl_ms=3_000))
        assert asyncio.run(used_bytes(nats_server.url)) == published + extra
        wait_used(nats_server.url, published, 10.0)

        # A half-written group the leader knew, then the leader dies: the new leader does not know
        # the slot; its rebuild finds it incomplete and frees it after the grace period.
        asyncio.run(write_unpublished(nats_server.url, seed=2, write_ttl_ms=600_000))
        assert asyncio.run(used_bytes(nats_server.url)) == published + extra
        leader.send_signal(signal.SIGKILL)
        started = time.monotonic()
        wait_used(nats_server.url, published, 20.0)
        reclaimed_s = time.monotonic() - started
        assert reclaimed_s >= 1.5  # not before the grace period (the old leader's longest lease)
        with client(nats_server) as reader:  # and what was published is intact
            hit = reader.lookup(tokens)
            assert hit.chunks == 4
            reader.release(hit)
