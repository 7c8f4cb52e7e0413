"""Directory failover benchmark (issue: directory HA).

A real nats-server, three directory instances (one leader, two standbys, default settings:
leader lease 3 s), two segments, and `--prompts` prompts of 4 chunks x 64 KiB published. Then,
`--rounds` times: SIGKILL the current leader, measure the time until a lookup is answered under
a newer epoch (failover), read every prompt back through a fresh client (objects kept, bytes
verified), and restart the killed instance as a standby.

Run: `.venv/bin/python -m bench.failover [--rounds 5] [--prompts 200]` (part of `make bench`).
Writes bench/results/failover.json and .md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import signal
import statistics
import tempfile
import time
from pathlib import Path

from kvfabric.testing import NatsServer, ServiceProcess
from tests.integration.clientkit import TOKENS_PER_CHUNK, client, objects_for, prompt
from tests.integration.cluster import segment_process, service_env
from tests.integration.test_directory_ha import groups_of, load_all, wait_new_leader

RESULTS = Path(__file__).resolve().parent / "results"
CHUNKS = 4


def directory(nats: NatsServer) -> ServiceProcess:
    proc = ServiceProcess.python_module(
        "kvfabric.directory", "--nats-url", nats.url, "--metrics-port", "0", "--log-json", env=service_env()
    )
    proc.start()
    return proc


def leader_of(procs: list[ServiceProcess]) -> ServiceProcess:
    live = [p for p in procs if p.returncode is None]
    leading = [p for p in live if any(e.get("event") == "directory_started" for e in p.events())]
    return leading[-1]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=200)
    args = parser.parse_args()
    prompts = [prompt(CHUNKS * TOKENS_PER_CHUNK, seed=s) for s in range(args.prompts)]
    rounds = []
    with (
        tempfile.TemporaryDirectory(prefix="kvf-failover-") as store,
        NatsServer(Path(store)) as nats,
        contextlib.ExitStack() as stack,
    ):
        procs = [directory(nats)]
        procs[0].wait_for_event("directory_started", 30.0)
        stack.callback(lambda: [p.stop(timeout_s=10.0) for p in procs])
        stack.enter_context(segment_process(nats, "seg-fo1", KVF_SEGMENT_ZONE="za"))
        stack.enter_context(segment_process(nats, "seg-fo2", KVF_SEGMENT_ZONE="zb"))
        for _ in range(2):
            procs.append(directory(nats))
            procs[-1].wait_for_event("directory_standby", 30.0)
        with client(nats) as writer:
            for tokens in prompts:
                writer.save(tokens, objects_for(tokens, 0, CHUNKS))
        probe = groups_of(prompts[0])[0].to_bytes()
        for _ in range(args.rounds):
            leader = leader_of(procs)
            old_epoch = leader.wait_for_event("directory_started", 1.0)["epoch"]
            killed = time.monotonic()
            leader.send_signal(signal.SIGKILL)
            new_epoch = wait_new_leader(nats.url, probe, old_epoch, 30.0)
            failover_s = time.monotonic() - killed
            started = leader_of(procs).wait_for_event("directory_started", 5.0)
            with client(nats) as reader:
                results = [load_all(reader, tokens) for tokens in prompts]
            kept = sum(n == CHUNKS and same for n, same in results)
            wrong = sum(not same for _, same in results)
            rounds.append(
                {
                    "failover_s": round(failover_s, 3),
                    "rebuild_ms": started.get("rebuild_ms", "-"),  # not logged by a sharded directory
                    "groups_adopted": started["groups_adopted"],
                    "epoch": [old_epoch, new_epoch],
                    "prompts_kept": kept,
                    "prompts_wrong": wrong,
                }
            )
            print(rounds[-1], flush=True)
            leader.wait(10.0)
            procs.append(directory(nats))  # the killed instance comes back as a standby
            procs[-1].wait_for_event("directory_standby", 30.0)
    failovers = [r["failover_s"] for r in rounds]
    summary = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, Python {platform.python_version()}",
        "command": "python -m bench.failover",
        "prompts": args.prompts,
        "objects": args.prompts * CHUNKS,
        "rounds": rounds,
        "failover_s_median": statistics.median(failovers),
        "failover_s_max": max(failovers),
        "kept_min_pct": round(100 * min(r["prompts_kept"] for r in rounds) / args.prompts, 2),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "failover.json").write_text(json.dumps(summary, indent=2))
    lines = [
        f"### Directory failover ({summary['date']}; {summary['machine']})",
        "",
        f"`{summary['command']}`: 3 directory instances (leader lease 3 s), 2 segments, "
        f"{args.prompts} prompts x {CHUNKS} chunks x 64 KiB; each round SIGKILLs the leader.",
        "",
        "| round | failover s | rebuild ms | groups adopted | epoch | prompts kept (bytes verified) |",
        "|---:|---:|---:|---:|---|---:|",
    ]
    for i, r in enumerate(rounds, 1):
        lines.append(
            f"| {i} | {r['failover_s']:.2f} | {r['rebuild_ms']} | {r['groups_adopted']} | "
            f"{r['epoch'][0]} → {r['epoch'][1]} | {r['prompts_kept']}/{args.prompts} |"
        )
    lines += [
        "",
        f"Median failover {summary['failover_s_median']:.2f} s (max {summary['failover_s_max']:.2f} s, "
        f"target ≤ 5 s); objects kept ≥ {summary['kept_min_pct']} % (target ≥ 99 %), 0 wrong bytes.",
        "",
    ]
    (RESULTS / "failover.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
