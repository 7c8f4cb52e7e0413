"""When the pieces of one object's disk read land (issue 23, the one-object SSD get): the ways a
segment could read an object of `size` bytes so that it can send a first part early, timed on one
`O_DIRECT` file of the disk the tier uses, one object at a time, modes interleaved per object.

- `whole`: one `preadv` of the object (the raw row of `bench.ssd_get_ab`; the segment's default).
- `together`: `--pieces` pieces queued on threads at once (the I/O engine's way for an object of
  several chunks).
- `head_then_rest`: a head of 1/`--pieces` read by the caller, then the rest in one read on the same
  thread (`KVF_SEGMENT_SSD_STREAM_HEAD_DIVISOR`: the head is sent between the two reads).
- `head_then_queue`: the head read by the caller, then the rest queued on a thread.

Per mode, the median time from the start until each piece has landed (ms). An early first piece
with an unchanged last one is what a pipelined send could use; a first piece landing with the
others is not.

Run: `.venv/bin/python -m bench.ssd_read_order [--sizes ...] [--pieces N] [--objects N]`; writes
`--out`.json and .md (default bench/results/ssd_read_order).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import mmap
import os
import platform
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

MiB: Final = 1 << 20
BLOCK: Final = 4096
FILE_BYTES: Final = 256 * MiB
RESULTS: Final = Path(__file__).resolve().parent / "results"


def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = [int(s) for s in args.sizes.split(",")]
    args.dir.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="order-", dir=args.dir) as tmp:
        path = Path(tmp) / "data.bin"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            chunk = os.urandom(8 * MiB)
            for offset in range(0, FILE_BYTES, len(chunk)):
                os.pwrite(fd, chunk, offset)
            os.fsync(fd)
        finally:
            os.close(fd)
        dfd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        buf = mmap.mmap(-1, max(sizes))
        view = memoryview(buf)
        pool = cf.ThreadPoolExecutor(args.pieces)
        try:

            def read(start: int, end: int, at: int, t0: float) -> float:
                os.preadv(dfd, [view[start:end]], at + start)
                return (time.perf_counter() - t0) * 1e3

            def modes(size: int) -> dict[str, Callable[[int, float], list[float]]]:
                head = max(BLOCK, size // args.pieces // BLOCK * BLOCK)
                part = size // args.pieces

                def whole(at: int, t0: float) -> list[float]:
                    return [read(0, size, at, t0)]

                def together(at: int, t0: float) -> list[float]:
                    spans = [
                        (i * part, size if i == args.pieces - 1 else (i + 1) * part)
                        for i in range(args.pieces)
                    ]
                    futures = [pool.submit(read, s, e, at, t0) for s, e in spans]
                    return [f.result() for f in futures]

                def head_then_rest(at: int, t0: float) -> list[float]:
                    return [read(0, head, at, t0), read(head, size, at, t0)]

                def head_then_queue(at: int, t0: float) -> list[float]:
                    first = read(0, head, at, t0)
                    return [first, pool.submit(read, head, size, at, t0).result()]

                return {
                    "whole": whole,
                    "together": together,
                    "head_then_rest": head_then_rest,
                    "head_then_queue": head_then_queue,
                }

            rng = random.Random(1)
            for size in sizes:
                got: dict[str, list[list[float]]] = {name: [] for name in modes(size)}
                for _ in range(args.objects):
                    for name, mode in modes(size).items():
                        at = rng.randrange(0, (FILE_BYTES - size) // BLOCK) * BLOCK
                        got[name].append(mode(at, time.perf_counter()))
                out[str(size)] = {
                    name: [statistics.median(t[i] for t in times) for i in range(len(times[0]))]
                    for name, times in got.items()
                }
        finally:
            pool.shutdown()
            view.release()
            buf.close()
            os.close(dfd)
    return {"sizes": sizes, "pieces": args.pieces, "objects": args.objects, "landed_ms": out}


def markdown(result: dict[str, Any]) -> str:
    meta = result["meta"]
    lines = [
        "# When a disk read's pieces land (bench/ssd_read_order.py)",
        "",
        f"{meta['date']}, `{meta['command']}`; {meta['machine']}, {meta['cpus']} CPUs, load average"
        f" at the end {meta['loadavg'][0]:.1f}. Median ms from the start until each piece landed,"
        f" {result['objects']} objects per mode and size, modes interleaved.",
        "",
        "| size | mode | pieces landed (ms) |",
        "|---|---|---|",
    ]
    for size in result["sizes"]:
        for name, landed in result["landed_ms"][str(size)].items():
            cells = ", ".join(f"{t:.3f}" for t in landed)
            lines.append(f"| {size // 1024} KiB | {name} | {cells} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default=f"{256 * 1024},{MiB},{4 * MiB}")
    parser.add_argument("--pieces", type=int, default=4)
    parser.add_argument("--objects", type=int, default=100)
    parser.add_argument("--dir", type=Path, default=Path(".data/bench-ssd-read-order"))
    parser.add_argument("--out", type=Path, default=RESULTS / "ssd_read_order")
    args = parser.parse_args()
    result = run(args)
    result["meta"] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": f"python -m bench.ssd_read_order --sizes {args.sizes} --pieces {args.pieces}"
        f" --objects {args.objects}",
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "loadavg": os.getloadavg(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps(result, indent=1))
    Path(f"{args.out}.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
