"""The CPython garbage-collector settings every service process runs with, in one place.

Why: CPython's cyclic collector stops the process while it walks every *tracked* object of the
generations it collects (containers: dicts, lists, class instances, tuples holding containers,
msgspec Structs unless declared `gc=False`; not bytes, str, int). A full (generation 2)
collection therefore costs time in proportion to everything long-lived: a service's own imports
alone are ~57,000 tracked objects (10-18 ms per full collection on the shared 2-core VM), and
per-object state kept as Python objects adds to it. Those pauses are the control plane's tail
latency (issue 20; figures in docs/directory.md).

The policy, applied by every service (`service_cli` calls `install`; the directory, segment,
eviction policy, repair and prefetch then call `freeze_long_lived` once their long-lived state
is built):
1. Long-lived per-object state is kept untracked where its owner can: the directory's
   published records are `bytes`, its reply cache holds encoded replies.
2. `freeze_long_lived()` after a start and after a rebuild of long-lived state (a directory
   shard adopted after a failover): `gc.unfreeze()` (so whatever an earlier freeze held that
   is garbage now, such as a replaced core with a reference cycle, is collected instead of
   kept forever), one full `gc.collect()`, then `gc.freeze()`: every object alive now moves
   to the permanent generation, which no later collection walks. Frozen objects are still
   freed by reference counting when dropped.
3. Thresholds `SERVICE_GC_POLICY.thresholds` (generation 0 allocations, generation 1 and 2
   collections), chosen by measurement: see docs/directory.md.
4. Pauses are measured: a `gc.callbacks` hook counts each collection's duration into a
   histogram per generation, served as `kvfabric_<service>_gc_pause_seconds{generation}` by
   `GcCollector` (registered by `ServiceMetrics`).

`install` is per process and idempotent; `uninstall` restores the interpreter's settings (tests).
Nothing here is applied unless `install` was called: libraries and tests that build a
`ServiceRuntime` directly keep the interpreter's defaults.
"""

from __future__ import annotations

import bisect
import gc
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from kvfabric.format.invariant import invariant
from kvfabric.runtime.logs import get_logger

__all__ = [
    "GC_PAUSE_BUCKETS_S",
    "SERVICE_GC_POLICY",
    "GcCollector",
    "GcPauses",
    "GcPolicy",
    "freeze_long_lived",
    "install",
    "installed",
    "pauses",
    "uninstall",
]

GENERATIONS: Final = 3
GC_PAUSE_BUCKETS_S: Final = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


@dataclass(frozen=True, slots=True)
class GcPolicy:
    # gc.set_threshold(gen0 allocations net of frees, gen1 collections per gen2 check, ...)
    thresholds: tuple[int, int, int]
    freeze: bool  # freeze_long_lived() acts (after a start and after a rebuild)


SERVICE_GC_POLICY: Final = GcPolicy(thresholds=(700, 10, 10), freeze=True)


class GcPauses:
    """Durations of the collector's runs, per generation, counted into `GC_PAUSE_BUCKETS_S`
    (cumulative on read, like a Prometheus histogram). Fed by `gc.callbacks`."""

    def __init__(self) -> None:
        self.bucket_counts = [[0] * (len(GC_PAUSE_BUCKETS_S) + 1) for _ in range(GENERATIONS)]
        self.sum_s = [0.0] * GENERATIONS
        self.max_s = [0.0] * GENERATIONS
        self._started_s = 0.0

    def callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started_s = time.perf_counter()
            return
        self.observe(info["generation"], time.perf_counter() - self._started_s)

    def observe(self, generation: int, pause_s: float) -> None:
        invariant(0 <= generation < GENERATIONS, "no such gc generation", generation=generation)
        self.bucket_counts[generation][bisect.bisect_left(GC_PAUSE_BUCKETS_S, pause_s)] += 1
        self.sum_s[generation] += pause_s
        self.max_s[generation] = max(self.max_s[generation], pause_s)

    def count(self, generation: int) -> int:
        return sum(self.bucket_counts[generation])

    def cumulative(self, generation: int) -> list[tuple[str, int]]:
        """(upper bound, observations ≤ it) per bucket, `+Inf` last."""
        out: list[tuple[str, int]] = []
        total = 0
        for bound, n in zip(
            (*map(str, GC_PAUSE_BUCKETS_S), "+Inf"), self.bucket_counts[generation], strict=True
        ):
            total += n
            out.append((bound, total))
        return out


_policy: GcPolicy | None = None
_pauses: GcPauses | None = None
_defaults: tuple[int, int, int] | None = None


def install(policy: GcPolicy = SERVICE_GC_POLICY) -> GcPauses:
    """Apply `policy` to this process: thresholds now, pause recording from now on, and
    `freeze_long_lived` acting. Idempotent per policy; returns the pause recorder."""
    global _policy, _pauses, _defaults
    invariant(
        all(t >= 0 for t in policy.thresholds) and policy.thresholds[0] > 0,
        "gc thresholds must be non-negative and generation 0's positive (0 disables the collector)",
        thresholds=policy.thresholds,
    )
    if _defaults is None:
        _defaults = gc.get_threshold()
    gc.set_threshold(*policy.thresholds)
    if _pauses is None:
        _pauses = GcPauses()
        gc.callbacks.append(_pauses.callback)
    _policy = policy
    return _pauses


def uninstall() -> None:
    """Undo `install`: the interpreter's thresholds, no pause recording, nothing frozen."""
    global _policy, _pauses, _defaults
    if _pauses is not None:
        gc.callbacks.remove(_pauses.callback)
    if _defaults is not None:
        gc.set_threshold(*_defaults)
    gc.unfreeze()
    _policy, _pauses, _defaults = None, None, None


def installed() -> GcPolicy | None:
    return _policy


def pauses() -> GcPauses | None:
    return _pauses


def freeze_long_lived(reason: str) -> float | None:
    """Move every object alive now out of the collector's view (see the module docstring, 2)
    and log `gc_frozen` with `reason`. Returns the seconds it took (one full collection), or
    None when the installed policy does not freeze or none is installed. Call it once
    long-lived state is built (a start, a rebuild), never per request."""
    if _policy is None or not _policy.freeze:
        return None
    began = time.perf_counter()
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    took_s = time.perf_counter() - began
    get_logger("kvfabric.runtime.gcpolicy").info(
        "gc_frozen", reason=reason, pause_ms=round(took_s * 1e3, 1), frozen_objects=gc.get_freeze_count()
    )
    return took_s


class GcCollector(Collector):
    """`kvfabric_<service>_gc_pause_seconds{generation}` and `kvfabric_<service>_gc_frozen_objects`,
    read from the process's pause recorder; nothing while no policy is installed."""

    def __init__(self, service: str) -> None:
        self.service = service

    def collect(self) -> Iterator[HistogramMetricFamily | GaugeMetricFamily]:
        recorder = _pauses
        if recorder is None:
            return
        prefix = f"kvfabric_{self.service}"
        pause = HistogramMetricFamily(
            f"{prefix}_gc_pause_seconds",
            "Duration of each run of Python's cyclic garbage collector (the process stops), by generation.",
            labels=["generation"],
        )
        for generation in range(GENERATIONS):
            pause.add_metric([str(generation)], recorder.cumulative(generation), recorder.sum_s[generation])
        yield pause
        frozen = GaugeMetricFamily(
            f"{prefix}_gc_frozen_objects", "Objects in the permanent generation (gc.freeze): never walked."
        )
        frozen.add_metric([], gc.get_freeze_count())
        yield frozen
