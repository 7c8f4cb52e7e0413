"""The disk tier's I/O choices on this machine's disk, in one run (issue 23, step 1).

What is measured, per object size, each row against the same file system and disk:

- **raw**: one `os.pwrite` of the whole object + `fdatasync` (write), one `os.pread` of it
  (read): the file's own throughput, the ceiling the tier is compared with.
- **engine**: the tier's I/O engine (`SsdIo`): the object in 1 MiB pieces, `os.pwritev` /
  `os.preadv`, on the calling thread (`t0`) or a pool of 4 threads (`t4`), + `fdatasync`.
- **tier**: the whole disk tier (`SsdTier.write`: data, sync, commit record, sync; `SsdTier.read`:
  read reference, read into a private buffer, XXH3-128 check).

each **buffered** (page cache; reads made cold by `posix_fadvise(DONTNEED)` before each round)
and **direct** (`O_DIRECT`: no page cache; memory, offsets and lengths 4 KiB-aligned), with 1
and 4 concurrent callers (threads of this process; 4 callers share syncs in the tier,
`GroupSync`). Objects rotate over a working set (`--set-mib`, 1 GiB) so reads do not come from a
disk cache. Every file is written once over its whole working set before the rounds, so rows
measure overwrites of allocated space (the tier's steady state); `raw fresh` writes a newly
fallocated file (unwritten extents: the file system converts them on the first write).

GB/s = 1e9 bytes / s; each point moves `--mib` MiB (at least 8 objects), in `--rounds` rounds
interleaved across rows (a slow spell of the shared machine hits every row alike); the median
round is reported. p50/p99 per object over all rounds.

Run: `.venv/bin/python -m bench.ssd_io [--dir DIR]` from the repository root (DIR: a folder on
the disk to measure, default `.data/bench`; the file is removed at the end). Writes
bench/results/ssd_io.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from kvfabric.format.checksum import checksum
from kvfabric.segment_storage.ssd import SsdIo, SsdTier, aligned_buffer

RESULTS: Final = Path(__file__).resolve().parent / "results"
MiB: Final = 1 << 20
SIZES: Final = (256 << 10, 1 << 20, 4 << 20, 16 << 20)


@dataclass
class Point:
    row: str
    size: int
    callers: int
    rounds_gbps: list[float] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies_s)
        return {
            "row": self.row,
            "size": self.size,
            "callers": self.callers,
            "gbps": statistics.median(self.rounds_gbps) if self.rounds_gbps else None,
            "rounds_gbps": self.rounds_gbps,
            "p50_ms": lat[len(lat) // 2] * 1e3 if lat else None,
            "p99_ms": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3 if lat else None,
        }


def run_callers(callers: int, count: int, op: Callable[[int], None], latencies: list[float]) -> float:
    """`count` ops split over `callers` threads; op(i) for i in range(count). Returns seconds."""
    next_i = iter(range(count))
    lock = threading.Lock()
    start = threading.Barrier(callers + 1)

    def worker() -> None:
        start.wait()
        while True:
            with lock:
                i = next(next_i, None)
            if i is None:
                return
            t = time.perf_counter()
            op(i)
            elapsed = time.perf_counter() - t
            with lock:
                latencies.append(elapsed)

    threads = [threading.Thread(target=worker) for _ in range(callers)]
    for th in threads:
        th.start()
    start.wait()
    t0 = time.perf_counter()
    for th in threads:
        th.join()
    return time.perf_counter() - t0


class RawFile:
    """A preallocated file of `set_bytes`, written and read in object-sized slots."""

    def __init__(self, path: Path, set_bytes: int, direct: bool) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.posix_fallocate(self.fd, 0, set_bytes)
        self.dfd = os.open(path, os.O_RDWR | os.O_DIRECT) if direct else self.fd
        self.direct = direct

    def close(self) -> None:
        if self.dfd != self.fd:
            os.close(self.dfd)
        os.close(self.fd)
        self.path.unlink(missing_ok=True)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dir", type=Path, default=Path(".data/bench"))
    parser.add_argument("--mib", type=int, default=128, help="MiB moved per point and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--set-mib", type=int, default=256, help="working set per size and mode")
    parser.add_argument("--sizes", default=",".join(str(s) for s in SIZES))
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    sizes = [int(s) for s in args.sizes.split(",")]
    set_bytes = args.set_mib * MiB
    points: dict[tuple[str, int, int], Point] = {}
    source = aligned_buffer(max(sizes))
    source[:] = os.urandom(len(source))
    digests = {size: checksum(memoryview(source)[:size]) for size in sizes}

    benches = [
        Bench(args.dir, size, direct, set_bytes, source, digests[size])
        for size in sizes
        for direct in (False, True)
    ]
    try:
        for rnd in range(args.rounds):
            for b in benches:
                count = max(8, args.mib * MiB // b.size)
                for callers in (1, 4):
                    b.round(points, count, callers)
            print(f"round {rnd + 1}/{args.rounds} done", flush=True)
    finally:
        for b in benches:
            b.close()

    rows = [p.summary() for p in points.values()]
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "command": "python -m bench.ssd_io "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "dir": str(args.dir.resolve()),
        "filesystem": _fs_of(args.dir),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ssd_io.json").write_text(json.dumps({"meta": meta, "points": rows}, indent=1))
    (RESULTS / "ssd_io.md").write_text(_markdown(meta, rows, sizes))
    print((RESULTS / "ssd_io.md").read_text())
    return 0


def _fs_of(path: Path) -> str:
    best = ("", "")
    with open("/proc/mounts") as f:
        for line in f:
            dev, mount, fs, *_ = line.split()
            if str(path.resolve()).startswith(mount) and len(mount) > len(best[0]):
                best = (mount, f"{fs} on {dev}")
    return best[1]


def _point(points: dict[tuple[str, int, int], Point], row: str, size: int, callers: int) -> Point:
    return points.setdefault((row, size, callers), Point(row, size, callers))


def _drop_cache(fd: int) -> None:
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


class Bench:
    """One object size and I/O mode: a raw file and two tiers (engine on the caller / 4 threads),
    each written once over its whole working set first, so rounds measure overwrites of
    allocated space (the tier's steady state); `fresh` rows write a newly fallocated file."""

    def __init__(
        self, base: Path, size: int, direct: bool, set_bytes: int, source: Any, digest: bytes
    ) -> None:
        self.size, self.direct, self.digest = size, direct, digest
        self.mode = "direct" if direct else "buffered"
        self.extent = -(-size // 4096) * 4096
        self.slots = max(16, set_bytes // self.extent)
        self.src = memoryview(source)[: self.extent]
        self.base = base / f"{size}-{self.mode}"
        self.base.mkdir(parents=True, exist_ok=True)
        self.raw = RawFile(self.base / "raw.bin", self.slots * self.extent, direct)
        self.ios = {t: SsdIo(t, 4096, MiB) for t in (0, 4)}
        for i in range(self.slots):  # prefill: every extent written once
            os.pwrite(self.raw.dfd, self.src, i * self.extent)
        os.fdatasync(self.raw.fd)
        self.tiers: dict[int, SsdTier] = {}
        self.held: dict[int, list[tuple[int, int]]] = {}
        for t in (0, 4):
            tier_dir = self.base / f"tier{t}"
            tier_dir.mkdir(exist_ok=True)
            (tier_dir / "kvf-bench.ssd").unlink(missing_ok=True)
            tier = SsdTier(
                tier_dir,
                "bench",
                self.slots * self.extent,
                self.slots,
                direct=direct,
                io=self.ios[t],
                read_bytes_max=1 << 34,
            )
            self.tiers[t] = tier
            self.held[t] = [tier.write(self.src[:size], b"k", digest) for _ in range(self.slots)]

    def close(self) -> None:
        for tier in self.tiers.values():
            tier.close()
            tier.path.unlink(missing_ok=True)
        for io in self.ios.values():
            io.close()
        self.raw.close()
        shutil.rmtree(self.base, ignore_errors=True)

    def round(self, points: dict[tuple[str, int, int], Point], count: int, callers: int) -> None:
        size, extent, slots, raw = self.size, self.extent, self.slots, self.raw
        view = self.src if self.direct else self.src[:size]
        count = min(count, slots - 1)
        # fresh: a new fallocated file of `count` extents
        fresh = RawFile(self.base / "fresh.bin", count * extent, self.direct)
        try:

            def fresh_write(i: int) -> None:
                os.pwrite(fresh.dfd, view, i * extent)
                os.fdatasync(fresh.dfd)

            self._measure(points, f"raw fresh {self.mode} write", callers, count, fresh_write)
        finally:
            fresh.close()
        for engine in (None, 0, 4):
            io = None if engine is None else self.ios[engine]
            name = "raw" if io is None else f"engine t{engine}"

            def write(i: int, io: SsdIo | None = io) -> None:
                if io is None:
                    assert os.pwrite(raw.dfd, view, (i % slots) * extent) == len(view)
                else:
                    io.pwrite(raw.dfd, view, (i % slots) * extent)
                os.fdatasync(raw.dfd)

            def read(i: int, io: SsdIo | None = io) -> None:
                buf = aligned_buffer(extent)
                with memoryview(buf) as dest:
                    if io is None:
                        assert os.preadv(raw.dfd, [dest[: len(view)]], (i % slots) * extent) >= size
                    else:
                        io.pread(raw.dfd, dest[: len(view)], (i % slots) * extent)

            self._measure(points, f"{name} {self.mode} write", callers, count, write)
            _drop_cache(raw.fd)
            self._measure(points, f"{name} {self.mode} read", callers, count, read)
        for engine, tier in self.tiers.items():
            held, lock = self.held[engine], threading.Lock()
            tier.free_many(held[:count])  # room for this round's writes (not timed)
            del held[:count]

            def tier_write(
                i: int,
                tier: SsdTier = tier,
                held: list[tuple[int, int]] = held,
                lock: threading.Lock = lock,
            ) -> None:
                slot_gen = tier.write(self.src[:size], b"k", self.digest)
                with lock:
                    held.append(slot_gen)

            def tier_read(i: int, tier: SsdTier = tier, held: list[tuple[int, int]] = held) -> None:
                slot, generation = held[i % len(held)]
                result = tier.read(slot, generation, size)
                assert result.status == "ok", result.status
                result.release()

            self._measure(points, f"tier t{engine} {self.mode} write", callers, count, tier_write)
            _drop_cache(tier._fd)
            self._measure(points, f"tier t{engine} {self.mode} read", callers, count, tier_read)

    def _measure(
        self,
        points: dict[tuple[str, int, int], Point],
        row: str,
        callers: int,
        count: int,
        op: Callable[[int], None],
    ) -> None:
        p = _point(points, row, self.size, callers)
        seconds = run_callers(callers, count, op, p.latencies_s)
        p.rounds_gbps.append(count * self.size / seconds / 1e9)


def _markdown(meta: dict[str, Any], rows: list[dict[str, Any]], sizes: list[int]) -> str:
    out = [
        "# Disk tier I/O (bench/ssd_io.py)",
        "",
        f"{meta['date']}, `{meta['command']}`, {meta['machine']}, {meta['cpus']} CPUs, "
        f"{meta['filesystem']}. GB/s (1e9 B/s), median round; 1 caller / 4 callers.",
        "",
        "| row | " + " | ".join(f"{s >> 10} KiB" for s in sizes) + " |",
        "|---|" + "---:|" * len(sizes),
    ]
    by = {(r["row"], r["size"], r["callers"]): r for r in rows}
    for row in sorted({r["row"] for r in rows}, key=_row_order):
        cells = []
        for s in sizes:
            one, four = by.get((row, s, 1)), by.get((row, s, 4))
            cells.append(
                f"{one['gbps']:.2f} / {four['gbps']:.2f}"
                if one and four and one["gbps"] and four["gbps"]
                else "-"
            )
        out.append(f"| {row} | " + " | ".join(cells) + " |")
    out += [
        "",
        "p50 / p99 ms per object, 1 caller:",
        "",
        "| row | " + " | ".join(f"{s >> 10} KiB" for s in sizes) + " |",
    ]
    out.append("|---|" + "---:|" * len(sizes))
    for row in sorted({r["row"] for r in rows}, key=_row_order):
        cells = []
        for s in sizes:
            one = by.get((row, s, 1))
            cells.append(
                f"{one['p50_ms']:.2f} / {one['p99_ms']:.2f}" if one and one["p50_ms"] is not None else "-"
            )
        out.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def _row_order(row: str) -> tuple[int, str, str]:
    op = row.rsplit(" ", 1)[-1]
    return (0 if op == "write" else 1, "1" if "direct" in row else "0", row)


if __name__ == "__main__":
    raise SystemExit(main())
