"""A GET whose verdicts come after its bytes (disk replicas, `GetRequest.verdicts_after`): the
final verdicts may take an `ok` back (bytes that failed after they were sent), never turn an
object the header refused into `ok` (no bytes of it were sent: nothing may be reported loaded)."""

from __future__ import annotations

import socket
import threading

from kvfabric.dataplane.frames import HEADER, Op, pack_header, unpack_header
from kvfabric.dataplane.tcp import TcpDataClient
from kvfabric.format.checksum import checksum
from kvfabric.proto.codec import encode
from kvfabric.proto.dataplane import GetReply, ObjectResult, ReadRef
from kvfabric.proto.segment import SSD_SLOT_BASE

DATA = b"x" * 4096


def _recv(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, "closed"
        out += chunk
    return bytes(out)


def serve_once(listener: socket.socket, first: list[ObjectResult], final: list[ObjectResult]) -> None:
    """Answer one GET: `first` (with DATA for each ok), then the verdicts `final`."""
    conn, _ = listener.accept()
    with conn:
        header = unpack_header(_recv(conn, HEADER.size))
        _recv(conn, header.meta_bytes)
        head = encode(GetReply(results=first, verdicts_after=True))
        oks = sum(r.status == "ok" for r in first)
        conn.sendall(pack_header(Op.REPLY, header.request_id, len(head), oks) + head + DATA * oks)
        tail = encode(GetReply(results=final))
        conn.sendall(pack_header(Op.REPLY, header.request_id, len(tail), 0) + tail)
        conn.recv(1)  # until the client closes


def get_with(first: list[ObjectResult], final: list[ObjectResult]) -> list[tuple[ObjectResult, bytes]]:
    listener = socket.create_server(("127.0.0.1", 0))
    server = threading.Thread(target=serve_once, args=(listener, first, final), daemon=True)
    server.start()
    try:
        host, port = listener.getsockname()[:2]
        reads = [ReadRef(1, SSD_SLOT_BASE + i, 1, len(DATA)) for i in range(len(first))]
        with TcpDataClient(host, port, timeout_s=5) as client:
            dests = [bytearray(len(DATA)) for _ in reads]
            return client.get_hashed(reads, dests)
    finally:
        server.join(5)
        listener.close()


def test_a_verdict_never_turns_an_object_sent_without_bytes_into_ok() -> None:
    ok = ObjectResult("ok", checksum(DATA))
    missing = ObjectResult("not_found", b"")
    out = get_with([ok, missing], [ok, ok])  # a verdict claiming the unsent one is ok
    assert [r.status for r, _ in out] == ["ok", "not_found"]
    assert out[1][1] == b""  # no digest: nothing of it may count as loaded


def test_a_verdict_takes_an_ok_back() -> None:
    ok = ObjectResult("ok", checksum(DATA))
    stale = ObjectResult("stale_generation", b"")
    out = get_with([ok, ok], [ok, stale])
    assert [r.status for r, _ in out] == ["ok", "stale_generation"]
    assert out[0][1] != b"" and out[1][1] == b""
