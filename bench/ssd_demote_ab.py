"""Demotion A/B in one run (issue 23): two clusters side by side, each a NATS, a directory and a
segment with a disk tier, segment A running the segment code found under `--a-src` (a copy of
`services/segment_storage/src` of an older commit: `git archive <commit>
services/segment_storage/src | tar -x -C DIR`), segment B this tree's. Both directories are this
tree's (they answer the older segment's per-object verbs as before).

Per round and object size: n objects saved into each cluster by a client, then, in an order that
alternates per round, `raw write` (`os.pwrite` + `fdatasync` of n objects into a preallocated file
on the same disk, the `O_DIRECT` choice of the segments) before each segment's demotion of its n
objects (`demote.<segment>`, batches of `DEMOTE_BATCH_MAX`). A ratio is demotion GB/s over the raw
write measured just before it, the median over rounds: A and B measured under the same load (the
shared VM's load moves 5x within minutes; figures of different runs do not compare).

Run: `.venv/bin/python -m bench.ssd_demote_ab --a-src DIR [--sizes ...] [--rounds N]`; writes
`--out`.json and .md (default bench/results/ssd_demote_ab).
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

from bench.ssd_tier import RawFile, _cpu_s, _save, extent_of
from kvfabric.cluster.requests import request
from kvfabric.format.ids import ObjectKey
from kvfabric.proto.segment import DEMOTE_BATCH_MAX, DemoteObject, DemoteReply, DemoteRequest, segment_decoder
from kvfabric.proto.subjects import segment_subject
from kvfabric.segment_storage.ssd import aligned_buffer
from kvfabric.testing import NatsServer
from kvfabric.testing.clientkit import client
from kvfabric.testing.cluster import directory_process, segment_process

MiB: Final = 1 << 20
DEMOTE_TIMEOUT_S: Final = 120.0
RESULTS: Final = Path(__file__).resolve().parent / "results"


async def demote(nc: Any, segment_id: str, objects: list[tuple[bytes, int, int]]) -> None:
    for i in range(0, len(objects), DEMOTE_BATCH_MAX):
        batch = [DemoteObject(ObjectKey(k), slot, gen) for k, slot, gen in objects[i : i + DEMOTE_BATCH_MAX]]
        reply = await request(
            nc,
            segment_subject(segment_id, "demote"),
            DemoteRequest(objects=batch),
            segment_decoder,
            DEMOTE_TIMEOUT_S,
        )
        if not isinstance(reply, DemoteReply) or any(r.status != "demoted" for r in reply.results):
            raise RuntimeError(f"demotion on {segment_id}: {reply}")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import nats

    sizes = [int(s) for s in args.sizes.split(",")]
    counts = {s: max(8, args.mib * MiB // s) for s in sizes}
    arena = 2 * sum(extent_of(s) * counts[s] for s in sizes) * 2 + 64 * MiB
    ssd_bytes = sum(extent_of(s) * counts[s] for s in sizes) * (args.rounds + 1) + 64 * MiB
    source_buf = aligned_buffer(max(sizes))
    source_buf[:] = os.urandom(len(source_buf))
    source = memoryview(source_buf)
    ratios: dict[str, dict[int, list[float]]] = {"A": {s: [] for s in sizes}, "B": {s: [] for s in sizes}}
    gbps: dict[str, dict[int, list[float]]] = {k: {s: [] for s in sizes} for k in ("A", "B", "raw")}
    # CPU seconds (user + system) of the directory and the segment process per GB demoted: the
    # work a demotion costs, which the shared machine's load disturbs far less than its wall time.
    cpu_s: dict[str, dict[int, list[float]]] = {k: {s: [0.0, 0.0, 0.0] for s in sizes} for k in ("A", "B")}
    args.dir.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        base = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="run-", dir=args.dir)))
        clusters: dict[str, tuple[str, Any, Any]] = {}
        pids: dict[str, tuple[int, int]] = {}
        for name in ("A", "B"):
            store = base / name
            store.mkdir()
            nats_server = stack.enter_context(NatsServer(store))
            directory = stack.enter_context(directory_process(nats_server, KVF_LOG_LEVEL="info"))
            segment_id = f"bench-dab-{name.lower()}-{os.getpid()}"
            env = {"PYTHONPATH": str(args.a_src.resolve())} if name == "A" else {}
            segment = stack.enter_context(
                segment_process(
                    nats_server,
                    segment_id,
                    arena,
                    KVF_SEGMENT_SSD_PATH=str(store / "ssd"),
                    KVF_SEGMENT_SSD_BYTES=str(ssd_bytes),
                    KVF_SEGMENT_SSD_DIRECT=str(args.direct),
                    KVF_SEGMENT_SCRUB_BYTES_PER_S="0",
                    KVF_LOG_LEVEL="info",
                    **env,
                )
            )
            kv = stack.enter_context(client(nats_server))
            nc = await nats.connect(nats_server.url)
            clusters[name] = (segment_id, kv, nc)
            pids[name] = (directory.pid, segment.pid)
        raws = {
            s: RawFile(base / f"raw-{s}.bin", extent_of(s), counts[s], bool(args.direct), source)
            for s in sizes
        }
        try:
            seed = iter(range(1, 1 << 30))
            for rnd in range(args.rounds):
                for s in sizes:
                    n, raw = counts[s], raws[s]
                    view = source[: extent_of(s)] if args.direct else source[:s]
                    victims = {
                        name: await _save(kv, s, n, next(seed), source)
                        for name, (_, kv, _) in clusters.items()
                    }
                    for name in ("A", "B") if rnd % 2 == 0 else ("B", "A"):
                        t0 = time.perf_counter()
                        for i in range(n):
                            os.pwrite(raw.io_fd, view, i * raw.extent)
                            os.fdatasync(raw.fd)
                        raw_gbps = n * s / (time.perf_counter() - t0) / 1e9
                        segment_id, _, nc = clusters[name]
                        cpu0 = [_cpu_s(pid) for pid in pids[name]]
                        t0 = time.perf_counter()
                        await demote(nc, segment_id, victims[name])
                        got = n * s / (time.perf_counter() - t0) / 1e9
                        for k, pid in enumerate(pids[name]):
                            cpu_s[name][s][k] += _cpu_s(pid) - cpu0[k]
                        cpu_s[name][s][2] += n * s / 1e9
                        gbps["raw"][s].append(raw_gbps)
                        gbps[name][s].append(got)
                        ratios[name][s].append(got / raw_gbps)
                print(f"round {rnd + 1}/{args.rounds} done", flush=True)
        finally:
            for raw in raws.values():
                raw.close()
            for _, _, nc in clusters.values():
                await nc.close()
    return {
        "sizes": sizes,
        "counts": counts,
        "ratio_median": {k: {s: statistics.median(v[s]) for s in sizes} for k, v in ratios.items()},
        "ratios": ratios,
        "gbps_median": {k: {s: statistics.median(v[s]) for s in sizes} for k, v in gbps.items()},
        # per cluster and size: (directory, segment) CPU seconds per GB demoted, all rounds
        "cpu_s_per_gb": {k: {s: (c[0] / c[2], c[1] / c[2]) for s, c in v.items()} for k, v in cpu_s.items()},
    }


def markdown(result: dict[str, Any]) -> str:
    meta, sizes = result["meta"], result["sizes"]

    def size(s: int) -> str:
        return f"{s // MiB} MiB" if s >= MiB else f"{s // 1024} KiB"

    out = [
        "# Demotion A/B in one run (bench/ssd_demote_ab.py)",
        "",
        f"{meta['date']}, `{meta['command']}`, A = segment code of `{meta['a_src']}`, B = this tree;"
        f" {meta['machine']}, {meta['cpus']} CPUs, {meta['elapsed_s']:.0f} s, load average at the end"
        f" {meta['loadavg'][0]:.1f}. Demotion / the raw write just before it, median over rounds"
        " (per-round ratios in the JSON).",
        "",
        "| | " + " | ".join(size(s) for s in sizes) + " |",
        "|---|" + "---:|" * len(sizes),
    ]
    for name, label in (("A", "A: demotion / raw write"), ("B", "B: demotion / raw write")):
        out.append(
            f"| {label} | " + " | ".join(f"{result['ratio_median'][name][s]:.2f}" for s in sizes) + " |"
        )
    for name in ("raw", "A", "B"):
        cells = " | ".join(f"{result['gbps_median'][name][s]:.3f}" for s in sizes)
        out.append(f"| {name}, GB/s (median round) | {cells} |")
    for name in ("A", "B"):
        cells = " | ".join("{:.2f} / {:.2f}".format(*result["cpu_s_per_gb"][name][s]) for s in sizes)
        out.append(f"| {name}: CPU s per GB demoted, directory / segment | {cells} |")
    return "\n".join(out) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--a-src", type=Path, required=True, help="PYTHONPATH of segment A (older segment code)"
    )
    parser.add_argument("--dir", type=Path, default=Path(".data/bench-ssd-demote-ab"))
    parser.add_argument("--out", type=Path, default=RESULTS / "ssd_demote_ab")
    parser.add_argument("--sizes", default=f"{256 * 1024},{MiB},{4 * MiB}")
    parser.add_argument("--mib", type=int, default=16, help="MiB per size, round and segment")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--direct", type=int, choices=(0, 1), default=1)
    args = parser.parse_args()
    started = time.perf_counter()
    result = asyncio.run(run(args))
    result["meta"] = {
        "date": time.strftime("%Y-%m-%d"),
        "command": f"python -m bench.ssd_demote_ab --a-src A --sizes {args.sizes} --mib {args.mib}"
        f" --rounds {args.rounds} --direct {args.direct}",
        "a_src": str(args.a_src),
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
