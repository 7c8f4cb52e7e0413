"""Exports the prefetch core's counters and its queues and copies as Prometheus metrics (read at
scrape time; docs/metrics.md).

- `kvfabric_prefetch_core_events{name}` (counter): the core's `COUNTERS` (`kvfabric.core.prefetch`,
  `hints_deadline_capped` among them) and the hint leases' `LEASE_COUNTERS`
  (`kvfabric.core.prefetch_leases`: `lease_renewals`, `lease_renew_failed`,
  `lease_renew_refused`, `leases_lost`, `lease_renewals_late`, `lease_release_failed`,
  `lease_releases_abandoned`, `lease_releases_dropped`), each without its `_total`.
- `kvfabric_prefetch_state{name}` (gauge): `PrefetchShell.status()`'s gauges (`leases_held`: the
  leases still held at the directory for live hints; `lease_renewals_queued`: due, waiting for
  room; `lease_releases_pending`: ended hints' leases still to be given back).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvfabric.prefetch.shell import PrefetchShell

__all__ = ["PrefetchCollector"]


class PrefetchCollector(Collector):
    def __init__(self, shell: PrefetchShell) -> None:
        self.shell = shell

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        status = self.shell.status()
        events = CounterMetricFamily(
            "kvfabric_prefetch_core_events", "Core counters, by name.", labels=["name"]
        )
        for name, value in sorted(status.counters.items()):
            events.add_metric([name.removesuffix("_total")], value)
        yield events
        state = GaugeMetricFamily("kvfabric_prefetch_state", "Queues and copies, by name.", labels=["name"])
        for name, value in sorted(status.gauges.items()):
            state.add_metric([name], value)
        yield state
