"""Directory failover benchmark (issue: directory HA and sharding).

A real nats-server, three directory instances sharing `--shards` virtual shards by rendezvous
hashing (`KVF_DIRECTORY_REBALANCE=1`, leader lease 3 s), two segments, and `--prompts` prompts
of 4 chunks x 64 KiB published. Then, `--rounds` times:
1. SIGKILL the instance leading the most shards; measure the time until the shard map (as the
   instances tell it, `DirectoryRouter`) has a live leader for every shard again under newer
   epochs (failover), and read every prompt back through a fresh client (objects kept, bytes
   verified);
2. restart the killed instance: it rejoins and takes its share back by handover; measure the
   time until the map equals the rendezvous owners again (rebalance) and read everything again.

Run: `.venv/bin/python -m bench.failover [--rounds 5] [--prompts 200] [--shards 16]` (part of
`make bench`). Writes bench/results/failover.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import platform
import signal
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import nats

from kvfabric.cluster.directory_router import DirectoryRouter, ShardRoute
from kvfabric.core.leadership import desired_owner
from kvfabric.testing import NatsServer, ServiceProcess
from kvfabric.testing.clientkit import TOKENS_PER_CHUNK, client, load_all, objects_for, prompt
from kvfabric.testing.cluster import segment_process, service_env

RESULTS = Path(__file__).resolve().parent / "results"
CHUNKS = 4
NAMES = ("dir-1", "dir-2", "dir-3")


def directory(nats_server: NatsServer, name: str, shards: int) -> ServiceProcess:
    env = service_env(KVF_INSTANCE_ID=name, KVF_DIRECTORY_SHARDS=str(shards), KVF_DIRECTORY_REBALANCE="1")
    proc = ServiceProcess.python_module(
        "kvfabric.directory", "--nats-url", nats_server.url, "--metrics-port", "0", "--log-json", env=env
    )
    proc.start()
    proc.wait_for_event("directory_standby", 30.0)
    return proc


async def _routes(url: str, shards: int) -> dict[int, ShardRoute]:
    nc = await nats.connect(url)
    try:
        router = DirectoryRouter(nc, gather_s=0.5)
        await router.refresh()
        return dict(router.routes) if router.shards == shards else {}
    finally:
        await nc.close()


def wait_map(url: str, shards: int, ok: object, timeout_s: float) -> tuple[float, dict[int, ShardRoute]]:
    """Poll the shard map until `ok(routes)` for a complete map; (seconds waited, routes)."""
    began = time.monotonic()
    while True:
        routes = asyncio.run(_routes(url, shards))
        if len(routes) == shards and ok(routes):  # type: ignore[operator]
            return time.monotonic() - began, routes
        if time.monotonic() - began > timeout_s:
            raise TimeoutError(f"shard map did not settle: {routes}")
        time.sleep(0.05)


def read_back(nats_server: NatsServer, prompts: list[list[int]]) -> tuple[int, int]:
    with client(nats_server) as reader:
        results = [load_all(reader, tokens) for tokens in prompts]
    return sum(n == CHUNKS and same for n, same in results), sum(not same for _, same in results)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--shards", type=int, default=16)
    args = parser.parse_args()
    shards = args.shards
    prompts = [prompt(CHUNKS * TOKENS_PER_CHUNK, seed=s) for s in range(args.prompts)]
    members = set(NAMES)
    settled = lambda r: all(r[s].instance == desired_owner(s, members) for s in r)  # noqa: E731
    rounds: list[dict[str, Any]] = []
    with (
        tempfile.TemporaryDirectory(prefix="kvf-failover-") as store,
        NatsServer(Path(store)) as nats_server,
        contextlib.ExitStack() as stack,
    ):
        url = nats_server.url
        procs = {NAMES[0]: directory(nats_server, NAMES[0], shards)}
        stack.callback(lambda: [p.stop(timeout_s=10.0) for p in procs.values()])
        wait_map(url, shards, lambda r: True, 30.0)
        stack.enter_context(segment_process(nats_server, "seg-fo1", KVF_SEGMENT_ZONE="za"))
        stack.enter_context(segment_process(nats_server, "seg-fo2", KVF_SEGMENT_ZONE="zb"))
        for name in NAMES[1:]:
            procs[name] = directory(nats_server, name, shards)
        with client(nats_server) as writer:
            for tokens in prompts:
                writer.save(tokens, objects_for(tokens, 0, CHUNKS))
        _, routes = wait_map(url, shards, settled, 60.0)
        for _ in range(args.rounds):
            victim, _ = Counter(r.instance for r in routes.values()).most_common(1)[0]
            moved = sorted(s for s, r in routes.items() if r.instance == victim)
            procs[victim].send_signal(signal.SIGKILL)
            failover_s, _ = wait_map(
                url,
                shards,
                lambda r, v=victim, old=routes: all(
                    r[s].instance != v and (old[s].instance != v or r[s].epoch > old[s].epoch) for s in r
                ),
                30.0,
            )
            kept, wrong = read_back(nats_server, prompts)
            procs[victim].wait(10.0)
            procs[victim] = directory(nats_server, victim, shards)  # it rejoins: handover back
            rebalance_s, routes = wait_map(url, shards, settled, 60.0)
            kept_after, wrong_after = read_back(nats_server, prompts)
            rounds.append(
                {
                    "victim": victim,
                    "shards_moved": len(moved),
                    "failover_s": round(failover_s, 3),
                    "prompts_kept": kept,
                    "prompts_wrong": wrong,
                    "rebalance_s": round(rebalance_s, 3),
                    "prompts_kept_after_rebalance": kept_after,
                    "prompts_wrong_after_rebalance": wrong_after,
                }
            )
            print(rounds[-1], flush=True)
    failovers = [r["failover_s"] for r in rounds]
    rebalances = [r["rebalance_s"] for r in rounds]
    kept_all = [r["prompts_kept"] for r in rounds] + [r["prompts_kept_after_rebalance"] for r in rounds]
    summary = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, Python {platform.python_version()}",
        "command": "python -m bench.failover",
        "shards": shards,
        "prompts": args.prompts,
        "objects": args.prompts * CHUNKS,
        "rounds": rounds,
        "failover_s_median": statistics.median(failovers),
        "failover_s_max": max(failovers),
        "rebalance_s_median": statistics.median(rebalances),
        "kept_min_pct": round(100 * min(kept_all) / args.prompts, 2),
        "wrong_total": sum(r["prompts_wrong"] + r["prompts_wrong_after_rebalance"] for r in rounds),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "failover.json").write_text(json.dumps(summary, indent=2))
    lines = [
        f"### Directory failover, sharded ({summary['date']}; {summary['machine']})",
        "",
        f"`{summary['command']}`: 3 directory instances, {shards} shards by rendezvous hashing "
        f"(leader lease 3 s), 2 segments, {args.prompts} prompts x {CHUNKS} chunks x 64 KiB. Each "
        "round SIGKILLs the instance leading the most shards (failover: every shard led again by "
        "a live instance, newer epochs), then restarts it (rebalance: the map is back to the "
        "rendezvous owners by handover); all prompts are read back after each step.",
        "",
        "| round | shards moved | failover s | prompts kept | rebalance s | kept after rebalance |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for i, r in enumerate(rounds, 1):
        lines.append(
            f"| {i} | {r['shards_moved']}/{shards} | {r['failover_s']:.2f} | "
            f"{r['prompts_kept']}/{args.prompts} | {r['rebalance_s']:.2f} | "
            f"{r['prompts_kept_after_rebalance']}/{args.prompts} |"
        )
    lines += [
        "",
        f"Median failover {summary['failover_s_median']:.2f} s (max {summary['failover_s_max']:.2f} s, "
        f"target ≤ 5 s); median rebalance {summary['rebalance_s_median']:.2f} s; objects kept ≥ "
        f"{summary['kept_min_pct']} % (target ≥ 99 %), {summary['wrong_total']} wrong reads.",
        "",
    ]
    (RESULTS / "failover.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
