"""What one repair tick costs the repair service's event loop with many objects below target.

A `RepairCore` (default config: 32 copies in flight) over three segments, `--objects` objects of
4 KiB with a replica on s1 and s2 and a target of 2; then s1 drains, so every object is below
target (healthy 1), and ticks run 100 ms apart, each copy reported ok at once. Two arms in one
run, per size:

- `kept`: the planning queues as the core keeps them (updated as objects change);
- `rebuilt`: both queues rebuilt from every object below target before each tick, the cost of
  the planning before they were kept (sorting every object below target each tick).

Then the drain's tail: every object but 10 reached its target elsewhere (`object_known` with a
third replica), one tick, which finds its queues mostly stale and rebuilds them once.

Then the drain flag itself (`--flag`, on by default), per size, on a fresh core with every
object at its target: `segment_draining` as the core does it (recounts `recounts_per_step` of
the segment's objects, 5,000 by default, and leaves the rest to the ticks: the event's ms, then
the ticks' p50 / max until no recount is pending and nothing stale is left, each copy reported
ok at once), next to the same core with an allowance as large as the segment's objects (every
recount in the event: what the core did before 2026-12-03). Both directions: a drain started
(every object at target), and a drain stopped once all its objects were below target.

Then a segment lost (`--down`, on by default), per size: `segment_down` of a segment holding a
replica of every object, either one of two (each object then below target and copied) or its
last (each LOST): the event's ms, then the ticks' p50 / max until no recount is pending, next
to the same core recounting every object in the event (what the core did before 2026-12-03).

Last, the scan's re-sync: the repair service's scan calls `object_known` for every object below
target each pass (every 2 s by default); one pass over the draining core's objects, every view
unchanged (ms per pass).

Run: `.venv/bin/python -m bench.repair_tick [--objects 100000,1000000] [--ticks 5] [--no-flag] [--no-down]`.
Prints tables (ms of wall time per tick or event, median and max); nothing written.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable

from kvfabric.core.repair import RepairConfig, RepairCore, StartCopy

SIZE = 4096


def core_at_target(objects: int, recounts_per_step: int = RepairConfig().recounts_per_step) -> RepairCore:
    core = RepairCore(RepairConfig(recounts_per_step=recounts_per_step))
    for s in ("s1", "s2", "s3"):
        core.segment_up(s, incarnation=1, zone=s, rack=s, host=s, free_bytes=1 << 50)
    for i in range(objects):
        core.object_known(i, size_bytes=SIZE, replica_target=2, segments=("s1", "s2"))
    return core


def draining_core(objects: int) -> RepairCore:
    """s1 drains and every object is below target (its recounts done, outside the timing)."""
    core = core_at_target(objects, recounts_per_step=objects)
    core.segment_draining("s1")
    return core


def flag_change(objects: int, all_at_once: bool, stop: bool) -> tuple[float, list[float]]:
    """ms of `segment_draining("s1", not stop)`, then of each tick until no recount is pending
    and no object is below target by a stale count."""
    allowance = objects if all_at_once else RepairConfig().recounts_per_step
    core = core_at_target(objects, recounts_per_step=allowance)
    now = 1
    if stop:  # drained until every object is below target (its recounts not timed)
        core.segment_draining("s1")
        while core.gauges()["recounts_pending"]:
            now += 100
            core.tick(now)
    gc.collect()
    started = time.perf_counter()
    core.segment_draining("s1", not stop)
    event_ms = (time.perf_counter() - started) * 1000
    took: list[float] = []
    while core.gauges()["recounts_pending"] or (stop and core.gauges()["objects_below_target"]):
        more, now = ticks(core, 1, False, now)
        took += more
    return event_ms, took


def segment_lost(objects: int, all_at_once: bool, last_replica: bool) -> tuple[float, list[float]]:
    """ms of `segment_down("s1")`, then of each tick until no recount is pending. Every object
    has a replica on s1 and on s2 (target 2: each is below target afterwards and copied, each
    copy reported ok at once), or only the one on s1 (`last_replica`, target 1: each is LOST)."""
    allowance = objects if all_at_once else RepairConfig().recounts_per_step
    core = RepairCore(RepairConfig(recounts_per_step=allowance))
    for s in ("s1", "s2", "s3"):
        core.segment_up(s, incarnation=1, zone=s, rack=s, host=s, free_bytes=1 << 50)
    segments, target = (("s1",), 1) if last_replica else (("s1", "s2"), 2)
    for i in range(objects):
        core.object_known(i, size_bytes=SIZE, replica_target=target, segments=segments)
    gc.collect()
    started = time.perf_counter()
    core.segment_down("s1")
    event_ms = (time.perf_counter() - started) * 1000
    took: list[float] = []
    now = 1
    while core.gauges()["recounts_pending"]:
        more, now = ticks(core, 1, False, now)
        took += more
    return event_ms, took


def ticks(core: RepairCore, n: int, rebuilt: bool, now_ms: int) -> tuple[list[float], int]:
    took = []
    for _ in range(n):
        now_ms += 100
        started = time.perf_counter()
        if rebuilt:
            core._rebuild_queues()
        effects = core.tick(now_ms)
        took.append((time.perf_counter() - started) * 1000)
        for effect in effects:
            if isinstance(effect, StartCopy):
                core.copy_ok(effect.copy_id)
    return took, now_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--objects", default="100000,1000000")
    parser.add_argument("--ticks", type=int, default=5)
    parser.add_argument("--flag", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--down", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    print("| objects below target | arm | tick ms p50 | tick ms max | copies started so far |")
    print("|---:|---|---:|---:|---:|")
    for objects in (int(x) for x in args.objects.split(",")):
        core = draining_core(objects)
        gc.collect()
        now = 1
        for arm in ("kept", "rebuilt", "kept"):  # interleaved: the machine's noise shows
            took, now = ticks(core, args.ticks, arm == "rebuilt", now)
            copies = core.counters.get("copies_started_total", 0)
            print(f"| {objects:,} | {arm} | {statistics.median(took):.1f} | {max(took):.1f} | {copies} |")
        for i in range(10, objects):  # the drain's tail: all but 10 have their target elsewhere
            core.object_known(i, size_bytes=SIZE, replica_target=2, segments=("s1", "s2", "s3"))
        took, now = ticks(core, 1, False, now)
        more, _ = ticks(core, args.ticks, False, now)
        print(f"| {objects:,} | kept, drain's tail (first tick / next) | {took[0]:.1f} | {max(more):.1f} | |")
    print()
    print("| objects below target | one scan's re-sync, views unchanged: ms |")
    print("|---:|---:|")
    for objects in (int(x) for x in args.objects.split(",")):
        core = draining_core(objects)
        gc.collect()
        started = time.perf_counter()
        for i in range(objects):
            core.object_known(i, size_bytes=SIZE, replica_target=2, segments=("s1", "s2"))
        print(f"| {objects:,} | {(time.perf_counter() - started) * 1000:.0f} |")
    if args.down:
        print()
        print("| objects on the segment | its replica was | recounts | event ms | ticks | p50 | max |")
        event_table(
            args.objects,
            {
                "one of two (copied)": lambda n, all_at_once: segment_lost(n, all_at_once, False),
                "the last one (lost)": lambda n, all_at_once: segment_lost(n, all_at_once, True),
            },
        )
    if not args.flag:
        return
    print()
    print("| objects on the segment | flag | recounts | event ms | ticks recounting | their ms p50 | max |")
    event_table(
        args.objects,
        {
            "drain started": lambda n, all_at_once: flag_change(n, all_at_once, False),
            "drain stopped": lambda n, all_at_once: flag_change(n, all_at_once, True),
        },
    )


def event_table(sizes: str, cases: dict[str, Callable[[int, bool], tuple[float, list[float]]]]) -> None:
    """The rows under a printed header: per size and case, the event's ms and its ticks' p50 /
    max, bounded per step and all in the event, interleaved (the machine's noise shows)."""
    print("|---:|---|---|---:|---:|---:|---:|")
    for objects in (int(x) for x in sizes.split(",")):
        for case, measure in cases.items():
            for all_at_once in (False, True, False):
                event_ms, took = measure(objects, all_at_once)
                arm = "all in the event (the old cost)" if all_at_once else "bounded per step"
                p50 = f"{statistics.median(took):.1f}" if took else "-"
                worst = f"{max(took):.1f}" if took else "-"
                print(f"| {objects:,} | {case} | {arm} | {event_ms:.1f} | {len(took)} | {p50} | {worst} |")


if __name__ == "__main__":
    main()
