"""The first request of a connection, once its credential is accepted, runs under the same
deadline as any later one (the frame timeout), not the rest of the 1 s auth deadline from the
accept: a GET whose first read waits on a busy disk, or a staged PUT read from the writer's file,
was cut off by the watchdog at the auth deadline, the client seeing a reset instead of its answer
(review finding, 2026-12-05, fixed 2026-12-06)."""

from __future__ import annotations

import socket
import time
from typing import Any

from kvfabric.dataplane.addresses import split_host_port
from kvfabric.dataplane.admission import ConnectionLimits
from kvfabric.dataplane.frames import Op
from kvfabric.dataplane.tcp import TcpDataServer
from kvfabric.format.errors import NotFound
from kvfabric.proto.common import ErrorReply
from kvfabric.proto.dataplane import GetRequest, ReadRef
from tests.security.dataplane_kit import frame, read_frame

AUTH_DEADLINE_MS = 300
SLOW_FIRST_READ_S = 0.9  # three auth deadlines: the watchdog (50 ms ticks) has long fired by then


class SlowBackend:
    """A backend whose GET takes SLOW_FIRST_READ_S (a disk read) and then finds nothing."""

    def __init__(self) -> None:
        self.closed: list[int] = []

    def begin_get(self, reads: list[ReadRef], conn: int) -> Any:
        time.sleep(SLOW_FIRST_READ_S)
        raise NotFound("no such object")

    def connection_leaked(self, conn: int) -> None:
        """(no link of these tests gets stuck)"""

    def close_connection(self, conn: int) -> None:
        self.closed.append(conn)


def test_an_admitted_first_request_is_answered_past_the_auth_deadline() -> None:
    backend = SlowBackend()
    server = TcpDataServer(
        backend,  # type: ignore[arg-type]
        limits=ConnectionLimits(auth_deadline_ms=AUTH_DEADLINE_MS),
        authenticate=lambda meta: True,  # any credential is valid here: the deadline is the point
    )
    server.start()
    try:
        host, port = split_host_port(server.address)
        with socket.create_connection((host, port), timeout=5.0) as sock:
            ref = ReadRef(incarnation=1, slot=0, slot_generation=1, size_bytes=16)
            sock.sendall(frame(Op.GET, GetRequest(reads=[ref])))
            answer = read_frame(sock)
        assert answer is not None, "the connection was closed before its first request was answered"
        op, meta = answer
        assert op is Op.ERROR and isinstance(meta, ErrorReply) and meta.code == "not_found", answer
        assert server.counters.get("closed_auth_deadline_total", 0) == 0, server.counters
    finally:
        server.stop()
