"""The directory service as a subprocess against a real nats-server: every endpoint, the events
stream, frees to segments, heartbeat loss, and typed errors for bad input (the service stays up).

One shard (one core): these tests read one core's endpoints (a lookup of several chunks under
one lease, the events of one core in order); requests go through a `DirectoryRouter`."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgspec
import nats.errors
import pytest
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from kvfabric.cluster.requests import error_from_response
from kvfabric.format.errors import (
    BadRequest,
    BatchTooLarge,
    NotFound,
    StaleGeneration,
    Unavailable,
    UnsupportedVersion,
)
from kvfabric.format.ids import GroupId, ObjectKey
from kvfabric.proto import directory as m
from kvfabric.proto.codec import encode
from kvfabric.proto.segment import FreeSlotsReply, FreeSlotsRequest, segment_decoder
from kvfabric.proto.subjects import Service, instance_subject, segment_subject
from kvfabric.proto.tickets import ticket_signature_valid
from kvfabric.testing import NatsServer, ServiceProcess, metric_value, micro_control, scrape_metrics_async
from tests.integration.cluster import ask_directory, directory_router
from tests.unit.core.dirkit import checksum_of, groups, key

pytestmark = pytest.mark.integration

SECRET = "integration-cluster-secret-0123"
TIMEOUT_S = 5.0


@pytest.fixture
def directory(nats_server: NatsServer) -> Iterator[ServiceProcess]:
    env = dict(
        os.environ,
        KVF_CLUSTER_SECRET=SECRET,
        # 2 s: the quiet segment's test must publish and look up (5 requests) before its silence
        # counts, and the fixture's segment beats every 0.1 s from the test's loop (a stall of
        # either on a loaded host is not a death); down is awaited within TIMEOUT_S.
        KVF_DIRECTORY_HEARTBEAT_TIMEOUT_MS="2000",
        KVF_DIRECTORY_TICK_MS="20",
        KVF_DIRECTORY_SHARDS="1",
    )
    proc = ServiceProcess.python_module(
        "kvfabric.directory", "--nats-url", nats_server.url, "--metrics-port", "0", "--log-json", env=env
    )
    proc.start()
    proc.wait_for_event("directory_started", 20.0)
    yield proc
    proc.stop(timeout_s=10.0)


async def call(nc: NatsClient, verb: str, message: msgspec.Struct) -> msgspec.Struct:
    return await ask_directory(await directory_router(nc), verb, message, TIMEOUT_S)


class FakeSegment:
    """Registers, heartbeats, and answers the directory's frees like a segment would."""

    def __init__(self, nc: NatsClient, segment_id: str) -> None:
        self.nc, self.segment_id, self.freed = nc, segment_id, []  # type: ignore[var-annotated]

    async def on_free(self, msg: Msg) -> None:
        req = segment_decoder.decode(msg.data)
        assert isinstance(req, FreeSlotsRequest)
        self.freed.extend(req.slots)
        await msg.respond(encode(FreeSlotsReply(incarnation=req.incarnation, freed=req.slots)))

    async def start(self) -> None:
        await self.nc.subscribe(segment_subject(self.segment_id, "free"), cb=self.on_free)
        await call(
            self.nc,
            "register",
            m.RegisterSegment(
                segment_id=self.segment_id,
                incarnation=1,
                capacity_bytes=1 << 30,
                domain=m.FailureDomain(host="h1"),
                data_addr="tcp://127.0.0.1:1",
            ),
        )

    async def heartbeat(self) -> None:
        await call(self.nc, "heartbeat", m.Heartbeat(segment_id=self.segment_id, incarnation=1, used_bytes=0))


@pytest.fixture
async def segment(nats_client: NatsClient, directory: ServiceProcess) -> AsyncIterator[FakeSegment]:
    seg = FakeSegment(nats_client, "seg-1")
    await seg.start()
    stop = asyncio.Event()

    async def beat() -> None:
        while not stop.is_set():
            await seg.heartbeat()
            await asyncio.sleep(0.1)

    task = asyncio.create_task(beat())
    yield seg
    stop.set()
    await asyncio.wait_for(task, TIMEOUT_S)


async def test_publish_lookup_release_evict_free_with_events(
    nats_client: NatsClient, segment: FakeSegment
) -> None:
    gs = groups(2)
    keys = [key(g) for g in gs]
    begin = await call(
        nats_client,
        "put_begin",
        m.PutBegin(
            writer_id="w",
            request_id="r1",
            objects=[m.ObjectSpec(key=k, size_bytes=4096, checksum=checksum_of(k)) for k in keys],
        ),
    )
    assert isinstance(begin, m.PutBeginReply)
    tickets = [r.tickets[0] for r in begin.results]
    assert all(ticket_signature_valid(t, SECRET.encode()) for t in tickets)
    miss = await call(nats_client, "lookup", m.Lookup(holder_id="h", groups=[g.group_id() for g in gs]))
    assert isinstance(miss, m.LookupReply) and miss.hit_chunks == 0
    confirm = await call(
        nats_client,
        "confirm",
        m.ConfirmReplicas(
            segment_id="seg-1",
            incarnation=1,
            confirms=[
                m.ReplicaConfirm(
                    ticket_id=t.ticket_id,
                    key=t.key,
                    slot=i,
                    slot_generation=1,
                    size_bytes=4096,
                    checksum=t.checksum,
                )
                for i, t in enumerate(tickets)
            ],
        ),
    )
    assert isinstance(confirm, m.ConfirmReply) and {r.status for r in confirm.results} == {"ok"}
    commit = await call(nats_client, "put_commit", m.PutCommit(writer_id="w", request_id="r2", keys=keys))
    assert isinstance(commit, m.PutCommitReply) and {r.status for r in commit.results} == {"published"}

    hit = await call(nats_client, "lookup", m.Lookup(holder_id="h", groups=[g.group_id() for g in gs]))
    assert isinstance(hit, m.LookupReply) and hit.hit_chunks == 2
    assert [o.replicas[0].slot for o in hit.objects] == [0, 1]
    renewed = await call(nats_client, "lease_renew", m.LeaseRenew(holder_id="h", lease_id=hit.lease_id))
    assert isinstance(renewed, m.LeaseReply) and renewed.expires_ms >= hit.lease_expires_ms
    leases = await call(nats_client, "list_leases", m.ListLeases())
    assert isinstance(leases, m.LeaseList) and [x.lease_id for x in leases.leases] == [hit.lease_id]
    refused = await call(nats_client, "evict", m.Evict(groups=[gs[1].group_id()]))
    assert isinstance(refused, m.EvictReply) and refused.results[0].status == "leased"
    await call(nats_client, "lease_release", m.LeaseRelease(holder_id="h", lease_id=hit.lease_id))
    pin = await call(nats_client, "pin", m.Pin(holder_id="admin", groups=[gs[0].group_id()], ttl_ms=60_000))
    assert isinstance(pin, m.PinReply) and pin.pinned_groups == 1
    evicted = await call(nats_client, "evict", m.Evict(groups=[g.group_id() for g in gs]))
    assert isinstance(evicted, m.EvictReply)
    assert [r.status for r in evicted.results] == ["pinned", "evicting"]
    await call(nats_client, "unpin", m.Unpin(holder_id="admin", pin_id=pin.pin_id))

    async def reserved_bytes() -> int:
        segs = await call(nats_client, "list_segments", m.ListSegments())
        assert isinstance(segs, m.SegmentList)
        return segs.segments[0].reserved_bytes

    async def settle() -> None:
        while await reserved_bytes() != 4096:
            await asyncio.sleep(0.02)

    await asyncio.wait_for(settle(), TIMEOUT_S)  # the segment freed slot 1; its reservation is gone
    assert [f.slot for f in segment.freed] == [1]
    shown = await call(nats_client, "show_group", m.ShowGroup(group=gs[0].to_bytes()))
    assert isinstance(shown, m.GroupList) and shown.groups[0].state == "published"
    listed = await call(nats_client, "list_groups", m.ListGroups())
    assert isinstance(listed, m.GroupList) and len(listed.groups) == 1

    js = nats_client.jetstream()
    sub = await js.pull_subscribe("kvf.v1.events.directory.>", durable=None, stream="KVF_DIRECTORY_EVENTS")
    # Lookup hits are batched per tick into GroupsAccessed, wherever the tick falls: not counted
    # here. So are the groups whose last pin ended: read on until the tick after the unpin.
    msgs: list[Any] = []
    events: list[Any] = []
    deadline = asyncio.get_running_loop().time() + TIMEOUT_S
    while len(events) < 5 and asyncio.get_running_loop().time() < deadline:
        with contextlib.suppress(TimeoutError, nats.errors.TimeoutError):
            msgs += await sub.fetch(10, timeout=0.5)
        events = [m.event_decoder.decode(x.data) for x in msgs]
        events = [e for e in events if not isinstance(e, m.GroupsAccessed)]
    # The shard's core started (its first event: followers list the directory again on it);
    # one put_commit, one published event naming its groups in order (issue 20); gs[1]'s
    # eviction; the unpin names the group it was the last pin of (stop 65).
    names = ["ShardStarted", "SegmentUp", "GroupsPublished", "GroupEvicted", "GroupsUnpinned"]
    assert [type(e).__name__ for e in events] == names
    assert isinstance(events[2], m.GroupsPublished)
    assert [p.group for p in events[2].groups] == [g.chain_hash for g in gs]
    assert isinstance(events[4], m.GroupsUnpinned)
    assert [ref.group for ref in events[4].groups] == [gs[0].chain_hash]
    seqs = [x.metadata.sequence.stream for x in msgs]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)


async def test_bad_input_gets_typed_errors_and_service_stays_up(
    nats_client: NatsClient, directory: ServiceProcess
) -> None:
    router = await directory_router(nats_client)
    subject = instance_subject(Service.DIRECTORY, "lookup", router.routes[0].instance)
    raw = await nats_client.request(subject, b"\xc1garbage", timeout=TIMEOUT_S)
    assert isinstance(error_from_response(raw.headers, raw.data), BadRequest)
    wrong_type = await nats_client.request(subject, encode(m.ListLeases()), timeout=TIMEOUT_S)
    assert isinstance(error_from_response(wrong_type.headers, wrong_type.data), BadRequest)
    future = await nats_client.request(
        subject, msgspec.msgpack.encode({"t": "dir.lookup.v9"}), timeout=TIMEOUT_S
    )
    assert isinstance(error_from_response(future.headers, future.data), BadRequest)
    with pytest.raises(BatchTooLarge):
        await call(
            nats_client,
            "lookup",
            m.Lookup(holder_id="h", groups=[GroupId(bytes(90))] * (m.LOOKUP_BATCH_GROUPS_MAX + 1)),
        )
    with pytest.raises(NotFound):
        await call(nats_client, "heartbeat", m.Heartbeat(segment_id="ghost", incarnation=1, used_bytes=0))
    with pytest.raises(Unavailable):  # the caller saw a newer directory epoch than this one's
        await call(nats_client, "list_groups", m.ListGroups(epoch=7))
    old = FakeSegment(nats_client, "seg-old")
    await old.start()
    with pytest.raises(StaleGeneration):  # an older process of a registered segment
        await call(
            nats_client,
            "register",
            m.RegisterSegment(
                segment_id="seg-old", incarnation=0, capacity_bytes=1, domain=m.FailureDomain(host="h")
            ),
        )
    bad_key = bytearray(key(groups(1)[0]))
    bad_key[0] = 9  # an unknown key encoding version
    with pytest.raises(UnsupportedVersion):
        await call(
            nats_client,
            "put_begin",
            m.PutBegin(
                writer_id="w",
                request_id="r",
                objects=[m.ObjectSpec(key=ObjectKey(bytes(bad_key)), size_bytes=1, checksum=b"0" * 16)],
            ),
        )
    ping = await micro_control(nats_client, "PING", "directory")
    assert ping["name"] == "directory"
    assert directory.returncode is None


async def test_silent_segment_goes_down_and_its_objects_stop_being_readable(
    nats_client: NatsClient, directory: ServiceProcess
) -> None:
    seg = FakeSegment(nats_client, "seg-quiet")
    await seg.start()
    (g,) = groups(1, seed=4)
    k = key(g)
    begin = await call(
        nats_client,
        "put_begin",
        m.PutBegin(
            writer_id="w",
            request_id="q",
            objects=[m.ObjectSpec(key=k, size_bytes=10, checksum=checksum_of(k))],
        ),
    )
    assert isinstance(begin, m.PutBeginReply)
    t = begin.results[0].tickets[0]
    await call(
        nats_client,
        "confirm",
        m.ConfirmReplicas(
            segment_id="seg-quiet",
            incarnation=1,
            confirms=[
                m.ReplicaConfirm(
                    ticket_id=t.ticket_id,
                    key=k,
                    slot=0,
                    slot_generation=1,
                    size_bytes=10,
                    checksum=t.checksum,
                )
            ],
        ),
    )
    await call(nats_client, "put_commit", m.PutCommit(writer_id="w", request_id="q2", keys=[k]))
    hit = await call(nats_client, "lookup", m.Lookup(holder_id="h", groups=[g.group_id()]))
    assert isinstance(hit, m.LookupReply) and hit.hit_chunks == 1

    async def until_down() -> None:
        while True:
            segs = await call(nats_client, "list_segments", m.ListSegments())
            assert isinstance(segs, m.SegmentList)
            if not segs.segments[0].up:
                return
            await asyncio.sleep(0.05)

    await asyncio.wait_for(until_down(), TIMEOUT_S)  # no heartbeats: down after 2 s
    after = await call(nats_client, "lookup", m.Lookup(holder_id="h", groups=[g.group_id()]))
    assert isinstance(after, m.LookupReply) and after.hit_chunks == 0
    with pytest.raises(NotFound):  # a down segment must register again (with a new incarnation)
        await seg.heartbeat()
    port = directory.wait_for_event("directory_standby", 1.0)["metrics_port"]
    text = await scrape_metrics_async(port)
    assert metric_value(text, "kvfabric_directory_segment_up", segment="seg-quiet") == 0.0
