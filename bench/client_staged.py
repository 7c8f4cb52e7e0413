"""Co-located writes, staged vs sent (issue 20): the client's write path (`SegmentPool.store`, what
`KvClient.save` runs for each replica) to a segment on this host, through a staging file
(`kvfabric.dataplane.staging`) and over TCP loopback, side by side, below the directory.

- Segment: `bench.dataplane_server.segment_main` (its own process: an arena in /dev/shm,
  pre-faulted, `ArenaBackend` with a confirm stub answering "ok", `TcpDataServer`): no NATS and no
  directory, so what is left is the bytes' way into the arena (a save adds put_begin, the
  segment's confirm and put_commit: docs/engines.md).
- Per size and round: one "prompt" of 8 objects written at once from 8 threads (as a save's
  writes are), by a pool that stages (`use_shm=True`) and by one that sends (`use_shm=False`),
  in alternating order; the slots are freed after each round. GB/s = 8 × size / wall time of the
  prompt, median over rounds; every write must answer "ok" (the segment verifies each object's
  checksum against its ticket before it does).

Run: `.venv/bin/python -m bench.client_staged` (writes bench/results/client_staged.{json,md}).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final

from bench.client import RESULTS, loadavg
from bench.dataplane import fmt, machine, size_label
from bench.dataplane_server import segment_main
from kvfabric.client.transfers import SegmentPool
from kvfabric.dataplane import tcp as dtcp
from kvfabric.format.checksum import checksum
from kvfabric.format.ids import ObjectKey
from kvfabric.proto.directory import WriteTicket
from kvfabric.proto.tickets import sign_ticket

SIZES: Final = (256 << 10, 1 << 20, 4 << 20, 16 << 20)
OBJECTS: Final = 8
ARENA_BYTES: Final = 1 << 30
SECRET: Final = os.urandom(32)
SEGMENT_ID: Final = "bench0"  # bench.dataplane_server's

written: list[tuple[int, int]] = []  # (slot, generation) of every write, to free after a round
_put = dtcp.TcpDataClient.put


def _recording_put(self: dtcp.TcpDataClient, *args: Any, **kw: Any) -> Any:
    reply = _put(self, *args, **kw)
    written.append((reply.slot, reply.slot_generation))
    return reply


dtcp.TcpDataClient.put = _recording_put  # type: ignore[method-assign]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--sizes", default=",".join(str(s) for s in SIZES))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--stem", default="client_staged")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=segment_main, args=(child, ARENA_BYTES, SECRET, False))
    proc.start()
    info = parent.recv()
    addr = f"tcp://{info.host}:{info.tcp_port}"
    started, load_start = time.monotonic(), loadavg()
    pools = {
        "staged": SegmentPool(connections_per_segment_max=OBJECTS, timeout_s=30, use_shm=True),
        "sent": SegmentPool(connections_per_segment_max=OBJECTS, timeout_s=30, use_shm=False),
    }
    threads = ThreadPoolExecutor(OBJECTS)
    points: dict[str, dict[str, Any]] = {}
    try:
        for size in sizes:
            blobs = [memoryview(os.urandom(size)) for _ in range(OBJECTS)]
            tickets = [
                sign_ticket(
                    WriteTicket(
                        ticket_id=i,
                        key=ObjectKey(b"k%d" % i),
                        segment_id=SEGMENT_ID,
                        incarnation=info.incarnation,
                        size_bytes=size,
                        checksum=checksum(blob),
                        writer_id="bench",
                        deadline_ms=int(time.time() * 1000) + 3_600_000,
                        epoch=1,
                        data_addr=addr,
                    ),
                    SECRET,
                )
                for i, blob in enumerate(blobs)
            ]
            runs: dict[str, list[float]] = {mode: [] for mode in pools}
            for r in range(args.rounds + 1):  # the first round warms the connections up
                for mode in list(pools) if r % 2 == 0 else list(pools)[::-1]:
                    pool = pools[mode]
                    t0 = time.perf_counter()
                    causes = list(threads.map(pool.store, tickets, blobs))
                    elapsed = time.perf_counter() - t0
                    if causes != ["ok"] * OBJECTS:
                        raise RuntimeError(f"{mode} {size_label(size)}: {causes}")
                    if r:
                        runs[mode].append(OBJECTS * size / elapsed / 1e9)
                    parent.send(("free", list(written)))
                    parent.recv()
                    written.clear()
            for mode, values in runs.items():
                points[f"{mode}:{size}"] = {
                    "mode": mode,
                    "size": size,
                    "gbps": round(statistics.median(values), 3),
                    "runs": [round(v, 3) for v in values],
                }
            print(
                f"{size_label(size)}: staged {points[f'staged:{size}']['gbps']:.2f} GB/s, "
                f"sent {points[f'sent:{size}']['gbps']:.2f} GB/s",
                flush=True,
            )
        staged_puts = pools["staged"].staged_puts
        if pools["sent"].staged_puts or not staged_puts:
            raise RuntimeError("the staged pool did not stage, or the sent one did")
    finally:
        for pool in pools.values():
            pool.close()
        threads.shutdown()
        parent.send(("stop",))
        proc.join(30)
    m = machine()
    result = {
        "bench": "client_staged",
        "date": time.strftime("%Y-%m-%d"),
        "command": "python -m bench.client_staged " + " ".join(sys.argv[1:]),
        "machine": m,
        "loadavg_start": load_start,
        "loadavg_end": loadavg(),
        "rounds": args.rounds,
        "staged_puts": staged_puts,
        "points": points,
        "elapsed_s": round(time.monotonic() - started, 1),
    }
    lines = [
        f"### Co-located writes, staged vs sent ({result['date']}; {m['cpu']}, {m['cores']} cores, "
        f"Python {m['python']})",
        "",
        f"`{result['command']}`, {result['elapsed_s']:.0f} s; load average at start / end "
        f"{result['loadavg_start']} / {result['loadavg_end']} (a shared machine). `SegmentPool.store` of "
        f"{OBJECTS} objects at once (8 threads) to a segment process on this host (no directory: its "
        f"confirm is a stub), through a staging file and over TCP loopback, rounds alternating; GB/s = "
        f"1e9 B/s, median of {args.rounds} rounds; every write verified by the segment.",
        "",
        "| size | staged GB/s | sent GB/s | staged ÷ sent |",
        "|---:|---:|---:|---:|",
    ]
    for size in sizes:
        a, b = points[f"staged:{size}"]["gbps"], points[f"sent:{size}"]["gbps"]
        lines.append(f"| {size_label(size)} | {fmt(a)} | {fmt(b)} | {fmt(a / b if b else None)} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{args.stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
