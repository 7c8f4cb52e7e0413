"""Prometheus metrics of one service runtime, on its own registry, served on `/metrics`.

Names: `kvfabric_<service>_<noun>_<unit>`, counters end in `_total`:

- `kvfabric_<service>_requests_total{endpoint,outcome}`: every request, by `Outcome`.
- `kvfabric_<service>_request_duration_seconds{endpoint}`: receipt to reply, histogram.
- `kvfabric_<service>_inflight_requests`: handlers running now (≤ `inflight_max` per lane: new
  work, gives-back).
- `kvfabric_<service>_rejected_busy_total{endpoint}`: answered `Busy` by the in-flight limit.
- `kvfabric_<service>_errors_total{code}`: error replies by wire code (`internal` included).
- `kvfabric_<service>_gc_pause_seconds{generation}`, `kvfabric_<service>_gc_frozen_objects`: the
  cyclic GC's pauses and frozen objects, once the process runs the services' GC policy
  (`kvfabric.runtime.gcpolicy.GcCollector`).

The HTTP server (`MetricsServer`) is prometheus-client's WSGI app on a threading `wsgiref` server in
a daemon thread, off the event loop (like `start_http_server`, but with a short shutdown poll and no
per-request access log on stderr, which would break JSON log lines).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from enum import StrEnum
from socketserver import ThreadingMixIn
from typing import Any, Final
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, make_wsgi_app

from kvfabric.format.invariant import invariant
from kvfabric.runtime.gcpolicy import GcCollector

__all__ = ["DURATION_BUCKETS_S", "MetricsServer", "Outcome", "ServiceMetrics"]

SERVE_POLL_S: Final = 0.05
DURATION_BUCKETS_S: Final = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


class Outcome(StrEnum):
    """How a request ended: the `outcome` label and the `outcome` field of `request_handled`."""

    OK = "ok"
    ERROR = "error"  # the handler raised a KvfError (an expected error)
    BUSY = "busy"  # rejected by the in-flight limit, handler not run
    INTERNAL = "internal"  # the handler raised something unexpected: a 500, logged with traceback
    FATAL = "fatal"  # InvariantViolation: the service stops and exits non-zero
    CANCELLED = "cancelled"  # still running when the shutdown grace ran out


class ServiceMetrics:
    """The standard metrics of one service, registered on a fresh `CollectorRegistry`."""

    def __init__(self, service: str) -> None:
        invariant(
            service.isidentifier() and service.islower(), "metric prefix must be snake_case", service=service
        )
        self.service = service
        self.registry = CollectorRegistry(auto_describe=True)
        prefix = f"kvfabric_{service}"
        self.requests = Counter(
            f"{prefix}_requests_total",
            "Requests received, by endpoint and outcome.",
            ["endpoint", "outcome"],
            registry=self.registry,
        )
        self.request_duration = Histogram(
            f"{prefix}_request_duration_seconds",
            "Time from receipt of a request to its reply.",
            ["endpoint"],
            buckets=DURATION_BUCKETS_S,
            registry=self.registry,
        )
        self.inflight = Gauge(
            f"{prefix}_inflight_requests",
            "Handlers running now.",
            registry=self.registry,
        )
        self.rejected_busy = Counter(
            f"{prefix}_rejected_busy_total",
            "Requests answered Busy because the in-flight limit was reached.",
            ["endpoint"],
            registry=self.registry,
        )
        self.errors = Counter(
            f"{prefix}_errors_total",
            "Error replies, by wire code.",
            ["code"],
            registry=self.registry,
        )
        # The tarpit (kvfabric.runtime.tarpit): tenants whose requests go unread, and how often.
        self.tenants_tarpitted = Gauge(
            f"{prefix}_tenants_tarpitted",
            "Tenants whose work requests go to the tarpit now (refused too often).",
            registry=self.registry,
        )
        self.tarpit_entries = Counter(
            f"{prefix}_tenant_tarpits_total",
            "Times a tenant was tarpitted.",
            registry=self.registry,
        )
        self.tarpit_links = Counter(
            f"{prefix}_tarpit_links_total",
            "Tarpit connections opened (one a second while a tenant is tarpitted).",
            registry=self.registry,
        )
        self.tarpit_full = Counter(
            f"{prefix}_tarpit_full_total",
            "Tenants past the tarpit's threshold left out: as many tarpitted as it holds.",
            registry=self.registry,
        )
        self.tarpit_link_failures = Counter(
            f"{prefix}_tarpit_link_failures_total",
            "Tarpit connections that could not be opened (a tarpitted tenant then reaches the service).",
            registry=self.registry,
        )
        self.registry.register(GcCollector(service))

    def observe(self, *, endpoint: str, outcome: Outcome, duration_s: float, error_code: str | None) -> None:
        """Count one finished request."""
        invariant(duration_s >= 0, "negative request duration", duration_s=duration_s)
        self.requests.labels(endpoint=endpoint, outcome=outcome.value).inc()
        self.request_duration.labels(endpoint=endpoint).observe(duration_s)
        if outcome is Outcome.BUSY:
            self.rejected_busy.labels(endpoint=endpoint).inc()
        if error_code is not None:
            self.errors.labels(code=error_code).inc()

    def exposition(self) -> bytes:
        """The text exposition format, as served on `/metrics`."""
        return generate_latest(self.registry)


# Scrapes served at once; a connection beyond them is closed at once. Each has `SCRAPE_TIMEOUT_S`
# per socket operation (an idle connection held a thread each, without bound; review,
# 2026-12-05) and `SCRAPE_DEADLINE_S` in all (one trickling a byte every few seconds kept its
# slot for ever, and eight of them shut every scrape out; review, stop 68).
SCRAPES_AT_ONCE_MAX: Final = 8
SCRAPE_TIMEOUT_S: Final = 10.0
SCRAPE_DEADLINE_S: Final = 30.0


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(SCRAPES_AT_ONCE_MAX)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


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
        pass


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
