"""The directory core: object lifecycle, two-phase publish, read leases, pins, placement.

Synchronous and I/O-free. The service shell decodes a request, calls `handle(request, now_ms)`
(and `tick(now_ms)` periodically), performs the returned effects and sends the reply; a large
put_begin, put_commit, put_abort or evict it runs as `steps(request, now_ms, ids_max)` instead, one bounded
call a slice (`base.Steps`). The same
entries as events: `DirectoryCore.step(event, now_ms)` (the shape every core shares,
`kvfabric.core.step`; the events in `events`). Time is passed in; nothing here reads a clock,
sleeps or does I/O.

`DirectoryCore` (`dispatch`) routes each verb to one of the protocol tables, a module each with
its states, invariants and `check_invariants`: `segments`, `writes` (two-phase put), `published`
(readable groups, holds, eviction, the sweep), `leases` (read leases and pins), `frees` (slots
handed back, grace), `replicas` (extra replica tickets), `reads` (lookups and read-only queries).
`base` holds the configuration, effects and the context the tables share; `replies` the reply
bounds and the retried-request cache. Pure helpers the tables use: `keys` (what the core needs from
a binary key or group id, over `kvfabric.format.ids`), `records` (the packed record of a published
group), `index` (the ordered per-domain index of group keys), `rebuild` (a shard's index rebuilt
from the segments' reports, `plan_rebuild`).
"""

from kvfabric.core.directory.base import (
    LIST_SCAN_GROUPS_MAX,
    DirectoryConfig,
    Effect,
    EmitEvent,
    FreeSlots,
    Outcome,
    Steps,
)
from kvfabric.core.directory.dispatch import DirectoryCore

__all__ = [
    "LIST_SCAN_GROUPS_MAX",
    "DirectoryConfig",
    "DirectoryCore",
    "Effect",
    "EmitEvent",
    "FreeSlots",
    "Outcome",
    "Steps",
]
