"""Tenancy benchmark (issue: tenancy and security): what authentication and the timing pad cost,
and how much a lookup's latency tells about a hit.

An authenticated cluster (`kvctl auth init`, nats-server with users + permissions, over TLS),
one directory and one segment; tenant `alice` saves `--prompts` prompts of 4 chunks x 64 KiB.
Then for each directory setting of `KVF_DIRECTORY_LOOKUP_REPLY_MIN_MS` (0 = off, then `--pad-ms`):
`--lookups` tenant lookups alternating between saved prompts (hits) and never-saved ones
(misses), each followed by a lease release for hits, timed one at a time on one connection.
Reported: median and p99 latency of hits and misses, and the hit - miss gap (the side channel).

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

import nats

from kvfabric.ctl.auth import plan_auth, write_auth
from kvfabric.proto import directory as m
from kvfabric.proto.subjects import Service, tenant_subject
from kvfabric.runtime import request
from kvfabric.testing import NatsServer
from tests.integration.clientkit import TOKENS_PER_CHUNK, objects_for, prompt
from tests.integration.cluster import directory_process, segment_process
from tests.integration.test_tenancy import Secure, groups_of

RESULTS = Path(__file__).resolve().parent / "results"
CHUNKS = 4


def quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


async def measure(
    secure: Secure, hits: list[list[bytes]], misses: list[list[bytes]], n: int
) -> dict[str, Any]:
    nc = await nats.connect(secure.nats.url, **secure.tenant_auth("alice").connect_options())
    subject = tenant_subject(Service.DIRECTORY, "alice", "lookup")
    release = tenant_subject(Service.DIRECTORY, "alice", "lease_release")
    times: dict[str, list[float]] = {"hit": [], "miss": []}
    try:
        for i in range(n):
            kind = "hit" if i % 2 == 0 else "miss"
            groups = (hits if kind == "hit" else misses)[i // 2 % len(hits)]
            started = time.perf_counter()
            reply = await request(
                nc, subject, m.Lookup(holder_id="bench", groups=groups), m.reply_decoder, 5.0
            )
            times[kind].append((time.perf_counter() - started) * 1000)
            assert isinstance(reply, m.LookupReply) and (reply.hit_chunks > 0) == (kind == "hit")
            if reply.lease_id:
                await request(
                    nc,
                    release,
                    m.LeaseRelease(holder_id="bench", lease_id=reply.lease_id),
                    m.reply_decoder,
                    5.0,
                )
    finally:
        await nc.close()
    out: dict[str, Any] = {}
    for kind, xs in times.items():
        out[f"{kind}_p50_ms"] = round(statistics.median(xs), 3)
        out[f"{kind}_p99_ms"] = round(quantile(xs, 0.99), 3)
    out["gap_p50_ms"] = round(out["hit_p50_ms"] - out["miss_p50_ms"], 3)
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--lookups", type=int, default=400)
    parser.add_argument("--pad-ms", type=int, default=5)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvf-tenancy-") as tmp:
        doc = write_auth(Path(tmp) / "auth", plan_auth(["alice", "bob"]), tls=True)
        with NatsServer(Path(tmp) / "nats", extra_args=["-c", doc["conf"]]) as server:
            secure = Secure(server, doc)
            spec = secure.spec("alice")
            saved = [prompt(CHUNKS * TOKENS_PER_CHUNK, seed=s) for s in range(args.prompts)]
            never = [prompt(CHUNKS * TOKENS_PER_CHUNK, seed=10_000 + s) for s in range(args.prompts)]
            hits = [groups_of(spec, t) for t in saved]
            misses = [groups_of(spec, t) for t in never]
            with segment_process(server, "seg-bench", 256 << 20, **secure.env("svc-segment")):
                for pad in (0, args.pad_ms):
                    env = dict(secure.env("svc-directory"), KVF_DIRECTORY_LOOKUP_REPLY_MIN_MS=str(pad))
                    with directory_process(server, **env):
                        with secure.client("alice") as alice:  # the directory is new: save again
                            for tokens in saved:
                                alice.save(tokens, objects_for(tokens, 0, CHUNKS))
                        row = asyncio.run(measure(secure, hits, misses, args.lookups))
                        rows.append({"pad_ms": pad, **row})
                        print(rows[-1])
    result = {
        "machine": f"{platform.machine()} {platform.system()} {platform.release()}",
        "command": "python -m bench.tenancy",
        "lookups": args.lookups,
        "prompts": args.prompts,
        "transport": "NATS over TLS, tenant subjects, password auth",
        "rows": rows,
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
    (RESULTS / "tenancy.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
