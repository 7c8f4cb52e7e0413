"""Trace-driven eviction simulator: replays Mooncake request traces through the production
eviction core (`kvfabric.core.eviction.EvictionCore`, not a copy) at several capacities.

    python tools/evict_sim.py [--traces ../shared/traces/*.jsonl] [--capacities 5,10,25,50]
                              [--out docs/eviction]

Each trace line is one request: `timestamp` (ms), `input_length` (tokens), `hash_ids` (its
512-token blocks, prefix-chained: block i depends on blocks 0..i-1). For each request: the hit is
the longest prefix of its blocks that is resident (a block past a missing one is useless); its
tokens are prefill saved; hit blocks are accessed, missed blocks are inserted (admission may
refuse them: not written), each with the previous block as parent; then the core's `tick` picks
victims, removed at once (no leases in the simulation). Capacity is a share of the trace's
unique blocks; one pool; sizes in blocks.

Reports per trace, capacity and policy: hit rate (requests with any hit), prefill tokens saved
(share of all input tokens), blocks written, evictions; a markdown table, JSON, and a PNG plot.
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
import time
from pathlib import Path
from typing import Any, Final

from kvfabric.core.eviction import Admitted, EvictBatch, EvictionConfig, EvictionCore

REPO: Final = Path(__file__).resolve().parents[1]
BLOCK_TOKENS: Final = 512
POLICIES: Final = {
    "lru": EvictionConfig(policy="lru", admission="always"),
    "lru-plain": EvictionConfig(policy="lru", admission="always", prefix_order=False),
    "lru+admission": EvictionConfig(policy="lru", admission="second_hit"),
    "gdsf": EvictionConfig(policy="gdsf", admission="always"),
    "gdsf+admission": EvictionConfig(policy="gdsf", admission="second_hit"),
}


def load_trace(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def simulate(requests: list[dict[str, Any]], capacity_blocks: int, base: EvictionConfig) -> dict[str, float]:
    config = EvictionConfig(
        policy=base.policy,
        admission=base.admission,
        high_watermark=1.0,  # a hard capacity: evict as soon as it is exceeded ...
        low_watermark=0.99,  # ... a little below it, in batches
        batch_max=4096,
        tokens_per_chunk=BLOCK_TOKENS,
        position_weight=base.position_weight,
        prefix_order=base.prefix_order,
    )
    core = EvictionCore(config)
    core.set_capacity("pool", capacity_blocks)
    saved = total = written = evicted = hits = 0
    for request in requests:
        now = int(request["timestamp"])
        blocks = request["hash_ids"]
        total += request["input_length"]
        hit = 0
        for block in blocks:
            if block in core and not core.is_evicting(block):
                hit += 1
            else:
                break
        saved += min(hit * BLOCK_TOKENS, request["input_length"])
        hits += hit > 0
        for block in blocks:
            core.seen(block)
        for i, block in enumerate(blocks):
            if i < hit:
                core.access(block, now)
                continue
            stored = block in core  # a block already resident (elsewhere in a chain) is not rewritten
            effects = core.insert(
                block,
                tenant="t",
                pool="pool",
                size=1,
                parent=blocks[i - 1] if i else None,
                chunk_index=i,
                now_ms=now,
            )
            if effects == [Admitted(block)] and not stored:
                written += 1
        for effect in core.tick(now):
            assert isinstance(effect, EvictBatch)
            for victim in effect.victims:
                core.removed(victim)
                evicted += 1
    return {
        "request_hit_rate": hits / len(requests),
        "prefill_saved_share": saved / total,
        "prefill_tokens_saved": saved,
        "blocks_written": written,
        "evictions": evicted,
    }


def plot(results: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = sorted({r["trace"] for r in results})
    fig, axes = plt.subplots(1, len(traces), figsize=(6 * len(traces), 4.2), squeeze=False)
    for ax, trace in zip(axes[0], traces, strict=True):
        for policy in POLICIES:
            rows = sorted(
                (r for r in results if r["trace"] == trace and r["policy"] == policy),
                key=lambda r: r["capacity_pct"],
            )
            ax.plot(
                [r["capacity_pct"] for r in rows],
                [100 * r["prefill_saved_share"] for r in rows],
                marker="o",
                label=policy,
            )
        ax.set_title(trace)
        ax.set_xlabel("capacity, % of unique blocks")
        ax.set_ylabel("prefill tokens saved, %")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--traces", nargs="*", default=sorted(glob.glob(str(REPO.parent / "shared" / "traces" / "*.jsonl")))
    )
    parser.add_argument("--capacities", default="5,10,25,50")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "eviction")
    args = parser.parse_args()
    if not args.traces:
        print("no traces found", file=sys.stderr)
        return 2
    capacities = [int(c) for c in args.capacities.split(",")]
    results: list[dict[str, Any]] = []
    started = time.perf_counter()
    for trace_path in map(Path, args.traces):
        requests = load_trace(trace_path)
        unique = len({b for r in requests for b in r["hash_ids"]})
        for pct in capacities:
            capacity = max(1, unique * pct // 100)
            for name, config in POLICIES.items():
                row = simulate(requests, capacity, config)
                results.append(
                    {
                        "trace": trace_path.stem,
                        "unique_blocks": unique,
                        "capacity_pct": pct,
                        "capacity_blocks": capacity,
                        "policy": name,
                        **row,
                    }
                )
                print(
                    f"{trace_path.stem} {pct}% {name}: saved {100 * row['prefill_saved_share']:.2f}%",
                    file=sys.stderr,
                )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        f"`python tools/evict_sim.py --capacities {args.capacities}` ({time.perf_counter() - started:.0f} s)",
        "",
        "| trace | capacity | policy | request hit rate | prefill tokens saved | vs LRU"
        " | blocks written | evictions |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lru = next(
            x
            for x in results
            if x["trace"] == r["trace"] and x["capacity_pct"] == r["capacity_pct"] and x["policy"] == "lru"
        )
        gain = (
            r["prefill_tokens_saved"] / lru["prefill_tokens_saved"] - 1
            if lru["prefill_tokens_saved"]
            else 0.0
        )
        lines.append(
            f"| {r['trace']} | {r['capacity_pct']}% ({r['capacity_blocks']} blocks) | {r['policy']} | "
            f"{100 * r['request_hit_rate']:.1f}% | {100 * r['prefill_saved_share']:.2f}% | "
            f"{100 * gain:+.1f}% | "
            f"{r['blocks_written']} | {r['evictions']} |"
        )
    Path(str(args.out) + ".md").write_text("\n".join(lines) + "\n")
    Path(str(args.out) + ".json").write_text(json.dumps(results, indent=2))
    plot(results, Path(str(args.out) + ".png"))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
