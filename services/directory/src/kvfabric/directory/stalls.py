"""How long the directory's synchronous core calls hold its event loop (issue 21 item 2).

A shard's core is called synchronously on the instance's one event loop: while a call runs,
nothing else does — no other tenant's request, no other shard, not the leader lease's renewal.
So the longest call is the instance's worst stall. Every core call the shells make (requests,
frees' acknowledgements, ticks, rate charges) is timed here, and exported
(`kvfabric.directory.metrics`):

- `kvfabric_directory_core_call_seconds` — a histogram of every call's duration;
- `kvfabric_directory_core_call_longest_seconds` — the longest call since the previous scrape
  (read, then reset, by the scrape);
- a call over `SLOW_CORE_CALL_S` is logged (`core_call_slow`, with what it was and the CPU time
  it took: much less than its wall time means the process was descheduled, not working).

One instance per process (`CORE_CALLS`), like a metrics registry: shells come and go with
leadership, the counts stay.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections.abc import Callable
from typing import Final, TypeVar

from kvfabric.runtime.logs import get_logger

__all__ = ["CORE_CALLS", "CORE_CALL_BUCKETS_S", "SLOW_CORE_CALL_S", "CoreCallTimes"]

# Histogram bucket upper bounds, seconds: a request's core call is ~0.05-1 ms; a stall that
# lasts a good part of the leader lease (3 s) is what must never happen.
CORE_CALL_BUCKETS_S: Final = (
    0.0001,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)
SLOW_CORE_CALL_S: Final = 0.05  # logged: 50 ms without serving anything else

T = TypeVar("T")


class CoreCallTimes:
    """Durations of synchronous core calls: counts per bucket, sum, the longest since taken."""

    def __init__(self) -> None:
        self.bucket_counts = [0] * (len(CORE_CALL_BUCKETS_S) + 1)  # the last: over every bound
        self.count = 0
        self.sum_s = 0.0
        self._longest_s = 0.0
        self._longest_what = ""
        self._lock = threading.Lock()  # the scrape (another thread) takes and resets the longest

    def observe(self, seconds: float, what: str, cpu_s: float | None = None) -> None:
        self.bucket_counts[bisect_left(CORE_CALL_BUCKETS_S, seconds)] += 1
        self.count += 1
        self.sum_s += seconds
        if seconds > self._longest_s:
            with self._lock:
                self._longest_s = max(self._longest_s, seconds)
                self._longest_what = what
        if seconds >= SLOW_CORE_CALL_S:  # (a logger got now: logging is configured after import)
            cpu_ms = None if cpu_s is None else round(cpu_s * 1e3, 1)
            get_logger("kvfabric.directory.stalls").warning(
                "core_call_slow", what=what, ms=round(seconds * 1e3, 1), cpu_ms=cpu_ms
            )

    def timed(self, what: str, call: Callable[[], T]) -> T:
        """`call()`, timed as a core call named `what` (a request type, `tick`, `adopt`)."""
        began = time.perf_counter()
        began_cpu = time.thread_time()  # ~1 us: read again only for a slow call
        try:
            return call()
        finally:
            seconds = time.perf_counter() - began
            cpu_s = time.thread_time() - began_cpu if seconds >= SLOW_CORE_CALL_S else None
            self.observe(seconds, what, cpu_s)

    def take_longest(self) -> tuple[float, str]:
        """The longest call since the previous take (seconds, what it was); starts over."""
        with self._lock:
            longest = (self._longest_s, self._longest_what)
            self._longest_s, self._longest_what = 0.0, ""
        return longest


CORE_CALLS: Final = CoreCallTimes()
