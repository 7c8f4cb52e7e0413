"""No exported counter goes down when a shard is handed over, rebuilt or the host stops (review,
stop 71): the collector summed `core.counters`, `events_published` and per-tenant rejections over
the shells led now, so a shard's totals left the sum with its shell and Prometheus read a counter
reset. Now a shell out of `shells` is counted while it drains, then folded into the host's
`retired` totals (`kvfabric.directory.retired`)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

from nats.js.api import StreamConfig
from prometheus_client.core import CounterMetricFamily

from kvfabric.core.directory import DirectoryConfig, DirectoryCore
from kvfabric.core.quotas import TenantStats
from kvfabric.directory.events import EventsStream
from kvfabric.directory.metrics import DirectoryCollector
from kvfabric.directory.retired import STREAMS_KEPT_MAX
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


def stream_counters(collector: DirectoryCollector) -> dict[tuple[str, tuple[str, ...]], float]:
    """The events stream's counters of a scrape (every family present: a missing one fails)."""
    names = (
        "kvfabric_directory_events_publish_failures_total",
        "kvfabric_directory_events_stream_recreated_total",
        "kvfabric_directory_events_stream_repairs_failed_total",
    )
    found = {k: v for k, v in counters(collector).items() if k[0] in names}
    assert {name for name, _ in found} == set(names)
    return found


def test_events_stream_counters_stay_while_the_instance_leads_no_shard() -> None:
    """The instance's `EventsStream` (shared by its shells) counts for the whole process, but the
    collector read it through the shells serving only: a standby, or an instance that lost every
    lease, exported 0 (a counter reset) until it led a shard again."""
    host = ShardHost("dir-a", 2, CONFIG, registry=cast(Any, None), make_shell=cast(Any, None))
    stream = EventsStream(cast(Any, None), StreamConfig(name="KVF_DIRECTORY_EVENTS"))
    stream.failures.update(timeout=7, no_responders=2)
    stream.recreated = 1
    stream.repairs_failed = 3
    for shard in (0, 1):
        host.shells[shard] = shell_with_counts(shard, 1)
        host.shells[shard].events_stream = stream  # one per instance (`ShellFactory`)
    collector = DirectoryCollector(host)

    async def go() -> None:
        first = stream_counters(collector)
        assert first[("kvfabric_directory_events_publish_failures_total", ("timeout",))] == 7
        assert first[("kvfabric_directory_events_stream_recreated_total", ())] == 1
        assert first[("kvfabric_directory_events_stream_repairs_failed_total", ())] == 3

        await host.stop_shard(0, drain_s=0.05)  # handed over: shard 1's shell still serves
        await host.stop_shard(1, drain_s=0.05)  # the last one: draining, then folded
        draining = stream_counters(collector)
        assert draining == first
        await asyncio.gather(*host._retiring)
        assert not host.shells and not host.draining
        standby = stream_counters(collector)
        assert standby == first  # not 0: the stream is the instance's, it counts on

        stream.failures["timeout"] += 1  # a stuck publisher the stop could not end
        later = stream_counters(collector)
        assert later[("kvfabric_directory_events_publish_failures_total", ("timeout",))] == 8

        host.shells[0] = shell_with_counts(0, 0, epoch=2)  # leads a shard again, same stream
        host.shells[0].events_stream = stream
        again = stream_counters(collector)
        assert again == later  # counted once, not once per shell or per fold
        assert await host.stop() == []
        assert stream_counters(collector) == later

    asyncio.run(go())


def test_events_streams_kept_are_bounded_and_their_counts_stay() -> None:
    """Shells that made their own stream (in-process): at most STREAMS_KEPT_MAX kept live, the
    counts of the ones forgotten summed; nothing goes down."""
    host = ShardHost("dir-a", 1, CONFIG, registry=cast(Any, None), make_shell=cast(Any, None))
    collector = DirectoryCollector(host)

    async def go() -> None:
        for epoch in range(1, STREAMS_KEPT_MAX + 3):
            host.shells[0] = shell_with_counts(0, 0, epoch=epoch)
            own = EventsStream(cast(Any, None), StreamConfig(name="KVF_DIRECTORY_EVENTS"))
            own.recreated = 1
            host.shells[0].events_stream = own
            await host.stop_shard(0)
            assert len(host.retired.streams) <= STREAMS_KEPT_MAX
            got = stream_counters(collector)
            assert got[("kvfabric_directory_events_stream_recreated_total", ())] == epoch

    asyncio.run(go())
