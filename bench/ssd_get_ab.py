"""SSD get A/B in one run (issue 23): two clusters side by side, each a NATS, a directory and a
segment with a disk tier, segment A running the segment code found under `--a-src` (a copy of
`services/segment_storage/src` of an older commit: `git archive <commit>
services/segment_storage/src | tar -x -C DIR`; default: this tree's), segment B this tree's
(or `--b-src`); `--a-env` / `--b-env KEY=VALUE,...` add settings to one segment's environment
(a switch: `--b-env KVF_SEGMENT_SSD_STREAM_HEAD_DIVISOR=4` reads a one-object get head first).
Segment B comes out ahead of A on this VM whatever it runs (docs/ssd-tier.md, 2026-12-02 11:10):
run both orders and take the geometric mean.

Per size, n objects are saved into each cluster by a client and demoted to its segment's disk
(`demote.<segment>`); then, per round, object by object, a raw read (`os.preadv` of the object
from a preallocated file on the same disk, the `O_DIRECT` choice of the segments), A's SSD get and
B's SSD get of that object, in an order that rotates per object (`TcpDataClient.get_hashed`, one
object a request, streamed: the verdict after the bytes, as `bench.ssd_tier`'s "SSD get" row);
then the same with `GET_BATCH` objects a request (a prefix's chunks) next to raw reads of the same
objects. In the same rotation, a DRAM get (arena objects of the same size, saved and not
demoted; from segment A and B in turn, so that neither is warmed by it more often): an SSD get
cannot beat it, so min(raw, DRAM get) / raw is the overlapped bound (disk read and send fully
overlapped) and 1 / (1/raw + 1/DRAM get) / raw the read-then-send one.
Each row's round is its own seconds summed; a ratio is a row's GB/s over the raw read's
of the same round, the median over rounds. The segments' CPU seconds per GB served beside them.

Run: `.venv/bin/python -m bench.ssd_get_ab --a-src DIR [--sizes ...] [--rounds N]`; writes
`--out`.json and .md (default bench/results/ssd_get_ab).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Final

from bench.ssd_tier import GET_BATCH, TOKEN_TTL_MS, RawFile, _cpu_s, _save, extent_of
from kvfabric.cluster.requests import request
from kvfabric.dataplane.tcp import TcpDataClient
from kvfabric.format.checksum import checksum
from kvfabric.format.ids import ObjectKey
from kvfabric.proto.dataplane import ReadRef
from kvfabric.proto.segment import DEMOTE_BATCH_MAX, DemoteObject, DemoteReply, DemoteRequest, segment_decoder
from kvfabric.proto.subjects import segment_subject
from kvfabric.segment_storage.ssd import aligned_buffer
from kvfabric.testing import NatsServer
from kvfabric.testing.clientkit import client
from kvfabric.testing.cluster import directory_process, segment_process, signed_ref

MiB: Final = 1 << 20
DEMOTE_TIMEOUT_S: Final = 120.0
RESULTS: Final = Path(__file__).resolve().parent / "results"
ROWS: Final = ("raw", "A", "B", "dram")


async def demote(nc: Any, segment_id: str, objects: list[tuple[bytes, int, int]]) -> list[tuple[int, int]]:
    """`objects` (key, arena slot, generation) onto the segment's disk: their disk (slot, generation)."""
    out: list[tuple[int, int]] = []
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
        out += [(r.slot, r.slot_generation) for r in reply.results]
    return out


def parse_env(text: str) -> dict[str, str]:
    """`KEY=VALUE,KEY=VALUE` (empty: none) as a dict."""
    pairs = [item.split("=", 1) for item in text.split(",") if item]
    if any(len(p) != 2 or not p[0] for p in pairs):
        raise SystemExit(f"bad KEY=VALUE list: {text!r}")
    return {k: v for k, v in pairs}


def rotate(ops: list[tuple[str, Callable[[], None]]], k: int, seconds: dict[str, float]) -> None:
    """Run each op once, starting at op k % len(ops), in the list's order for even k // len(ops)
    and reversed for odd (so each op follows every other as often: which op runs just before
    another biased a row by up to 1.6x on the shared VM); add each one's seconds to its row."""
    order = ops if (k // len(ops)) % 2 == 0 else ops[::-1]
    for j in range(len(order)):
        name, op = order[(k + j) % len(order)]
        t = time.perf_counter()
        op()
        seconds[name] += time.perf_counter() - t


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import nats

    sizes = [int(s) for s in args.sizes.split(",")]
    counts = {s: max(GET_BATCH, args.mib * MiB // s // GET_BATCH * GET_BATCH) for s in sizes}
    stored = sum(extent_of(s) * counts[s] for s in sizes)
    arena, ssd_bytes = 2 * stored + 64 * MiB, stored + 64 * MiB
    source_buf = aligned_buffer(max(sizes))
    source_buf[:] = os.urandom(len(source_buf))
    source = memoryview(source_buf)
    digests = {s: checksum(source[:s]) for s in sizes}
    modes = ("one", "batch")
    gbps: dict[str, dict[str, dict[int, list[float]]]] = {
        mode: {r: {s: [] for s in sizes} for r in ROWS} for mode in modes
    }
    cpu: dict[str, list[float]] = {"A": [0.0, 0.0], "B": [0.0, 0.0]}  # segment CPU s, bytes served
    args.dir.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        base = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="run-", dir=args.dir)))
        refs: dict[str, dict[int, list[ReadRef]]] = {}
        conns: dict[str, TcpDataClient] = {}
        pids: dict[str, int] = {}
        addrs: dict[str, str] = {}
        for name in ("A", "B"):
            store = base / name
            store.mkdir()
            nats_server = stack.enter_context(NatsServer(store))
            stack.enter_context(directory_process(nats_server, KVF_LOG_LEVEL="info"))
            segment_id = f"bench-gab-{name.lower()}-{os.getpid()}"
            src = args.a_src if name == "A" else args.b_src
            env = {"PYTHONPATH": str(src.resolve())} if src is not None else {}
            env |= parse_env(args.a_env if name == "A" else args.b_env)
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
            started = segment.wait_for_event("segment_started", 5.0)
            kv = stack.enter_context(client(nats_server))
            nc = await nats.connect(nats_server.url)
            try:
                refs[name] = {}
                for k, s in enumerate(sizes):
                    saved = await _save(kv, s, counts[s], 1 + k, source)
                    on_disk = await demote(nc, segment_id, saved)
                    refs[name][s] = [
                        signed_ref(segment_id, started["incarnation"], slot, gen, s, TOKEN_TTL_MS)
                        for slot, gen in on_disk
                    ]
                refs[f"dram-{name}"] = {}  # arena objects for the DRAM row, the same sizes and counts
                for k, s in enumerate(sizes):
                    saved = await _save(kv, s, counts[s], 101 + k, source)
                    refs[f"dram-{name}"][s] = [
                        signed_ref(segment_id, started["incarnation"], slot, gen, s, TOKEN_TTL_MS)
                        for _, slot, gen in saved
                    ]
            finally:
                await nc.close()
            addrs[name] = started["data_addr"]
            pids[name] = segment.pid
        raws = {
            s: RawFile(base / f"raw-{s}.bin", extent_of(s), counts[s], bool(args.direct), source)
            for s in sizes
        }
        for raw in raws.values():
            stack.callback(raw.close)
        for name, addr in addrs.items():  # now: a data connection idle while B starts is closed
            conns[name] = stack.enter_context(TcpDataClient.connect(addr))
        for rnd in range(args.rounds):
            for s in sizes:
                n, raw = counts[s], raws[s]
                buf = aligned_buffer(extent_of(s) * GET_BATCH)
                dests = [memoryview(buf)[i * extent_of(s) : i * extent_of(s) + s] for i in range(GET_BATCH)]
                raw_view = memoryview(buf)[: extent_of(s) if args.direct else s]

                def get(name: str, batch: list[ReadRef], s: int = s, dests: list[memoryview] = dests) -> None:
                    got = conns[name.removeprefix("dram-")].get_hashed(batch, dests[: len(batch)])
                    if any(r.status != "ok" or d != digests[s] for r, d in got):
                        raise RuntimeError(f"{name}: get of {len(batch)} {s} B objects: {got[0][0].status}")

                def raw_read(at: int, k: int, raw: RawFile = raw, view: memoryview = raw_view) -> None:
                    for i in range(at, at + k):
                        os.preadv(raw.io_fd, [view], i * raw.extent)

                for mode, step in (("one", 1), ("batch", GET_BATCH)):
                    seconds = dict.fromkeys(ROWS, 0.0)
                    cpu0 = {name: _cpu_s(pid) for name, pid in pids.items()}
                    for k, at in enumerate(range(0, n, step)):
                        dram = f"dram-{'AB'[(k + rnd) % 2]}"
                        ops: list[tuple[str, Callable[[], None]]] = [
                            ("raw", functools.partial(raw_read, at, step)),
                            *(
                                (name, functools.partial(get, name, refs[name][s][at : at + step]))
                                for name in ("A", "B")
                            ),
                            ("dram", functools.partial(get, dram, refs[dram][s][at : at + step])),
                        ]
                        rotate(ops, k + rnd, seconds)
                    for name, pid in pids.items():
                        cpu[name][0] += _cpu_s(pid) - cpu0[name]
                        cpu[name][1] += n * s * 3 // 2  # each serves half the DRAM row too
                    for r in ROWS:
                        gbps[mode][r][s].append(n * s / seconds[r] / 1e9)
            print(f"round {rnd + 1}/{args.rounds} done", flush=True)

    def ratios(mode: str, name: str, s: int) -> list[float]:
        return [g / r for g, r in zip(gbps[mode][name][s], gbps[mode]["raw"][s], strict=True)]

    return {
        "sizes": sizes,
        "counts": counts,
        "gbps_median": {
            mode: {r: {s: statistics.median(v[s]) for s in sizes} for r, v in rows.items()}
            for mode, rows in gbps.items()
        },
        "ratio_median": {
            mode: {
                name: {s: statistics.median(ratios(mode, name, s)) for s in sizes}
                for name in ("A", "B", "dram")
            }
            for mode in modes
        },
        "bound_median": {
            mode: {
                s: {
                    "overlapped": statistics.median(min(1.0, d) for d in ratios(mode, "dram", s)),
                    "read_then_send": statistics.median(1 / (1 + 1 / d) for d in ratios(mode, "dram", s)),
                }
                for s in sizes
            }
            for mode in modes
        },
        "b_over_a_median": {
            mode: {
                s: statistics.median(
                    b / a for a, b in zip(gbps[mode]["A"][s], gbps[mode]["B"][s], strict=True)
                )
                for s in sizes
            }
            for mode in modes
        },
        "gbps": gbps,
        "segment_cpu_s_per_gb": {name: c[0] / (c[1] / 1e9) for name, c in cpu.items()},
    }


def markdown(result: dict[str, Any]) -> str:
    meta, sizes = result["meta"], result["sizes"]

    def size(s: int) -> str:
        return f"{s // MiB} MiB" if s >= MiB else f"{s // 1024} KiB"

    out = [
        "# SSD get A/B in one run (bench/ssd_get_ab.py)",
        "",
        f"{meta['date']}, `{meta['command']}`, A = segment code of `{meta['a_src']}`, B = `{meta['b_src']}`;"
        f" {meta['machine']}, {meta['cpus']} CPUs, {meta['elapsed_s']:.0f} s, load average at the end"
        f" {meta['loadavg'][0]:.1f}. SSD get / raw read of the same objects in the same round, median"
        " over rounds (per-round GB/s in the JSON).",
        "",
        "| | " + " | ".join(size(s) for s in sizes) + " |",
        "|---|" + "---:|" * len(sizes),
    ]
    for mode, label in (("one", "one object a request"), ("batch", f"{GET_BATCH} a request")):
        for name in ("A", "B"):
            cells = " | ".join(f"{result['ratio_median'][mode][name][s]:.2f}" for s in sizes)
            out.append(f"| {name}: SSD get / raw read, {label} | {cells} |")
        cells = " | ".join(f"{result['b_over_a_median'][mode][s]:.2f}" for s in sizes)
        out.append(f"| B / A, {label}, paired per round | {cells} |")
        cells = " | ".join(f"{result['ratio_median'][mode]['dram'][s]:.2f}" for s in sizes)
        out.append(f"| DRAM get / raw read, {label} | {cells} |")
        bounds = result["bound_median"][mode]
        cells = " | ".join(
            f"{bounds[s]['read_then_send']:.2f} / {bounds[s]['overlapped']:.2f}" for s in sizes
        )
        out.append(f"| bound of an SSD get: read then send / overlapped, {label} | {cells} |")
        for name in ROWS:
            cells = " | ".join(f"{result['gbps_median'][mode][name][s]:.3f}" for s in sizes)
            out.append(f"| {name}, GB/s (median round), {label} | {cells} |")
    cpu = result["segment_cpu_s_per_gb"]
    out += [
        "",
        f"Segment CPU s per GB served (all sizes and rounds): A {cpu['A']:.2f}, B {cpu['B']:.2f}"
        " (its SSD gets and half the DRAM gets).",
    ]
    return "\n".join(out) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--a-src", type=Path, default=None, help="PYTHONPATH of segment A (default: this tree)"
    )
    parser.add_argument("--a-env", default="", help="KEY=VALUE,... added to segment A's environment")
    parser.add_argument("--b-env", default="", help="KEY=VALUE,... added to segment B's environment")
    parser.add_argument(
        "--b-src", type=Path, default=None, help="PYTHONPATH of segment B (default: this tree)"
    )
    parser.add_argument("--dir", type=Path, default=Path(".data/bench-ssd-get-ab"))
    parser.add_argument("--out", type=Path, default=RESULTS / "ssd_get_ab")
    parser.add_argument("--sizes", default=f"{256 * 1024},{MiB},{4 * MiB}")
    parser.add_argument("--mib", type=int, default=16, help="MiB per size and segment")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--direct", type=int, choices=(0, 1), default=1)
    args = parser.parse_args()
    started = time.perf_counter()
    result = asyncio.run(run(args))
    result["meta"] = {
        "date": time.strftime("%Y-%m-%d"),
        "command": f"python -m bench.ssd_get_ab{' --a-src A' if args.a_src else ''}"
        f"{f' --a-env {args.a_env}' if args.a_env else ''}{f' --b-env {args.b_env}' if args.b_env else ''}"
        f" --sizes {args.sizes} --mib {args.mib} --rounds {args.rounds} --direct {args.direct}",
        "a_src": f"{args.a_src or 'this tree'}{f' with {args.a_env}' if args.a_env else ''}",
        "b_src": f"{args.b_src or 'this tree'}{f' with {args.b_env}' if args.b_env else ''}",
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
