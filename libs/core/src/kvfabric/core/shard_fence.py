"""Fencing the late events of a directory shard core that a newer epoch replaced.

Both followers of the directory's events stream (the router's index, `kvfabric.core.routing_index`,
and the eviction policy, `kvfabric.eviction_policy.shell`) resync on a shard's `ShardStarted`
marker. A handover drains the old core's queued events while its lease key is released, and
nats-py may flush a publish it had cancelled when it reconnects, so an old core's event can land
in the stream after the new core's marker: applied after the resync, it left the follower
holding a group the directory no longer has (or missing one it has) until something else made
it list again. Every event of a shard's core names that core's shard and epoch in the NATS
header `Kvf-Shard-Epoch` (`kvfabric.proto.directory.shard_epoch_of`; the marker names them in
its fields too).

`ShardEpochFence.admit(origin)` keeps, per shard, the highest epoch any event named, and answers
False for an event naming a lower one for its shard (a stale marker too: no resync on it). An
event naming none (an older directory, a header malformed) is admitted, as before the header.
Epochs are JetStream KV revisions, strictly increasing per bucket (`kvfabric.core.leadership`),
and never reset (the directory keeps them growing past a recreated bucket; the shard router
fences replies the same way: `DirectoryRouter.epochs`), so the map is never cleared. A
same-epoch rebuild's core is not fenced from the one it replaces (one epoch).

A follower that reads an event again (a replay onto a listing's view, the router's
`resync_replay`) asks the fence as it stands then: an old core's event that preceded its
successor's marker in the stream may be dropped in the replay though it was applied the first
time; the marker itself comes later in the same replay and asks for a listing again, which the
follower's index tolerates meanwhile (docs/router.md).

Logged, not flooded: a drained outbox can put a thousand or two late events of one old core in
the stream, so a follower logs the first fenced event of each (shard, epoch) (`first_fenced`, which
keeps only the last (shard, epoch) it answered for per shard) and counts the rest.

Bounded: shard ids past `SHARD_ID_MAX` (the cluster's `kvfabric.proto.shards.SHARDS_MAX` shards,
0-4095), or negative, name nothing, so a foreign publisher's made-up shards cannot fill the table;
at most `shards_max` shards are tracked (by default every valid id), a shard beyond them is
admitted unfenced. Pure and I/O-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from kvfabric.proto.directory import SHARD_ID_MAX

__all__ = ["SHARDS_TRACKED_MAX", "ShardEpochFence"]

SHARDS_TRACKED_MAX: Final = SHARD_ID_MAX + 1  # every shard a header may name


class ShardEpochFence:
    """Per shard, the highest epoch seen (module docstring)."""

    __slots__ = ("_epochs", "_reported", "shards_max")

    def __init__(self, shards_max: int = SHARDS_TRACKED_MAX) -> None:
        self.shards_max = shards_max
        self._epochs: dict[int, int] = {}
        self._reported: dict[int, int] = {}  # shard -> the epoch `first_fenced` last answered for

    def admit(self, origin: tuple[int, int] | None) -> bool:
        """Whether an event of the core `origin` = (shard, epoch) is applied (None: it names
        none); the shard's highest epoch is raised to it."""
        if origin is None:
            return True
        shard, epoch = origin
        if not 0 <= shard <= SHARD_ID_MAX or epoch < 0:
            return True
        seen = self._epochs.get(shard)
        if seen is not None and epoch < seen:
            return False
        if seen is not None or len(self._epochs) < self.shards_max:
            self._epochs[shard] = epoch
        return True

    def raise_to(self, epochs: Mapping[int, int]) -> None:
        """Each shard's highest epoch raised to `epochs`' (the shard map of a listing: its
        leaders' epochs), never lowered."""
        for shard, epoch in epochs.items():
            self.admit((shard, epoch))

    def first_fenced(self, origin: tuple[int, int] | None) -> bool:
        """Whether an event of `origin` that `admit` just fenced is the first fenced of its
        (shard, epoch) (the caller logs it, and only counts the others): True unless the last
        one answered True for its shard named the same epoch. Per shard one epoch kept, within
        `shards_max` (past it: True)."""
        if origin is None:
            return True
        shard, epoch = origin
        if self._reported.get(shard) == epoch:
            return False
        if shard in self._reported or len(self._reported) < self.shards_max:
            self._reported[shard] = epoch
        return True

    def highest(self, shard: int) -> int | None:
        """The highest epoch seen for `shard` (None: none)."""
        return self._epochs.get(shard)

    def __len__(self) -> int:
        return len(self._epochs)
