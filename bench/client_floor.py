"""The fixed cost of one engine call through the client: what bounds bench.client at small objects.

One engine process, one prompt of 8 chunks × 1 object of 4 KiB (the bytes cost next to nothing),
against the same local cluster bench.client starts (tools/localcluster.py, authenticated, one
segment). Per call, p50 / p99 over `--calls` calls (after 20 untimed ones):

- `lookup + release`: the directory round trip an engine pays before any byte moves (NATS, the
  directory's lookup with a read lease and read tokens, the client's loop thread and the hop back
  to the calling thread); the release is sent without waiting.
- `load`: a hit's 8 objects, remote (TCP) and co-located (shared memory): the client's own
  per-call work (load table, worker thread hop, one data request, checksums).
- `save`: put_begin, the 8 writes (each confirmed by the segment to the directory), put_commit.
- the directory round trips of a save, timed inside the client loop (`put_begin`, `put_commit`);
- their floor, in the same run (`bench.nats_floor`): a NATS request/reply of the same size to a
  `nats.micro` echo endpoint in a process of its own, in the client loop and from a calling
  thread — what is left of a directory call with no directory work behind it.

Run: `.venv/bin/python -m bench.client_floor` (writes bench/results/client_floor.{json,md}).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from bench import nats_floor
from bench.client import RESULTS, local_cluster, percentile, read_env_file
from bench.client_worker import TOKENS_PER_CHUNK, bench_spec
from kvfabric.client import KvClient, settings_from_env

OBJECT_BYTES: Final = 4 << 10
CHUNKS: Final = 8
WARMUP_CALLS: Final = 20


def tokens_of(serial: int) -> list[int]:
    return [serial, *((serial * 7919 + i) % 50_000 for i in range(CHUNKS * TOKENS_PER_CHUNK - 1))]


def stats_ms(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_ms": percentile(ordered, 0.5) * 1e3,
        "p99_ms": percentile(ordered, 0.99) * 1e3,
        "mean_ms": statistics.fmean(ordered) * 1e3,
        "calls": len(ordered),
    }


def timed(calls: int, fn: Callable[[int], None]) -> list[float]:
    for i in range(WARMUP_CALLS):
        fn(i)
    out = []
    for i in range(WARMUP_CALLS, WARMUP_CALLS + calls):
        started = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - started)
    return out


def measure(state: dict[str, Any], calls: int) -> dict[str, dict[str, float]]:
    tenant = read_env_file(Path(state["auth"]["dir"]) / "env" / "tenant-demo.env")
    url = state["nats_url"]
    spec = bench_spec(tenant, url, "floor")
    remote = KvClient(settings_from_env(tenant, nats_url=url, use_shm=False), spec)
    local = KvClient(settings_from_env(tenant, nats_url=url, use_shm=True), spec)
    objects = [[memoryview(bytes([c]) * OBJECT_BYTES)] for c in range(CHUNKS)]
    dests = [[memoryview(bytearray(OBJECT_BYTES))] for _ in range(CHUNKS)]
    base = int.from_bytes(os.urandom(2), "little") * 10_000 + 1_000_000  # ids below 2**32
    out: dict[str, dict[str, float]] = {}
    try:
        saved = [base + i for i in range(WARMUP_CALLS + calls)]

        def save(i: int) -> None:
            result = remote.save(tokens_of(saved[i]), objects)
            if result.chunks_saved != CHUNKS:
                raise RuntimeError(f"save failed: {result}")

        out["save (8 × 4 KiB)"] = stats_ms(timed(calls, save))

        def lookup_release(i: int) -> None:
            hit = remote.lookup(tokens_of(saved[i]))
            if hit.chunks != CHUNKS:
                raise RuntimeError(f"lookup missed: {hit.cause}")
            remote.release(hit)

        out["lookup + release"] = stats_ms(timed(calls, lookup_release))
        router = remote.aio.router
        if router is not None and router.shards > 1:
            # As before `lookup_many`: one request per shard the prompt spans (the client asks an
            # instance it believes has no `lookup_many` shard by shard).
            remote.aio._lookup_many_refused.update(router.instances())
            out["lookup + release, one request per shard"] = stats_ms(timed(calls, lookup_release))
            remote.aio._lookup_many_refused.clear()
        for name, client in (("remote", remote), ("co-located", local)):
            hits = [client.lookup(tokens_of(s)) for s in saved]
            loads = []
            for i, hit in enumerate(hits):
                started = time.perf_counter()
                result = client.load(hit, dests)
                loads.append(time.perf_counter() - started)
                client.release(hit)
                if result.chunks_loaded != CHUNKS:
                    raise RuntimeError(f"load failed: {result}")
                if i == 0 and any(bytes(d[0]) != bytes([c]) * OBJECT_BYTES for c, d in enumerate(dests)):
                    raise RuntimeError("loaded bytes differ")
            out[f"load, {name} (8 × 4 KiB)"] = stats_ms(loads[WARMUP_CALLS:])
        for verb, times in verb_times(remote, ("put_begin", "put_commit"), base + 500_000, calls).items():
            out[f"directory {verb}, in the client loop"] = stats_ms(times)
        out.update(nats_floor.measure(max(calls, 1000)))
    finally:
        remote.close()
        local.close()
    return out


def verb_times(client: KvClient, verbs: tuple[str, ...], base: int, calls: int) -> dict[str, list[float]]:
    """The round trips of save verbs, timed on the client's loop around `_ask_directory`."""
    times: dict[str, list[float]] = {verb: [] for verb in verbs}
    ask = client.aio._ask_directory

    async def timed_ask(verb: str, *args: Any) -> Any:
        started = time.perf_counter()
        try:
            return await ask(verb, *args)
        finally:
            if verb in times:
                times[verb].append(time.perf_counter() - started)

    client.aio._ask_directory = timed_ask  # type: ignore[method-assign, assignment]
    try:
        objects = [[memoryview(bytes([7]) * OBJECT_BYTES)] for _ in range(CHUNKS)]
        for i in range(calls):
            client.save(tokens_of(base + i), objects)
    finally:
        client.aio._ask_directory = ask  # type: ignore[method-assign]
    return times


def markdown(record: dict[str, Any]) -> str:
    lines = [
        f"### Client call floor ({record['date']}; {record['machine']})",
        "",
        f"`python -m bench.client_floor --calls {record['calls']}"
        f"{' --shards ' + str(record['shards']) if record.get('shards', 1) > 1 else ''}`; "
        f"{record.get('shards', 1)} directory shard(s), one instance; load average at start / end "
        f"{record['load_start']} / {record['load_end']}. One engine process; a prompt = 8 chunks × "
        "1 object of 4 KiB: what a call costs before its bytes do (bench.client's 256 KiB cells "
        "move 2 MiB a call on top of this).",
        "",
        "| call | p50 ms | p99 ms | mean ms |",
        "|---|---:|---:|---:|",
    ]
    for name, s in record["calls_ms"].items():
        lines.append(f"| {name} | {s['p50_ms']:.3f} | {s['p99_ms']:.3f} | {s['mean_ms']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--shards",
        type=int,
        default=0,
        help="the directory's virtual shards (default: localcluster's 1 for one instance); with "
        "more, lookup + release is also timed one request per shard",
    )
    args = parser.parse_args()
    extra_env = {"KVF_DIRECTORY_SHARDS": str(args.shards)} if args.shards else {}
    load_start = " ".join(f"{x:.2f}" for x in os.getloadavg())
    with (
        tempfile.TemporaryDirectory(prefix="kvf-bench-floor-") as tmp,
        local_cluster(Path(tmp) / "run", extra_env) as state,
    ):
        calls_ms = measure(state, args.calls)
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}",
        "calls": args.calls,
        "shards": args.shards or 1,
        "load_start": load_start,
        "load_end": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "calls_ms": calls_ms,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "client_floor.json").write_text(json.dumps(record, indent=2) + "\n")
    (args.out / "client_floor.md").write_text(markdown(record))
    print(markdown(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
