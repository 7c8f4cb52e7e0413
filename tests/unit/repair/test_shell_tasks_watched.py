"""The repair and prefetch services' background tasks (the scan loop, the core's ticker) are
watched by the service runtime: one that dies of an exception (a bug, not a `KvfError`) stops
the service for its supervisor to restart. They died silently before (review, 2026-12-05): the
service answered `$SRV.PING` while it repaired or prefetched nothing."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from kvfabric.core.repair import RepairConfig, RepairCore
from kvfabric.repair.shell import RepairShell


class WatchingRuntime:
    """What the shells use of `ServiceRuntime`: endpoints (ignored) and `watch`."""

    def __init__(self) -> None:
        self.watched: dict[str, asyncio.Task[Any]] = {}

    def add_endpoint(self, *args: Any, **kwargs: Any) -> None:
        return None

    def watch(self, task: asyncio.Task[Any], name: str) -> None:
        self.watched[name] = task


class Nats:
    """What the shells' `start` uses of a NATS connection here (prefetch subscribes)."""

    async def subscribe(self, *args: Any, **kwargs: Any) -> None:
        return None


async def scan_death_is_watched(shell: Any, service: str) -> None:
    """`shell` started with a scan that raises a bug: its scan and ticker are watched, and the
    scan task the runtime watches ends with that error."""
    runtime = WatchingRuntime()
    shell.attach(cast(Any, runtime))

    async def buggy_scan() -> None:
        raise RuntimeError("a bug in the scan")

    shell.scan = buggy_scan
    await shell.start(cast(Any, Nats()))
    try:
        assert set(runtime.watched) == {f"{service}_scan", f"{service}_ticker"}
        scan = runtime.watched[f"{service}_scan"]
        await asyncio.wait([scan], timeout=5)
        assert scan.done() and isinstance(scan.exception(), RuntimeError)
    finally:
        await shell.stop()


async def test_a_repair_scan_that_dies_of_a_bug_is_seen_by_the_runtime() -> None:
    timeouts = {"request_timeout_s": 1.0, "copy_timeout_s": 1.0}
    shell = RepairShell(RepairCore(RepairConfig()), replicas_target=3, scan_ms=10, tick_ms=10, **timeouts)
    await scan_death_is_watched(shell, "repair")


async def test_a_prefetch_scan_that_dies_of_a_bug_is_seen_by_the_runtime() -> None:
    from kvfabric.core.prefetch import PrefetchConfig, PrefetchCore
    from kvfabric.prefetch.shell import PrefetchShell

    shell = PrefetchShell(
        PrefetchCore(PrefetchConfig()),
        holder_id="prefetch-test",
        tick_ms=10,
        scan_ms=10,
        resolving_max=4,
        hot_groups_per_event_max=8,
        request_timeout_s=1.0,
        copy_timeout_s=1.0,
    )
    await scan_death_is_watched(shell, "prefetch")
