"""Stale leaders are fenced by epoch (docs/design.md invariant 4) where the bytes and the answers
are: a segment that has heard of a newer directory epoch refuses the older epoch's write tickets
and frees, and a client that has seen a newer epoch ignores replies carrying an older one."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import pytest
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from prometheus_client import generate_latest

from kvfabric.client import AsyncKvClient, ClientSettings
from kvfabric.cluster.requests import request
from kvfabric.dataplane.tcp import TcpDataClient
from kvfabric.format.checksum import checksum
from kvfabric.format.errors import StaleGeneration
from kvfabric.proto import directory as m
from kvfabric.proto.codec import encode
from kvfabric.proto.segment import FreeSlotsRequest, ReportRequest, SegmentReport, segment_decoder
from kvfabric.proto.subjects import Service, endpoint_subject, instance_subject, segment_subject
from kvfabric.testing import NatsServer, ServiceProcess, metric_value
from tests.integration.clientkit import SPEC, TOKENS_PER_CHUNK, prompt
from tests.integration.cluster import TIMEOUT_S, directory_call, directory_process, segment_process
from tests.unit.core.dirkit import groups, key

pytestmark = pytest.mark.integration

SEGMENT = "seg-epoch"
NEWER_EPOCH = 1 << 40  # what a new leader's report would carry
FAKE = "fake"  # the instance id of the fake directory


@pytest.fixture
def cluster(nats_server: NatsServer) -> Iterator[ServiceProcess]:
    with directory_process(nats_server), segment_process(nats_server, SEGMENT) as segment:
        yield segment


async def test_a_segment_refuses_tickets_and_frees_of_an_older_epoch(
    nats_client: NatsClient, cluster: ServiceProcess
) -> None:
    nc = nats_client
    (g1, g2) = groups(2, seed=77)
    data = os.urandom(4096)
    # A ticket of the current leader of its shard for later, and one object stored under it now.
    tickets = []
    for g in (g1, g2):
        reply = await directory_call(
            nats_client,
            "put_begin",
            m.PutBegin(
                writer_id="w",
                request_id=g.chain_hash.hex(),
                objects=[m.ObjectSpec(key=key(g), size_bytes=len(data), checksum=checksum(data))],
            ),
        )
        assert isinstance(reply, m.PutBeginReply)
        tickets.append(reply.results[0].tickets[0])
    with TcpDataClient.connect(tickets[0].data_addr) as data_client:
        await asyncio.to_thread(data_client.put, tickets[0], data)
    # A newer leader of each ticket's shard reports: from now on the tickets' epochs (and any
    # older) are fenced at this segment for those shards. A report lists every shard's objects.
    reports = [
        await request(
            nc,
            segment_subject(SEGMENT, "report"),
            ReportRequest(epoch=NEWER_EPOCH, shard=shard),
            segment_decoder,
            TIMEOUT_S,
        )
        for shard in sorted({t.shard for t in tickets})
    ]
    report = reports[0]
    assert isinstance(report, SegmentReport) and len(report.objects) == 1
    assert all(isinstance(r, SegmentReport) and r.objects == report.objects for r in reports)
    held = report.objects[0]
    with pytest.raises(StaleGeneration):  # the old leader's free of a stored slot: refused
        await request(
            nc,
            segment_subject(SEGMENT, "free"),
            FreeSlotsRequest(
                segment_id=SEGMENT,
                incarnation=report.incarnation,
                slots=[m.FreedSlot(held.key, held.slot, held.slot_generation)],
                epoch=tickets[0].epoch,
                shard=tickets[0].shard,
            ),
            segment_decoder,
            TIMEOUT_S,
        )
    with TcpDataClient.connect(tickets[1].data_addr) as data_client, pytest.raises(StaleGeneration):
        await asyncio.to_thread(data_client.put, tickets[1], data)  # the old leader's ticket: refused
    again = await request(
        nc,
        segment_subject(SEGMENT, "report"),
        ReportRequest(epoch=NEWER_EPOCH, shard=tickets[0].shard),
        segment_decoder,
        TIMEOUT_S,
    )
    assert isinstance(again, SegmentReport)
    assert [(o.slot, o.slot_generation) for o in again.objects] == [(held.slot, held.slot_generation)]


async def test_a_client_ignores_replies_from_an_older_epoch(
    nats_server: NatsServer, nats_client: NatsClient
) -> None:
    epochs = iter([5, 3])  # a new leader answers, then a paused old one wakes up and answers

    async def fake_shard_map(msg: Msg) -> None:  # one shard, led by the fake under epoch 1
        leaders = [m.ShardLeader(0, FAKE, 1)]
        await msg.respond(encode(m.ShardMapReply(shards=1, instance=FAKE, leaders=leaders)))

    async def fake_directory(msg: Msg) -> None:
        await msg.respond(encode(m.LookupReply(epoch=next(epochs), hit_chunks=0)))

    await nats_client.subscribe(endpoint_subject(Service.DIRECTORY, "shard_map"), cb=fake_shard_map)
    await nats_client.subscribe(instance_subject(Service.DIRECTORY, "lookup", FAKE), cb=fake_directory)
    await nats_client.flush()
    kv = AsyncKvClient(ClientSettings(nats_url=nats_server.url), SPEC)
    await kv.start()
    try:
        tokens = prompt(2 * TOKENS_PER_CHUNK)
        assert (await kv.lookup(tokens)).chunks == 0  # epoch 5 seen
        assert (await kv.lookup(tokens)).chunks == 0  # epoch 3: stale, a miss, not used
        text = generate_latest(kv.metrics.registry).decode()
        assert metric_value(text, "kvfabric_client_fallbacks_total", cause="directory_stale_epoch") == 1
    finally:
        await kv.close()
