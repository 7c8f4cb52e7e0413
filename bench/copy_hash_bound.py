"""The machine's bound for a segment's half of a co-located save (issue 20): copy N objects into
a slot buffer in 1 MiB pieces, each piece hashed right after it landed (what
`kvfabric.dataplane.staging.StagingFiles.read_into` does), on 1 and 2 threads; beside it the copy
alone (what Mooncake Store's local put does) and the hash alone. Best of `--repeats`, ms.

Run: `.venv/bin/python -m bench.copy_hash_bound [--size 16777216] [--objects 8] [--repeats 5]`.
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np

from kvfabric.dataplane.staging import READ_PIECE_BYTES
from kvfabric.format.checksum import StreamingChecksum


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=16 << 20, help="object bytes")
    parser.add_argument("--objects", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    size, piece = args.size, READ_PIECE_BYTES
    source = np.random.default_rng(1).integers(0, 255, args.objects * size, dtype=np.uint8)
    slots = np.zeros_like(source)

    def work(objects: list[int], copy: bool, hash_: bool) -> None:
        for o in objects:
            digest = StreamingChecksum()
            for at in range(o * size, (o + 1) * size, piece):
                if copy:
                    np.copyto(slots[at : at + piece], source[at : at + piece])
                if hash_:
                    digest.update(memoryview(slots[at : at + piece]))
            digest.digest()

    def best_ms(threads: int, copy: bool, hash_: bool) -> float:
        times = []
        for _ in range(args.repeats):
            workers = [
                threading.Thread(target=work, args=(list(range(i, args.objects, threads)), copy, hash_))
                for i in range(threads)
            ]
            started = time.perf_counter()
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            times.append((time.perf_counter() - started) * 1e3)
        return min(times)

    print(f"{args.objects} x {args.size} B, pieces of {piece} B, best of {args.repeats} (ms)")
    print("| threads | copy + hash | copy alone | hash alone |\n|---:|---:|---:|---:|")
    for threads in (1, 2):
        row = [best_ms(threads, True, True), best_ms(threads, True, False), best_ms(threads, False, True)]
        print(f"| {threads} | " + " | ".join(f"{x:.1f}" for x in row) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
