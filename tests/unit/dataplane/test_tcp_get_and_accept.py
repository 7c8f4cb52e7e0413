"""The TCP data server. A GET that names one object twice is refused before the backend is
asked: each copy was sent again, so one token repeated 4,096 times made a ~49 KB request send
4,096 x the object, under a deadline as long, the slot pinned all along (a free answered done
meanwhile while the arena kept the bytes; review, stop 68). A failed `accept` is retried, not
the end of the data plane."""

from __future__ import annotations

import errno
import socket
from typing import Any

from kvfabric.dataplane.addresses import split_host_port
from kvfabric.dataplane.frames import Op
from kvfabric.dataplane.tcp import TcpDataServer
from kvfabric.proto.common import ErrorReply
from kvfabric.proto.dataplane import GetRequest, ReadRef
from tests.security.dataplane_kit import frame, read_frame


class CountingBackend:
    """Grants every read `statuses` says (default all ok) with 16 bytes each; counts the grants
    ended (`end_get`)."""

    def __init__(self) -> None:
        self.gets: list[int] = []
        self.ended = 0
        self.statuses: list[str] | None = None

    def begin_get(self, reads: list[ReadRef], conn: int) -> Any:
        from kvfabric.dataplane.backend import GetGrant

        self.gets.append(len(reads))
        statuses = self.statuses or ["ok"] * len(reads)
        views = [memoryview(b"x" * 16) if s == "ok" else None for s in statuses]
        return GetGrant(1, statuses, [b"c" * 16] * len(reads), views)  # type: ignore[arg-type]

    def end_get(self, grant: Any, conn: int) -> None:
        self.ended += 1

    def connection_leaked(self, conn: int) -> None:
        """(no link of these tests gets stuck)"""

    def close_connection(self, conn: int) -> None:
        """(nothing held per connection here)"""


def ask(server: TcpDataServer, reads: list[ReadRef]) -> tuple[Op, object]:
    host, port = split_host_port(server.address)
    with socket.create_connection((host, port), timeout=5.0) as sock:
        sock.sendall(frame(Op.GET, GetRequest(reads=reads)))
        answer = read_frame(sock)
    assert answer is not None
    return answer


def test_a_get_naming_a_readable_object_twice_is_refused() -> None:
    backend = CountingBackend()
    server = TcpDataServer(backend, authenticate=lambda meta: True)  # type: ignore[arg-type]
    server.start()
    try:
        ref = ReadRef(incarnation=1, slot=3, slot_generation=1, size_bytes=16)
        op, meta = ask(server, [ref] * 4_096)
        assert op is Op.ERROR and isinstance(meta, ErrorReply) and meta.code == "bad_request"
        assert backend.ended == 1  # its grant given back
        other_generation = ReadRef(incarnation=1, slot=3, slot_generation=2, size_bytes=16)
        assert ask(server, [ref, other_generation])[0] is Op.REPLY  # two objects
        backend.statuses = ["ok", "unauthorized"]  # a refused ref of it (a forged token): no bytes
        assert ask(server, [ref, ref])[0] is Op.REPLY
    finally:
        server.stop()


class FailingOnce:
    """The listening socket, whose next `accept` fails as when the process is out of fds."""

    def __init__(self, listener: socket.socket) -> None:
        self.listener = listener
        self.failed = False

    def accept(self) -> Any:
        if not self.failed:
            self.failed = True
            raise OSError(errno.EMFILE, "Too many open files")
        return self.listener.accept()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.listener, name)


def test_a_failed_accept_does_not_stop_the_data_plane() -> None:
    """(review, stop 68: the accept loop returned on any OSError, the segment heartbeating on)"""
    backend = CountingBackend()
    server = TcpDataServer(backend, authenticate=lambda meta: True)  # type: ignore[arg-type]
    real = server._listener
    server._listener = FailingOnce(real)  # type: ignore[assignment]
    server.start()
    try:
        ref = ReadRef(incarnation=1, slot=3, slot_generation=1, size_bytes=16)
        assert ask(server, [ref])[0] is Op.REPLY  # answered after the failed accept
        assert server.counters["accept_errors_total"] == 1
    finally:
        server.stop()
        real.close()


def test_a_get_past_its_byte_bound_is_refused_and_its_grant_given_back(monkeypatch: Any) -> None:
    """A GET's references pin its slots until the reply is sent (frees deferred): 4 GiB at the
    1 MiB/s floor held them ~68 min after the directory freed them (review, stop 70). A GET
    reads at most `GET_BYTES_MAX` bytes, as over UCX."""
    from kvfabric.dataplane import tcp_server

    monkeypatch.setattr(tcp_server, "GET_BYTES_MAX", 40)  # the backend's objects are 16 bytes
    backend = CountingBackend()
    server = TcpDataServer(backend, authenticate=lambda meta: True)  # type: ignore[arg-type]
    server.start()
    try:
        refs = [ReadRef(incarnation=1, slot=i, slot_generation=1, size_bytes=16) for i in range(3)]
        op, meta = ask(server, refs)  # 48 bytes
        assert op is Op.ERROR and isinstance(meta, ErrorReply) and meta.code == "batch_too_large"
        assert backend.ended == 1
        assert ask(server, refs[:2])[0] is Op.REPLY  # 32 bytes
    finally:
        server.stop()
