"""Mooncake Store filled by one writer faster than its eviction: the peer beside `python -m bench.fill`.

Runs with the Mooncake venv's python, in a network namespace of its own (`bench.mooncake.measure_fill`
starts it with `unshare -n`, as `bench.mooncake.measure` does the main peer), stdlib + numpy + mooncake
only. `mooncake_master` with its default eviction (as a user starts it), and in `--mode remote` a
`mooncake_client` store process holding the only segment of `--segment-bytes` while the writer mounts
none (every byte over the TCP transfer engine); in `--mode local` the writer mounts that segment itself
and puts there (`preferred_segment`). The writer puts `--warmup` then `--saves` prompts of `--objects`
fresh keys of `--size` bytes back to back with `batch_put_from` (buffers registered), more bytes in all
than the segment holds, and counts the keys whose code is not 0 (refused: nothing stored for them).
At the end the last prompt stored whole is read back with `batch_get_into` and compared.

Prints one JSON object: saves, objects, size, chunks_failed, elapsed_s, stored_gb_per_s (bytes of the
keys answered 0 / elapsed), p50_ms / p90_ms per call, verified (the read-back matched), version.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Final

import numpy as np

if __package__ in (None, ""):
    # Run as a script: sys.path[0] is bench/, whose mooncake.py would shadow the mooncake package.
    _BENCH_DIR = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _BENCH_DIR]
    sys.path.insert(0, str(_BENCH_DIR.parent))

from bench.mooncake_peer import (
    HOST,
    LOCAL_BUFFER_SLACK_BYTES,
    METADATA_SERVER,
    PROTOCOL,
    mooncake_version,
    start_store,
)

GiB: Final = 1 << 30


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--mode", choices=("remote", "local"), default="remote")
    parser.add_argument("--size", type=int, default=16 << 20)
    parser.add_argument("--objects", type=int, default=8)
    parser.add_argument("--saves", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--segment-bytes", type=int, default=4 * GiB)
    args = parser.parse_args(argv)
    if min(args.size, args.objects, args.saves, args.segment_bytes) < 1 or args.warmup < 0:
        parser.error("sizes and counts must be at least 1 (--warmup at least 0)")
    return args


def fill(args: argparse.Namespace, master_address: str) -> dict[str, Any]:
    store_mod = importlib.import_module("mooncake.store")  # the Mooncake venv only

    store = store_mod.MooncakeDistributedStore()
    mounted = args.segment_bytes if args.mode == "local" else 0
    rc = store.setup(
        HOST,
        METADATA_SERVER,
        mounted,
        args.objects * args.size + LOCAL_BUFFER_SLACK_BYTES,
        PROTOCOL,
        "",
        master_address,
    )
    if rc != 0:
        raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
    replicate = store_mod.ReplicateConfig()
    if args.mode == "local":
        replicate.preferred_segment = store.get_hostname()
    prompt = args.objects * args.size
    pool = np.random.default_rng(7).integers(0, 256, prompt * 2, dtype=np.uint8)
    dst = np.zeros(prompt, dtype=np.uint8)
    for buf in (pool, dst):
        if store.register_buffer(buf.ctypes.data, buf.nbytes) != 0:
            raise RuntimeError(f"register_buffer({buf.nbytes} B) failed")
    sizes = [args.size] * args.objects

    def put(i: int) -> tuple[int, float]:
        """Prompt i (its own keys; content shifted by i % 2 objects): keys refused, call seconds."""
        keys = [f"fill-{i}-{c}" for c in range(args.objects)]
        ptrs = [pool.ctypes.data + ((i % 2) + c) * args.size for c in range(args.objects)]
        t0 = time.perf_counter()
        codes = store.batch_put_from(keys, ptrs, sizes, replicate)
        return sum(1 for code in codes if code != 0), time.perf_counter() - t0

    for i in range(args.warmup):
        put(i)
    failed, walls, last_whole = 0, [], -1
    t0 = time.perf_counter()
    for i in range(args.warmup, args.warmup + args.saves):
        refused, wall = put(i)
        failed += refused
        walls.append(wall)
        last_whole = i if refused == 0 else last_whole
    elapsed = time.perf_counter() - t0
    verified = None
    if last_whole >= 0:
        keys = [f"fill-{last_whole}-{c}" for c in range(args.objects)]
        got = store.batch_get_into(
            keys, [dst.ctypes.data + c * args.size for c in range(args.objects)], sizes
        )
        start = (last_whole % 2) * args.size
        verified = all(g == args.size for g in got) and bool(
            np.array_equal(dst, pool[start : start + prompt])
        )
    store.close()
    walls.sort()
    stored = (args.saves * args.objects - failed) * args.size
    return {
        "mode": args.mode,
        "saves": args.saves,
        "objects": args.objects,
        "size": args.size,
        "segment_bytes": args.segment_bytes,
        "chunks_failed": failed,
        "elapsed_s": elapsed,
        "stored_gb_per_s": stored / elapsed / 1e9,
        "p50_ms": statistics.median(walls) * 1e3,
        "p90_ms": walls[int(0.9 * len(walls))] * 1e3,
        "verified": verified,
        "version": mooncake_version(),
    }


def main(argv: list[str]) -> int:
    args = parse(argv)
    with contextlib.ExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="mooncake-fill-")))
        master_address = start_store(stack, logs, args.segment_bytes if args.mode == "remote" else 0)
        print(json.dumps(fill(args, master_address)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
