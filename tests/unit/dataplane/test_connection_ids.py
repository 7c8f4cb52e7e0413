"""Connection ids come from one source for every transport of a process (review, 2026-12-06):
a TCP and a UCX server over one segment backend each counted from 1, so a UCX peer's close
(even an unauthenticated one's) released TCP connection 1's PUT slot while its bytes still
arrived — the slot aborted, reused by another PUT, then written over."""

from __future__ import annotations

import socket
import time

from kvfabric.dataplane import backend as backend_module
from kvfabric.dataplane.addresses import split_host_port
from kvfabric.dataplane.tcp import TcpDataServer


class Closing:
    def __init__(self) -> None:
        self.closed: list[int] = []

    def connection_leaked(self, conn: int) -> None:
        """(no link of these tests gets stuck)"""

    def close_connection(self, conn: int) -> None:
        self.closed.append(conn)


def test_tcp_connections_take_ids_no_other_transport_has() -> None:
    backend = Closing()
    server = TcpDataServer(backend, authenticate=lambda meta: False)  # type: ignore[arg-type]
    server.start()
    try:
        host, port = split_host_port(server.address)
        taken = [backend_module.new_connection_id()]  # as the UCX server takes its ids
        for _ in range(2):
            with socket.create_connection((host, port), timeout=5.0):
                pass
            taken.append(backend_module.new_connection_id())
        deadline = time.monotonic() + 5
        while len(backend.closed) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        server.stop()
    assert len(backend.closed) == 2 and not set(backend.closed) & set(taken)
