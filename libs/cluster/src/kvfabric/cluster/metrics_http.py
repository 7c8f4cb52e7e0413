"""`/metrics` over HTTP for one prometheus-client registry, bounded, for services and clients.

prometheus-client's WSGI app on a threading `wsgiref` server in a daemon thread, off any event
loop (like `start_http_server`, but with a short shutdown poll, no per-request access log on
stderr, which would break JSON log lines, and bounds): at most `SCRAPES_AT_ONCE_MAX` connections
served at once, `PEER_SCRAPES_MAX` of them from one address (one more is closed at once), each
with `SCRAPE_TIMEOUT_S` per socket operation and `SCRAPE_DEADLINE_S` in all. A client's endpoint
used `start_http_server` (review, stop 68): bound to every address, no timeout, a thread per
connection without bound, inside the engine's process.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from socketserver import ThreadingMixIn
from typing import Any, Final
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from kvfabric.format.invariant import invariant

__all__ = [
    "PEER_SCRAPES_MAX",
    "SCRAPES_AT_ONCE_MAX",
    "SCRAPE_DEADLINE_S",
    "SCRAPE_TIMEOUT_S",
    "SERVE_POLL_S",
    "MetricsServer",
]

SERVE_POLL_S: Final = 0.05
# Scrapes served at once; a connection beyond them is closed at once. Each has `SCRAPE_TIMEOUT_S`
# per socket operation (an idle connection held a thread each, without bound; review,
# 2026-12-05) and `SCRAPE_DEADLINE_S` in all (one trickling a byte every few seconds kept its
# slot for ever, and eight of them shut every scrape out; review, stop 68).
SCRAPES_AT_ONCE_MAX: Final = 8
# Of those, from one address: a scraper that reconnected as soon as the deadline cut it held
# every slot (review, stop 69); now it holds half. Not a defence against two such addresses, nor
# on a loopback endpoint (every local scraper is 127.0.0.1: half the slots for all of them).
PEER_SCRAPES_MAX: Final = SCRAPES_AT_ONCE_MAX // 2
SCRAPE_TIMEOUT_S: Final = 10.0
SCRAPE_DEADLINE_S: Final = 30.0


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lock = threading.Lock()
        self._served = 0
        self._by_peer: dict[str, int] = {}  # address -> connections served now (> 0 each)

    def _take_slot(self, peer: str) -> bool:
        with self._lock:
            if self._served >= SCRAPES_AT_ONCE_MAX or self._by_peer.get(peer, 0) >= PEER_SCRAPES_MAX:
                return False
            self._served += 1
            self._by_peer[peer] = self._by_peer.get(peer, 0) + 1
            return True

    def _give_slot(self, peer: str) -> None:
        with self._lock:
            self._served -= 1
            left = self._by_peer[peer] - 1
            if left:
                self._by_peer[peer] = left
            else:
                del self._by_peer[peer]

    def process_request(self, request: Any, client_address: Any) -> None:
        peer = str(client_address[0])
        if not self._take_slot(peer):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._give_slot(peer)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._give_slot(str(client_address[0]))


class _QuietHandler(WSGIRequestHandler):
    timeout = SCRAPE_TIMEOUT_S  # per socket operation (StreamRequestHandler sets it)
    deadline_s = SCRAPE_DEADLINE_S  # the whole connection's

    def setup(self) -> None:
        super().setup()
        # Past the deadline the socket is shut: a read or write blocked on it returns at once,
        # and the handler's thread (and slot) ends.
        self._deadline = threading.Timer(self.deadline_s, self._cut)
        self._deadline.daemon = True
        self._deadline.start()

    def _cut(self) -> None:
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    def finish(self) -> None:
        self._deadline.cancel()
        with contextlib.suppress(OSError):  # (a socket shut by the deadline)
            super().finish()

    def handle(self) -> None:
        try:
            super().handle()
        except OSError:  # an idle or trickling scraper past its timeout, or gone: closed quietly
            self.close_connection = True

    def log_message(self, format: str, *args: object) -> None:
        """No access log: a line per scrape on stderr broke the JSON log lines."""


class MetricsServer:
    """`/metrics` over HTTP for one registry. Port 0 binds a free port; `port` is the bound one."""

    def __init__(self, registry: CollectorRegistry, *, host: str, port: int) -> None:
        invariant(0 <= port <= 65535, "metrics port out of range", port=port)
        self.registry = registry
        self.host = host
        self.requested_port = port
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        invariant(self._server is not None, "metrics server not started")
        assert self._server is not None
        return int(self._server.server_port)

    @property
    def running(self) -> bool:
        return self._server is not None

    def start(self) -> int:
        """Bind and serve in a daemon thread. Returns the bound port. Raises OSError if taken."""
        invariant(self._server is None, "metrics server started twice")
        server = make_server(
            self.host,
            self.requested_port,
            make_wsgi_app(self.registry),
            server_class=_ThreadingWSGIServer,
            handler_class=_QuietHandler,
        )
        thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": SERVE_POLL_S},
            name=f"metrics-{server.server_port}",
            daemon=True,
        )
        thread.start()
        self._server, self._thread = server, thread
        return self.port

    def stop(self) -> None:
        """Stop serving and release the port. Blocks up to one poll interval: call it off the loop."""
        server, thread = self._server, self._thread
        self._server, self._thread = None, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join()
