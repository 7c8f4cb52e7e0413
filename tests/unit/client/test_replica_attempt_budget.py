"""A slow replica costs a load part of its deadline, not all of it (issue 27, segment-link-delay-loss):
a replica read that is not the last one tried gets its share of what is left of the load's deadline
(`replica_attempt_share_pct`, at least `replica_attempt_min_ms`), then the next replica is tried
inside the same load. The slow replica is a real segment behind a relay that trickles its replies
(1 KiB every 50 ms: every recv gets data, so no socket timeout ever fires, as over a lossy link);
the good replica is the same segment read directly."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from kvfabric.client import AsyncKvClient, ClientSettings, Hit
from kvfabric.client.attempts import attempt_budget_s
from kvfabric.core.segment_slots import SlotTable
from kvfabric.dataplane.tcp import TcpDataServer
from kvfabric.format.checksum import checksum
from kvfabric.format.ids import ObjectKey
from kvfabric.proto import directory as m
from kvfabric.proto.tickets import sign_ticket
from kvfabric.segment_storage.arena import Arena
from kvfabric.segment_storage.backend import ArenaBackend
from tests.integration.clientkit import SPEC, prompt

SECRET = b"unit-attempt-budget-secret-0123"
ARENA_BYTES = 4 << 20
SIZE = 64 << 10
CHUNKS = 2
LOAD_TIMEOUT_MS = 1_000
TRICKLE_BYTES = 1024
TRICKLE_PAUSE_S = 0.05  # 128 KiB through the relay would take 6.4 s


class TrickleRelay:
    """TCP relay to `upstream`: requests pass at once, replies trickle back."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.accepted = 0
        self.ended = 0  # client connections that ended (the client closed or shut down its side)
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            with self.lock:
                self.accepted += 1
            server = socket.create_connection(self.upstream)
            threading.Thread(target=self._up, args=(client, server), daemon=True).start()
            threading.Thread(target=self._down, args=(client, server), daemon=True).start()

    def _up(self, client: socket.socket, server: socket.socket) -> None:
        try:
            while data := client.recv(65536):
                server.sendall(data)
        except OSError:
            pass
        with self.lock:
            self.ended += 1
        for s in (client, server):
            s.close()

    def _down(self, client: socket.socket, server: socket.socket) -> None:
        try:
            while data := server.recv(TRICKLE_BYTES):
                client.sendall(data)
                time.sleep(TRICKLE_PAUSE_S)
        except OSError:
            pass

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def segment(tmp_path: Path) -> Iterator[tuple[ArenaBackend, str]]:
    arena = Arena(tmp_path, "seg", 5, ARENA_BYTES)
    backend = ArenaBackend(
        arena,
        SlotTable(ARENA_BYTES),
        segment_id="seg",
        incarnation=5,
        secret=SECRET,
        confirm=lambda *_: "ok",
    )
    server = TcpDataServer(backend)
    server.start()
    try:
        yield backend, server.address
    finally:
        server.stop()
        arena.close()


def stored_hit(
    backend: ArenaBackend, slow_addr: str, good_addr: str, slow_only: frozenset[int] = frozenset()
) -> tuple[Hit, list[bytes]]:
    """CHUNKS objects stored on the segment; each has two replicas: the relay first, then direct
    (chunks in `slow_only`: the relay only)."""
    kv = AsyncKvClient(ClientSettings(nats_url="nats://unused:1"), SPEC)
    groups = kv.chunk_groups(prompt(CHUNKS * SPEC.layout.tokens_per_chunk))
    payloads, objects = [], []
    for c in range(CHUNKS):
        data = bytes([c + 1]) * SIZE
        ticket = m.WriteTicket(
            ticket_id=c + 1,
            key=ObjectKey(b"k%d" % c),
            segment_id="seg",
            incarnation=5,
            size_bytes=SIZE,
            checksum=checksum(data),
            writer_id="test",
            deadline_ms=time.time_ns() // 1_000_000 + 60_000,
            epoch=1,
        )
        put = backend.begin_put(sign_ticket(ticket, SECRET), conn=0)
        put.view[:] = data
        slot, generation = backend.finish_put(put, conn=0)
        replica = m.Replica(
            segment_id="slow", incarnation=5, slot=slot, slot_generation=generation, data_addr=slow_addr
        )
        good = msgspec.structs.replace(replica, segment_id="good", data_addr=good_addr)
        location = m.ObjectLocation(
            chunk_index=c,
            member=m.Member(0, 0, 0),
            size_bytes=SIZE,
            checksum=checksum(data),
            replicas=[replica] if c in slow_only else [replica, good],
        )
        payloads.append(data)
        objects.append((location,))
    tpc = SPEC.layout.tokens_per_chunk
    return Hit(CHUNKS * tpc, tpc, tuple(groups), (SPEC.layout.member,), tuple(objects), 7), payloads


async def test_a_slow_first_replica_fails_over_inside_the_load(segment: tuple[ArenaBackend, str]) -> None:
    backend, good_addr = segment
    host, port = good_addr.removeprefix("tcp://").rsplit(":", 1)
    relay = TrickleRelay((host, int(port)))
    kv = AsyncKvClient(
        ClientSettings(nats_url="nats://unused:1", load_timeout_ms=LOAD_TIMEOUT_MS, use_shm=False), SPEC
    )
    try:
        hit, payloads = stored_hit(backend, relay.address, good_addr)
        dests = [[bytearray(SIZE)] for _ in range(CHUNKS)]
        started = time.monotonic()
        result = await kv.load(hit, dests)
        elapsed_s = time.monotonic() - started
        # In full, within the deadline: the relay's read was cut at its share (0.5 s), the
        # objects were read from the other replica.
        assert result.cause == "" and result.chunks_loaded == CHUNKS, result
        assert [bytes(d[0]) for d in dests] == payloads
        assert elapsed_s < LOAD_TIMEOUT_MS / 1000
        assert kv.pool.watchdog.cuts == 1
        assert kv.metrics.replica_retries._value.get() == CHUNKS  # counted, one per object retried
        # The cut connection was closed, never pooled half-read; the good one went back.
        assert not kv.pool._idle.get((relay.address, False))
        assert len(kv.pool._idle.get((good_addr, False), [])) == 1
        for _ in range(100):
            if relay.ended == relay.accepted == 1:
                break
            await asyncio.sleep(0.01)
        assert relay.ended == relay.accepted == 1
        assert kv.table.held_bytes == 0 and not kv._waiters and not kv._targets
        # The next load reads the relay on a fresh connection (and fails over again).
        again = await kv.load(hit, [[bytearray(SIZE)] for _ in range(CHUNKS)])
        assert again.chunks_loaded == CHUNKS and relay.accepted == 2 and kv.pool.watchdog.cuts == 2
    finally:
        await kv.close()
        relay.close()


async def test_a_replica_that_answers_is_not_watched_past_its_read(segment: tuple[ArenaBackend, str]) -> None:
    """The fast case: both replicas direct; the first answers, nothing is cut, no retry."""
    backend, good_addr = segment
    kv = AsyncKvClient(
        ClientSettings(nats_url="nats://unused:1", load_timeout_ms=LOAD_TIMEOUT_MS, use_shm=False), SPEC
    )
    try:
        hit, payloads = stored_hit(backend, good_addr, good_addr)
        for _ in range(3):
            dests = [[bytearray(SIZE)] for _ in range(CHUNKS)]
            result = await kv.load(hit, dests)
            assert result.chunks_loaded == CHUNKS and [bytes(d[0]) for d in dests] == payloads
        await asyncio.sleep(0.6)  # past the first attempts' budgets: a disarmed read is never cut
        assert kv.pool.watchdog.cuts == 0 and kv.metrics.replica_retries._value.get() == 0
        assert not kv.pool.watchdog._armed and not kv.pool.watchdog._cut
    finally:
        await kv.close()


async def test_an_object_without_another_replica_ends_with_the_cut(segment: tuple[ArenaBackend, str]) -> None:
    """Chunk 0 has two replicas, chunk 1 only the slow one: one request reads both and is cut at
    its share; chunk 0 is read from its other replica, chunk 1 ends `timeout` with the cut (the
    batch reports together: waiting for chunk 1 until the deadline would hold chunk 0 back too)."""
    backend, good_addr = segment
    host, port = good_addr.removeprefix("tcp://").rsplit(":", 1)
    relay = TrickleRelay((host, int(port)))
    kv = AsyncKvClient(
        ClientSettings(nats_url="nats://unused:1", load_timeout_ms=LOAD_TIMEOUT_MS, use_shm=False), SPEC
    )
    try:
        hit, payloads = stored_hit(backend, relay.address, good_addr, slow_only=frozenset({1}))
        dests = [[bytearray(SIZE)] for _ in range(CHUNKS)]
        started = time.monotonic()
        result = await kv.load(hit, dests)
        elapsed_s = time.monotonic() - started
        assert result.chunks_loaded == 1 and result.cause == "timeout", result
        assert bytes(dests[0][0]) == payloads[0]
        assert elapsed_s < LOAD_TIMEOUT_MS / 1000 and relay.accepted == 1
        assert kv.metrics.replica_retries._value.get() == 1  # only chunk 0 went to another replica
    finally:
        await kv.close()
        relay.close()


def test_attempt_budget_is_a_share_of_what_is_left_and_the_last_replica_gets_it_all() -> None:
    assert attempt_budget_s(1.5, False, 0.5, 0.1) == 0.75
    assert attempt_budget_s(0.15, False, 0.5, 0.1) == 0.1  # at least the minimum ...
    assert attempt_budget_s(0.05, False, 0.5, 0.1) == 0.05  # ... never more than is left
    assert attempt_budget_s(1.5, True, 0.5, 0.1) == 1.5
    assert attempt_budget_s(1.5, False, 1.0, 0.1) == 1.5  # share 100%: no per-attempt budget


@pytest.mark.parametrize("batched", [False, True])
def test_a_sync_read_of_a_last_replica_ends_at_the_deadline(
    segment: tuple[ArenaBackend, str], batched: bool
) -> None:
    """Review, 2026-12-05: the last replica tried had no watchdog (its budget was "all that is
    left"), which a load's gate bounds on the async path but not a sync load on the engine's
    thread (`load_now`): one replica behind a trickling link held it ~3 s past a 0.5 s deadline.
    Now the last try is cut at the deadline, and no replica is tried past it."""
    from kvfabric.dataplane.scatter import ScatterDest

    backend, good_addr = segment
    host, port = good_addr.removeprefix("tcp://").rsplit(":", 1)
    relay = TrickleRelay((host, int(port)))
    kv = AsyncKvClient(ClientSettings(nats_url="nats://unused:1", use_shm=False), SPEC)
    try:
        hit, _ = stored_hit(backend, relay.address, good_addr, slow_only=frozenset({0, 1}))
        location = hit.objects[0][0]
        dest = ScatterDest([memoryview(bytearray(SIZE))])
        started = time.monotonic()
        deadline_s = started + 0.5
        if batched:
            (cause,) = kv.pool.fetch_many([location], [dest], 2, deadline_s)
        else:
            cause = kv.pool.fetch(location, dest, 2, deadline_s)
        elapsed_s = time.monotonic() - started
        assert cause == "timeout" and elapsed_s < 1.5, (cause, elapsed_s)  # the trickle: ~3.2 s
        assert kv.pool.fetch(location, dest, 2, time.monotonic() - 1) == "timeout"  # nothing tried
        assert relay.accepted == 1
    finally:
        asyncio.run(kv.close())
        relay.close()


def test_a_segment_that_accepts_but_never_answers_its_map_is_cut_at_the_deadline(
    segment: tuple[ArenaBackend, str],
) -> None:
    """Review, 2026-12-05: a new connection's MAP request (shared memory on, the default) ran
    before the watchdog was armed, so a frozen segment that still accepts connections held the
    read for the socket's whole timeout. Now the MAP is inside the attempt's budget, and the
    connection (its answer may still come) is closed."""
    from kvfabric.dataplane.scatter import ScatterDest

    backend, good_addr = segment
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (the backlog), never answers
    frozen = f"tcp://127.0.0.1:{silent.getsockname()[1]}"
    kv = AsyncKvClient(ClientSettings(nats_url="nats://unused:1", use_shm=True), SPEC)
    try:
        hit, _ = stored_hit(backend, frozen, good_addr, slow_only=frozenset({0, 1}))
        dest = ScatterDest([memoryview(bytearray(SIZE))])
        started = time.monotonic()
        cause = kv.pool.fetch(hit.objects[0][0], dest, 2, started + 0.5)
        elapsed_s = time.monotonic() - started
        assert cause == "timeout" and elapsed_s < 1.5, (cause, elapsed_s)
        assert not kv.pool._idle.get((frozen, True))  # not pooled out of step
    finally:
        asyncio.run(kv.close())
        silent.close()
