"""No exported counter goes down when a shard is handed over, rebuilt or the host stops (review,
stop 71): the collector summed `core.counters`, `events_published` and per-tenant rejections over
the shells led now, so a shard's totals left the sum with its shell and Prometheus read a counter
reset. Now a shell out of `shells` is counted while it drains, then folded into the host's
`retired` totals (`kvfabric.directory.retired`)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

from prometheus_client.core import CounterMetricFamily

from kvfabric.core.directory import DirectoryConfig, DirectoryCore
from kvfabric.core.quotas import TenantStats
from kvfabric.directory.metrics import DirectoryCollector
from kvfabric.directory.shard_host import ShardHost
from kvfabric.directory.shell import DirectoryShell
from tests.unit.core.dirkit import SECRET

CONFIG = DirectoryConfig(ticket_secret=SECRET)
TENANT = b"t" * 16


def shell_with_counts(shard: int, n: int, epoch: int = 1) -> DirectoryShell:
    shell = DirectoryShell(
        DirectoryCore(CONFIG, epoch=epoch, shard=shard),
        tick_ms=100,
        events_outbox_max=100,
        events_max_age_s=60,
        free_timeout_s=1,
    )
    shell.core.counters["lookups_total"] = n
    shell.core.counters[f"only_shard_{shard}_total"] = n
    shell.core.quotas.stats[cast(Any, TENANT)] = TenantStats(None, quota_exceeded=n, rate_limited=2 * n)
    shell.publisher = cast(Any, SimpleNamespace(published=3 * n))
    return shell


def counters(collector: DirectoryCollector) -> dict[tuple[str, tuple[str, ...]], float]:
    """Every counter sample of a scrape, by (name, label values)."""
    return {
        (s.name, tuple(s.labels.values())): s.value
        for family in collector.collect()
        if isinstance(family, CounterMetricFamily)
        for s in family.samples
        if s.name.endswith("_total")
    }


def assert_none_went_down(before: dict[Any, float], after: dict[Any, float]) -> None:
    down = {k: (v, after.get(k)) for k, v in before.items() if after.get(k, 0.0) < v}
    assert not down, down


def test_no_counter_goes_down_when_shards_stop_or_are_rebuilt() -> None:
    host = ShardHost("dir-a", 2, CONFIG, registry=cast(Any, None), make_shell=cast(Any, None))
    host.shells[0] = shell_with_counts(0, 10)
    host.shells[1] = shell_with_counts(1, 100)
    collector = DirectoryCollector(host)

    async def go() -> None:
        first = counters(collector)
        assert first[("kvfabric_directory_core_events_total", ("lookups",))] == 110
        assert first[("kvfabric_directory_events_published_total", ())] == 330
        assert first[("kvfabric_directory_tenant_rejected_total", (TENANT.hex(), "rate_limited"))] == 220

        await host.stop_shard(0)  # handed over: shard 0 gone from the shells led
        second = counters(collector)
        assert_none_went_down(first, second)
        assert second == first  # nothing counted twice either

        host.shells[1].core.counters["lookups_total"] += 1
        await host.stop_shard(1, drain_s=0.05)  # rebuilt: stopped, draining in the background ...
        draining = counters(collector)
        assert draining[("kvfabric_directory_core_events_total", ("lookups",))] == 111
        await asyncio.gather(*host._retiring)
        host.shells[1] = shell_with_counts(1, 0, epoch=2)  # ... and a new core, counting from zero
        third = counters(collector)
        assert_none_went_down(draining, third)
        assert third[("kvfabric_directory_core_events_total", ("lookups",))] == 111

        host.shells[1].core.counters["lookups_total"] += 5
        assert await host.stop() == []
        last = counters(collector)
        assert_none_went_down(third, last)
        assert last[("kvfabric_directory_core_events_total", ("lookups",))] == 116
        assert not host.draining  # every stopped shell folded: the cores are not kept

    asyncio.run(go())
