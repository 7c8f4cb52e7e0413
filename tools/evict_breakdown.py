"""Which misses the offline reference avoids that LRU does not (issue 25, docs/eviction-policy.md).

    python tools/evict_breakdown.py [--traces ../shared/traces/*.jsonl] [--capacities 5,10]

For every request, the hit (in blocks) under the reference (`evict_sim.simulate_reference`'s
Belady MIN with bypass) and under plain LRU (every named block moved to the young end, the
oldest dropped past capacity; no chains: a breakdown, not the simulator's LRU row) is
attributed to the block that ends the request's reusable prefix (its longest prefix some
earlier request named): by how many requests had named that block before (1, 2, 3, 4+) and by
the time since the last of them. Prints, per trace and capacity, the share of the
reference - LRU difference in each class. Full chunks only, as the simulator.
"""

from __future__ import annotations

import argparse
import glob
import heapq
from collections import OrderedDict
from pathlib import Path
from typing import Any, Final

from evict_sim import full_chunks, load_trace, next_uses  # type: ignore[import-not-found]

REPO: Final = Path(__file__).resolve().parents[1]
NAMING_CLASSES: Final = 4  # 1, 2, 3, 4 or more earlier namings
GAP_EDGES_S: Final = (30, 120, 300)  # time since the last naming: < 30 s, 30-120 s, 120-300 s, >= 300 s


def _prefix(blocks: list[int], held: Any) -> int:
    n = 0
    for block in blocks:
        if block not in held:
            break
        n += 1
    return n


def reference_hits(requests: list[dict[str, Any]], capacity: int) -> list[int]:
    """Hit blocks per request under Belady's MIN with bypass (as `evict_sim.simulate_reference`)."""
    uses = next_uses(requests)
    resident: dict[int, float] = {}
    furthest: list[tuple[float, int]] = []
    hits = []
    for r, request in enumerate(requests):
        blocks = request["hash_ids"]
        hits.append(_prefix(blocks, resident))
        for block, use in zip(blocks, uses[r], strict=True):
            if block not in resident and len(resident) >= capacity:
                while resident.get(furthest[0][1]) != -furthest[0][0]:
                    heapq.heappop(furthest)
                if use >= -furthest[0][0]:
                    continue
                del resident[heapq.heappop(furthest)[1]]
            resident[block] = use
            heapq.heappush(furthest, (-use, block))
    return hits


def lru_hits(requests: list[dict[str, Any]], capacity: int) -> list[int]:
    resident: OrderedDict[int, None] = OrderedDict()
    hits = []
    for request in requests:
        blocks = request["hash_ids"]
        hits.append(_prefix(blocks, resident))
        for block in blocks:
            resident[block] = None
            resident.move_to_end(block)
        while len(resident) > capacity:
            resident.popitem(last=False)
    return hits


def breakdown(requests: list[dict[str, Any]], capacity: int) -> dict[str, float]:
    """Share of the reference - LRU hit-block difference per naming class and per gap class."""
    ref, lru = reference_hits(requests, capacity), lru_hits(requests, capacity)
    seen: set[int] = set()
    count: dict[int, int] = {}
    last_ms: dict[int, int] = {}
    diff: dict[str, float] = {}
    for i, request in enumerate(requests):
        blocks = request["hash_ids"]
        reusable = _prefix(blocks, seen)
        if reusable:
            end = blocks[reusable - 1]
            gap_s = (request["timestamp"] - last_ms[end]) / 1000
            gap = sum(gap_s >= edge for edge in GAP_EDGES_S)
            for key in (f"named {min(count[end], NAMING_CLASSES)}", f"gap {gap}"):
                diff[key] = diff.get(key, 0.0) + ref[i] - lru[i]
        for block in blocks:
            seen.add(block)
            count[block] = count.get(block, 0) + 1
            last_ms[block] = request["timestamp"]
    total = sum(ref) - sum(lru)
    return {k: v / total for k, v in sorted(diff.items())} if total else {}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--traces", nargs="*", default=sorted(glob.glob(str(REPO.parent / "shared" / "traces" / "*.jsonl")))
    )
    parser.add_argument("--capacities", default="5,10")
    args = parser.parse_args()
    labels = {f"gap {i}": label for i, label in enumerate(("< 30 s", "30-120 s", "120-300 s", ">= 300 s"))}
    for path in map(Path, args.traces):
        requests = full_chunks(load_trace(path))
        unique = len({b for r in requests for b in r["hash_ids"]})
        for pct in (int(c) for c in args.capacities.split(",")):
            shares = breakdown(requests, max(1, unique * pct // 100))
            cells = ", ".join(f"{labels.get(k, k)}: {100 * v:.0f} %" for k, v in shares.items())
            print(f"{path.stem} {pct} %: {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
