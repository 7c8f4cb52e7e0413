"""The counters of shard shells that no longer serve, kept so the exported counters never go down.

The directory's Prometheus counters (`kvfabric_directory_core_events_total`,
`..._events_published_total`, `..._events_dropped_total`, `..._tenant_rejected_total`:
`kvfabric.directory.metrics`) are sums over the shard shells of this instance. A shard handed
over, lost, or rebuilt for a missing segment (a new core, starting at zero) took its totals out
of the sum, and Prometheus read the drop as a counter reset: `rate()` and `increase()` over it
were wrong (review, stop 71). Now the host (`ShardHost`) moves a shell it stops serving to
`draining` (still counted as it is: a handover's queued events go on being published) and, once
it has stopped, folds its counters in here; the collector exports retired + draining + serving.

Thread safety: the scrape runs on another thread. Every move of a shell between `shells`,
`draining` and the folded totals happens under `lock` in one synchronous stretch of the loop,
and the collector copies all three under it (`snapshot`), so a shell is counted exactly once in
every scrape.

Bounds: one entry per core counter name, and per-tenant rejections for at most `tenants_max`
tenants (the core's own bound, `DirectoryConfig.tenants_max`), the least recently folded
forgotten first, as a core forgets a tenant's counts.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvfabric.core.quotas import Tenant

if TYPE_CHECKING:
    from kvfabric.directory.shell import DirectoryShell

__all__ = ["RetiredCounters"]


@dataclass(slots=True)
class RetiredCounters:
    """What shells no longer counted live had counted (see the module docstring)."""

    tenants_max: int
    core: Counter[str] = field(default_factory=Counter)
    events_published: int = 0
    events_dropped: int = 0
    # share domain -> (quota_exceeded, rate_limited): tuples, so a copy is one C-level walk
    tenants: OrderedDict[Tenant, tuple[int, int]] = field(default_factory=OrderedDict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fold(self, shell: DirectoryShell) -> None:
        """Add what `shell` counted (call it with `lock` held, once per shell, once it has stopped)."""
        self.core.update(dict(shell.core.counters))
        self.events_published += shell.events_published
        self.events_dropped += shell.events_dropped
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
        )
