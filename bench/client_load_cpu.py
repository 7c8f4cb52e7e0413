"""What one `lookup` + `load` + `release` prompt costs in CPU, per process (issue 20, load path).

On a 2-core machine the CPU a prompt takes over every process of the path — the engine, NATS,
the directory, the segment and the services that follow the directory's events — bounds how
fast prompts can go whatever the client overlaps. This measures it: one engine (this process)
against a local cluster (`bench.client.local_cluster`: tools/localcluster.py, authenticated
NATS, one directory, one segment, eviction policy, repair, prefetch), a working set of `--prompts`
prompts of 8 objects saved first, then blocks of `--rounds` prompts (lookup, load into one set of
buffers, release) per client (remote: TCP; co-located: shared memory) with the prefetch service
running and stopped (SIGSTOP, then SIGCONT), interleaved; utime + stime of each process from
/proc/<pid>/stat around each block. Every load must load all 8 chunks (verified by the client).
Then `load` alone (its lookups outside the timer), by where its read runs: on a worker thread
(as before issue 20's load-path work), on the client's loop thread (co-located only), or on the
engine's thread (as built), blocks of each interleaved.

Run: `.venv/bin/python -m bench.client_load_cpu` (prints a markdown table; nothing written).
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Final

import numpy as np

from bench.client import local_cluster, percentile, read_env_file
from bench.client_worker import CHUNKS, bench_spec, prompt_tokens
from kvfabric.client import KvClient, aio_loads, settings_from_env

MODES: Final = ("prefetch running", "prefetch stopped")
COPY_PLACES: Final = ("worker thread", "loop thread", "engine's thread")
LOCAL_INLINE_BYTES: Final = aio_loads.LOCAL_INLINE_BYTES_MAX
WARMUP_PROMPTS: Final = 5


def cpu_ticks(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except OSError:
        return 0


def copy_place(
    client: KvClient, tokens: list[list[int]], dests: list[list[memoryview]], rounds: int, blocks: int
) -> dict[str, list[float]]:
    """`load` alone (hits looked up first), by where its read runs, blocks interleaved: a worker
    thread (the loop hands it over: `LOCAL_INLINE_BYTES_MAX` 0, `load_now` off), the loop thread
    (co-located only: `load_now` off) and the engine's thread (as built). Seconds per load."""
    load_now = client.aio.load_now
    out: dict[str, list[float]] = {}
    places = COPY_PLACES if client.settings.use_shm else (COPY_PLACES[0], COPY_PLACES[2])
    for _ in range(blocks):
        for place in places:
            inline_max = 0 if place == "worker thread" else LOCAL_INLINE_BYTES
            setattr(aio_loads, "LOCAL_INLINE_BYTES_MAX", inline_max)  # noqa: B010
            client.aio.load_now = (  # type: ignore[method-assign]
                load_now if place == "engine's thread" else (lambda *a, **k: None)
            )
            hits = [client.lookup(tokens[i % len(tokens)]) for i in range(rounds)]
            for hit in hits:
                started = time.perf_counter()
                result = client.load(hit, dests)
                out.setdefault(place, []).append(time.perf_counter() - started)
                if result.chunks_loaded != CHUNKS:
                    raise RuntimeError(f"a load fell short: {result}")
            for hit in hits:
                client.release(hit)
    setattr(aio_loads, "LOCAL_INLINE_BYTES_MAX", LOCAL_INLINE_BYTES)  # noqa: B010  # a Final, patched here
    client.aio.load_now = load_now  # type: ignore[method-assign]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--size", type=int, default=256 << 10, help="object size, bytes")
    parser.add_argument("--prompts", type=int, default=64, help="working set, prompts")
    parser.add_argument("--rounds", type=int, default=150, help="prompts per block")
    parser.add_argument("--blocks", type=int, default=3, help="blocks per client and mode")
    args = parser.parse_args()
    size, hz = args.size, os.sysconf("SC_CLK_TCK")
    load_start = os.getloadavg()
    with (
        tempfile.TemporaryDirectory(prefix="kvf-bench-load-cpu-") as tmp,
        local_cluster(Path(tmp) / "run") as state,
    ):
        tenant = read_env_file(Path(state["auth"]["dir"]) / "env" / "tenant-demo.env")
        url = state["nats_url"]
        spec = bench_spec(tenant, url, f"load-cpu-{os.getpid()}")
        clients = {
            "remote": KvClient(settings_from_env(tenant, nats_url=url, use_shm=False), spec),
            "co-located": KvClient(settings_from_env(tenant, nats_url=url, use_shm=True), spec),
        }
        try:
            rng = np.random.default_rng(1)
            source = rng.integers(0, 255, size * CHUNKS * args.prompts, dtype=np.uint8)
            tokens = [prompt_tokens(1, size, os.getpid(), p) for p in range(args.prompts)]
            for p in range(args.prompts):
                at = p * CHUNKS * size
                objects = [[source[at + c * size : at + (c + 1) * size].data] for c in range(CHUNKS)]
                saved = clients["remote"].save(tokens[p], objects)
                if saved.chunks_saved + saved.chunks_existing != CHUNKS:
                    raise RuntimeError(f"working set not saved: {saved}")
            dest = np.zeros(size * CHUNKS, dtype=np.uint8)
            dests = [[dest[c * size : (c + 1) * size].data] for c in range(CHUNKS)]
            pids = {**{k: v for k, v in state["pids"].items() if v}, "engine": os.getpid()}
            prefetch = state["pids"]["prefetch"]
            lat: dict[tuple[str, str], list[float]] = {}
            cpu: dict[tuple[str, str], dict[str, float]] = {}
            for _ in range(args.blocks):
                for name, client in clients.items():
                    for mode in MODES:
                        stopped = mode == "prefetch stopped"
                        if stopped:
                            os.kill(prefetch, signal.SIGSTOP)
                        try:
                            for p in range(WARMUP_PROMPTS):
                                hit = client.lookup(tokens[p])
                                client.load(hit, dests)
                                client.release(hit)
                            before = {k: cpu_ticks(v) for k, v in pids.items()}
                            for i in range(args.rounds):
                                started = time.perf_counter()
                                hit = client.lookup(tokens[i % args.prompts])
                                result = client.load(hit, dests)
                                client.release(hit)
                                lat.setdefault((name, mode), []).append(time.perf_counter() - started)
                                if result.chunks_loaded != CHUNKS:
                                    raise RuntimeError(f"a load fell short: {result}")
                            time.sleep(0.05)  # the gathered releases go out within 20 ms
                            spent = {k: (cpu_ticks(v) - before[k]) / hz for k, v in pids.items()}
                        finally:
                            if stopped:
                                os.kill(prefetch, signal.SIGCONT)
                        into = cpu.setdefault((name, mode), {})
                        for k, v in spent.items():
                            into[k] = into.get(k, 0.0) + v
            where = {
                (name, place): samples
                for name, client in clients.items()
                for place, samples in copy_place(client, tokens, dests, args.rounds, args.blocks).items()
            }
        finally:
            for client in clients.values():
                client.close()
    prompts = args.rounds * args.blocks
    names = list(pids)
    print(
        f"`python -m bench.client_load_cpu --size {size} --rounds {args.rounds} --blocks {args.blocks}` "
        f"({time.strftime('%Y-%m-%d')}; load average at start / end {load_start[0]:.1f} / "
        f"{os.getloadavg()[0]:.1f}); CPU ms per prompt of {CHUNKS} × {size >> 10} KiB:\n"
    )
    print("| client | prefetch | p50 ms | total | " + " | ".join(names) + " |")
    print("|---|---|---:|---:|" + "---:|" * len(names))
    for (name, mode), spent in cpu.items():
        per = {k: v / prompts * 1e3 for k, v in spent.items()}
        p50 = percentile(sorted(lat[(name, mode)]), 0.5) * 1e3
        cells = " | ".join(f"{per[k]:.2f}" for k in names)
        print(f"| {name} | {mode.split()[1]} | {p50:.2f} | {sum(per.values()):.2f} | {cells} |")
    print("\n`load` alone, by where its read runs (blocks interleaved), ms per load:\n")
    print("| client | read on | p50 | p90 | mean |")
    print("|---|---|---:|---:|---:|")
    for (name, place), samples in where.items():
        ordered = sorted(samples)
        p50, p90 = percentile(ordered, 0.5) * 1e3, percentile(ordered, 0.9) * 1e3
        print(f"| {name} | {place} | {p50:.2f} | {p90:.2f} | {sum(ordered) / len(ordered) * 1e3:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
