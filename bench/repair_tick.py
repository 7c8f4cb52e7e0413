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

Run: `.venv/bin/python -m bench.repair_tick [--objects 100000,1000000] [--ticks 5]`. Prints a table
(ms of wall time per tick, median and max); nothing written.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from kvfabric.core.repair import RepairConfig, RepairCore, StartCopy

SIZE = 4096


def draining_core(objects: int) -> RepairCore:
    core = RepairCore(RepairConfig())
    for s in ("s1", "s2", "s3"):
        core.segment_up(s, incarnation=1, zone=s, rack=s, host=s, free_bytes=1 << 50)
    for i in range(objects):
        core.object_known(i, size_bytes=SIZE, replica_target=2, segments=("s1", "s2"))
    core.segment_draining("s1")
    return core


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


if __name__ == "__main__":
    main()
