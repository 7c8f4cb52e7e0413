"""Client metrics (prometheus-client), one registry per client so several clients in one process
(tests, multi-engine hosts) never collide. `serve(port)` exposes them over HTTP."""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvfabric.cluster.metrics_http import MetricsServer

__all__ = ["ClientMetrics"]

_LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ClientMetrics:
    def __init__(self) -> None:
        self._server: MetricsServer | None = None  # `serve`'s HTTP server, until `stop`
        # Held across all of `serve` and all of `stop`: clients in several threads share one
        # metrics object (SGLang's re-key: the old client's late start and the new one's start),
        # and both bound the fixed port (EADDRINUSE: the new client disabled, `config_error`), or
        # with port 0 one server leaked; `stop` cleared `_server` before the port was let go.
        self._serve_lock = threading.Lock()
        self.registry = CollectorRegistry()
        r = self.registry
        self.lookups = Counter("kvfabric_client_lookups", "Lookups asked", registry=r)
        self.hit_tokens = Counter(
            "kvfabric_client_hit_tokens", "Candidate hit tokens the directory reported (folded)", registry=r
        )
        self.loaded_tokens = Counter(
            "kvfabric_client_loaded_tokens", "Tokens loaded and verified", registry=r
        )
        self.loaded_bytes = Counter(
            "kvfabric_client_loaded_bytes", "Bytes copied into engine buffers", registry=r
        )
        self.prefill_tokens_saved = Counter(
            "kvfabric_client_prefill_tokens_saved", "Prefill tokens the engine did not compute", registry=r
        )
        self.fallbacks = Counter(
            "kvfabric_client_fallbacks",
            "Hits or loads shortened (engine recomputes), by cause",
            ["cause"],
            registry=r,
        )
        self.replica_retries = Counter(
            "kvfabric_client_replica_retries",
            "Object reads retried on another replica (the first one failed)",
            registry=r,
        )
        self.corrupt_reports = Counter(
            "kvfabric_client_corrupt_reports",
            "Replicas whose bytes failed their checksum, by what became of the report to the directory",
            ["outcome"],
            registry=r,
        )
        self.busy_retries = Counter(
            "kvfabric_client_busy_retries",
            "Directory requests of saves asked again after a busy answer (backoff)",
            registry=r,
        )
        self.load_seconds = Histogram(
            "kvfabric_client_load_seconds", "Load latency", buckets=_LATENCY_BUCKETS_S, registry=r
        )
        self.lookup_seconds = Histogram(
            "kvfabric_client_lookup_seconds", "Lookup latency", buckets=_LATENCY_BUCKETS_S, registry=r
        )
        self.save_seconds = Histogram(
            "kvfabric_client_save_seconds",
            "Save latency (begin to commit)",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.queued_seconds = Histogram(
            "kvfabric_client_queued_seconds",
            "Time a load waited for transfer room (queued, not transferring)",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.saved_tokens = Counter(
            "kvfabric_client_saved_tokens", "Tokens newly published by saves", registry=r
        )
        self.saved_bytes = Counter("kvfabric_client_saved_bytes", "Bytes written by saves", registry=r)
        self.save_failures = Counter(
            "kvfabric_client_save_failures", "Chunks a save did not publish, by cause", ["cause"], registry=r
        )
        self.saves_dropped = Counter(
            "kvfabric_client_saves_dropped", "Saves refused before starting, by cause", ["cause"], registry=r
        )
        self.close_aborts_unfinished = Counter(
            "kvfabric_client_close_aborts_unfinished",
            "Aborts (and commits) of cancelled or cut saves still unanswered when close stopped"
            " waiting for them, and aborts answered closed unsent after that: what they end stays"
            " reserved at the directory until its write TTL",
            registry=r,
        )
        self.leases_held = Gauge("kvfabric_client_leases_held", "Read leases held", registry=r)
        self.inflight_bytes = Gauge(
            "kvfabric_client_save_inflight_bytes", "Bytes of saves not finished", registry=r
        )

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve `/metrics` on `host`:`port` (0: any port) until `stop`; the port served. The
        services' bounded server (`kvfabric.cluster.metrics_http`): prometheus-client's
        `start_http_server` bound every address, with no timeout and a thread per connection
        without bound, inside the engine's process (review, stop 68). Idempotent, from any
        thread: served already, the port served (one server, however many threads ask at once)."""
        with self._serve_lock:
            if self._server is not None:  # served already (a start that failed, then `_disable`):
                return self._server.port  # a second server leaked the first, or read its port as taken
            server = MetricsServer(self.registry, host=host, port=port)
            port = server.start()
            self._server = server
            return port

    def stop(self) -> None:
        """Stop serving and let the port go (a client made again in the same process with the
        same fixed `metrics_port` could not start: the closed one's server still held it;
        review, 2026-12-06). A `serve` meanwhile, from another thread, waits until the port is
        let go (it bound a port still held: EADDRINUSE). Blocks up to one poll interval."""
        with self._serve_lock:
            server, self._server = self._server, None
            if server is not None:
                server.stop()
