"""The eviction policy's latest decisions per chunk group, for `kvctl eviction explain`.

Pure and bounded: a `DecisionLog` keeps, for at most `groups_max` group keys (share domain +
chain hash), the latest `DECISIONS_PER_GROUP_MAX` decisions of each by time, oldest first
(`what` in `DECISION_KINDS`, a reason code, the pool, a victim batch's cause), each a plain
tuple (no GC tracking past the first collection). Recording moves the group to the newest
end; past `groups_max` groups the one least recently decided about is forgotten, so a busy
policy remembers the latest `groups_max` groups it touched and memory stays bounded whatever
the store holds: measured with `tracemalloc`, 11 MiB for the default 16,384 groups with four
decisions each (~0.7 KiB a group; eight, the most, ~1.2 KiB: under 20 MiB), 0.8-0.9 µs a record.
`groups_max = 0` keeps nothing.

Who calls it: the shell (`EvictionShell`) and its records (`GroupRecords`), on the event loop,
once per decision: a published group taken into the core, a victim chosen and the directory's
answer, a demotion's outcome, an `evicted` / `invalidated` event, a segment lost.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Final, TypeAlias

from kvfabric.format.invariant import invariant
from kvfabric.proto.eviction import DECISION_KINDS, DECISIONS_PER_GROUP_MAX, EvictionDecision

__all__ = ["DECISIONS_GROUPS_DEFAULT", "DecisionLog"]

DECISIONS_GROUPS_DEFAULT: Final = 16_384

# (at_ms, what, reason, pool, cause)
Entry: TypeAlias = tuple[int, str, str, str, str]


class DecisionLog:
    def __init__(self, groups_max: int = DECISIONS_GROUPS_DEFAULT) -> None:
        invariant(groups_max >= 0, "groups_max must not be negative")
        self.groups_max = groups_max
        self._groups: OrderedDict[bytes, tuple[Entry, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._groups)

    def __contains__(self, key: object) -> bool:
        return key in self._groups

    def record(
        self, key: bytes, at_ms: int, what: str, reason: str = "", pool: str = "", cause: str = ""
    ) -> None:
        """One decision about the group `key`, at `at_ms` (the policy's clock)."""
        if not self.groups_max:
            return
        entry: Entry = (at_ms, what, reason, pool, cause)
        groups = self._groups
        entries = list(groups.pop(key, ()))
        # In time order, not arrival order: a segment's loss is dropped in steps, all stamped
        # with the time its event was applied, while the ticker and the directory's answers go
        # on deciding about the group's other replicas: its `lost` can arrive older than what
        # is kept.
        at = len(entries)
        while at and entries[at - 1][0] > at_ms:
            at -= 1
        entries.insert(at, entry)
        groups[key] = tuple(entries[-DECISIONS_PER_GROUP_MAX:])
        if len(groups) > self.groups_max:
            groups.popitem(last=False)

    def of(self, key: bytes) -> list[EvictionDecision]:
        """The group's kept decisions, oldest first (none if forgotten or never seen)."""
        return [
            EvictionDecision(at_ms=at, what=what, reason=reason, pool=pool, cause=cause)
            for at, what, reason, pool, cause in self._groups.get(key, ())
        ]

    def check_invariants(self) -> None:
        invariant(len(self._groups) <= self.groups_max, "decision log past its group bound")
        for entries in self._groups.values():
            invariant(0 < len(entries) <= DECISIONS_PER_GROUP_MAX, "decisions per group unbounded")
            invariant(all(e[1] in DECISION_KINDS for e in entries), "unknown decision kind")
            ordered = all(a[0] <= b[0] for a, b in itertools.pairwise(entries))
            invariant(ordered, "decisions out of time order")
