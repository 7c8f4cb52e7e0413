"""A save's writes to one segment as one pipelined stream (`SegmentPool.write_many`, issue 20):
staged through the connection's staging file when co-located (each object at its own offset),
sent otherwise; every object stored under its own ticket and read back intact, with receipts.
A real `ArenaBackend` served over TCP, confirms answered in process (no NATS)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvfabric.client.transfers import SegmentPool
from kvfabric.core.segment_slots import SlotTable
from kvfabric.dataplane import tcp_client, tcp_wire
from kvfabric.dataplane.frames import HEADER
from kvfabric.dataplane.tcp import TcpDataClient, TcpDataServer
from kvfabric.format.checksum import checksum
from kvfabric.format.errors import BadRequest, Indeterminate
from kvfabric.format.ids import ObjectKey
from kvfabric.proto.dataplane import ReadRef
from kvfabric.proto.directory import WriteTicket
from kvfabric.proto.tickets import sign_ticket, write_receipt
from kvfabric.segment_storage.arena import Arena
from kvfabric.segment_storage.backend import ArenaBackend

SECRET = b"unit-save-streams-secret-0123456789"
ARENA_BYTES = 32 << 20
NOW_MS = 1_000_000
INCARNATION = 3
SEGMENT = "seg-streams"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[ArenaBackend, TcpDataServer, list[int]]]:
    later: list[int] = []
    arena = Arena(tmp_path, SEGMENT, INCARNATION, ARENA_BYTES)
    backend = ArenaBackend(
        arena,
        SlotTable(ARENA_BYTES),
        segment_id=SEGMENT,
        incarnation=INCARNATION,
        secret=SECRET,
        confirm=lambda *args, **kw: "ok",
        confirm_later=lambda ticket, *_: later.append(ticket.ticket_id),
        clock_ms=lambda: NOW_MS,
    )
    tcp = TcpDataServer(backend)
    tcp.start()
    try:
        yield backend, tcp, later
    finally:
        tcp.stop()
        arena.close()


def ticket(tcp: TcpDataServer, data: bytes, ticket_id: int, digest: bytes | None = None) -> WriteTicket:
    return sign_ticket(
        WriteTicket(
            ticket_id=ticket_id,
            key=ObjectKey(b"k%d" % ticket_id),
            segment_id=SEGMENT,
            incarnation=INCARNATION,
            size_bytes=len(data),
            checksum=digest if digest is not None else checksum(data),
            writer_id="w",
            deadline_ms=NOW_MS + 30_000,
            epoch=1,
            data_addr=tcp.address,
        ),
        SECRET,
    )


@pytest.mark.parametrize("use_shm", [True, False])
def test_a_stream_of_writes_lands_whole_staged_or_sent(
    server: tuple[ArenaBackend, TcpDataServer, list[int]], use_shm: bool
) -> None:
    backend, tcp, later = server
    pool = SegmentPool(connections_per_segment_max=2, timeout_s=5.0, use_shm=use_shm)
    blobs = [os.urandom(n) for n in (3000, 256 << 10, 1 << 20, 5 << 20)]  # 6+ MiB: the file grows
    tickets = [ticket(tcp, b, i + 1) for i, b in enumerate(blobs)]
    tickets[1] = ticket(tcp, blobs[1], 2, digest=checksum(b"other"))  # bytes that fail their ticket
    try:
        outcomes = pool.write_many(
            [(t, memoryview(b), "trace", 4) for t, b in zip(tickets, blobs, strict=True)], receipt=True
        )
        assert [cause for cause, _ in outcomes] == ["ok", "checksum_mismatch", "ok", "ok"]
        assert pool.staged_puts == (3 if use_shm else 0)
        assert later == [1, 3, 4]
        with TcpDataClient.connect(tcp.address) as c:
            for (cause, receipt), t, data in zip(outcomes, tickets, blobs, strict=True):
                if cause != "ok":
                    continue
                assert receipt is not None
                assert receipt.mac == write_receipt(SECRET, t, receipt.slot, receipt.slot_generation)
                dest = bytearray(len(data))
                (result,) = c.get(
                    [ReadRef(INCARNATION, receipt.slot, receipt.slot_generation, len(data))], [dest]
                )
                assert result.status == "ok" and bytes(dest) == data
        # a second stream on the same pooled connection: staged again, at offsets from 0
        again = [os.urandom(4096) for _ in range(3)]
        more = pool.write_many(
            [(ticket(tcp, b, 10 + i), memoryview(b), "t2", 3) for i, b in enumerate(again)], receipt=True
        )
        assert [cause for cause, _ in more] == ["ok"] * 3
        assert pool.staged_puts == (6 if use_shm else 0)
    finally:
        pool.close()
    assert backend.counters["puts_receipted_total"] == 6


@pytest.mark.parametrize("use_shm", [True, False])
def test_a_stream_cut_after_some_replies_keeps_what_they_say(
    server: tuple[ArenaBackend, TcpDataServer, list[int]], use_shm: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connection fails after the segment answered two of four writes (the third reply's
    header cannot be read): the two answered stand with their receipts, only the other two fail
    with the connection. All four failed before (stop 69's list): writes that had landed and
    been receipted were thrown away, the save wrote them again or went without them."""
    _, tcp, _ = server
    pool = SegmentPool(connections_per_segment_max=2, timeout_s=5.0, use_shm=use_shm)
    blobs = [os.urandom(64 << 10) for _ in range(4)]
    tickets = [ticket(tcp, b, 20 + i) for i, b in enumerate(blobs)]
    headers_read = 0
    real = tcp_wire.recv_exact

    def cut_at_the_third_reply(sock: object, view: memoryview) -> None:
        nonlocal headers_read
        if len(view) == HEADER.size:
            headers_read += 1
            if headers_read == 3:
                raise ConnectionResetError("the connection failed here")
        real(sock, view)  # type: ignore[arg-type]

    put_many_partial = TcpDataClient.put_many_partial

    def counted_from_the_stream(self: TcpDataClient, *args: object, **kwargs: object) -> object:
        nonlocal headers_read
        headers_read = 0  # (a co-located connection's MAP reply came first)
        return put_many_partial(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(tcp_client, "recv_exact", cut_at_the_third_reply)
    monkeypatch.setattr(TcpDataClient, "put_many_partial", counted_from_the_stream)
    try:
        outcomes = pool.write_many(
            [(t, memoryview(b), "trace", 4) for t, b in zip(tickets, blobs, strict=True)], receipt=True
        )
    finally:
        pool.close()
    assert [cause for cause, _ in outcomes] == ["ok", "ok", "indeterminate", "indeterminate"]
    for (_, receipt), t in zip(outcomes[:2], tickets, strict=False):
        assert receipt is not None
        assert receipt.mac == write_receipt(SECRET, t, receipt.slot, receipt.slot_generation)
    assert pool.staged_puts == (2 if use_shm else 0)


def test_a_resend_of_refused_staged_writes_that_fails_keeps_the_first_pass(
    server: tuple[ArenaBackend, TcpDataServer, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The segment refuses to stage one of four writes (answered with a `staging` detail), and
    the connection fails while that write is sent again: the three stored in the first pass keep
    their receipts, only the resent one fails (all four failed; review, stop 71)."""
    _, tcp, _ = server
    pool = SegmentPool(connections_per_segment_max=2, timeout_s=5.0, use_shm=True)
    blobs = [os.urandom(64 << 10) for _ in range(4)]
    tickets = [ticket(tcp, b, 40 + i) for i, b in enumerate(blobs)]
    real = TcpDataClient.put_many_partial
    calls: list[int] = []

    def refuse_one_then_fail(self: TcpDataClient, writes: Any, **kwargs: Any) -> Any:
        calls.append(len(writes))
        if len(calls) == 1:  # the staged pass: write 1 refused as a segment refuses staging
            replies, failure = real(self, writes, **kwargs)
            replies[1] = BadRequest("cannot open the staging file", staging=True)
            return replies, failure
        return [], Indeterminate("data connection failed during pipelined PUTs")

    monkeypatch.setattr(TcpDataClient, "put_many_partial", refuse_one_then_fail)
    try:
        outcomes = pool.write_many(
            [(t, memoryview(b), "trace", 4) for t, b in zip(tickets, blobs, strict=True)], receipt=True
        )
    finally:
        pool.close()
    assert calls == [4, 1]
    assert [cause for cause, _ in outcomes] == ["ok", "indeterminate", "ok", "ok"]
    assert all(receipt is not None for cause, receipt in outcomes if cause == "ok")
    assert pool.staged_puts == 3
