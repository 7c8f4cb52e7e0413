"""What a segment lost costs the eviction policy's event loop (`EvictionCore.drop_pool`).

An `EvictionCore` (default config, the services' GC policy installed) following `--objects`
groups of 4 KiB spread round robin over three segments' pools; then one segment is lost:
`drop_pool` of its pool, which walks every group the policy follows and removes those left with
no pool (a third here). Milliseconds per drop, `--rounds` fresh cores per size.

Run: `.venv/bin/python -m bench.eviction_segment_down [--objects 100000,1000000] [--rounds 2]`.
Prints a table; nothing written. Figures: docs/eviction-policy.md, "Garbage collector".
"""

from __future__ import annotations

import argparse
import gc
import time

from kvfabric.core.eviction import EvictionCore
from kvfabric.core.eviction_model import EvictionConfig
from kvfabric.runtime import gcpolicy

POOLS = ("s1", "s2", "s3")


def filled(objects: int) -> EvictionCore:
    core = EvictionCore(EvictionConfig())
    for pool in POOLS:
        core.set_capacity(pool, 1 << 50)
    for i in range(objects):
        core.insert(i, tenant="t", pool=POOLS[i % 3], size=4096, parent=None, chunk_index=0, now_ms=1)
    return core


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--objects", default="100000,1000000")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    gcpolicy.install()
    print("| groups followed | dropped with the segment | drop_pool ms |")
    print("|---:|---:|---:|")
    for objects in (int(x) for x in args.objects.split(",")):
        for _ in range(args.rounds):
            core = filled(objects)
            gc.collect()
            started = time.perf_counter()
            gone = core.drop_pool("s1")
            took_ms = (time.perf_counter() - started) * 1000
            core.check_invariants()
            print(f"| {objects:,} | {len(gone):,} | {took_ms:.0f} |", flush=True)
            del core
            gc.collect()
    gcpolicy.uninstall()


if __name__ == "__main__":
    main()
