"""The counters of shard shells that no longer serve, kept so the exported counters never go down.

The directory's Prometheus counters (`kvfabric_directory_core_events_total`,
`..._events_published_total`, `..._events_dropped_total`, `..._tenant_rejected_total`:
`kvfabric.directory.metrics`) are sums over the shard shells of this instance. A shard handed
over, lost, or rebuilt for a missing segment (a new core, starting at zero) took its totals out
of the sum, and Prometheus read the drop as a counter reset: `rate()` and `increase()` over it
were wrong (review, stop 71). Now the host (`ShardHost`) moves a shell it stops serving to
`draining` (still counted as it is: a handover's queued events go on being published) and, once
it has stopped, folds its counters in here; the collector exports retired + draining + serving.

The events stream's counters (`kvfabric_directory_events_publish_failures_total`,
`..._events_stream_recreated_total`, `..._events_stream_repairs_failed_total`) live in the
instance's `EventsStream` (`kvfabric.directory.events`), which the shells share and which counts
on for the whole process; the collector used to find it only through the shells serving now, so an
instance leading no shard (a standby, or one that lost every lease) exported them as 0, a counter
reset for Prometheus. A folded shell's stream is kept here (`streams`, one per distinct stream:
the instance has one, `ShellFactory`'s), and the collector reads every stream of the serving,
draining and folded shells once each (by identity), so those counters stay while no shard is led
and go on from where they were when one is led again.

Thread safety: the scrape runs on another thread. Every move of a shell between `shells`,
`draining` and the folded totals happens under `lock` in one synchronous stretch of the loop,
and the collector copies all three under it (`snapshot`), so a shell is counted exactly once in
every scrape.

Bounds: one entry per core counter name, and per-tenant rejections for at most `tenants_max`
tenants (the core's own bound, `DirectoryConfig.tenants_max`), the least recently folded
forgotten first, as a core forgets a tenant's counts; at most `STREAMS_KEPT_MAX` streams kept,
the least recently folded one's counts moved into `stream_counts` when another comes (only shells
started without the instance's stream, in-process tests, make their own, and no later shell uses
those; the instance's stream is folded again with each shell and stays).
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from kvfabric.core.quotas import Tenant

if TYPE_CHECKING:
    from kvfabric.directory.events import EventsStream
    from kvfabric.directory.shell import DirectoryShell

__all__ = ["STREAMS_KEPT_MAX", "RetiredCounters", "StreamCounts"]

STREAMS_KEPT_MAX: Final = 4  # events streams kept (the instance has one: module docstring)


@dataclass(slots=True)
class StreamCounts:
    """An events stream's counters (`EventsStream`), summed over streams."""

    failures: Counter[str] = field(default_factory=Counter)  # publish attempts failed, by reason
    recreated: int = 0
    repairs_failed: int = 0

    def add(self, stream: EventsStream) -> None:
        """Add what `stream` counted so far."""
        self.failures.update(dict(stream.failures))  # written by the loop: a copy (in C)
        self.recreated += stream.recreated
        self.repairs_failed += stream.repairs_failed

    def copy(self) -> StreamCounts:
        return StreamCounts(Counter(self.failures), self.recreated, self.repairs_failed)


@dataclass(slots=True)
class RetiredCounters:
    """What shells no longer counted live had counted (see the module docstring)."""

    tenants_max: int
    core: Counter[str] = field(default_factory=Counter)
    events_published: int = 0
    events_dropped: int = 0
    # share domain -> (quota_exceeded, rate_limited): tuples, so a copy is one C-level walk
    tenants: OrderedDict[Tenant, tuple[int, int]] = field(default_factory=OrderedDict)
    # id -> the events stream of shells folded (read live: it counts on), least recently folded
    # first; `stream_counts`: the counts of those forgotten (bounds, module docstring)
    streams: OrderedDict[int, EventsStream] = field(default_factory=OrderedDict)
    stream_counts: StreamCounts = field(default_factory=StreamCounts)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fold(self, shell: DirectoryShell) -> None:
        """Add what `shell` counted (call it with `lock` held, once per shell, once it has stopped)."""
        self.core.update(dict(shell.core.counters))
        self.events_published += shell.events_published
        self.events_dropped += shell.events_dropped
        if (stream := shell.events_stream) is not None:
            self.streams.pop(id(stream), None)
            self.streams[id(stream)] = stream
            while len(self.streams) > STREAMS_KEPT_MAX:
                _, forgotten = self.streams.popitem(last=False)
                self.stream_counts.add(forgotten)
        for domain, stats in shell.core.quotas.stats.copy().items():
            if not (stats.quota_exceeded or stats.rate_limited):
                continue
            quota_exceeded, rate_limited = self.tenants.pop(domain, (0, 0))
            self.tenants[domain] = (quota_exceeded + stats.quota_exceeded, rate_limited + stats.rate_limited)
            while len(self.tenants) > self.tenants_max:
                self.tenants.popitem(last=False)

    def copy(self) -> RetiredCounters:
        """A copy the scrape may read while the loop folds more (call it with `lock` held)."""
        return RetiredCounters(
            self.tenants_max,
            Counter(self.core),
            self.events_published,
            self.events_dropped,
            self.tenants.copy(),
            self.streams.copy(),
            self.stream_counts.copy(),
        )
