"""Exports the policy core's counters and usage as Prometheus metrics (read at scrape time)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvfabric.eviction_policy.shell import EvictionShell

__all__ = ["EvictionCollector"]


class EvictionCollector(Collector):
    def __init__(self, shell: EvictionShell) -> None:
        self.shell = shell

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        status = self.shell.status()
        events = CounterMetricFamily(
            "kvfabric_eviction_core_events", "Core counters, by name.", labels=["name"]
        )
        for name, value in sorted(status.counters.items()):
            events.add_metric([name.removesuffix("_total")], value)
        yield events
        yield CounterMetricFamily(
            "kvfabric_eviction_events_applied", "Directory events applied.", value=status.events_applied
        )
        yield CounterMetricFamily(
            "kvfabric_eviction_events_fenced",
            "Directory events of a replaced shard core (an epoch below one seen): not applied.",
            value=self.shell.events_fenced,
        )
        yield CounterMetricFamily(
            "kvfabric_eviction_requests_failed",
            "Evict requests without an answer.",
            value=self.shell.evict_requests_failed,
        )
        yield GaugeMetricFamily("kvfabric_eviction_objects", "Chunk groups tracked.", value=status.objects)
        used = GaugeMetricFamily(
            "kvfabric_eviction_pool_used_bytes", "Tracked bytes per segment.", labels=["segment"]
        )
        capacity = GaugeMetricFamily(
            "kvfabric_eviction_pool_capacity_bytes", "Segment capacity.", labels=["segment"]
        )
        inflow = GaugeMetricFamily(
            "kvfabric_eviction_pool_inflow_bytes_per_second",
            "New objects' bytes a second per segment, as the last tick measured them.",
            labels=["segment"],
        )
        margin = GaugeMetricFamily(
            "kvfabric_eviction_pool_margin_bytes",
            "How far below the configured ones a segment's watermarks are (its writers' headroom).",
            labels=["segment"],
        )
        core = self.shell.core
        for pool in status.pools:
            used.add_metric([pool.segment_id], pool.used_bytes)
            capacity.add_metric([pool.segment_id], pool.capacity_bytes)
            inflow.add_metric([pool.segment_id], core.inflow(pool.segment_id))
            margin.add_metric([pool.segment_id], core.margin_bytes(pool.segment_id))
        yield used
        yield capacity
        yield inflow
        yield margin
        tenants = GaugeMetricFamily(
            "kvfabric_eviction_tenant_used_bytes", "Tracked bytes per share domain.", labels=["domain"]
        )
        for tenant in status.tenants:
            tenants.add_metric([tenant.domain_digest.hex()], tenant.used_bytes)
        yield tenants
