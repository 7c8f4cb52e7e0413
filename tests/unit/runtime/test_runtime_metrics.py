"""Standard metrics on a per-runtime registry, and the /metrics server on a picked port."""

from __future__ import annotations

import urllib.error
from typing import Any

import pytest

from kvfabric.format.invariant import InvariantViolation
from kvfabric.runtime.metrics import MetricsServer, Outcome, ServiceMetrics
from kvfabric.testing import metric_value, scrape_metrics
from kvfabric.testing.probes import scrape_metrics_once_served


def test_observe_counts_by_endpoint_outcome_and_code() -> None:
    metrics = ServiceMetrics("directory")
    metrics.observe(endpoint="lookup", outcome=Outcome.OK, duration_s=0.002, error_code=None)
    metrics.observe(endpoint="lookup", outcome=Outcome.BUSY, duration_s=0.0001, error_code="busy")
    metrics.observe(endpoint="lookup", outcome=Outcome.ERROR, duration_s=0.001, error_code="not_found")
    metrics.inflight.set(3)
    text = metrics.exposition().decode()

    assert metric_value(text, "kvfabric_directory_requests_total", endpoint="lookup", outcome="ok") == 1.0
    assert metric_value(text, "kvfabric_directory_requests_total", endpoint="lookup", outcome="busy") == 1.0
    assert metric_value(text, "kvfabric_directory_rejected_busy_total", endpoint="lookup") == 1.0
    assert metric_value(text, "kvfabric_directory_errors_total", code="busy") == 1.0
    assert metric_value(text, "kvfabric_directory_errors_total", code="not_found") == 1.0
    assert metric_value(text, "kvfabric_directory_request_duration_seconds_count", endpoint="lookup") == 3.0
    assert metric_value(text, "kvfabric_directory_inflight_requests") == 3.0


def test_each_runtime_has_its_own_registry() -> None:
    a, b = ServiceMetrics("echo"), ServiceMetrics("echo")
    a.observe(endpoint="say", outcome=Outcome.OK, duration_s=0.0, error_code=None)
    assert (
        metric_value(b.exposition().decode(), "kvfabric_echo_requests_total", endpoint="say", outcome="ok")
        is None
    )


def test_negative_duration_is_a_bug() -> None:
    with pytest.raises(InvariantViolation):
        ServiceMetrics("echo").observe(endpoint="say", outcome=Outcome.OK, duration_s=-1.0, error_code=None)


def test_server_binds_a_free_port_serves_and_releases_it() -> None:
    metrics = ServiceMetrics("echo")
    metrics.observe(endpoint="say", outcome=Outcome.OK, duration_s=0.01, error_code=None)
    server = MetricsServer(metrics.registry, host="127.0.0.1", port=0)
    port = server.start()
    try:
        assert port > 0
        assert server.port == port
        text = scrape_metrics(port)
        assert metric_value(text, "kvfabric_echo_requests_total", endpoint="say", outcome="ok") == 1.0
    finally:
        server.stop()
    assert not server.running
    with pytest.raises(urllib.error.URLError):
        scrape_metrics(port, timeout_s=0.5)


def test_the_metrics_server_serves_a_bounded_number_of_connections_at_once() -> None:
    """Idle connections hold at most `SCRAPES_AT_ONCE_MAX` threads: one more is closed at once
    (each held a thread of its own, without bound or timeout; review, 2026-12-05); once they
    go, scrapes are served again."""

    from prometheus_client import CollectorRegistry

    from kvfabric.cluster.metrics_http import SCRAPES_AT_ONCE_MAX, MetricsServer

    server = MetricsServer(CollectorRegistry(), host="127.0.0.1", port=0)
    port = server.start()
    idle = [_connect_from(f"127.0.0.{2 + i % 4}", port) for i in range(SCRAPES_AT_ONCE_MAX)]  # 2 a peer
    try:
        import time

        time.sleep(0.3)  # each taken by a handler thread, waiting for its request line
        extra = _connect_from("127.0.0.9", port)
        extra.settimeout(5)
        assert extra.recv(1) == b""  # closed at once, not served
        extra.close()
    finally:
        for conn in idle:
            conn.close()
    scrape_metrics_once_served(port)  # served again once they go
    server.stop()


def test_connections_trickling_bytes_lose_their_slot_at_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight connections each sending a byte of a request line now and then kept their slots
    for ever (the timeout is per socket operation), and every scrape was closed unanswered
    (review, stop 68). Each connection now has a deadline in all."""
    import contextlib
    import threading
    import time
    import urllib.request

    from prometheus_client import CollectorRegistry

    from kvfabric.cluster import metrics_http as metrics_module
    from kvfabric.cluster.metrics_http import SCRAPES_AT_ONCE_MAX, MetricsServer

    monkeypatch.setattr(metrics_module._QuietHandler, "deadline_s", 0.5)
    server = MetricsServer(CollectorRegistry(), host="127.0.0.1", port=0)
    port = server.start()
    stop = threading.Event()
    trickling = [_connect_from(f"127.0.0.{2 + i % 4}", port) for i in range(SCRAPES_AT_ONCE_MAX)]

    def trickle() -> None:
        while not stop.wait(0.1):
            for conn in trickling:
                with contextlib.suppress(OSError):
                    conn.send(b"G")

    feeder = threading.Thread(target=trickle, daemon=True)
    feeder.start()
    try:
        time.sleep(1.0)  # past the deadline: their slots are free while they still trickle
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as reply:
            assert reply.status == 200
    finally:
        stop.set()
        feeder.join(2)
        for conn in trickling:
            conn.close()
        server.stop()


def _connect_from(source: str, port: int) -> Any:
    """A connection to the metrics server on 127.0.0.1 from `source` (any 127/8 address is local)."""
    import socket

    return socket.create_connection(("127.0.0.1", port), source_address=(source, 0))


def test_one_peer_holds_at_most_its_share_of_the_connections() -> None:
    """A scraper that reconnected as soon as the deadline cut it held every slot (review, stop
    69): one address is served `PEER_SCRAPES_MAX` connections at once, one more is closed at
    once, and another address is still served."""
    import time
    import urllib.request

    from prometheus_client import CollectorRegistry

    from kvfabric.cluster.metrics_http import PEER_SCRAPES_MAX, SCRAPES_AT_ONCE_MAX, MetricsServer

    assert PEER_SCRAPES_MAX < SCRAPES_AT_ONCE_MAX
    server = MetricsServer(CollectorRegistry(), host="127.0.0.1", port=0)
    port = server.start()
    hostile = [_connect_from("127.0.0.2", port) for _ in range(PEER_SCRAPES_MAX)]
    try:
        time.sleep(0.3)  # each taken by a handler thread, waiting for its request line
        extra = _connect_from("127.0.0.2", port)
        extra.settimeout(5)
        assert extra.recv(1) == b""  # closed at once, not served
        extra.close()
        other = _connect_from("127.0.0.3", port)
        other.settimeout(5)
        other.sendall(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        assert other.recv(12).startswith(b"HTTP/1.0 200")
        other.close()
    finally:
        for conn in hostile:
            conn.close()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        assert reply.status == 200
    server.stop()
