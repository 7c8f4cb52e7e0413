"""A client's `/metrics` endpoint (inside an engine's process) is the services' bounded server
(review, stop 68): prometheus-client's `start_http_server` listened on every address, with no
timeout and one thread per connection without bound, so idle connections grew the engine's
threads for ever. Now it listens on `metrics_host` (127.0.0.1 by default), serves at most
`SCRAPES_AT_ONCE_MAX` connections at once and closes the next one at once."""

from __future__ import annotations

import socket
import time

import pytest

from kvfabric.client.metrics import ClientMetrics
from kvfabric.client.settings import ClientSettings
from kvfabric.cluster.metrics_http import SCRAPES_AT_ONCE_MAX
from kvfabric.format.errors import BadRequest
from kvfabric.testing.probes import scrape_metrics_once_served


def test_the_client_endpoint_listens_on_loopback_and_is_bounded() -> None:
    metrics = ClientMetrics()
    port = metrics.serve(0)
    try:
        assert metrics._server is not None and metrics._server.host == "127.0.0.1"
        # from four addresses (one address gets half the connections: `PEER_SCRAPES_MAX`)
        idle = [
            socket.create_connection(("127.0.0.1", port), source_address=(f"127.0.0.{2 + i % 4}", 0))
            for i in range(SCRAPES_AT_ONCE_MAX)
        ]
        try:
            time.sleep(0.3)  # each taken by a handler thread
            extra = socket.create_connection(("127.0.0.1", port), source_address=("127.0.0.9", 0))
            extra.settimeout(5)
            assert extra.recv(1) == b""  # closed at once: no thread more
            extra.close()
        finally:
            for conn in idle:
                conn.close()
        assert "kvfabric_client" in scrape_metrics_once_served(port)  # served again once they go
    finally:
        metrics.stop()


def test_an_empty_metrics_host_is_a_setting_error() -> None:
    with pytest.raises(BadRequest, match="metrics_host"):
        ClientSettings(nats_url="nats://x:1", metrics_host=" ")


def test_serving_twice_keeps_the_one_server() -> None:
    """A start that failed after the endpoint was up, then `_disable`, served it again: with port
    0 the first server leaked (never stopped by `close`), with a fixed port the log said it was
    taken (review of the fix). The second call answers the first server's port."""
    metrics = ClientMetrics()
    port = metrics.serve(0)
    first = metrics._server
    try:
        assert metrics.serve(0) == port and metrics._server is first
    finally:
        metrics.stop()
    assert first is not None and not first.running
