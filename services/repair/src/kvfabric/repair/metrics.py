"""Exports the repair core's counters and gauges as Prometheus metrics (read at scrape time)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvfabric.repair.shell import RepairShell

__all__ = ["RepairCollector"]


class RepairCollector(Collector):
    def __init__(self, shell: RepairShell) -> None:
        self.shell = shell

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        status = self.shell.status()
        events = CounterMetricFamily(
            "kvfabric_repair_core_events", "Core counters, by name.", labels=["name"]
        )
        for name, value in sorted(status.counters.items()):
            events.add_metric([name.removesuffix("_total")], value)
        yield events
        gauges = GaugeMetricFamily("kvfabric_repair_core_state", "Core gauges, by name.", labels=["name"])
        for name, value in sorted(status.gauges.items()):
            gauges.add_metric([name], value)
        yield gauges
        yield CounterMetricFamily(
            "kvfabric_repair_bytes_copied", "Bytes copied into place.", value=status.bytes_copied
        )
        yield CounterMetricFamily("kvfabric_repair_scans", "Anti-entropy passes.", value=status.scans)
        yield GaugeMetricFamily(
            "kvfabric_repair_objects_below_target",
            "Objects below target at the last pass.",
            value=status.below_target,
        )
