"""A client's save rate: bytes per second one engine may save (issue 24, item 3: no write storm).

When a cache is lost (segments down, a cluster restart, a new share domain), every request of
every engine misses and every engine saves everything it computes: N engines write at their full
prefill rate into a cluster that is also serving the reads of whatever it still has. A
per-engine byte rate bounds that refill. Saves are best-effort, so a save over the rate is not
queued (a queue would hold the engine's KV copies and then write a burst anyway): it keeps its
**leading** chunks that the budget covers — a prefix of what was asked, so every chunk saved is
still reachable from its head — and reports the rest skipped (`save_rate`); the engine
recomputes those on a later miss, as it would after an eviction.

`SaveRate` is a token bucket with debt, a pure state machine (time passed in, no I/O; the client
holds it under a lock: its loop's saves and an engine thread's `take_save_rate` both take from it):

- **State**: `level` (bytes the engine may still start saving; ≤ `burst_bytes`, may be below 0
  by less than one chunk) and `at_s` (when `level` was last brought up to date).
- **Refill**: `level` grows by `bytes_per_s` × elapsed seconds, capped at `burst_bytes`.
- **Admission** (`admit_leading`): chunks are taken in order while `level` > 0, each subtracting
  its size; the first chunk refused ends it (leading chunks only). Debt, not a full-size check,
  so that a chunk larger than the burst is still admitted once the level is positive: any chunk
  size passes, and over any interval the bytes admitted are at most
  `burst_bytes + bytes_per_s × elapsed + one chunk` (the Hypothesis test checks this bound).
- `peek_leading` answers the same question without taking anything (the client peeks, checks its
  other admission bounds on the trimmed save, and takes only once the save may start).

`bytes_per_s` 0 means no limit (every chunk admitted, nothing tracked).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvfabric.format.errors import BadRequest
from kvfabric.format.invariant import invariant

__all__ = ["SaveRate"]


class SaveRate:
    """Token bucket with debt over save bytes (module doc)."""

    __slots__ = ("at_s", "burst_bytes", "bytes_per_s", "level")

    def __init__(self, bytes_per_s: int, burst_bytes: int, now_s: float) -> None:
        if bytes_per_s < 0 or burst_bytes < 0:
            raise BadRequest(f"save rate and burst must be >= 0, got {bytes_per_s}, {burst_bytes}")
        self.bytes_per_s = bytes_per_s
        # 0: one second of the rate (a prompt's burst of chunks at the steady rate)
        self.burst_bytes = burst_bytes or bytes_per_s
        self.level = float(self.burst_bytes)  # a new engine may save one burst at once
        self.at_s = now_s

    @property
    def limited(self) -> bool:
        return self.bytes_per_s > 0

    def _refilled(self, now_s: float) -> float:
        elapsed = max(0.0, now_s - self.at_s)  # a clock that steps back refills nothing
        return min(float(self.burst_bytes), self.level + elapsed * self.bytes_per_s)

    def peek_leading(self, sizes: Sequence[int], now_s: float) -> int:
        """How many leading chunks of `sizes` `admit_leading` would admit now (takes nothing)."""
        if not self.limited:
            return len(sizes)
        level = self._refilled(now_s)
        admitted = 0
        for size in sizes:
            if level <= 0:
                break
            level -= size
            admitted += 1
        return admitted

    def admit_leading(self, sizes: Sequence[int], now_s: float) -> int:
        """Admit the leading chunks of `sizes` the budget covers, take their bytes, return how
        many (0: none; the save is skipped whole)."""
        admitted = self.peek_leading(sizes, now_s)
        if self.limited:
            invariant(all(size >= 0 for size in sizes[:admitted]), "a chunk's size is never negative")
            self.level = self._refilled(now_s) - sum(sizes[:admitted])
            self.at_s = max(self.at_s, now_s)
        return admitted
