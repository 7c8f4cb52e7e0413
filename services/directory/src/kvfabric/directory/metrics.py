"""Exports the core's plain counters and state sizes as Prometheus metrics (read at scrape time)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvfabric.directory.handlers import DirectoryShell

__all__ = ["DirectoryCollector"]


class DirectoryCollector(Collector):
    def __init__(self, shell: DirectoryShell) -> None:
        self.shell = shell

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        core = self.shell.core
        events = CounterMetricFamily(
            "kvfabric_directory_core_events", "Core counters, by name.", labels=["name"]
        )
        for name, value in sorted(core.counters.items()):
            events.add_metric([name.removesuffix("_total")], value)
        yield events
        yield CounterMetricFamily(
            "kvfabric_directory_events_published",
            "Events JetStream acknowledged.",
            value=self.shell.events_published,
        )
        state = GaugeMetricFamily("kvfabric_directory_groups", "Chunk groups by state.", labels=["state"])
        state.add_metric(["building"], len(core.building))
        state.add_metric(["published"], len(core.published))
        state.add_metric(["evicting"], len(core.evicting))
        yield state
        yield GaugeMetricFamily(
            "kvfabric_directory_pending_objects", "Objects being written.", value=core.pending_objects
        )
        yield GaugeMetricFamily("kvfabric_directory_epoch", "Directory epoch.", value=core.epoch)
        leases = GaugeMetricFamily("kvfabric_directory_leases", "Read leases and pins held.", labels=["kind"])
        leases.add_metric(["pin"], core.pins_held)
        leases.add_metric(["read"], core.leases_held - core.pins_held)
        yield leases
        up = GaugeMetricFamily(
            "kvfabric_directory_segment_up", "1 when the segment is up.", labels=["segment"]
        )
        reserved = GaugeMetricFamily(
            "kvfabric_directory_segment_reserved_bytes", "Bytes placed on a segment.", labels=["segment"]
        )
        for seg in core.segments.values():
            up.add_metric([seg.segment_id], 1.0 if seg.up else 0.0)
            reserved.add_metric([seg.segment_id], seg.reserved_bytes)
        yield up
        yield reserved
        yield from self._tenants()

    def _tenants(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        """Per share domain (hex digest): what it holds and what it was refused."""
        quotas = self.shell.core.quotas
        used = GaugeMetricFamily(
            "kvfabric_directory_tenant_used_bytes",
            "Bytes a tenant holds (size x replicas: building, published, copying, freeing).",
            labels=["domain"],
        )
        objects = GaugeMetricFamily(
            "kvfabric_directory_tenant_objects", "Objects a tenant holds.", labels=["domain"]
        )
        for tenant, use in list(quotas.usage.items()):  # scraped from another thread
            used.add_metric([tenant.hex()], use.bytes)
            objects.add_metric([tenant.hex()], use.objects)
        yield used
        yield objects
        rejected = CounterMetricFamily(
            "kvfabric_directory_tenant_rejected",
            "Refusals by quota (objects) or rate limit (requests), per tenant tracked.",
            labels=["domain", "reason"],
        )
        for tenant, stats in list(quotas.stats.items()):
            rejected.add_metric([tenant.hex(), "quota_exceeded"], stats.quota_exceeded)
            rejected.add_metric([tenant.hex(), "rate_limited"], stats.rate_limited)
        yield rejected
