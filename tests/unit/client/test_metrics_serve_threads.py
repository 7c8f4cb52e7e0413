"""`ClientMetrics.serve` and `stop` from several threads at once: clients in several threads share
one metrics object (SGLang's re-key: the replaced client's late background start and the new
client's start; a replaced client's close and the newest client's serve). Both were
check-then-act without a lock: two threads serving at once each bound a server (with port 0 one
leaked, never stopped; with the fixed `metrics_port` the second failed EADDRINUSE and disabled
its client, `config_error`), and `stop` cleared `_server` before the port was let go, so a serve
meanwhile bound a port still held (EADDRINUSE). Now one lock is held across all of each."""

from __future__ import annotations

import threading
import time

import pytest

from kvfabric.client import metrics as client_metrics
from kvfabric.client.metrics import ClientMetrics
from kvfabric.cluster.metrics_http import MetricsServer
from kvfabric.testing.ports import free_port
from kvfabric.testing.probes import scrape_metrics_once_served

SLOW_S = 0.3  # a bind or a stop that takes this long (a loaded host), the other thread meanwhile


def _slow_servers(monkeypatch: pytest.MonkeyPatch) -> tuple[list[MetricsServer], threading.Event]:
    """Servers that take `SLOW_S` to start (before they bind) and to stop (before they let the
    port go); every one made is listed, and the event is set once a stop began."""
    made: list[MetricsServer] = []
    stopping = threading.Event()

    class SlowServer(MetricsServer):
        def start(self) -> int:
            made.append(self)
            time.sleep(SLOW_S)
            return super().start()

        def stop(self) -> None:
            if self.running:
                stopping.set()
                time.sleep(SLOW_S)
            super().stop()

    monkeypatch.setattr(client_metrics, "MetricsServer", SlowServer)
    return made, stopping


def test_two_threads_serving_at_once_make_one_server(monkeypatch: pytest.MonkeyPatch) -> None:
    made, _ = _slow_servers(monkeypatch)
    metrics = ClientMetrics()
    both = threading.Barrier(2)
    ports: list[int] = []
    errors: list[BaseException] = []

    def serve() -> None:
        both.wait(10)
        try:
            ports.append(metrics.serve(0))
        except BaseException as exc:  # (reported below, not lost in the thread)
            errors.append(exc)

    threads = [threading.Thread(target=serve) for _ in range(2)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert not errors
        assert len(made) == 1  # one server bound, none leaked
        assert len(ports) == 2 and ports[0] == ports[1] == made[0].port
        assert "kvfabric_client" in scrape_metrics_once_served(ports[0])
    finally:
        metrics.stop()
        for server in made:  # (the old code's leaked one too)
            server.stop()
    assert not any(server.running for server in made)


def test_serving_while_another_thread_stops_waits_for_the_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """The replaced client's close stops the server while the newest client serves it again on
    the same fixed port: the serve waits for the stop to let the port go, then binds it."""
    made, stopping = _slow_servers(monkeypatch)
    metrics = ClientMetrics()
    port = metrics.serve(free_port())
    stopper = threading.Thread(target=metrics.stop)
    try:
        stopper.start()
        assert stopping.wait(10)  # the stop has begun: the port is still held
        assert metrics.serve(port) == port  # no EADDRINUSE
        stopper.join(30)
        assert len(made) == 2 and not made[0].running and made[1].running
        assert "kvfabric_client" in scrape_metrics_once_served(port)
    finally:
        stopper.join(30)
        metrics.stop()
        for server in made:
            server.stop()
