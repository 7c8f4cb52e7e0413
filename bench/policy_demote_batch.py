"""The eviction policy's demote requests, one group each vs several, A/B in one run (issue 23).

One cluster: a NATS, a directory and a segment with a disk tier (its own segment id and run
folder). Per round and object size, two sets of n one-object chunk groups are saved by a client;
then, in an order that alternates per round, the eviction policy's own demotion code
(`EvictionShell._demote_groups`, against the live directory and segment) demotes one set as
**A**, one group per demote request (`DEMOTE_REQUEST_GROUPS_MAX` set to 1: the policy before
several groups shared a request), and the other as **B**, this tree's bounds. Reported per mode:
CPU seconds (user + system) of the directory, the segment and this process (the policy, its
`show_group` lookups; the idle client's threads too) per GB demoted, over all rounds, the demote
requests sent, and the median round's GB/s.

Run: `.venv/bin/python -m bench.policy_demote_batch [--sizes ...] [--mib N] [--rounds N]`;
writes `--out`.json and .md (default bench/results/policy_demote_batch).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Final

from bench.ssd_tier import _cpu_s, _save, extent_of
from kvfabric.cluster.directory_router import DirectoryRouter
from kvfabric.core.eviction import EvictBatch, EvictionConfig, EvictionCore
from kvfabric.eviction_policy import shell, tiers
from kvfabric.eviction_policy.shell import EvictionShell
from kvfabric.format.ids import ObjectKey, group_id_in_key, pack_group_key
from kvfabric.format.key import ChunkGroupId
from kvfabric.segment_storage.ssd import aligned_buffer
from kvfabric.testing import NatsServer
from kvfabric.testing.clientkit import client
from kvfabric.testing.cluster import directory_process, segment_process

MiB: Final = 1 << 20
DEMOTE_TIMEOUT_S: Final = 120.0
RESULTS: Final = Path(__file__).resolve().parent / "results"
MODES: Final = ("A", "B")


async def demote_with_policy(
    nc: Any, segment_id: str, size: int, victims: list[tuple[bytes, int, int]], groups_max: int
) -> int:
    """The policy's demotion of these one-object groups (all of them one watermark batch of the
    segment's arena pool), `groups_max` groups per request at most: the demote requests sent."""
    core = EvictionCore(
        EvictionConfig(policy="lru", high_watermark=0.5, low_watermark=0.0001, batch_max=len(victims) + 1)
    )
    sh = EvictionShell(
        core, tick_ms=10, segments_refresh_ms=1000, request_timeout_s=10.0, demote_timeout_s=DEMOTE_TIMEOUT_S
    )
    sh._nc = nc
    sh._router = DirectoryRouter(nc)
    sh._set_capacity(segment_id, len(victims) * size)
    for i, (key, _, _) in enumerate(victims):
        group_id = group_id_in_key(ObjectKey(key))
        group = ChunkGroupId.from_bytes(group_id)
        chain = pack_group_key(group.domain_digest, group.chain_hash)
        pools = {segment_id: size}
        core.insert(
            chain,
            tenant=group.domain_digest,
            pools=pools,
            parent=None,
            chunk_index=group.chunk_index,
            now_ms=i,
        )
        sh._group_ids[chain] = group_id
        sh._held[chain] = (group.domain_digest, group.chunk_index, dict(pools), 0)
    chains = [
        v
        for b in core.tick(len(victims))
        if isinstance(b, EvictBatch)
        for v in b.victims
        if isinstance(v, bytes)
    ]
    if len(chains) != len(victims):
        raise RuntimeError(f"{len(chains)} victims of {len(victims)}")
    sent = 0
    real_request = vars(shell)["nats_request"]

    async def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal sent
        sent += 1
        return await real_request(*args, **kwargs)

    saved_max = tiers.DEMOTE_REQUEST_GROUPS_MAX
    setattr(shell, "nats_request", counted)  # noqa: B010
    setattr(tiers, "DEMOTE_REQUEST_GROUPS_MAX", groups_max)  # noqa: B010
    try:
        handled = await sh._demote_groups(segment_id, chains)
    finally:
        setattr(shell, "nats_request", real_request)  # noqa: B010
        setattr(tiers, "DEMOTE_REQUEST_GROUPS_MAX", saved_max)  # noqa: B010
    if len(handled) != len(chains) or sh.demotions != {"demoted": len(chains)}:
        raise RuntimeError(f"demotion on {segment_id}: {sh.demotions}")
    return sent


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import nats

    sizes = [int(s) for s in args.sizes.split(",")]
    counts = {s: max(8, args.mib * MiB // s) for s in sizes}
    one_set = sum(extent_of(s) * counts[s] for s in sizes)
    arena = 4 * one_set + 64 * MiB
    ssd_bytes = 2 * one_set * (args.rounds + 1) + 64 * MiB
    source_buf = aligned_buffer(max(sizes))
    source_buf[:] = os.urandom(len(source_buf))
    source = memoryview(source_buf)
    gbps: dict[str, dict[int, list[float]]] = {k: {s: [] for s in sizes} for k in MODES}
    # per mode and size: CPU seconds of (directory, segment, this process) and GB demoted
    cpu_s: dict[str, dict[int, list[float]]] = {k: {s: [0.0] * 4 for s in sizes} for k in MODES}
    requests: dict[str, dict[int, int]] = {k: dict.fromkeys(sizes, 0) for k in MODES}
    args.dir.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        base = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="run-", dir=args.dir)))
        nats_server = stack.enter_context(NatsServer(base))
        directory = stack.enter_context(directory_process(nats_server, KVF_LOG_LEVEL="info"))
        segment_id = f"bench-pdb-{os.getpid()}"
        segment = stack.enter_context(
            segment_process(
                nats_server,
                segment_id,
                arena,
                KVF_SEGMENT_SSD_PATH=str(base / "ssd"),
                KVF_SEGMENT_SSD_BYTES=str(ssd_bytes),
                KVF_SEGMENT_SSD_DIRECT=str(args.direct),
                KVF_SEGMENT_SCRUB_BYTES_PER_S="0",
                KVF_LOG_LEVEL="info",
            )
        )
        kv = stack.enter_context(client(nats_server))
        nc = await nats.connect(nats_server.url)
        pids = (directory.pid or 0, segment.pid or 0)
        try:
            seed = iter(range(1, 1 << 30))
            for rnd in range(args.rounds):
                for s in sizes:
                    n = counts[s]
                    victims = {k: await _save(kv, s, n, next(seed), source) for k in MODES}
                    for mode in MODES if rnd % 2 == 0 else MODES[::-1]:
                        groups_max = 1 if mode == "A" else tiers.DEMOTE_REQUEST_GROUPS_MAX
                        cpu0 = [*(_cpu_s(pid) for pid in pids), time.process_time()]
                        t0 = time.perf_counter()
                        requests[mode][s] += await demote_with_policy(
                            nc, segment_id, s, victims[mode], groups_max
                        )
                        seconds = time.perf_counter() - t0
                        cpu1 = [*(_cpu_s(pid) for pid in pids), time.process_time()]
                        for k in range(3):
                            cpu_s[mode][s][k] += cpu1[k] - cpu0[k]
                        cpu_s[mode][s][3] += n * s / 1e9
                        gbps[mode][s].append(n * s / seconds / 1e9)
                print(f"round {rnd + 1}/{args.rounds} done", flush=True)
        finally:
            await nc.close()
    return {
        "sizes": sizes,
        "counts": counts,
        "requests": requests,
        "gbps_median": {k: {s: statistics.median(v[s]) for s in sizes} for k, v in gbps.items()},
        "gbps": gbps,
        # per mode and size: (directory, segment, policy process) CPU seconds per GB demoted
        "cpu_s_per_gb": {
            k: {s: (c[0] / c[3], c[1] / c[3], c[2] / c[3]) for s, c in v.items()} for k, v in cpu_s.items()
        },
    }


def markdown(result: dict[str, Any]) -> str:
    meta, sizes = result["meta"], result["sizes"]

    def size(s: int) -> str:
        return f"{s // MiB} MiB" if s >= MiB else f"{s // 1024} KiB"

    per_round = ", ".join(f"{result['counts'][s]} of {size(s)}" for s in sizes)
    out = [
        "# The policy's demote requests: one group each (A) vs several (B), one run"
        " (bench/policy_demote_batch.py)",
        "",
        f"{meta['date']}, `{meta['command']}`; {meta['machine']}, {meta['cpus']} CPUs,"
        f" {meta['elapsed_s']:.0f} s, load average at the end {meta['loadavg'][0]:.1f}."
        f" One-object groups, {per_round} per mode and round.",
        "",
        "| | " + " | ".join(size(s) for s in sizes) + " |",
        "|---|" + "---:|" * len(sizes),
    ]
    for mode in MODES:
        cells = " | ".join(str(result["requests"][mode][s]) for s in sizes)
        out.append(f"| {mode}: demote requests, all rounds | {cells} |")
    for mode in MODES:
        cells = " | ".join("{:.2f} / {:.2f} / {:.2f}".format(*result["cpu_s_per_gb"][mode][s]) for s in sizes)
        out.append(f"| {mode}: CPU s per GB demoted, directory / segment / policy | {cells} |")
    for mode in MODES:
        cells = " | ".join(f"{result['gbps_median'][mode][s]:.3f}" for s in sizes)
        out.append(f"| {mode}: GB/s (median round) | {cells} |")
    return "\n".join(out) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dir", type=Path, default=Path(".data/bench-policy-demote-batch"))
    parser.add_argument("--out", type=Path, default=RESULTS / "policy_demote_batch")
    parser.add_argument("--sizes", default=f"{256 * 1024},{MiB}")
    parser.add_argument("--mib", type=int, default=16, help="MiB per size, round and mode")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--direct", type=int, choices=(0, 1), default=1)
    args = parser.parse_args()
    started = time.perf_counter()
    result = asyncio.run(run(args))
    result["meta"] = {
        "date": time.strftime("%Y-%m-%d"),
        "command": f"python -m bench.policy_demote_batch --sizes {args.sizes} --mib {args.mib}"
        f" --rounds {args.rounds} --direct {args.direct}",
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "elapsed_s": time.perf_counter() - started,
        "loadavg": os.getloadavg(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps(result, indent=1, default=str))
    Path(f"{args.out}.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
