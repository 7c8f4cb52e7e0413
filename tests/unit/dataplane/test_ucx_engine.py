"""The UCX transport's progress engine: one worker per event loop, progressed by that loop alone.

ucxx's asyncio layer (a progress thread, a notifier thread setting futures on one event loop) cost
~0.5 ms per request here (docs/ucx.md); the transport now drives ucxx's low-level worker itself.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from kvfabric.dataplane.backend import GetGrant, PutSlot
from kvfabric.dataplane.ucx import UcxClient, UcxServer
from kvfabric.proto.dataplane import LocalGrants, MapReply, ReadRef
from kvfabric.proto.directory import WriteTicket

pytestmark = pytest.mark.ucx

TIMEOUT_S = 30.0


class OneSlot:
    """A backend with one slot, no checks: what is put is what is read."""

    def __init__(self, nbytes: int = 1 << 20) -> None:
        self.arena = bytearray(nbytes)
        self.generation = 0
        self.closed: list[int] = []

    def begin_put(self, ticket: WriteTicket, conn: int) -> PutSlot:
        self.generation += 1
        return PutSlot(0, self.generation, memoryview(self.arena)[: ticket.size_bytes], ticket, 0)

    def finish_put(self, put: PutSlot, conn: int) -> tuple[int, int]:
        return 0, put.slot_generation

    def abort_put(self, put: PutSlot, conn: int) -> None:
        pass

    def begin_get(self, reads: list[ReadRef], conn: int) -> GetGrant:
        views: list[memoryview | None] = [memoryview(self.arena)[: r.size_bytes].toreadonly() for r in reads]
        return GetGrant(1, ["ok"] * len(reads), [b""] * len(reads), views)

    def end_get(self, grant: GetGrant, conn: int) -> None:
        pass

    def map_info(self) -> MapReply:
        raise NotImplementedError

    def pin_local(self, reads: list[ReadRef], conn: int) -> LocalGrants:
        raise NotImplementedError

    def unpin_local(self, grant_id: int, conn: int) -> int:
        raise NotImplementedError

    def close_connection(self, conn: int) -> None:
        self.closed.append(conn)


def ticket(size: int) -> WriteTicket:
    return WriteTicket(
        ticket_id=1,
        key=b"k" * 16,
        segment_id="s",
        incarnation=1,
        size_bytes=size,
        checksum=b"",
        writer_id="w",
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
    assert backend.closed == [1]


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
    assert sorted(backend.closed) == [1, 2]  # the server may see the two closes in either order


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
