"""The two clocks of kvfabric, in integer milliseconds: one definition each, for every layer.

- `now_ms()`: wall-clock time (ms since the Unix epoch). For times told to another process:
  lease, ticket and read-token deadlines, event timestamps. Hosts' clocks differ (the skew
  tolerances of docs/design.md cover it).
- `monotonic_ms()`: a clock that never goes back, meaningful only inside one process. For
  timeouts, backoffs and terms compared with the same process's own earlier readings (the
  shard leadership core's lease deadlines).

Protocol cores (`kvfabric.core`) never read a clock: their shells read one of these and pass
the time in (`now_ms` arguments), so a test can drive a core with any time it likes.
"""

from __future__ import annotations

import time

__all__ = ["monotonic_ms", "now_ms"]


def now_ms() -> int:
    """Wall-clock milliseconds since the Unix epoch."""
    return time.time_ns() // 1_000_000


def monotonic_ms() -> int:
    """Milliseconds on this process's monotonic clock (its origin means nothing elsewhere)."""
    return time.monotonic_ns() // 1_000_000
