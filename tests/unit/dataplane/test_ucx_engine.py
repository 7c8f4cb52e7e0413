"""The UCX transport's progress engine: one worker per event loop, progressed by that loop alone.

ucxx's asyncio layer (a progress thread, a notifier thread setting futures on one event loop) cost
~0.7-1.2 ms per request here (docs/ucx.md); the transport now drives ucxx's low-level worker itself.
`UcxSyncClient`: the same, progressed by the calling thread.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from kvfabric.dataplane.backend import GetGrant, PutSlot
from kvfabric.dataplane.ucx import UcxClient, UcxServer, UcxSyncClient
from kvfabric.format.errors import BadRequest, Busy, Indeterminate, Unavailable
from kvfabric.format.ids import ObjectKey
from kvfabric.proto.dataplane import LocalGrants, MapReply, ObjectStatus, ReadRef
from kvfabric.proto.directory import WriteTicket

pytestmark = pytest.mark.ucx

TIMEOUT_S = 30.0


class OneSlot:
    """A backend with one slot, no checksums: what is put is what is read. A ticket whose writer is
    "forged" is refused; `statuses` (when set) answers reads; `get_delay_s` stalls the server."""

    def __init__(self, nbytes: int = 1 << 20) -> None:
        self.arena = bytearray(nbytes)
        self.generation = 0
        self.closed: list[int] = []
        self.statuses: list[ObjectStatus] = []
        self.get_delay_s = 0.0

    def begin_put(self, ticket: WriteTicket, conn: int, claim: object = None) -> PutSlot:
        if ticket.writer_id == "forged":
            raise BadRequest("bad ticket signature", ticket_id=ticket.ticket_id)
        self.generation += 1
        return PutSlot(0, self.generation, memoryview(self.arena)[: ticket.size_bytes], ticket, 0)

    def finish_put(self, put: PutSlot, conn: int) -> tuple[int, int]:
        return 0, put.slot_generation

    def abort_put(self, put: PutSlot, conn: int) -> None:
        pass

    def begin_get(self, reads: list[ReadRef], conn: int) -> GetGrant:
        time.sleep(self.get_delay_s)  # blocks the server's loop: a stalled segment
        statuses = self.statuses or ["ok"] * len(reads)
        views: list[memoryview | None] = [
            memoryview(self.arena)[: r.size_bytes].toreadonly() if st == "ok" else None
            for r, st in zip(reads, statuses, strict=True)
        ]
        return GetGrant(1, statuses, [b""] * len(reads), views)

    def end_get(self, grant: GetGrant, conn: int) -> None:
        pass

    def map_info(self) -> MapReply:
        raise NotImplementedError

    def pin_local(self, reads: list[ReadRef], conn: int) -> LocalGrants:
        raise NotImplementedError

    def unpin_local(self, grant_id: int, conn: int) -> int:
        raise NotImplementedError

    def connection_leaked(self, conn: int) -> None:
        """(no link of these tests gets stuck)"""

    def close_connection(self, conn: int) -> None:
        self.closed.append(conn)


def ticket(size: int, writer_id: str = "w") -> WriteTicket:
    return WriteTicket(
        ticket_id=1,
        key=ObjectKey(b"k" * 16),
        segment_id="s",
        incarnation=1,
        size_bytes=size,
        checksum=bytes(16),  # unchecked here (a ticket without one needs a receipt: not over UCX)
        writer_id=writer_id,
        deadline_ms=2**40,
        epoch=1,
    )


async def round_trip(client: UcxClient, data: bytes) -> bytes:
    reply = await client.put(ticket(len(data)), data)
    dest = bytearray(len(data))
    [result] = await client.get([ReadRef(1, reply.slot, reply.slot_generation, len(data))], [dest])
    assert result.status == "ok"
    return bytes(dest)


@contextmanager
def server_on_a_thread(backend: OneSlot) -> Iterator[UcxServer]:
    """A UCX server on its own thread's event loop, as the segment runs it."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = UcxServer(backend, "127.0.0.1", 0)
    try:
        asyncio.run_coroutine_threadsafe(server.start(), loop).result(TIMEOUT_S)
        yield server
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(TIMEOUT_S)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(TIMEOUT_S)
        loop.close()


def test_server_and_client_on_the_loops_of_two_threads() -> None:
    """A segment's UCX server runs on its own thread's loop; a client in the same process on
    another loop works at the same time (ucxx's notifier served one loop per process)."""
    backend = OneSlot()
    with server_on_a_thread(backend) as server:

        async def client_side() -> None:
            async with UcxClient("127.0.0.1", server.port) as client:
                for size in (1, 4096, 1 << 20):
                    data = os.urandom(size)
                    assert await round_trip(client, data) == data

        asyncio.run(asyncio.wait_for(client_side(), TIMEOUT_S))
    assert len(backend.closed) == 1  # (ids are the process's: `new_connection_id`)


def test_a_client_used_from_a_later_loop_reconnects_there() -> None:
    backend = OneSlot()
    with server_on_a_thread(backend) as server:
        client = UcxClient("127.0.0.1", server.port)
        try:
            for _ in range(2):  # two `asyncio.run`s: the second one's worker gets a new connection
                data = os.urandom(1000)
                assert asyncio.run(asyncio.wait_for(round_trip(client, data), TIMEOUT_S)) == data
        finally:
            client.close()
    assert len(set(backend.closed)) == len(backend.closed) == 2  # two connections, closed once each


def test_the_transport_starts_no_ucxx_threads_and_the_process_exits() -> None:
    """Only UCX's own `async` thread runs next to the interpreter (ucxx's progress and notifier
    threads are not started; the notifier, a non-daemon thread, kept processes from exiting)."""
    script = textwrap.dedent(
        """
        import asyncio, os, threading
        from kvfabric.dataplane.ucx import UcxClient, UcxServer
        from tests.unit.dataplane.test_ucx_engine import OneSlot, round_trip

        def threads():
            return {open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")}

        before = threads()

        async def main():
            async with UcxServer(OneSlot(), "127.0.0.1", 0) as server:
                async with UcxClient("127.0.0.1", server.port) as client:
                    assert await round_trip(client, b"x" * 5000) == b"x" * 5000
                    print("THREADS", sorted(threads() - before - {"async"}), flush=True)
                    print("PYTHREADS", [t.name for t in threading.enumerate()], flush=True)

        asyncio.run(main())
        """
    )
    env = {**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n"}
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=env,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in out.stdout.splitlines() if " " in line}
    assert lines["THREADS"] == "[]"
    assert lines["PYTHREADS"] == "['MainThread']"


# ---- the blocking client ---------------------------------------------------------------------


def sync_round_trip(client: UcxSyncClient, data: bytes) -> bytes:
    reply = client.put(ticket(len(data)), data)
    dest = bytearray(len(data))
    [result] = client.get([ReadRef(1, reply.slot, reply.slot_generation, len(data))], [dest])
    assert result.status == "ok"
    return bytes(dest)


def test_blocking_clients_on_several_threads_get_their_bytes() -> None:
    backend = OneSlot(16 << 20)
    errors: list[BaseException] = []
    lock = threading.Lock()  # one slot: a put and its get must not interleave with another's

    def worker(i: int) -> None:
        try:
            with UcxSyncClient("127.0.0.1", server.port, io_timeout_s=TIMEOUT_S) as client:
                for size in (1, 4096, 1 << 20, 16 << 20):
                    data = bytes([i]) * size
                    with lock:
                        assert sync_round_trip(client, data) == data
        except BaseException as exc:
            errors.append(exc)

    with server_on_a_thread(backend) as server:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT_S)
    assert errors == [] and len(set(backend.closed)) == len(backend.closed) == 4


def test_blocking_client_errors_are_typed_and_the_connection_stays_in_step() -> None:
    backend = OneSlot()
    with server_on_a_thread(backend) as server, UcxSyncClient.from_address(server.address) as client:
        with pytest.raises(BadRequest, match="bad ticket signature"):
            client.put(ticket(5000, writer_id="forged"), os.urandom(5000))  # its payload is drained
        data = os.urandom(5000)
        assert sync_round_trip(client, data) == data
        backend.statuses = ["ok", "not_found", "ok"]
        reads = [ReadRef(1, 0, backend.generation, len(data))] * 3
        dests = [bytearray(b"\xee" * len(data)) for _ in reads]
        assert [r.status for r in client.get(reads, dests)] == backend.statuses
        assert dests[0] == data and dests[2] == data and set(dests[1]) == {0xEE}
        with pytest.raises(BadRequest, match="destination is 9 bytes"):
            client.get(reads[:1], [bytearray(9)])
    assert len(backend.closed) == 1  # one connection throughout


def test_blocking_client_times_out_on_a_stalled_segment_then_reconnects() -> None:
    backend = OneSlot()
    with server_on_a_thread(backend) as server:
        client = UcxSyncClient("127.0.0.1", server.port, io_timeout_s=0.3)
        try:
            data = os.urandom(1000)
            assert sync_round_trip(client, data) == data
            backend.get_delay_s = 1.0
            started = time.monotonic()
            with pytest.raises(Indeterminate):
                client.get([ReadRef(1, 0, backend.generation, len(data))], [bytearray(len(data))])
            assert time.monotonic() - started < 0.9  # gave up at its timeout, not the segment's pace
            backend.get_delay_s = 0.0
            assert sync_round_trip(client, data) == data  # a new connection
        finally:
            client.close()
    assert len(set(backend.closed)) == len(backend.closed) == 2


def test_blocking_client_sees_busy_and_unreachable_segments() -> None:
    backend = OneSlot()
    with server_on_a_thread(backend) as server:
        server.connections_max = 1
        with UcxSyncClient("127.0.0.1", server.port) as first:
            assert sync_round_trip(first, b"a" * 100) == b"a" * 100
            with UcxSyncClient("127.0.0.1", server.port) as second, pytest.raises(Busy):
                second.put(ticket(100), b"b" * 100)
    with socket.socket() as probe:  # a port nobody listens on: UCX reports it as a truncated handshake
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(Unavailable):
        UcxSyncClient("127.0.0.1", port, connect_timeout_s=2.0).connect()
    closed = UcxSyncClient("127.0.0.1", port)
    closed.close()
    with pytest.raises(Unavailable, match="closed"):
        closed.put(ticket(1), b"x")
