"""Segment service + directory as subprocesses: put then get identical bytes over TCP and shared
memory for 1 B … 64 MiB, a writer killed mid-put leaks nothing, a corrupted arena byte is caught by
the reader's checksum, bad input gets typed errors and the segment stays up, directory frees land."""

from __future__ import annotations

import asyncio
import mmap
import os
import socket
from collections.abc import Iterator

import msgspec
import pytest
from nats.aio.client import Client as NatsClient

from kvfabric.dataplane.addresses import pick, split_host_port
from kvfabric.dataplane.frames import READS_MAX, Op, pack_header
from kvfabric.dataplane.shm import ShmReader, verify
from kvfabric.dataplane.tcp import TcpDataClient
from kvfabric.format.checksum import checksum
from kvfabric.format.errors import BadRequest, ChecksumMismatch, Unauthorized
from kvfabric.format.ids import ObjectKey, group_id_in_key
from kvfabric.proto import directory as m
from kvfabric.proto.codec import encode
from kvfabric.proto.dataplane import PutRequest, ReadRef
from kvfabric.testing import NatsServer, ServiceProcess, metric_value, scrape_metrics_async
from tests.integration.cluster import (
    directory_call,
    directory_process,
    directory_router,
    segment_process,
    segment_state,
    signed_ref,
)
from tests.unit.core.dirkit import groups, key

pytestmark = pytest.mark.integration

SEGMENT = "seg-a"
SIZES = [1, 4096, 1 << 20, 16 << 20, 64 << 20]


@pytest.fixture
def cluster(nats_server: NatsServer) -> Iterator[ServiceProcess]:
    with (
        directory_process(nats_server),
        # The scrubber is off: these tests flip stored bytes and read them back through each
        # transport; a scrub pass finding the flip first frees the object (`stale_generation`:
        # CI failure, 2026-12-06). Scrubbing is tested in test_corruption_reports.py and
        # tests/unit/segment_storage/test_copy_scrub.py.
        segment_process(
            nats_server, SEGMENT, KVF_SEGMENT_UCX="1", KVF_SEGMENT_SCRUB_BYTES_PER_S="0"
        ) as segment,
    ):
        yield segment


@pytest.fixture
def placed(nats_client: NatsClient, cluster: ServiceProcess) -> NatsClient:
    """A NATS client of the test, with a directory and segment SEGMENT running."""
    return nats_client


async def begin(
    nc: NatsClient, k: ObjectKey, data: bytes, *, writer: str = "w", digest: bytes | None = None
) -> m.WriteTicket:
    reply = await directory_call(
        nc,
        "put_begin",
        m.PutBegin(
            writer_id=writer,
            request_id=k[58:90].hex(),
            objects=[m.ObjectSpec(key=k, size_bytes=len(data), checksum=digest or checksum(data))],
        ),
    )
    assert isinstance(reply, m.PutBeginReply) and reply.results[0].status == "placed"
    return reply.results[0].tickets[0]


async def put_and_commit(nc: NatsClient, k: ObjectKey, data: bytes) -> m.ObjectLocation:
    ticket = await begin(nc, k, data)
    with TcpDataClient.connect(ticket.data_addr) as client:
        await asyncio.to_thread(client.put, ticket, data)
    commit = await directory_call(
        nc, "put_commit", m.PutCommit(writer_id="w", request_id="c" + k[58:90].hex(), keys=[k])
    )
    assert isinstance(commit, m.PutCommitReply) and commit.results[0].status == "published"
    return await locate(nc, k)


async def locate(nc: NatsClient, k: ObjectKey) -> m.ObjectLocation:
    group = group_id_in_key(k)
    hit = await directory_call(nc, "lookup", m.Lookup(holder_id="reader", groups=[group]))
    assert isinstance(hit, m.LookupReply) and hit.hit_chunks == 1
    shard = (await directory_router(nc)).shard_of(group)
    await directory_call(
        nc, "lease_release", m.LeaseRelease(holder_id="reader", lease_id=hit.lease_id, shard=shard)
    )
    return hit.objects[0]


def ref_of(loc: m.ObjectLocation) -> tuple[str, ReadRef]:
    r = loc.replicas[0]
    return r.data_addr, signed_ref(r.segment_id, r.incarnation, r.slot, r.slot_generation, loc.size_bytes)


async def test_put_get_identical_bytes_over_tcp_and_shm(placed: NatsClient) -> None:
    gs = groups(len(SIZES), seed=11)
    for g, size in zip(gs, SIZES, strict=True):
        data = os.urandom(size)
        loc = await put_and_commit(placed, key(g), data)
        addr, ref = ref_of(loc)
        assert loc.checksum == checksum(data)
        with TcpDataClient.connect(addr) as client:
            dest = bytearray(size)
            results = await asyncio.to_thread(client.get, [ref], [dest])
            assert results[0].status == "ok" and verify(results, [dest]) == [True]
            assert dest == data
            again = bytearray(size)
            assert await asyncio.to_thread(client.get_verified, [ref], [again]) == [True] and again == data
            reader = ShmReader(client)
            try:
                local = bytearray(size)
                results = await asyncio.to_thread(reader.get, [ref], [local])
                assert verify(results, [local]) == [True] and local == data
                # Hashed block by block while copying: the same digest as one pass over the bytes.
                fused = bytearray(size)
                ((result, digest),) = await asyncio.to_thread(reader.get_hashed, [ref], [fused])
                assert result.status == "ok" and digest == loc.checksum and fused == data
            finally:
                reader.close()
    state = await segment_state(placed, SEGMENT)
    assert state.used_bytes >= sum(SIZES)


async def test_writer_killed_mid_put_leaves_nothing(placed: NatsClient) -> None:
    (g,) = groups(1, seed=12)
    data = os.urandom(8 << 20)
    ticket = await begin(placed, key(g), data)
    host, port = split_host_port(pick(ticket.data_addr, "tcp"))
    meta = encode(PutRequest(ticket=ticket))
    with socket.create_connection((host, port)) as sock:
        sock.sendall(pack_header(Op.PUT, 1, len(meta), 1) + meta + data[: 3 << 20])

    async def settled() -> None:
        while (await segment_state(placed, SEGMENT)).used_bytes != 0:
            await asyncio.sleep(0.02)

    await asyncio.wait_for(settled(), 10.0)
    commit = await directory_call(
        placed, "put_commit", m.PutCommit(writer_id="w", request_id="c", keys=[key(g)])
    )
    assert isinstance(commit, m.PutCommitReply) and commit.results[0].status == "missing"
    hit = await directory_call(placed, "lookup", m.Lookup(holder_id="r", groups=[g.group_id()]))
    assert isinstance(hit, m.LookupReply) and hit.hit_chunks == 0


async def test_corrupted_arena_byte_is_caught_by_the_reader(placed: NatsClient) -> None:
    (g,) = groups(1, seed=13)
    data = os.urandom(1 << 20)
    loc = await put_and_commit(placed, key(g), data)
    addr, ref = ref_of(loc)
    with TcpDataClient.connect(addr) as client:
        info = client.map_info(reads=[ref])  # the arena path only for a token holder
        fd = os.open(info.arena_path, os.O_RDWR)  # test hook: flip one stored byte in place
        try:
            with mmap.mmap(fd, info.arena_bytes) as arena:
                grants = client.pin_local([ref])
                offset = grants.grants[0].offset + 12345
                arena[offset] ^= 0xFF
                client.unpin_local(grants.grant_id)
        finally:
            os.close(fd)
        dest = bytearray(len(data))
        results = client.get([ref], [dest])
        assert results[0].status == "ok" and verify(results, [dest]) == [False]
        assert client.get_verified([ref], [dest]) == [False]  # hashed while receiving: same verdict


async def test_bad_input_is_typed_and_the_segment_stays_up(
    placed: NatsClient, cluster: ServiceProcess
) -> None:
    gs = groups(3, seed=14)
    data = os.urandom(4096)
    ticket = await begin(placed, key(gs[0]), data)
    with TcpDataClient.connect(ticket.data_addr) as client:
        wrong = await begin(placed, key(gs[1]), data, writer="w2", digest=b"\x00" * 16)
        with pytest.raises(ChecksumMismatch):  # a valid ticket: the connection is admitted first
            client.put(wrong, data)
        forged = msgspec.structs.replace(ticket, size_bytes=8192)  # signature no longer matches
        with pytest.raises(Unauthorized):
            client.put(forged, os.urandom(8192))
        with pytest.raises(BadRequest):
            client.put(ticket, os.urandom(100))  # wrong size, refused before sending
        assert (await segment_state(placed, SEGMENT)).used_bytes == 0  # nothing stored
        loc = await put_and_commit(placed, key(gs[2]), data)
        _, ref = ref_of(loc)
        stale = signed_ref(SEGMENT, ref.incarnation, ref.slot, ref.slot_generation - 1, ref.size_bytes)
        unknown = signed_ref(SEGMENT, ref.incarnation, 999_999, 1, ref.size_bytes)
        old_inc = signed_ref(SEGMENT, ref.incarnation - 1, ref.slot, ref.slot_generation, ref.size_bytes)
        results = client.get([stale, unknown, old_inc, ref], [bytearray(4096) for _ in range(4)])
        assert [r.status for r in results] == ["stale_generation", "not_found", "stale_incarnation", "ok"]
        with pytest.raises(BadRequest):
            client.get([ref] * (READS_MAX + 1), [bytearray(4096)] * (READS_MAX + 1))
        dest = bytearray(4096)
        assert client.get([ref], [dest])[0].status == "ok" and dest == data  # still serving
    text = await scrape_metrics_async(cluster.wait_for_event("segment_started", 1.0)["metrics_port"])
    for name in ("bad_ticket_signature", "checksum_mismatch"):  # errors are counted
        assert metric_value(text, "kvfabric_segment_events_total", name=name) == 1.0
    assert metric_value(text, "kvfabric_segment_used_bytes") == 4096.0


async def test_eviction_frees_the_slot_and_old_generation_reads_fail(placed: NatsClient) -> None:
    (g,) = groups(1, seed=15)
    data = os.urandom(2 << 20)
    loc = await put_and_commit(placed, key(g), data)
    addr, ref = ref_of(loc)
    evicted = await directory_call(placed, "evict", m.Evict(groups=[g.group_id()]))
    assert isinstance(evicted, m.EvictReply) and evicted.results[0].status == "evicting"

    async def freed() -> None:
        while (await segment_state(placed, SEGMENT)).used_bytes != 0:
            await asyncio.sleep(0.02)

    await asyncio.wait_for(freed(), 10.0)
    with TcpDataClient.connect(addr) as client:
        assert client.get([ref], [bytearray(len(data))])[0].status == "stale_generation"

    async def reservation_released() -> None:  # once the segment's answer reaches the directory
        while True:
            segs = await directory_call(placed, "list_segments", m.ListSegments())
            assert isinstance(segs, m.SegmentList)
            if segs.segments[0].reserved_bytes == 0:
                return
            await asyncio.sleep(0.02)

    await asyncio.wait_for(reservation_released(), 10.0)


@pytest.mark.ucx
async def test_a_receipted_put_over_ucx_is_answered_with_a_receipt_and_commits(placed: NatsClient) -> None:
    """The UCX PUT carries the receipt ask (and trace id, confirm count) as the TCP one does: a
    receipted save (the engine path) failed over UCX after its payload moved (review,
    2026-12-05)."""
    from kvfabric.client.transfers import _receipt
    from kvfabric.dataplane.ucx import UcxClient

    (g,) = groups(1, seed=17)
    data = os.urandom(1 << 16)
    ticket = await begin(placed, key(g), data)
    client = UcxClient.from_address(pick(ticket.data_addr, "ucx"))
    try:
        put = await asyncio.wait_for(client.put(ticket, data, receipt=True), 30.0)
        assert put.receipt and not put.confirmed
        commit = await directory_call(
            placed,
            "put_commit",
            m.PutCommit(writer_id="w", request_id="rc", keys=[key(g)], receipts=[_receipt(ticket, put)]),
        )
        assert isinstance(commit, m.PutCommitReply) and commit.results[0].status == "published"
    finally:
        client.close()


@pytest.mark.ucx
async def test_put_get_identical_bytes_over_ucx_and_corruption_is_caught(placed: NatsClient) -> None:
    from kvfabric.dataplane.ucx import UcxClient

    gs = groups(len(SIZES), seed=16)
    for g, size in zip(gs, SIZES, strict=True):
        data = os.urandom(size)
        ticket = await begin(placed, key(g), data)
        client = UcxClient.from_address(pick(ticket.data_addr, "ucx"))
        try:
            put = await asyncio.wait_for(client.put(ticket, data), 30.0)
            assert put.confirmed
            commit = await directory_call(
                placed,
                "put_commit",
                m.PutCommit(writer_id="w", request_id="c" + key(g)[58:90].hex(), keys=[key(g)]),
            )
            assert isinstance(commit, m.PutCommitReply) and commit.results[0].status == "published"
            _, ref = ref_of(await locate(placed, key(g)))
            dest = bytearray(size)
            results = await asyncio.wait_for(client.get([ref], [dest]), 30.0)
            assert verify(results, [dest]) == [True] and dest == data
            if size == 1 << 20:  # flip a stored byte through the arena file: the reader's checksum sees it
                with TcpDataClient.connect(ticket.data_addr) as tcp:
                    info = tcp.map_info(reads=[ref])
                    grants = tcp.pin_local([ref])
                    fd = os.open(info.arena_path, os.O_RDWR)
                    try:
                        with mmap.mmap(fd, info.arena_bytes) as arena:
                            arena[grants.grants[0].offset + 7] ^= 0x01
                    finally:
                        os.close(fd)
                    tcp.unpin_local(grants.grant_id)
                results = await asyncio.wait_for(client.get([ref], [dest]), 30.0)
                assert results[0].status == "ok" and verify(results, [dest]) == [False]
                with TcpDataClient.connect(ticket.data_addr) as tcp:  # both fused paths see it too
                    assert tcp.get_verified([ref], [dest]) == [False]
                    reader = ShmReader(tcp)
                    try:
                        assert reader.get_verified([ref], [dest]) == [False]
                    finally:
                        reader.close()
        finally:
            client.close()


async def test_local_reads_use_the_slot_board_and_a_freed_slot_reads_stale(placed: NatsClient) -> None:
    """A co-located read goes through the slot board (no round trip to the segment); once the
    directory's free reaches the segment, the same read answers stale_generation at once."""
    (g,) = groups(1, seed=18)
    data = os.urandom((1 << 20) + 3)
    loc = await put_and_commit(placed, key(g), data)
    addr, ref = ref_of(loc)
    with TcpDataClient.connect(addr) as client:
        reader = ShmReader(client, reads=[ref])
        try:
            assert reader.board is not None and reader.board.covers(ref)
            dest = bytearray(len(data))
            ((result, digest),) = reader.get_hashed([ref], [dest])
            assert result.status == "ok" and digest == result.checksum == loc.checksum and dest == data
            evicted = await directory_call(placed, "evict", m.Evict(groups=[g.group_id()]))
            assert isinstance(evicted, m.EvictReply) and evicted.results[0].status == "evicting"

            async def freed() -> None:
                while (await segment_state(placed, SEGMENT)).used_bytes:
                    await asyncio.sleep(0.02)

            await asyncio.wait_for(freed(), 10.0)
            assert reader.get([ref], [bytearray(len(data))])[0].status == "stale_generation"
        finally:
            reader.close()


async def test_pinned_local_read_unpins_without_waiting(placed: NatsClient) -> None:
    """Without a board (an older segment) a local read pins through the segment; the unpin is
    pipelined (its reply is read on the next request): the pins still drop at once, so a free
    right after the read is not deferred, and the connection stays in step after it."""
    (g,) = groups(1, seed=19)
    data = os.urandom(1 << 20)
    loc = await put_and_commit(placed, key(g), data)
    addr, ref = ref_of(loc)
    with TcpDataClient.connect(addr) as client:
        reader = ShmReader(client, use_board=False, reads=[ref])  # as off x86-64, or an older segment
        try:
            assert reader.board is None
            assert reader.get_verified([ref], [bytearray(len(data))]) == [True]
            evicted = await directory_call(placed, "evict", m.Evict(groups=[g.group_id()]))
            assert isinstance(evicted, m.EvictReply) and evicted.results[0].status == "evicting"

            async def space_returned() -> None:
                while (await segment_state(placed, SEGMENT)).used_bytes:
                    await asyncio.sleep(0.02)

            await asyncio.wait_for(space_returned(), 10.0)  # no pin left behind by the read
            client.unpin_local_nowait(123_456)  # a second unanswered unpin (of nothing) in a row
            assert client.map_info().incarnation == reader.incarnation  # replies still in step
            assert reader.get([ref], [bytearray(len(data))])[0].status == "stale_generation"
        finally:
            reader.close()


async def test_free_during_a_local_read_is_deferred_until_the_pin_ends(placed: NatsClient) -> None:
    """Invariant 3 at the service level: a free that arrives while a reader holds the slot does not
    let the memory be reused; the bytes stay intact until the reader lets go, then the space returns."""
    (g,) = groups(1, seed=17)
    data = os.urandom(1 << 20)
    loc = await put_and_commit(placed, key(g), data)
    addr, ref = ref_of(loc)
    with TcpDataClient.connect(addr) as client:
        reader = ShmReader(client, reads=[ref])
        try:
            pinned = client.pin_local([ref])  # as ShmReader.get does, but held across the eviction
            evicted = await directory_call(placed, "evict", m.Evict(groups=[g.group_id()]))
            assert isinstance(evicted, m.EvictReply) and evicted.results[0].status == "evicting"

            async def directory_released() -> None:
                while True:
                    segs = await directory_call(placed, "list_segments", m.ListSegments())
                    assert isinstance(segs, m.SegmentList)
                    if segs.segments[0].reserved_bytes == 0:
                        return
                    await asyncio.sleep(0.02)

            await asyncio.wait_for(directory_released(), 10.0)  # the segment took the free
            assert (await segment_state(placed, SEGMENT)).used_bytes > 0  # ...but deferred it
            offset = pinned.grants[0].offset
            assert reader._view[offset : offset + len(data)] == data  # bytes intact under the pin
            assert client.get([ref], [bytearray(len(data))])[0].status == "stale_generation"  # no new reads
            client.unpin_local(pinned.grant_id)
            assert (await segment_state(placed, SEGMENT)).used_bytes == 0
        finally:
            reader.close()
