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

The HTTP server (`MetricsServer`) is `kvfabric.cluster.metrics_http`'s, shared with the client:
prometheus-client's WSGI app on a bounded threading `wsgiref` server in a daemon thread, off the
event loop.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvfabric.cluster.metrics_http import MetricsServer
from kvfabric.format.invariant import invariant
from kvfabric.runtime.gcpolicy import GcCollector

__all__ = ["DURATION_BUCKETS_S", "MetricsServer", "Outcome", "ServiceMetrics"]

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
