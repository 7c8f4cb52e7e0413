"""A GET of one disk replica of at most one I/O chunk, read head first (`SsdTier.read_stream(...,
alone=True)`): the sender reads the head, sends it with the reply header, then reads the rest while
the client takes the head off the socket; the verdict follows the bytes. What must hold on this
path: the head's bytes arrive while the rest is still being read; a rest that fails after the head
went out is answered not ok (never loaded data) and the replica is freed and reported once; a
connection that closes mid-object gives back its read reference, buffer and I/O bound exactly
once. Each test fails when the object is read whole before anything is sent (divisor 1, the
default: off; see docs/ssd-tier.md for why)."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfabric.dataplane.frames import Op, pack_header
from kvfabric.dataplane.tcp import TcpDataClient, TcpDataServer
from kvfabric.format.checksum import checksum
from kvfabric.proto.codec import encode
from kvfabric.proto.dataplane import GetRequest, ReadRef
from kvfabric.segment_storage.settings import load_segment_settings
from kvfabric.segment_storage.ssd import SsdIo
from kvfabric.segment_storage.ssd_io import (
    STREAM_HEAD_DIVISOR_DEFAULT,
    STREAM_PIECE_MIN_BYTES,
    stream_head_bytes,
)
from tests.unit.segment_storage.test_ssd_backend import (
    Seg,
    _file_offset,
    _recv,
    _reply,
    close,
    make,
    wait_for,
)

CHUNK = 1 << 20  # the I/O engine's chunk (the default): a 1 MiB object is one chunk
SIZE = 1 << 20
HEAD = 256 << 10  # divisor 4: the head is a quarter


class RestHeldIo(SsdIo):
    """The I/O engine, except that a read piece starting at `rest` (a file offset) waits for
    `gate` (`waiting` says it is being read), then fails with an I/O error if `fail`. The
    sizes of the read pieces are kept in `reads`."""

    def __init__(self) -> None:
        super().__init__(2, 64, CHUNK)
        self.gate = threading.Event()
        self.waiting = threading.Event()
        self.rest = -1
        self.fail = False
        self.reads: list[int] = []

    def _piece(self, fd: int, view: memoryview, offset: int, write: bool) -> None:
        if not write:
            self.reads.append(len(view))
        if not write and offset == self.rest:
            self.waiting.set()
            assert self.gate.wait(10), "gate never opened"
            if self.fail:
                raise OSError(5, "injected I/O error")
        super()._piece(fd, view, offset, write)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Seg, RestHeldIo, TcpDataServer]]:
    io = RestHeldIo()
    seg = make(tmp_path, io=io)
    seg.ssd.stream_head_divisor = 4
    server = TcpDataServer(seg.backend, authenticate=seg.backend.admits)
    server.start()
    try:
        yield seg, io, server
    finally:
        io.gate.set()
        server.stop()
        close(seg)


def _stored(seg: Seg, io: RestHeldIo, key: bytes, size: int = SIZE) -> tuple[bytes, ReadRef]:
    data = os.urandom(size)
    disk = seg.demote(seg.store(data, key))
    io.rest = _file_offset(seg, disk) + size // 4
    io.reads.clear()
    return data, disk


def _ask(sock: socket.socket, request_id: int, refs: list[ReadRef]) -> None:
    body = encode(GetRequest(reads=refs, verdicts_after=True))
    sock.sendall(pack_header(Op.GET, request_id, len(body)) + body)


def _all_given_back(seg: Seg) -> bool:
    stats = seg.ssd.stats()
    return stats["read_bytes_in_flight"] == 0 and stats["io_pieces_in_flight"] == 0


def test_stream_head_bytes() -> None:
    assert STREAM_PIECE_MIN_BYTES == 64 << 10
    assert stream_head_bytes(256 << 10, CHUNK, 4) == 64 << 10
    assert stream_head_bytes(1 << 20, CHUNK, 4) == 256 << 10
    assert stream_head_bytes(1 << 20, CHUNK, 2) == 512 << 10
    assert stream_head_bytes(300 << 10, CHUNK, 4) == 128 << 10  # 75 KiB, in whole 64 KiB
    assert stream_head_bytes(4 << 20, CHUNK, 4) == CHUNK  # never more than a chunk
    assert stream_head_bytes(1 << 20, CHUNK, 1) == CHUNK  # 1: the object whole
    assert stream_head_bytes(8 << 10, CHUNK, 4) == 64 << 10  # ≥ the object: no head


def test_stream_head_divisor_setting() -> None:
    base = {"KVF_SEGMENT_ID": "s1", "KVF_CLUSTER_SECRET": "x" * 32}
    assert load_segment_settings(base).ssd_stream_head_divisor == STREAM_HEAD_DIVISOR_DEFAULT == 1
    on = load_segment_settings({**base, "KVF_SEGMENT_SSD_STREAM_HEAD_DIVISOR": "4"})
    assert on.ssd_stream_head_divisor == 4


@pytest.mark.parametrize("size", [SIZE, 256 << 10])
def test_the_head_is_sent_while_the_rest_is_read(
    served: tuple[Seg, RestHeldIo, TcpDataServer], size: int
) -> None:
    """The reply header and the head arrive while the rest's read is held; the rest follows, then
    the verdict ok. Two reads: the head (a quarter: 256 KiB, 64 KiB) and the rest. (Before: one
    read of the whole object, then the send — no read was ever held, nothing arrived before it
    ended. A 64 KiB head also needs the server to send less than 256 KiB a time.)"""
    seg, io, server = served
    data, disk = _stored(seg, io, b"key-h", size)
    head_bytes = size // 4
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        _ask(sock, 1, [disk])
        head = _reply(sock)
        assert head.verdicts_after and [r.status for r in head.results] == ["ok"]
        assert _recv(sock, head_bytes) == data[:head_bytes]
        assert io.waiting.wait(10), "the rest is not being read after the head was sent"
        io.gate.set()
        assert _recv(sock, size - head_bytes) == data[head_bytes:]
        final = _reply(sock)
        assert [(r.status, r.checksum) for r in final.results] == [("ok", checksum(data))]
    assert io.reads == [head_bytes, size - head_bytes]
    wait_for(lambda: _all_given_back(seg))
    assert seg.ssd.counters["reads_streamed_total"] == 1 and seg.ssd.read_buffers.lent() == 0


def test_a_rest_that_fails_after_the_head_was_sent_is_not_loaded(
    served: tuple[Seg, RestHeldIo, TcpDataServer],
) -> None:
    """The head (good bytes) is sent, then the rest's read fails: the rest goes as zeros (the
    stream stays in step) and the verdict says `stale_generation`; the replica is freed and
    reported once, everything given back, and the next GET on the connection reads intact. The
    client (`get_hashed`) reports such an object as not ok, with no digest."""
    seg, io, server = served
    data, disk = _stored(seg, io, b"key-f")
    good = os.urandom(300_000)
    other = seg.demote(seg.store(good, b"key-g"))
    io.fail = True
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        _ask(sock, 1, [disk])
        assert [r.status for r in _reply(sock).results] == ["ok"]
        assert _recv(sock, HEAD) == data[:HEAD]  # sent before the rest failed
        assert io.waiting.wait(10)
        io.gate.set()
        assert _recv(sock, SIZE - HEAD) == bytes(SIZE - HEAD)
        assert [(r.status, r.checksum) for r in _reply(sock).results] == [("stale_generation", b"")]
        _ask(sock, 2, [other])
        assert [r.status for r in _reply(sock).results] == ["ok"]
        assert _recv(sock, len(good)) == good
        assert [(r.status, r.checksum) for r in _reply(sock).results] == [("ok", checksum(good))]
    assert seg.corrupt == [(b"key-f", disk.slot, disk.slot_generation, SIZE)]
    assert seg.backend.counters["disk_get_failed_after_bytes_total"] == 1
    assert seg.ssd.counters["read_errors_total"] == 1
    assert seg.ssd.held_one(disk.slot, disk.slot_generation) is None  # freed
    wait_for(lambda: _all_given_back(seg))
    assert seg.ssd.read_buffers.lent() == 0
    # the same failure through the client: not ok, no digest (never loaded data)
    again, disk2 = _stored(seg, io, b"key-f2")
    with TcpDataClient.connect(server.address) as client:
        dest = bytearray(SIZE)
        [(result, digest)] = client.get_hashed([disk2], [dest])
        assert result.status == "stale_generation" and digest == b""
    assert bytes(dest[:HEAD]) == again[:HEAD] and io.reads == [HEAD, SIZE - HEAD]


def test_a_connection_closed_mid_object_gives_everything_back_once(
    served: tuple[Seg, RestHeldIo, TcpDataServer],
) -> None:
    """The client closes its connection after the head, while the sender is reading the rest:
    once that read ends, the send fails, and the GET's read reference, buffer and I/O bound are
    given back exactly once (the in-flight figures are 0, not below; a free of the replica right
    after is not deferred by a reader left behind); nothing is reported corrupt; the replica still
    reads intact."""
    seg, io, server = served
    data, disk = _stored(seg, io, b"key-c")
    before = set(seg.backend._conns)  # the harness's own (its puts)
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        _ask(sock, 1, [disk])
        assert [r.status for r in _reply(sock).results] == ["ok"]
        assert _recv(sock, HEAD) == data[:HEAD]
        assert io.waiting.wait(10)
    io.gate.set()  # the client is gone: the sender's read ends, its send fails
    wait_for(lambda: _all_given_back(seg) and set(seg.backend._conns) == before)  # closed
    assert seg.ssd.read_buffers.lent() == 0 and seg.corrupt == []
    result = seg.ssd.read(disk.slot, disk.slot_generation, SIZE)
    assert result.status == "ok" and result.view is not None and bytes(result.view) == data
    result.release()
    assert _all_given_back(seg)
    deferred = seg.ssd.table.counters.get("frees_deferred_total", 0)
    seg.ssd.free_many([(disk.slot, disk.slot_generation)])
    assert seg.ssd.table.counters.get("frees_deferred_total", 0) == deferred
    assert seg.ssd.held_one(disk.slot, disk.slot_generation) is None
    seg.ssd.table.check_invariants()


def test_a_get_of_several_disk_objects_reads_no_head(
    served: tuple[Seg, RestHeldIo, TcpDataServer],
) -> None:
    """Only a GET's only disk object is read head first: with several, the later objects are
    read while the first is sent already, and a head's rest would wait behind them."""
    seg, io, server = served
    datas = [os.urandom(SIZE) for _ in range(2)]
    disks = [seg.demote(seg.store(d, b"key-s%d" % i)) for i, d in enumerate(datas)]
    io.reads.clear()
    io.gate.set()
    with TcpDataClient.connect(server.address) as client:
        dests = [bytearray(SIZE) for _ in datas]
        got = client.get_hashed(disks, dests)
    assert [(r.status, d) for r, d in got] == [("ok", checksum(d)) for d in datas]
    assert sorted(io.reads) == [SIZE, SIZE]
    wait_for(lambda: _all_given_back(seg))
