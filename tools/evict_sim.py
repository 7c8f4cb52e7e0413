"""Trace-driven eviction simulator: replays Mooncake request traces through the production
eviction core (`kvfabric.core.eviction.EvictionCore`, not a copy) at several capacities.

    python tools/evict_sim.py [--traces ../shared/traces/*.jsonl] [--capacities 5,10,25,50]
                              [--out bench/results/eviction]

Each trace line is one request: `timestamp` (ms), `input_length` (tokens), `hash_ids` (its
512-token blocks, prefix-chained: block i depends on blocks 0..i-1). For each request: the hit is
the longest prefix of its blocks that is resident (a block past a missing one is useless); its
tokens are prefill saved; hit blocks are accessed, missed blocks are inserted (admission may
refuse them: not written), each with the previous block as parent; then the core's `tick` picks
victims, removed at once (no leases in the simulation). Capacity is a share of the trace's
unique blocks; one pool; sizes in blocks.

Two references run next to the policies, with the same accounting:
- `reference`: Belady's MIN with bypass, offline (it reads the future of the trace). Every block
  carries its next use (the index of the next request naming it; never = infinity). A missed
  block is written only if the cache has room or its next use comes before that of the resident
  block used furthest in the future, which it then replaces; otherwise it is not written
  (bypass). A resident block named by a request (hit or past the first miss) takes its new next
  use. It is a reference, not a proven optimum for prefix hits: MIN ignores that a block is
  useless without its head and that a request's blocks are worth different token counts.
- `infinite`: no eviction at all (every block stays once written): the ceiling of any policy.
Each policy's `gap closed` is the share of the LRU -> reference gap it closes:
(saved - saved by lru) / (saved by reference - saved by lru); not given where the gap is under
`GAP_MIN_SHARE` of the input tokens (there the share is noise: see `vs LRU`, in points).

Like the live client (`kvfabric.client`: only full chunks are looked up and saved), a request's
last block is dropped when `input_length` is not a multiple of 512 tokens (a partial chunk, whose
hash no longer prompt can share): it is neither looked up nor written, by any policy or
reference, and capacities are shares of the unique full blocks. `--partial-chunks` keeps them
(the accounting of issue 25's first table).

Reports per trace, capacity and policy: hit rate (requests with any hit), prefill tokens saved
(share of all input tokens), gap closed, blocks written, evictions; a markdown table, JSON, and a
PNG plot. `--max-requests N` replays only the first N requests of each trace.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import heapq
import json
import sys
import time
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any, Final

from kvfabric.core.eviction import Admitted, EvictBatch, EvictionConfig, EvictionCore

REPO: Final = Path(__file__).resolve().parents[1]
BLOCK_TOKENS: Final = 512
NEVER: Final = float("inf")  # next use of a block no later request names
REFERENCE: Final = "reference"  # Belady's MIN with bypass (offline)
PREDICTOR_ROW: Final = "reuse+admission"  # whose learned classes the table shows ...
PREDICTOR_ROW_CAPACITY_PCT: Final = 10  # ... at this capacity
ORACLES: Final = ("oracle-admission", "oracle-order")  # --oracles: the reference's two halves
INFINITE: Final = "infinite"  # no eviction
BASELINE: Final = "lru"  # the gap is measured from it
REUSE_CLASSES: Final = 4  # request counts 1, 2, 3, 4 or more (reuse_by_accesses)
GAP_PLOT_MIN_PCT: Final = -100  # the gap plot's floor (a small gap makes shares explode)
GAP_MIN_SHARE: Final = 0.01  # a smaller LRU -> reference gap (share of input tokens) gets no share
POLICIES: Final = {
    "lru": EvictionConfig(policy="lru", admission="always"),
    "lru-plain": EvictionConfig(policy="lru", admission="always", prefix_order=False),
    "lru+admission": EvictionConfig(policy="lru", admission="second_hit"),
    "gdsf": EvictionConfig(policy="gdsf", admission="always"),
    "gdsf+admission": EvictionConfig(policy="gdsf", admission="second_hit"),
    "lru2": EvictionConfig(policy="lru2", admission="always"),
    "sieve": EvictionConfig(policy="sieve", admission="always"),
    "s3fifo": EvictionConfig(policy="s3fifo", admission="always"),
    "wtinylfu": EvictionConfig(policy="wtinylfu", admission="always"),
    "reuse": EvictionConfig(policy="reuse", admission="always"),
    "reuse+admission": EvictionConfig(policy="reuse", admission="predicted"),
    "density": EvictionConfig(policy="density", admission="always"),
    "density+admission": EvictionConfig(policy="density", admission="predicted"),
}


def load_trace(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def full_chunks(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each request with its full blocks only (what the client looks up and saves)."""
    return [{**r, "hash_ids": r["hash_ids"][: r["input_length"] // BLOCK_TOKENS]} for r in requests]


def simulate(
    requests: list[dict[str, Any]],
    capacity_blocks: int,
    base: EvictionConfig,
    oracle: list[list[float]] | None = None,
    split_ms: float = NEVER,
    watermarks: tuple[float, float] = (1.0, 0.99),
) -> dict[str, Any]:
    """Replay through the core. `oracle` (next uses, `next_uses`): perfect admission, the
    `oracle-admission` row: a missed block no later request names, or whose parent is not
    resident, is not written. `watermarks` (high, low): by default a hard capacity (evict as soon
    as it is exceeded, a little below it, in batches); `bench/evict_replay.py` passes the live
    service's."""
    core = EvictionCore(replay_config(base, watermarks))
    core.set_capacity("pool", capacity_blocks)
    saved = total = written = evicted = hits = 0
    late = [0, 0]  # saved, total: requests at or after split_ms (the evaluation half)
    for r, request in enumerate(requests):
        now = int(request["timestamp"])
        blocks = request["hash_ids"]
        total += request["input_length"]
        skip = None if oracle is None else _oracle_skip(core, blocks, oracle[r])
        hit, wrote = serve(core, blocks, now, skip=skip)
        written += wrote
        saved += min(hit * BLOCK_TOKENS, request["input_length"])
        _tally(late, request, hit, split_ms)
        hits += hit > 0
        for effect in core.tick(now):
            assert isinstance(effect, EvictBatch)
            for victim in effect.victims:
                core.removed(victim)
                evicted += 1
    row = _row(requests, hits, saved, total, written, evicted, late)
    row["reuse_classes"] = [[*cls, reused, named] for cls, (reused, named) in core.reuse_classes().items()]
    row["not_admitted"] = {
        k.removeprefix("admission_refused_").removesuffix("_total"): v
        for k, v in sorted(core.counters.items())
        if k.startswith("admission_refused_") and k != "admission_refused_total"
    }
    return row


def resident_prefix(core: EvictionCore, blocks: Sequence[Hashable]) -> int:
    """How many of `blocks` a lookup finds: the longest resident prefix (a block being evicted
    is gone already)."""
    hit = 0
    for block in blocks:
        if block not in core or core.is_evicting(block):
            break
        hit += 1
    return hit


def serve(
    core: EvictionCore,
    blocks: list[Hashable],
    now: int,
    *,
    skip: Callable[[int, Hashable], bool] | None = None,
    prompt_chunks: bool = True,
) -> tuple[int, int]:
    """One request as an engine serves it, the simulators' one place for it: the lookup names
    every block (`seen`), the resident prefix hits (accessed), every block past it is written
    (inserted; one resident elsewhere in the chain is not rewritten) unless `skip(i, block)`,
    asked for a block not resident, says not. `prompt_chunks`: the prompt's length passed to
    the core (False: the chunk's position, as the live service has it). Returns (blocks hit,
    blocks written)."""
    hit = resident_prefix(core, blocks)
    for block in blocks:
        core.seen(block)
    written = 0
    for i, block in enumerate(blocks):
        if i < hit:
            core.access(block, now)
            continue
        stored = block in core
        if skip is not None and not stored and skip(i, block):
            continue
        effects = core.insert(
            block,
            tenant="t",
            pool="pool",
            size=1,
            parent=blocks[i - 1] if i else None,
            chunk_index=i,
            now_ms=now,
            prompt_chunks=len(blocks) if prompt_chunks else None,
        )
        if effects == [Admitted(block)] and not stored:
            written += 1
    return hit, written


def _oracle_skip(
    core: EvictionCore, blocks: list[Hashable], uses: list[float]
) -> Callable[[int, Hashable], bool]:
    """Perfect admission (`oracle-admission`): a block no later request names, or whose parent
    is not resident, is not written."""
    return lambda i, _block: uses[i] == NEVER or bool(i and blocks[i - 1] not in core)


def replay_config(base: EvictionConfig, watermarks: tuple[float, float], **extra: Any) -> EvictionConfig:
    """`base`'s policy (and its tuning) for a replay: the given watermarks, batches of up to 4096,
    512-token chunks, the core's defaults otherwise (`extra`: overrides)."""
    return EvictionConfig(
        policy=base.policy,
        admission=base.admission,
        position_weight=base.position_weight,
        prefix_order=base.prefix_order,
        reuse_horizon_ms=base.reuse_horizon_ms,
        high_watermark=watermarks[0],
        low_watermark=watermarks[1],
        batch_max=4096,
        tokens_per_chunk=BLOCK_TOKENS,
        **extra,
    )


def next_uses(requests: list[dict[str, Any]]) -> list[list[float]]:
    """For each request and block: the index of the next request naming the block (or NEVER)."""
    next_use: list[list[float]] = [[] for _ in requests]
    later: dict[int, float] = {}
    for r in range(len(requests) - 1, -1, -1):
        blocks = requests[r]["hash_ids"]
        next_use[r] = [later.get(b, NEVER) for b in blocks]
        for b in blocks:
            later[b] = r
    return next_use


def simulate_next_use_order(
    requests: list[dict[str, Any]], capacity_blocks: int, split_ms: float = NEVER
) -> dict[str, Any]:
    """The `oracle-order` row: every missed block is written (no bypass); on overflow the leaf
    (no resident child: tails before heads, as the core) used furthest in the future goes."""
    next_use = next_uses(requests)
    resident: dict[int, list[Any]] = {}  # block -> [next use, resident children, parent, version]
    heap: list[tuple[float, int, int]] = []  # (-next use, version, block) of leaves, stale skipped
    saved = total = written = evicted = hits = 0
    late = [0, 0]

    def push(block: int) -> None:
        entry = resident[block]
        entry[3] += 1
        heapq.heappush(heap, (-entry[0], entry[3], block))

    for r, request in enumerate(requests):
        blocks = request["hash_ids"]
        total += request["input_length"]
        hit = 0
        for block in blocks:
            if block not in resident:
                break
            hit += 1
        saved += min(hit * BLOCK_TOKENS, request["input_length"])
        _tally(late, request, hit, split_ms)
        hits += hit > 0
        for i, (block, use) in enumerate(zip(blocks, next_use[r], strict=True)):
            if block in resident:
                resident[block][0] = use
                push(block)
                continue
            parent = blocks[i - 1] if i else None
            resident[block] = [use, 0, parent, 0]
            written += 1
            if parent is not None and parent in resident:
                resident[parent][1] += 1
            push(block)
        while len(resident) > capacity_blocks:
            _, version, block = heapq.heappop(heap)
            entry = resident.get(block)
            if entry is None or entry[3] != version or entry[1]:
                continue  # stale, or its tail is resident (pushed again when that goes)
            del resident[block]
            evicted += 1
            parent = entry[2]
            if parent is not None and parent in resident:
                resident[parent][1] -= 1
                if not resident[parent][1]:
                    push(parent)
        if len(heap) > 4 * len(resident) + 1024:
            heap = [e for e in heap if (x := resident.get(e[2])) is not None and x[3] == e[1]]
            heapq.heapify(heap)
    return _row(requests, hits, saved, total, written, evicted, late)


def simulate_reference(
    requests: list[dict[str, Any]], capacity_blocks: int, split_ms: float = NEVER
) -> dict[str, Any]:
    """Belady's MIN with bypass (module docstring), same accounting as `simulate`."""
    next_use = next_uses(requests)
    resident: dict[int, float] = {}  # block -> its next use
    furthest: list[tuple[float, int]] = []  # (-next use, block), stale entries skipped
    saved = total = written = evicted = hits = 0
    late = [0, 0]
    for r, request in enumerate(requests):
        blocks = request["hash_ids"]
        total += request["input_length"]
        hit = 0
        for block in blocks:
            if block not in resident:
                break
            hit += 1
        saved += min(hit * BLOCK_TOKENS, request["input_length"])
        _tally(late, request, hit, split_ms)
        hits += hit > 0
        for block, use in zip(blocks, next_use[r], strict=True):
            if block not in resident and len(resident) >= capacity_blocks:
                while resident.get(furthest[0][1]) != -furthest[0][0]:
                    heapq.heappop(furthest)  # stale: the block was used (or dropped) since
                if use >= -furthest[0][0]:
                    continue  # bypass: used no sooner than anything resident
                del resident[heapq.heappop(furthest)[1]]
                evicted += 1
            written += block not in resident
            resident[block] = use
            heapq.heappush(furthest, (-use, block))
    return _row(requests, hits, saved, total, written, evicted, late)


def simulate_infinite(requests: list[dict[str, Any]], split_ms: float = NEVER) -> dict[str, Any]:
    """No eviction: every block stays once written."""
    resident: set[int] = set()
    saved = total = hits = 0
    late = [0, 0]
    for request in requests:
        blocks = request["hash_ids"]
        total += request["input_length"]
        hit = 0
        for block in blocks:
            if block not in resident:
                break
            hit += 1
        saved += min(hit * BLOCK_TOKENS, request["input_length"])
        _tally(late, request, hit, split_ms)
        hits += hit > 0
        resident.update(blocks)
    return _row(requests, hits, saved, total, len(resident), 0, late)


def _tally(late: list[int], request: dict[str, Any], hit: int, split_ms: float) -> None:
    """Add a request of the evaluation half (at or after `split_ms`) to `late` = [saved, total]."""
    if request["timestamp"] >= split_ms:
        late[0] += min(hit * BLOCK_TOKENS, request["input_length"])
        late[1] += request["input_length"]


def _row(
    requests: list[dict[str, Any]],
    hits: int,
    saved: int,
    total: int,
    written: int,
    evicted: int,
    late: list[int] | None = None,
) -> dict[str, Any]:
    late_saved, late_total = late or (0, 0)
    return {
        "request_hit_rate": hits / len(requests),
        "prefill_saved_share": saved / total,
        "prefill_tokens_saved": saved,
        "blocks_written": written,
        "evictions": evicted,
        # the two halves by time (`split_ms`: the median request's timestamp): early = tuning, late = report
        "early_tokens_saved": saved - late_saved,
        "early_input_tokens": total - late_total,
        "late_tokens_saved": late_saved,
        "late_input_tokens": late_total,
    }


def gap_closed(saved: float, lru: float, reference: float, min_gap: float = 0.0) -> float | None:
    """Share of the LRU -> reference gap that `saved` closes; None when the gap is not above
    `min_gap`."""
    return (saved - lru) / (reference - lru) if reference - lru > max(min_gap, 0) else None


def plot(results: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = sorted({r["trace"] for r in results})
    names = list(dict.fromkeys(r["policy"] for r in results))
    cmap = plt.get_cmap("tab20")
    palette = [cmap(i) for i in range(20) if i not in (14, 15)]  # greys: the references
    colors = {
        name: palette[i % len(palette)]
        for i, name in enumerate(n for n in names if n not in (REFERENCE, INFINITE))
    }
    fig, axes = plt.subplots(2, len(traces), figsize=(6.5 * len(traces), 8.4), squeeze=False)
    for column, trace in enumerate(traces):
        top, bottom = axes[0][column], axes[1][column]
        for name in names:
            rows = sorted(
                (r for r in results if r["trace"] == trace and r["policy"] == name),
                key=lambda r: r["capacity_pct"],
            )
            reference = name in (REFERENCE, INFINITE)
            style: dict[str, Any] = (
                {"linestyle": "--", "color": "black" if name == REFERENCE else "grey"}
                if reference
                else {"color": colors[name], "linestyle": ":" if name in ORACLES else "-"}
            )
            top.plot(
                [r["capacity_pct"] for r in rows],
                [100 * r["prefill_saved_share"] for r in rows],
                marker="o",
                label=name,
                **style,
            )
            if not reference:
                bottom.plot(
                    [r["capacity_pct"] for r in rows],
                    [100 * r["gap_closed"] if r["gap_closed"] is not None else float("nan") for r in rows],
                    marker="o",
                    label=name,
                    **style,
                )
        top.set_title(f"{trace}: prefill tokens saved")
        top.set_ylabel("prefill tokens saved, %")
        bottom.set_title(f"{trace}: share of the LRU -> reference gap closed")
        bottom.set_ylabel(f"gap closed, % (reference = 100; clipped at {GAP_PLOT_MIN_PCT})")
        bottom.set_ylim(GAP_PLOT_MIN_PCT, 110)
        bottom.axhline(0, color="grey", linewidth=0.8)
        bottom.axhline(100, color="black", linestyle="--", linewidth=0.8)
        for ax in (top, bottom):
            ax.set_xlabel("capacity, % of unique blocks")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def reuse_by_accesses(requests: list[dict[str, Any]]) -> dict[int, tuple[int, int]]:
    """What a reuse predictor could learn from a block's request count alone: for every request
    naming a block, by how many requests named it so far (1 = its first, capped at
    `REUSE_CLASSES`), how many such accesses there were and how many a later request followed.
    (Reads the future: a table of the trace, not a policy.)"""
    later: set[int] = set()
    followed: list[tuple[int, bool]] = []
    for request in reversed(requests):
        followed.extend((b, b in later) for b in reversed(request["hash_ids"]))
        later.update(request["hash_ids"])
    seen: dict[int, int] = {}
    table: dict[int, list[int]] = {}
    for block, again in reversed(followed):
        count = seen[block] = seen.get(block, 0) + 1
        row = table.setdefault(min(count, REUSE_CLASSES), [0, 0])
        row[0] += 1
        row[1] += again
    return {k: (v[0], v[1]) for k, v in sorted(table.items())}


def table(results: list[dict[str, Any]], command: str) -> list[str]:
    lines = [
        command,
        "",
        "| trace | capacity | policy | prefill tokens saved | gap closed | vs LRU (points) | blocks written"
        " | evictions | request hit rate |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        gap = "—" if r["gap_closed"] is None else f"{100 * r['gap_closed']:.0f}%"
        lines.append(
            f"| {r['trace']} | {r['capacity_pct']}% ({r['capacity_blocks']} blocks) | {r['policy']} | "
            f"{100 * r['prefill_saved_share']:.2f}% | {gap} | {100 * r['vs_lru_points']:+.2f} | "
            f"{r['blocks_written']} | {r['evictions']} | {100 * r['request_hit_rate']:.1f}% |"
        )
    return lines


def class_marginals(results: list[dict[str, Any]], policy: str, capacity_pct: int) -> list[str]:
    """What the reuse predictor learned (`policy`'s run at `capacity_pct`): per feature value,
    the share of namings followed by another naming within the predictor's ghost, over all
    classes with that value (counts as learned: halved past `REUSE_HALVE_AT`)."""
    features = ("accesses", "turn", "log2 prompt chunks", "last chunk")
    lines = [
        f"What the reuse predictor learned online ({policy}, {capacity_pct}% capacity): share of"
        " namings of a chunk followed by another within the predictor's ghost, by feature",
        "",
        "| trace | feature | " + " | ".join(f"value {v}" for v in range(8)) + " |",
        "|---|---|" + "---:|" * 8,
    ]
    for r in results:
        if r["policy"] != policy or r["capacity_pct"] != capacity_pct or not r.get("reuse_classes"):
            continue
        for f, feature in enumerate(features):
            sums: dict[int, list[float]] = {}
            for entry in r["reuse_classes"]:
                acc = sums.setdefault(int(entry[f]), [0.0, 0.0])
                acc[0] += entry[-2]
                acc[1] += entry[-1]
            cells = [
                f"{100 * sums[v][0] / sums[v][1]:.0f}% of {sums[v][1]:.0f}"
                if v in sums and sums[v][1]
                else ""
                for v in range(8)
            ]
            lines.append(f"| {r['trace'].removesuffix('_trace')} | {feature} | " + " | ".join(cells) + " |")
    return lines


def gap_table(results: list[dict[str, Any]]) -> list[str]:
    """One row per policy, one column per trace and capacity: prefill saved, share of the
    LRU -> reference gap closed, blocks written (LRU = 100 %)."""
    columns = list(dict.fromkeys((r["trace"], r["capacity_pct"]) for r in results))
    names = list(dict.fromkeys(r["policy"] for r in results))
    cell = {(r["policy"], r["trace"], r["capacity_pct"]): r for r in results}
    lru = {(t, c): cell[(BASELINE, t, c)]["blocks_written"] for t, c in columns}
    lines = [
        "Prefill saved / gap closed / blocks written (LRU = 100 %), per trace and capacity:",
        "",
        "| policy | " + " | ".join(f"{t.removesuffix('_trace')} {c}%" for t, c in columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for name in names:
        cells = []
        for t, c in columns:
            r = cell.get((name, t, c))
            if r is None:
                cells.append("")
                continue
            gap = "—" if r["gap_closed"] is None else f"{100 * r['gap_closed']:.0f}%"
            written = 100 * r["blocks_written"] / lru[(t, c)] if lru[(t, c)] else 0.0
            cells.append(f"{100 * r['prefill_saved_share']:.2f}% / {gap} / {written:.0f}%")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def halves_table(results: list[dict[str, Any]]) -> list[str]:
    """Share of the LRU -> reference gap closed in each half of each trace by time: the first
    half (requests before the median request's timestamp: where choices were tuned) and the
    second (the evaluation half), and prefill saved in the second half."""
    columns = list(dict.fromkeys((r["trace"], r["capacity_pct"]) for r in results))
    names = list(dict.fromkeys(r["policy"] for r in results))
    cell = {(r["policy"], r["trace"], r["capacity_pct"]): r for r in results}

    def share(value: float | None) -> str:
        return "—" if value is None else f"{100 * value:.0f}%"

    lines = [
        "Gap closed in the first half (tuning) / the second half (evaluation), and prefill saved in"
        " the second half, per trace and capacity:",
        "",
        "| policy | " + " | ".join(f"{t.removesuffix('_trace')} {c}%" for t, c in columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for name in names:
        cells = []
        for t, c in columns:
            r = cell.get((name, t, c))
            if r is None or not r["late_input_tokens"]:
                cells.append("")
                continue
            late = r["late_tokens_saved"] / r["late_input_tokens"]
            gaps = f"{share(r['early_gap_closed'])} / {share(r['late_gap_closed'])}"
            cells.append(f"{gaps} / {100 * late:.2f}%")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--traces", nargs="*", default=sorted(glob.glob(str(REPO.parent / "shared" / "traces" / "*.jsonl")))
    )
    parser.add_argument("--capacities", default="5,10,25,50")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated, of: %(default)s")
    parser.add_argument(
        "--max-requests", type=int, default=0, help="replay the first N requests only (0: all)"
    )
    parser.add_argument(
        "--partial-chunks", action="store_true", help="keep partial last blocks (the client never saves them)"
    )
    parser.add_argument(
        "--reuse-horizon-ms",
        type=int,
        default=EvictionConfig().reuse_horizon_ms,
        help="the reuse policies' horizon (default %(default)s)",
    )
    parser.add_argument(
        "--oracles",
        action="store_true",
        help="add oracle-admission (LRU order, only blocks named again are written) and oracle-order"
        " (every block written, next-use order): which half of the reference closes the gap",
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "eviction")
    args = parser.parse_args()
    if not args.traces:
        print("no traces found", file=sys.stderr)
        return 2
    capacities = [int(c) for c in args.capacities.split(",")]
    policies = {
        name: dataclasses.replace(POLICIES[name], reuse_horizon_ms=args.reuse_horizon_ms)
        for name in args.policies.split(",")
    }
    results: list[dict[str, Any]] = []
    reuse_lines = [
        "",
        "Blocks named again by a later request, by how many requests named them so far:",
        "",
        "| trace | 1st request | 2nd | 3rd | 4th or later |",
        "|---|---:|---:|---:|---:|",
    ]
    started = time.perf_counter()
    for trace_path in map(Path, args.traces):
        requests = load_trace(trace_path)
        if args.max_requests:
            requests = requests[: args.max_requests]
        if not args.partial_chunks:
            requests = full_chunks(requests)
        unique = len({b for r in requests for b in r["hash_ids"]})
        split_ms = float(requests[len(requests) // 2]["timestamp"])  # tuning half | evaluation half
        infinite = simulate_infinite(requests, split_ms)
        cells = [f"{100 * again / n:.0f}% of {n}" for n, again in reuse_by_accesses(requests).values()]
        reuse_lines.append(f"| {trace_path.stem} | {' | '.join(cells)} |")
        for pct in capacities:
            capacity = max(1, unique * pct // 100)
            rows = {n: simulate(requests, capacity, cfg, split_ms=split_ms) for n, cfg in policies.items()}
            rows[BASELINE] = rows.get(BASELINE) or simulate(
                requests, capacity, POLICIES[BASELINE], split_ms=split_ms
            )
            if args.oracles:
                rows[ORACLES[0]] = simulate(
                    requests, capacity, POLICIES[BASELINE], next_uses(requests), split_ms=split_ms
                )
                rows[ORACLES[1]] = simulate_next_use_order(requests, capacity, split_ms)
            rows[REFERENCE] = simulate_reference(requests, capacity, split_ms)
            rows[INFINITE] = infinite
            lru = rows[BASELINE]["prefill_tokens_saved"]
            reference = rows[REFERENCE]["prefill_tokens_saved"]
            input_tokens = sum(r["input_length"] for r in requests)
            for name, row in rows.items():
                results.append(
                    {
                        "trace": trace_path.stem,
                        "requests": len(requests),
                        "unique_blocks": unique,
                        "capacity_pct": pct,
                        "capacity_blocks": capacity,
                        "policy": name,
                        **row,
                        "gap_closed": gap_closed(
                            row["prefill_tokens_saved"], lru, reference, GAP_MIN_SHARE * input_tokens
                        ),
                        **{
                            f"{half}_gap_closed": gap_closed(
                                row[f"{half}_tokens_saved"],
                                rows[BASELINE][f"{half}_tokens_saved"],
                                rows[REFERENCE][f"{half}_tokens_saved"],
                                GAP_MIN_SHARE * row[f"{half}_input_tokens"],
                            )
                            for half in ("early", "late")
                        },
                        "vs_lru": row["prefill_tokens_saved"] / lru - 1 if lru else 0.0,
                        "vs_lru_points": (row["prefill_tokens_saved"] - lru) / input_tokens,
                    }
                )
                print(
                    f"{trace_path.stem} {pct}% {name}: saved {100 * row['prefill_saved_share']:.2f}%",
                    file=sys.stderr,
                )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    flags = f" --capacities {args.capacities}"
    if args.policies != parser.get_default("policies"):
        flags += f" --policies {args.policies}"
    if args.max_requests:
        flags += f" --max-requests {args.max_requests}"
    if args.partial_chunks:
        flags += " --partial-chunks"
    if args.oracles:
        flags += " --oracles"
    if args.reuse_horizon_ms != parser.get_default("reuse_horizon_ms"):
        flags += f" --reuse-horizon-ms {args.reuse_horizon_ms}"
    elapsed_s = time.perf_counter() - started
    command = (
        f"`python tools/evict_sim.py{flags}` ({time.strftime('%Y-%m-%d')}, {elapsed_s:.0f} s on a shared"
        " 2-core VM)"
    )
    lines = table(results, command) + reuse_lines + [""] + gap_table(results) + [""] + halves_table(results)
    if any(r["policy"] == PREDICTOR_ROW for r in results):
        lines += ["", *class_marginals(results, PREDICTOR_ROW, PREDICTOR_ROW_CAPACITY_PCT)]
    Path(str(args.out) + ".md").write_text("\n".join(lines) + "\n")
    Path(str(args.out) + ".json").write_text(json.dumps(results, indent=2))
    plot(results, Path(str(args.out) + ".png"))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
