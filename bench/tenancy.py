"""Tenancy benchmark (issue: tenancy and security): what authentication and the timing pad cost,
and how much a lookup's latency tells about a hit.

An authenticated cluster (`kvctl auth init`, nats-server with users + permissions, over TLS),
one directory and one segment; tenant `alice` saves `--prompts` prompts of 4 chunks x 64 KiB.
Then for each directory setting of `KVF_DIRECTORY_LOOKUP_REPLY_MIN_MS` (0 = off, then `--pad-ms`):
`--lookups` tenant lookups alternating between saved prompts (hits) and never-saved ones
(misses), each followed by a lease release for hits, timed one at a time on one connection
(a prompt's chunks fall in several directory shards: one request per shard, concurrently, as
the client does; a lookup's time is that of its slowest shard).
Reported: median and p99 latency of hits and misses, and the hit - miss gap (the side channel).
Then the cost of data-plane TLS: a segment with and without `KVF_SEGMENT_TLS_*`, whole loads of
16 x `--object-mib` MiB through the client over TCP (shared memory off), checksums verified.

Run: `.venv/bin/python -m bench.tenancy [--lookups 400] [--pad-ms 5]` (part of `make bench`).
Writes bench/results/tenancy.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import nats

from kvfabric.client import KvClient
from kvfabric.cluster.directory_router import DirectoryRouter
from kvfabric.ctl.auth import plan_auth, write_auth
from kvfabric.format.ids import GroupId
from kvfabric.proto import directory as m
from kvfabric.testing import NatsServer
from kvfabric.testing.clientkit import TOKENS_PER_CHUNK, objects_for, prompt
from kvfabric.testing.cluster import directory_process, segment_process
from kvfabric.testing.tenants import Secure, groups_of

RESULTS = Path(__file__).resolve().parent / "results"
CHUNKS = 4


def quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


async def measure(
    secure: Secure, hits: list[list[GroupId]], misses: list[list[GroupId]], n: int
) -> dict[str, Any]:
    nc = await nats.connect(secure.nats.url, **secure.tenant_auth("alice").connect_options())
    router = DirectoryRouter(nc, tenant="alice")
    times: dict[str, list[float]] = {"hit": [], "miss": []}
    try:
        await router.refresh()
        for i in range(n):
            kind = "hit" if i % 2 == 0 else "miss"
            by_shard: dict[int, list[GroupId]] = {}
            for group in (hits if kind == "hit" else misses)[i // 2 % len(hits)]:
                by_shard.setdefault(router.shard_of(group), []).append(group)
            started = time.perf_counter()
            replies = await asyncio.gather(
                *(
                    router.ask(shard, "lookup", m.Lookup(holder_id="bench", groups=groups), 5.0)
                    for shard, groups in by_shard.items()
                )
            )
            times[kind].append((time.perf_counter() - started) * 1000)
            for shard, reply in zip(by_shard, replies, strict=True):
                assert isinstance(reply, m.LookupReply) and (reply.hit_chunks > 0) == (kind == "hit")
                if reply.lease_id:
                    release = m.LeaseRelease(holder_id="bench", lease_id=reply.lease_id, shard=shard)
                    await router.ask(shard, "lease_release", release, 5.0)
    finally:
        await nc.close()
    out: dict[str, Any] = {}
    for kind, xs in times.items():
        out[f"{kind}_p50_ms"] = round(statistics.median(xs), 3)
        out[f"{kind}_p99_ms"] = round(quantile(xs, 0.99), 3)
    out["gap_p50_ms"] = round(out["hit_p50_ms"] - out["miss_p50_ms"], 3)
    return out


DP_CHUNKS = 16


def data_plane(secure: Secure, server: NatsServer, tls: bool, object_mib: int) -> dict[str, Any]:
    """Save one prompt of DP_CHUNKS objects, then time whole loads of it over TCP (no shm)."""
    seg_env = secure.env("svc-segment")
    if not tls:
        seg_env = {k: v for k, v in seg_env.items() if not k.startswith("KVF_SEGMENT_TLS_")}
    size = object_mib << 20
    tokens = prompt(DP_CHUNKS * TOKENS_PER_CHUNK, seed=77)
    objects = [[bytes([i]) * size] for i in range(DP_CHUNKS)]
    with (
        directory_process(server, **secure.env("svc-directory")),
        segment_process(server, f"seg-dp-{int(tls)}", 2 * DP_CHUNKS * size, **seg_env, KVF_SEGMENT_UCX="0"),
    ):
        settings = msgspec.structs.replace(secure.client_settings("alice"), use_shm=False)
        with KvClient(settings, secure.spec("alice")) as alice:
            assert alice.save(tokens, objects).chunks_saved == DP_CHUNKS
            dests = [[bytearray(size)] for _ in range(DP_CHUNKS)]
            times = []
            for _ in range(6):
                hit = alice.lookup(tokens)
                started = time.perf_counter()
                assert alice.load(hit, dests).tokens == DP_CHUNKS * TOKENS_PER_CHUNK
                times.append(time.perf_counter() - started)
                alice.release(hit)
            assert hit.objects[0][0].replicas[0].data_addr.startswith("tls://" if tls else "tcp://")
    median = statistics.median(times[1:])  # the first load opens the connections
    return {
        "transport": "TLS" if tls else "TCP",
        "gb_s": round(DP_CHUNKS * size / median / 1e9, 2),
        "p50_ms": round(median * 1000, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--lookups", type=int, default=400)
    parser.add_argument("--pad-ms", type=int, default=5)
    parser.add_argument("--object-mib", type=int, default=4)
    args = parser.parse_args()
    rows = []
    rows_dp: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvf-tenancy-") as tmp:
        doc = write_auth(Path(tmp) / "auth", plan_auth(["alice", "bob"]), tls=True)
        with NatsServer(Path(tmp) / "nats", extra_args=["-c", doc["conf"]]) as server:
            secure = Secure(server, doc)
            spec = secure.spec("alice")
            saved = [prompt(CHUNKS * TOKENS_PER_CHUNK, seed=s) for s in range(args.prompts)]
            never = [prompt(CHUNKS * TOKENS_PER_CHUNK, seed=10_000 + s) for s in range(args.prompts)]
            hits = [groups_of(spec, t) for t in saved]
            misses = [groups_of(spec, t) for t in never]
            for pad in (0, args.pad_ms):
                env = dict(secure.env("svc-directory"), KVF_DIRECTORY_LOOKUP_REPLY_MIN_MS=str(pad))
                with (
                    directory_process(server, **env),
                    segment_process(server, f"seg-bench-{pad}", 256 << 20, **secure.env("svc-segment")),
                ):
                    with secure.client("alice") as alice:
                        for tokens in saved:
                            alice.save(tokens, objects_for(tokens, 0, CHUNKS))
                    row = asyncio.run(measure(secure, hits, misses, args.lookups))
                    rows.append({"pad_ms": pad, **row})
                    print(rows[-1])
            for tls in (False, True):
                rows_dp.append(data_plane(secure, server, tls, args.object_mib))
                print(rows_dp[-1])
    result = {
        "machine": f"{platform.machine()} {platform.system()} {platform.release()}",
        "command": "python -m bench.tenancy",
        "lookups": args.lookups,
        "prompts": args.prompts,
        "transport": "NATS over TLS, tenant subjects, password auth",
        "rows": rows,
        "data_plane": rows_dp,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "tenancy.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "# Tenancy: lookup latency of hits vs misses (timing side channel) and the pad",
        "",
        f"`{result['command']}` on {result['machine']}; {args.lookups} lookups alternating hit/miss, "
        f"4 chunks each, one tenant connection over TLS.",
        "",
        "| lookup pad (ms) | hit p50 ms | hit p99 ms | miss p50 ms | miss p99 ms | hit - miss p50 ms |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['pad_ms'] or 'off'} | {r['hit_p50_ms']} | {r['hit_p99_ms']} | {r['miss_p50_ms']} | "
            f"{r['miss_p99_ms']} | {r['gap_p50_ms']} |"
        )
    lines += [
        "",
        f"## Data plane: loads over plain TCP vs TLS ({args.object_mib} MiB objects, "
        f"{DP_CHUNKS} per load, checksums verified, no shared memory)",
        "",
        "| transport | load GB/s (median of 5) | load p50 ms |",
        "|---|---|---|",
    ]
    lines += [f"| {r['transport']} | {r['gb_s']} | {r['p50_ms']} |" for r in rows_dp]
    (RESULTS / "tenancy.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
