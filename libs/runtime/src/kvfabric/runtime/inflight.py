"""The in-flight limit: a counter with a hard bound, no queue, no event loop.

States: `count` in 0..`limit`. `try_acquire` either takes a slot (count + 1) or refuses when
`count == limit`: the caller then answers `Busy` at once instead of queueing, so memory and
latency stay bounded under overload. `release` gives a slot back; releasing more than was
acquired is a bug (`InvariantViolation`).
"""

from __future__ import annotations

from kvfabric.format.invariant import invariant

__all__ = ["InflightLimiter"]


class InflightLimiter:
    def __init__(self, limit: int) -> None:
        invariant(limit >= 1, "in-flight limit must be at least 1", limit=limit)
        self._limit = limit
        self._count = 0
        self.rejected_total = 0

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def count(self) -> int:
        return self._count

    @property
    def full(self) -> bool:
        return self._count >= self._limit

    def try_acquire(self) -> bool:
        """Take a slot if one is free. Never waits."""
        if self._count >= self._limit:
            self.rejected_total += 1
            return False
        self._count += 1
        invariant(
            self._count <= self._limit, "in-flight count above limit", count=self._count, limit=self._limit
        )
        return True

    def release(self) -> None:
        invariant(self._count > 0, "in-flight release without acquire")
        self._count -= 1
