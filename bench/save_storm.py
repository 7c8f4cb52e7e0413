"""The refill after a cache loss (issue 24, item 3): what a write storm costs a reader, and what an
engine's save rate (`ClientSettings.save_bytes_per_s_max`) buys back.

When the cache is lost (segments down, a cluster restart), every request of every engine misses,
and every engine saves all it computes: each offers its whole prefill's KV. Here `--engines`
spawned engine processes each *offer* `--offer-mib` MiB/s of saves (a new prompt of `--chunks`
objects of `--object-kib` KiB every `chunks × object / offer` seconds, through `KvClient.save_async`
over TCP, as a remote engine), while a reader in this process does `lookup` + `load` + `release` of
its own prompts (saved before, kept hot, over TCP) one after another and times each. Phases, each
`--seconds` long, in one run against one cluster: `quiet` (no storm), `storm` (no save rate), and
`storm` with each engine's rate at each of `--rate-mib` MiB/s; then `quiet` again (the machine's
drift).

Cluster: NATS with JetStream, one directory, one segment of `--segment-mib` MiB and the eviction
policy (its default watermarks), all this checkout's, on this host (2 cores: a storm competes with
the reader for CPU as much as for the segment).

Reported per phase: the reader's latency p50 / p99 (ms) and its loads whole and verified (bytes
compared); the engines' bytes offered, saved (`SaveResult.bytes_written`) and skipped by the rate
(`save_rate` chunks), their other failures by cause; and the ratios of each storm's p50 / p99 to
the quiet phases'.

Run: `.venv/bin/python -m bench.save_storm` (about 1 minute). Writes
bench/results/save_storm.{json,md} (`--name`).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Final

from kvfabric.client import ClientSettings, KvClient, SaveResult
from kvfabric.testing import NatsServer
from kvfabric.testing.clientkit import SPEC, TOKENS_PER_CHUNK
from kvfabric.testing.cluster import directory_process, eviction_process, segment_process

RESULTS: Final = Path(__file__).resolve().parent / "results"
READER_PROMPTS: Final = 8
READER_OBJECT_BYTES: Final = 256 << 10
SAVES_OUTSTANDING_MAX: Final = 4  # an engine's saves in flight before it waits for the oldest


def quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def tokens_of(engine: int, n: int, chunks: int) -> list[int]:
    """A prompt no other engine or phase names (its first token is unique)."""
    return [engine * 10_000_000 + n, *range(1, chunks * TOKENS_PER_CHUNK)]


# ---- an engine: offers saves at a fixed rate ---------------------------------------------------


def engine_main(conn: Connection, nats_url: str, engine: int, args: dict[str, Any]) -> None:
    settings = ClientSettings(
        nats_url=nats_url,
        use_shm=False,  # a remote engine: its writes go over TCP
        save_bytes_per_s_max=args["rate_bytes"],
    )
    kv = KvClient(settings, SPEC)
    try:
        if not kv.enabled:
            raise RuntimeError(f"engine {engine}: the client did not start: {kv.status}")
        chunks, object_bytes = args["chunks"], args["object_bytes"]
        payload = [[bytes([engine % 256]) * object_bytes] for _ in range(chunks)]  # content is not the point
        period_s = chunks * object_bytes / args["offer_bytes"]
        conn.send("ready")
        conn.recv()  # go
        started = time.monotonic()
        pending: list[Any] = []
        results: list[SaveResult] = []
        offered = dropped = 0
        n = 0
        while time.monotonic() - started < args["seconds"]:
            due = started + n * period_s
            pause = due - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            future = kv.save_async(tokens_of(engine, n, chunks), payload)
            n += 1
            offered += chunks * object_bytes
            if future is None:
                dropped += chunks
            else:
                pending.append(future)
            while len(pending) > SAVES_OUTSTANDING_MAX or (pending and pending[0].done()):
                results.append(pending.pop(0).result(60.0))
        results += [f.result(60.0) for f in pending]
        causes: Counter[str] = Counter()
        for r in results:
            causes.update(r.causes)
        conn.send(
            {
                "offered_bytes": offered,
                "saved_bytes": sum(r.bytes_written for r in results),
                "chunks_saved": sum(r.chunks_saved for r in results),
                "chunks_dropped_before_start": dropped,
                "causes": dict(causes),
                "seconds": time.monotonic() - started,
            }
        )
    finally:
        kv.close()


# ---- the reader -------------------------------------------------------------------------------


def reader_prompts() -> list[tuple[list[int], list[list[bytes]]]]:
    out = []
    for p in range(READER_PROMPTS):
        tokens = [99_000_000 + p, *range(1, 8 * TOKENS_PER_CHUNK)]
        objects = [[bytes([p, c]) * (READER_OBJECT_BYTES // 2)] for c in range(8)]
        out.append((tokens, objects))
    return out


def read_for(
    kv: KvClient, prompts: list[tuple[list[int], list[list[bytes]]]], seconds: float
) -> dict[str, Any]:
    times: list[float] = []
    whole = 0
    bad = 0
    dests = [[bytearray(READER_OBJECT_BYTES)] for _ in range(8)]
    started = time.monotonic()
    i = 0
    while time.monotonic() - started < seconds:
        tokens, objects = prompts[i % len(prompts)]
        i += 1
        t0 = time.perf_counter()
        hit = kv.lookup(tokens)
        result = kv.load(hit, dests[: hit.chunks])
        kv.release(hit)
        times.append((time.perf_counter() - t0) * 1000)
        n = result.tokens // TOKENS_PER_CHUNK
        if n == 8:
            whole += 1
            if any(bytes(dests[c][0]) != objects[c][0] for c in range(8)):
                bad += 1
    return {
        "reads": len(times),
        "whole": whole,
        "bad_bytes": bad,
        "p50_ms": quantile(times, 0.5),
        "p99_ms": quantile(times, 0.99),
        "mean_ms": statistics.fmean(times) if times else float("nan"),
    }


def phase(
    name: str,
    kv: KvClient,
    prompts: list[tuple[list[int], list[list[bytes]]]],
    nats_url: str,
    args: argparse.Namespace,
    rate_bytes: int | None,
    index: int,
) -> dict[str, Any]:
    """One phase: `rate_bytes` None = no storm; 0 = engines with no save rate."""
    for tokens, objects in prompts:  # a reader's prompt the storm evicted comes back first
        kv.save(tokens, objects)
    engines: list[tuple[Any, Connection]] = []
    ctx = mp.get_context("spawn")
    if rate_bytes is not None:
        spec = {
            "rate_bytes": rate_bytes,
            "chunks": args.chunks,
            "object_bytes": args.object_kib << 10,
            "offer_bytes": args.offer_mib << 20,
            "seconds": args.seconds,
        }
        for e in range(args.engines):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=engine_main, args=(theirs, nats_url, 100 * index + e + 1, spec))
            proc.start()
            engines.append((proc, ours))
        for _, conn in engines:
            if not conn.poll(60.0) or conn.recv() != "ready":
                raise RuntimeError("an engine did not start")
        for _, conn in engines:
            conn.send("go")
    row: dict[str, Any] = {"phase": name, "rate_mib_per_engine": None if not rate_bytes else rate_bytes >> 20}
    row["reader"] = read_for(kv, prompts, args.seconds)
    storm = []
    for proc, conn in engines:
        if not conn.poll(120.0):
            raise RuntimeError("an engine did not report")
        storm.append(conn.recv())
        proc.join(30.0)
    if storm:
        causes: Counter[str] = Counter()
        for s in storm:
            causes.update(s["causes"])
        secs = max(s["seconds"] for s in storm)
        row["engines"] = {
            "offered_mib_per_s": sum(s["offered_bytes"] for s in storm) / secs / (1 << 20),
            "saved_mib_per_s": sum(s["saved_bytes"] for s in storm) / secs / (1 << 20),
            "chunks_saved": sum(s["chunks_saved"] for s in storm),
            "chunks_skipped_save_rate": causes.pop("save_rate", 0),
            "chunks_dropped_before_start": sum(s["chunks_dropped_before_start"] for s in storm),
            "other_failures": dict(causes),
        }
    print(json.dumps(row), flush=True)
    return row


def markdown(report: dict[str, Any]) -> str:
    a = report["args"]
    lines = [
        "# Save storm: a reader during the refill after a cache loss, with and without a save rate",
        "",
        f"`{report['command']}` — {report['when']}, {report['machine']}, load average "
        f"{report['load_start']} → {report['load_end']}.",
        f"{a['engines']} engines each offering {a['offer_mib']} MiB/s of saves ({a['chunks']} × "
        f"{a['object_kib']} KiB a prompt, over TCP); a reader's lookup + load + release of 8 × 256 KiB "
        f"(TCP), one after another; phases of {a['seconds']} s.",
        "",
        "| phase | reader p50 ms | p99 ms | p50 / quiet | p99 / quiet | reads (whole, bad) "
        "| offered MiB/s | saved MiB/s | chunks skipped (rate) | other failures |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    q50, q99 = report["quiet_p50_ms"], report["quiet_p99_ms"]
    for row in report["phases"]:
        r = row["reader"]
        e = row.get("engines")
        label = row["phase"] + (
            f" ({row['rate_mib_per_engine']} MiB/s each)" if row["rate_mib_per_engine"] else ""
        )
        lines.append(
            f"| {label} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['p50_ms'] / q50:.2f} | "
            f"{r['p99_ms'] / q99:.2f} | {r['reads']} ({r['whole']}, {r['bad_bytes']}) | "
            + (
                f"{e['offered_mib_per_s']:.0f} | {e['saved_mib_per_s']:.0f} | "
                f"{e['chunks_skipped_save_rate']} | {e['other_failures'] or '—'} |"
                if e
                else "— | — | — | — |"
            )
        )
    lines += ["", "quiet = the mean of the two quiet phases' p50 / p99.", ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--offer-mib", type=int, default=256, help="MiB/s of saves each engine offers")
    parser.add_argument(
        "--rate-mib", default="32,128", help="each engine's save rate, MiB/s: a storm phase per value"
    )
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--object-kib", type=int, default=1024)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--segment-mib", type=int, default=2048)
    parser.add_argument("--name", default="save_storm")
    args = parser.parse_args()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load_start = [round(x, 2) for x in os.getloadavg()]
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvf-storm-")))
        nats = stack.enter_context(NatsServer(tmp / "nats"))
        quiet_logs = {"KVF_LOG_LEVEL": "info"}
        stack.enter_context(directory_process(nats, **quiet_logs))
        stack.enter_context(segment_process(nats, "storm-seg", args.segment_mib << 20, **quiet_logs))
        stack.enter_context(eviction_process(nats, **quiet_logs))
        kv = stack.enter_context(KvClient(ClientSettings(nats_url=nats.url, use_shm=False), SPEC))
        prompts = reader_prompts()
        rates = [int(r) for r in args.rate_mib.split(",") if r]
        phases = [
            phase("quiet", kv, prompts, nats.url, args, None, 1),
            phase("storm", kv, prompts, nats.url, args, 0, 2),
            *(phase("storm, rate", kv, prompts, nats.url, args, r << 20, 3 + i) for i, r in enumerate(rates)),
            phase("quiet", kv, prompts, nats.url, args, None, 3 + len(rates)),
        ]
    quiet = [p["reader"] for p in phases if p["phase"] == "quiet"]
    report = {
        "command": "python -m bench.save_storm "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "name"),
        "when": started,
        "machine": f"{platform.node()} ({os.cpu_count()} CPUs)",
        "load_start": load_start,
        "load_end": [round(x, 2) for x in os.getloadavg()],
        "args": vars(args),
        "phases": phases,
        "quiet_p50_ms": statistics.fmean(q["p50_ms"] for q in quiet),
        "quiet_p99_ms": statistics.fmean(q["p99_ms"] for q in quiet),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(report, indent=1) + "\n")
    (RESULTS / f"{args.name}.md").write_text(markdown(report))
    print(markdown(report))
    bad = sum(p["reader"]["bad_bytes"] for p in phases)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
