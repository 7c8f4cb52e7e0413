"""The segment's gate for the directory's requests: epoch fencing per shard, and drain.

Pure: no I/O, no clock, no lock. `ArenaBackend` owns one (`backend.gate`) and changes it under its
lock; the shell asks the backend (`admit_directory`, `saw_epoch`, `draining`), never the gate.

## States
- `fences`: per directory shard, the newest epoch this segment has heard of from a leader of that
  shard (a shard not listed: 0, nothing fenced yet). A fence only rises.
- `draining`: new writes are refused (set either way by the directory's `drain`); reads, frees and
  reports go on.

## Rules
- A request of `(shard, epoch)` from the directory passes only if `epoch >= fences[shard]`: an
  older epoch is a replaced leader's of that shard, refused with
  `StaleGeneration("directory_epoch", epoch, fence)` and applied nowhere (`check`).
- A write ticket is checked (`check`); it does not raise the fence (a ticket comes through a
  client: the fence moves only on what the directory itself sends).
- A free or report is the shard leader speaking: `admit` checks it, then raises the fence to it.
- Any reply of a leader, or a heartbeat's shard epochs, says a leader of `(shard, epoch)` exists:
  `saw` raises the fence to it (returns whether it rose, for the caller's log).
- `check_writes`: `Conflict` while draining.

## Invariants (`check_invariants`)
1. Every listed fence is a shard id >= 0 with an epoch >= 1 (0 is "nothing fenced": not listed).
2. A fence never falls: `saw` and `admit` only raise it (the tests check it against a model).
"""

from __future__ import annotations

from kvfabric.format.errors import Conflict, StaleGeneration
from kvfabric.format.invariant import invariant

__all__ = ["SegmentGate"]


class SegmentGate:
    """Epoch fences per directory shard and the drain flag (see the module doc)."""

    def __init__(self) -> None:
        self.fences: dict[int, int] = {}  # shard -> newest epoch heard of (absent: 0)
        self.draining = False

    def fence(self, shard: int) -> int:
        """The oldest epoch of `shard` still accepted."""
        return self.fences.get(shard, 0)

    def check(self, shard: int, epoch: int) -> None:
        """`StaleGeneration` if a newer leader of `shard` than `epoch` has been heard of."""
        fence = self.fences.get(shard, 0)
        if epoch < fence:  # from a leader of the shard that has been replaced: fenced
            raise StaleGeneration("directory_epoch", epoch, fence)

    def saw(self, shard: int, epoch: int) -> bool:
        """A leader of `shard` with `epoch` exists: older epochs are fenced from now on. Returns
        whether the fence rose."""
        if epoch > self.fences.get(shard, 0):
            self.fences[shard] = epoch
            return True
        return False

    def admit(self, shard: int, epoch: int) -> bool:
        """A free or report from the leader of `shard` at `epoch`: `check`, then `saw`."""
        self.check(shard, epoch)
        return self.saw(shard, epoch)

    def check_writes(self) -> None:
        if self.draining:
            raise Conflict("segment is draining: no new writes")

    def check_invariants(self) -> None:
        for shard, epoch in self.fences.items():
            invariant(shard >= 0 and epoch >= 1, "bad epoch fence", shard=shard, epoch=epoch)
