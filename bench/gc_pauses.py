"""What CPython's cyclic GC costs the services (issue 20; docs/directory.md, "Garbage collector").

Two measurements, printed as tables (nothing written):

- `thresholds`: a directory core filled with `--objects` published objects, its reply cache in
  steady state; then, for each GC setting (frozen or not, thresholds), 5,000 single publishes
  and 2,000 64-group lookups: collections per generation, their total and longest pause. Pauses
  are the CPU time of this thread (other jobs on a shared VM do not inflate them). Settings are
  interleaved over `--rounds` rounds.
- `state`: the tracked objects and the full-collection pause of a segment's slot table and of
  the eviction policy's core holding `--objects` objects, with the service's modules imported,
  before and after `gc.freeze()`.

Run: `.venv/bin/python -m bench.gc_pauses thresholds [--objects 1000000] [--rounds 2]`
     `.venv/bin/python -m bench.gc_pauses state [--objects 1000000]`
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import statistics
import time

from bench import directory_core as bench  # the directory benchmark's fill and requests

PUBLISHES = 5_000
LOOKUPS = 2_000
SETTINGS: list[tuple[bool, tuple[int, int, int]]] = [
    (False, (700, 10, 10)),
    (True, (700, 10, 10)),
    (True, (2_000, 10, 10)),
    (True, (10_000, 10, 10)),
    (True, (50_000, 20, 20)),
]


class CpuPauses:
    """(generation, CPU seconds) of every collection, from `gc.callbacks`."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []
        self._started = 0.0

    def callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.thread_time()
        else:
            self.pauses.append((info["generation"], time.thread_time() - self._started))


def thresholds(objects: int, rounds: int) -> None:
    importlib.import_module(bench.SERVICE_MODULE)
    log = CpuPauses()
    gc.callbacks.append(log.callback)
    groups = bench.make_groups(objects, seed=2)
    warm = 16_384
    fresh = bench.make_groups(warm + PUBLISHES * len(SETTINGS) * rounds, seed=3)
    core = bench.new_core()
    now = 0
    for step, i in enumerate(range(0, len(groups), 4096)):
        now = step * 100
        bench.publish(core, groups[i : i + 4096], f"f{i}", now)
        core.tick(now)
    for i in range(warm):
        bench.publish(core, [fresh[i]], f"w{i}", now)
    cursor = warm
    print("| round | frozen | thresholds | gen: collections, total ms, longest ms | CPU s |")
    print("|---:|---|---|---|---:|")
    for r in range(rounds):
        for k, (frozen, setting) in enumerate(SETTINGS):
            gc.unfreeze()
            gc.set_threshold(700, 10, 10)
            gc.collect()
            if frozen:
                gc.freeze()
            gc.set_threshold(*setting)
            mark = len(log.pauses)
            cpu0 = time.thread_time()
            for _ in range(PUBLISHES):
                bench.publish(core, [fresh[cursor]], f"s{cursor}", now)
                cursor += 1
            for i in range(LOOKUPS):
                bench.lookup(core, bench.window(groups, (i + 7919 * (r * 10 + k)) * 64, 64), now)
            cpu_s = time.thread_time() - cpu0
            gens = []
            for gen in range(3):
                times = [p for g, p in log.pauses[mark:] if g == gen]
                gens.append(f"{gen}: {len(times)}, {sum(times) * 1e3:.1f}, {max(times, default=0) * 1e3:.2f}")
            print(f"| {r} | {frozen} | {setting} | {'; '.join(gens)} | {cpu_s:.2f} |")
    gc.set_threshold(700, 10, 10)


def full_collection_ms() -> float:
    times = []
    for _ in range(5):
        began = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def state(objects: int) -> None:
    print(
        "| service core | objects | tracked: imports / with state (per object) "
        "| full collection ms: imports / with state / frozen |"
    )
    print("|---|---:|---|---|")
    for which in ("segment", "eviction"):
        # Each in a process of its own: the other's state and modules must not count.
        if os.fork() == 0:
            try:
                _state_one(which, objects)
            finally:
                os._exit(0)
        os.wait()


def _state_one(which: str, objects: int) -> None:
    holder: object
    if which == "segment":
        importlib.import_module("kvfabric.segment_storage.__main__")
        from kvfabric.core.segment_slots import SlotTable

        gc.collect()
        base, base_ms = len(gc.get_objects()), full_collection_ms()
        table = SlotTable(objects * 4096, slots_max=objects + 1)
        for _ in range(objects):
            a = table.alloc(4096, 0, 10_000, key=os.urandom(54))
            table.stored(a.slot, a.generation, os.urandom(16))
        holder = table
    else:
        importlib.import_module("kvfabric.eviction_policy.__main__")
        from kvfabric.core.eviction import EvictionConfig, EvictionCore

        gc.collect()
        base, base_ms = len(gc.get_objects()), full_collection_ms()
        core = EvictionCore(EvictionConfig(policy="gdsf", high_watermark=0.9, low_watermark=0.7))
        core.set_capacity("seg0", 1 << 60)
        domain = os.urandom(16)
        parent = None
        for i in range(objects):
            key = domain + os.urandom(32)
            core.insert(
                key,
                tenant=domain,
                pools={"seg0": 2 << 20},
                parent=parent if i % 64 else None,
                chunk_index=i % 64,
                now_ms=i,
            )
            parent = key
        holder = core
    gc.collect()
    tracked, full_ms = len(gc.get_objects()), full_collection_ms()
    gc.freeze()
    frozen_ms = full_collection_ms()
    per_object = (tracked - base) / objects
    print(
        f"| {which} | {objects:,} | {base:,} / {tracked:,} ({per_object:.2f}) | "
        f"{base_ms:.1f} / {full_ms:.1f} / {frozen_ms:.2f} |"
    )
    del holder


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=("thresholds", "state"))
    parser.add_argument("--objects", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.what == "thresholds":
        thresholds(args.objects, args.rounds)
    else:
        state(args.objects)


if __name__ == "__main__":
    main()
