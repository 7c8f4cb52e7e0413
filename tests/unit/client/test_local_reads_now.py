"""Small co-located reads on the client's loop (issue 20, load path): once a pooled connection maps
the segment's arena and its slot board covers the replicas, a load of a few small objects copies
them from the arena into the engine's buffers on the loop thread, hashed as they land, with no
hop to a worker thread (`SegmentPool.fetch_local_now`); anything that would need I/O, or any
object that does not read ok, goes the worker-thread way as before. A real `ArenaBackend` served
over TCP (no NATS)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvfabric.client import AsyncKvClient, ClientSettings, Hit, KvClient, aio_loads
from kvfabric.client.sync import ENABLED, ClientStatus
from kvfabric.client.transfers import SegmentPool
from kvfabric.core.segment_slots import SlotTable
from kvfabric.dataplane.scatter import WriteGate, scatter_dests
from kvfabric.dataplane.tcp import TcpDataClient, TcpDataServer
from kvfabric.format.checksum import checksum
from kvfabric.format.ids import ObjectKey
from kvfabric.proto import directory as m
from kvfabric.proto.tickets import read_token, sign_ticket
from kvfabric.segment_storage.arena import Arena
from kvfabric.segment_storage.backend import ArenaBackend
from tests.integration.clientkit import SPEC, prompt

SECRET = b"unit-local-reads-secret-0123456789"
ARENA_BYTES = 16 << 20
NOW_MS = 1_000_000
INCARNATION = 3
SEGMENT = "seg-local-now"
SIZE = 64 << 10
CHUNKS = 4


@dataclass
class Segment:
    backend: ArenaBackend
    server: TcpDataServer

    def store(self, data: bytes, key: bytes) -> m.ObjectLocation:
        """Stored through a sent PUT; where it lies, as a lookup would name it (with its read token)."""
        ticket = m.WriteTicket(
            ticket_id=1,
            key=ObjectKey(key),
            segment_id=SEGMENT,
            incarnation=INCARNATION,
            size_bytes=len(data),
            checksum=checksum(data),
            writer_id="w",
            deadline_ms=NOW_MS + 30_000,
            epoch=1,
            data_addr=self.server.address,
        )
        with TcpDataClient.connect(self.server.address) as client:
            reply = client.put(sign_ticket(ticket, SECRET), data)
        expires_ms = NOW_MS + 60_000
        token = read_token(
            SECRET, SEGMENT, INCARNATION, reply.slot, reply.slot_generation, len(data), expires_ms
        )
        replica = m.Replica(
            segment_id=SEGMENT,
            incarnation=INCARNATION,
            slot=reply.slot,
            slot_generation=reply.slot_generation,
            data_addr=self.server.address,
            read_token=token,
            read_expires_ms=expires_ms,
        )
        return m.ObjectLocation(
            chunk_index=0,
            member=m.Member(0, 0, 0),
            size_bytes=len(data),
            checksum=checksum(data),
            replicas=[replica],
        )


@pytest.fixture
def segment(tmp_path: Path) -> Iterator[Segment]:
    arena = Arena(tmp_path, SEGMENT, INCARNATION, ARENA_BYTES)
    backend = ArenaBackend(
        arena,
        SlotTable(ARENA_BYTES),
        segment_id=SEGMENT,
        incarnation=INCARNATION,
        secret=SECRET,
        confirm=lambda *args, **kw: "ok",
        clock_ms=lambda: NOW_MS,
    )
    server = TcpDataServer(backend)
    server.start()
    try:
        yield Segment(backend, server)
    finally:
        server.stop()
        arena.close()


def stored(segment: Segment, n: int = CHUNKS) -> tuple[list[bytes], list[m.ObjectLocation]]:
    blobs = [os.urandom(SIZE) for _ in range(n)]
    return blobs, [segment.store(data, b"k%d" % i) for i, data in enumerate(blobs)]


def dests_for(n: int) -> tuple[list[bytearray], list[Any]]:
    bufs = [bytearray(SIZE) for _ in range(n)]
    return bufs, scatter_dests(bufs, [SIZE] * n, WriteGate())


def test_a_pooled_mapped_connection_reads_now_and_verifies(segment: Segment) -> None:
    pool = SegmentPool(connections_per_segment_max=2, timeout_s=5.0, use_shm=True)
    try:
        blobs, locations = stored(segment)
        bufs, views = dests_for(CHUNKS)
        # No connection yet: reading now would need a connect, so it is not done here.
        assert pool.fetch_local_now(locations, views) is None and not any(any(b) for b in bufs)
        assert pool.fetch_many(locations, views, 1) == ["ok"] * CHUNKS  # a worker's read pools one
        bufs, views = dests_for(CHUNKS)
        assert pool.fetch_local_now(locations, views) == ["ok"] * CHUNKS
        assert bufs == blobs and pool.local_reads_now == CHUNKS
    finally:
        pool.close()


def test_bytes_that_do_not_match_the_directorys_checksum_are_never_reported_ok(segment: Segment) -> None:
    pool = SegmentPool(connections_per_segment_max=2, timeout_s=5.0, use_shm=True)
    try:
        _, locations = stored(segment, 2)
        pool.fetch_many(locations, dests_for(2)[1], 1)
        wrong = [locations[0], m.ObjectLocation(**{**_fields(locations[1]), "checksum": b"x" * 16})]
        assert pool.fetch_local_now(wrong, dests_for(2)[1]) is None  # the worker's way decides
        assert pool.fetch_many(wrong, dests_for(2)[1], 1) == ["ok", "checksum"]
    finally:
        pool.close()


def _fields(location: m.ObjectLocation) -> dict[str, Any]:
    return {f: getattr(location, f) for f in location.__struct_fields__}


def hit_of(locations: list[m.ObjectLocation]) -> Hit:
    groups = AsyncKvClient(ClientSettings(nats_url="nats://unused:1"), SPEC).chunk_groups(
        prompt(len(locations) * SPEC.layout.tokens_per_chunk)
    )
    objects = tuple(
        (m.ObjectLocation(**{**_fields(loc), "chunk_index": c}),) for c, loc in enumerate(locations)
    )
    tpc = SPEC.layout.tokens_per_chunk
    return Hit(len(locations) * tpc, tpc, tuple(groups), (SPEC.layout.member,), objects, 0)


@pytest.mark.parametrize("use_shm", [True, False])
def test_a_small_co_located_load_needs_no_worker_thread(segment: Segment, use_shm: bool) -> None:
    """Co-located: after the first load (which connects on a worker), loads run on the loop alone;
    remote (TCP) loads always go to a worker thread (a socket read would block the loop)."""
    blobs, locations = stored(segment)
    hit = hit_of(locations)

    async def run() -> tuple[int, list[bytes]]:
        kv = AsyncKvClient(ClientSettings(nats_url="nats://unused:1", use_shm=use_shm), SPEC)
        submitted = 0
        submit = kv._executor.submit

        def counting(*args: Any, **kwargs: Any) -> Any:
            nonlocal submitted
            submitted += 1
            return submit(*args, **kwargs)

        kv._executor.submit = counting  # type: ignore[method-assign]
        try:
            first = [bytearray(SIZE) for _ in range(CHUNKS)]
            assert (await kv.load(hit, [[b] for b in first])).chunks_loaded == CHUNKS
            submitted = 0
            out = []
            for _ in range(3):
                bufs = [bytearray(SIZE) for _ in range(CHUNKS)]
                result = await kv.load(hit, [[b] for b in bufs])
                assert result.chunks_loaded == CHUNKS and result.cause == ""
                out = [bytes(b) for b in bufs]
            return submitted, out
        finally:
            await kv.close()

    submitted, out = asyncio.run(run())
    assert out == blobs
    assert submitted == (0 if use_shm else 3)


def test_the_loop_copies_at_most_its_budget_a_flush(
    segment: Segment, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A co-located load larger than `LOCAL_INLINE_BYTES_MAX` copies that much on the loop and
    sends the rest to the worker threads (before: every batch under the bound was copied on the
    loop, a 16 MiB load whole, holding the loop 3-19 ms; review of stop 33)."""
    monkeypatch.setattr(aio_loads, "FETCH_BATCH_OBJECTS_MAX", 1)  # one object a request
    monkeypatch.setattr(aio_loads, "LOCAL_INLINE_BYTES_MAX", 2 * SIZE)
    blobs, locations = stored(segment)
    hit = hit_of(locations)

    async def run() -> tuple[int, list[bytes]]:
        kv = AsyncKvClient(ClientSettings(nats_url="nats://unused:1", use_shm=True), SPEC)
        submitted = 0
        submit = kv._executor.submit

        def counting(*args: Any, **kwargs: Any) -> Any:
            nonlocal submitted
            submitted += 1
            return submit(*args, **kwargs)

        kv._executor.submit = counting  # type: ignore[method-assign]
        try:
            first = [bytearray(SIZE) for _ in range(CHUNKS)]
            assert (await kv.load(hit, [[b] for b in first])).chunks_loaded == CHUNKS  # connects
            submitted = 0
            bufs = [bytearray(SIZE) for _ in range(CHUNKS)]
            result = await kv.load(hit, [[b] for b in bufs])
            assert result.chunks_loaded == CHUNKS and result.cause == ""
            return submitted, [bytes(b) for b in bufs]
        finally:
            await kv.close()

    submitted, out = asyncio.run(run())
    assert out == blobs
    assert submitted == CHUNKS - 2  # two copied on the loop, the others on workers


@pytest.mark.parametrize("use_shm", [True, False])
def test_a_small_sync_load_runs_on_the_callers_thread(
    segment: Segment, use_shm: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`KvClient.load` of a small hit (co-located: copied from the mapped arena; remote: one
    request on this thread) runs on the calling thread: the client's loop runs nothing for it (no
    hop there, to a worker and back); the bytes are verified, and a chunk that does not verify
    (the wrong checksum) fails with the ones after it, never reported loaded; a larger load goes
    the loop's way."""
    blobs, locations = stored(segment)
    hit = hit_of(locations)
    kv = KvClient.disabled(
        SPEC, "test", "unit", settings=ClientSettings(nats_url="nats://unused:1", use_shm=use_shm)
    )
    kv.status = ClientStatus(ENABLED)
    try:
        bufs = [bytearray(SIZE) for _ in range(CHUNKS)]
        assert kv.load(hit, [[b] for b in bufs]).chunks_loaded == CHUNKS  # the first one connects
        ran: list[str] = []
        load = kv.aio.load

        async def on_the_loop(*args: Any, **kwargs: Any) -> Any:
            ran.append("load")
            return await load(*args, **kwargs)

        kv.aio.load = on_the_loop  # type: ignore[method-assign]
        for _ in range(3):
            bufs = [bytearray(SIZE) for _ in range(CHUNKS)]
            result = kv.load(hit, [[b] for b in bufs])
            assert result.chunks_loaded == CHUNKS and result.tokens == hit.tokens and bufs == blobs
        assert ran == []
        bad = list(hit.objects)
        bad[2] = (m.ObjectLocation(**{**_fields(bad[2][0]), "checksum": b"x" * 16}),)
        bufs = [bytearray(SIZE) for _ in range(CHUNKS)]
        result = kv.load(dataclasses.replace(hit, objects=tuple(bad)), [[b] for b in bufs])
        assert result.chunks_loaded == 2 and result.failed_chunks == (2, 3) and result.cause == "checksum"
        assert result.tokens == 2 * SPEC.layout.tokens_per_chunk and bufs[:2] == blobs[:2]
        # too large for the engine's thread: the loop's way (co-located: only past
        # LOAD_NOW_LOCAL_BYTES_MAX; one thread copying a mapped arena beat the workers here)
        big = [bytearray(SIZE) for _ in range(CHUNKS)]
        assert kv.aio.load_now(hit, [[b] for b in big]) is not None
        monkeypatch.setattr(aio_loads, "LOAD_NOW_BYTES_MAX", SIZE)
        if use_shm:
            big = [bytearray(SIZE) for _ in range(CHUNKS)]
            assert kv.load(hit, [[b] for b in big]).chunks_loaded == CHUNKS and big == blobs
            assert ran == []
            monkeypatch.setattr(aio_loads, "LOAD_NOW_LOCAL_BYTES_MAX", SIZE)
        big = [bytearray(SIZE) for _ in range(CHUNKS)]
        assert kv.load(hit, [[b] for b in big]).chunks_loaded == CHUNKS and big == blobs
        assert ran == ["load"]
    finally:
        kv.close()


@pytest.mark.parametrize("use_shm", [True, False])
def test_a_sync_load_up_to_load_now_bytes_runs_on_the_callers_thread(
    segment: Segment, use_shm: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hit larger than `LOCAL_INLINE_BYTES_MAX` (once the bound of the caller's-thread way) but
    within `LOAD_NOW_BYTES_MAX` is read on the engine's thread too (issue 20, the hit floor: a
    vLLM prompt's 4-12 MiB hit took the hops engine -> loop -> workers -> loop -> engine;
    bench/results/hit_floor.md): co-located copied from the mapped arena, remote as one data
    request. Bytes verified: a chunk that does not verify fails with those after it."""
    monkeypatch.setattr(aio_loads, "LOCAL_INLINE_BYTES_MAX", SIZE)  # the hit is "large"
    blobs, locations = stored(segment)
    hit = hit_of(locations)
    kv = KvClient.disabled(
        SPEC, "test", "unit", settings=ClientSettings(nats_url="nats://unused:1", use_shm=use_shm)
    )
    kv.status = ClientStatus(ENABLED)
    try:
        bufs = [bytearray(SIZE) for _ in range(CHUNKS)]
        assert kv.load(hit, [[b] for b in bufs]).chunks_loaded == CHUNKS  # connects, maps
        ran: list[str] = []
        load = kv.aio.load

        async def on_the_loop(*args: Any, **kwargs: Any) -> Any:
            ran.append("load")
            return await load(*args, **kwargs)

        kv.aio.load = on_the_loop  # type: ignore[method-assign]
        bufs = [bytearray(SIZE) for _ in range(CHUNKS)]
        result = kv.load(hit, [[b] for b in bufs])
        assert result.chunks_loaded == CHUNKS and result.tokens == hit.tokens and bufs == blobs
        bad = list(hit.objects)
        bad[2] = (m.ObjectLocation(**{**_fields(bad[2][0]), "checksum": b"x" * 16}),)
        bufs = [bytearray(SIZE) for _ in range(CHUNKS)]
        result = kv.load(dataclasses.replace(hit, objects=tuple(bad)), [[b] for b in bufs])
        assert result.chunks_loaded == 2 and result.failed_chunks == (2, 3) and result.cause == "checksum"
        assert bufs[:2] == blobs[:2]
        assert ran == []
    finally:
        kv.close()
