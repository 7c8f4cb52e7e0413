"""Two-tier (DRAM + SSD) trace simulator: what a disk tier under the DRAM cache adds in prefill
tokens saved, and what it costs in disk writes (issue 23, step 7).

    python tools/evict_sim_tiers.py [--traces ../shared/traces/*.jsonl]
                                    [--tiers 5+0,5+10,5+25,5+50,5+95,10+50] [--demote all,reused]
                                    [--out bench/results/ssd_tiers]

Traces, blocks and the hit rule are those of `tools/evict_sim.py` (imported, not copied): one
512-token block per hash id, only full chunks, and a request's hit is the longest prefix of its
blocks that is resident, here in either tier. A tier pair `D+S` gives DRAM D % and SSD S % of the
trace's unique blocks (sizes in blocks; S = 0: no disk).

- **DRAM** is the one-tier simulator's LRU, driven by the production eviction core
  (`kvfabric.core.eviction.EvictionCore`, same configuration as `evict_sim.simulate`) with the same
  calls in the same order: blocks of the request's DRAM-resident prefix are accessed, every other
  block is inserted, whether it was recomputed or read from the SSD (promotion on use). So the
  DRAM tier holds exactly what it holds without a disk, whatever the SSD's size.
- **Demotion.** Each DRAM victim (the core's `tick`) is, per `--demote`: `all` demoted to the SSD;
  `reused` demoted only if at least two requests have named it so far (a cheap reuse predictor),
  else dropped; `none` dropped (DRAM alone). A victim still on the SSD (promotions keep their
  disk copy) is not written again.
- **SSD** is its own LRU: a demotion writes the block at the most recent end (evicting the least
  recent past its capacity), and every block a request names that is on the SSD is moved to the
  most recent end (the lookup names all of a request's blocks). Under these rules the SSD at any
  size holds a subset of what a larger SSD holds at the same step (the demotions and lookups do not
  depend on its size), so saved tokens never decrease as the SSD grows; with S = 0 every figure
  equals `evict_sim.simulate`'s LRU (both pinned by tests/unit/tools/test_evict_sim_tiers.py).

Per run: prefill tokens saved (share of all input tokens), the same without the SSD (`dram_only`),
hit blocks by tier (a block of the hit prefix resident in DRAM counts as DRAM, else SSD), blocks
demoted (SSD writes) and SSD evictions, and the SSD write amplification: blocks demoted / blocks of
prefill the SSD adds (saved with it minus saved without it; bytes are blocks x the block's KV
size, so the ratio is the same in bytes). Writes JSON and markdown (`--out` + .json/.md).
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
import time
from collections import OrderedDict
from collections.abc import Hashable
from pathlib import Path
from typing import Any, Final

from evict_sim import BLOCK_TOKENS, full_chunks, load_trace, serve  # type: ignore[import-not-found]

from kvfabric.core.eviction import EvictBatch, EvictionConfig, EvictionCore

REPO: Final = Path(__file__).resolve().parents[1]
DEMOTE_POLICIES: Final = ("all", "reused", "none")
REUSED_MIN_REQUESTS: Final = 2  # `reused`: a victim named by at least this many requests is demoted
DEFAULT_TIERS: Final = "5+0,5+10,5+25,5+50,5+95,10+50"


def dram_core() -> EvictionCore:
    """The DRAM tier: `evict_sim.simulate`'s LRU configuration (a hard capacity in blocks)."""
    return EvictionCore(
        EvictionConfig(
            policy="lru",
            admission="always",
            high_watermark=1.0,  # evict as soon as the capacity is exceeded ...
            low_watermark=0.99,  # ... a little below it, in batches (as evict_sim)
            batch_max=4096,
            tokens_per_chunk=BLOCK_TOKENS,
        )
    )


def simulate_tiers(
    requests: list[dict[str, Any]], dram_blocks: int, ssd_blocks: int, demote: str = "all"
) -> dict[str, Any]:
    """Replay `requests` through DRAM (`dram_blocks`, >= 1) over an SSD LRU (`ssd_blocks`, >= 0)."""
    if demote not in DEMOTE_POLICIES:
        raise ValueError(f"demote must be one of {DEMOTE_POLICIES}, not {demote!r}")
    if dram_blocks < 1 or ssd_blocks < 0:
        raise ValueError("dram_blocks must be >= 1 and ssd_blocks >= 0")
    core = dram_core()
    core.set_capacity("pool", dram_blocks)
    ssd: OrderedDict[Hashable, None] = OrderedDict()  # least recent first
    named: dict[Hashable, int] = {}  # block -> requests that named it so far
    total = saved = saved_dram_only = hits = 0
    written = evicted = dram_hit = ssd_hit = demoted = demote_skipped = dropped = ssd_evicted = 0
    for request in requests:
        now = int(request["timestamp"])
        blocks = request["hash_ids"]
        total += request["input_length"]
        in_dram = [b in core and not core.is_evicting(b) for b in blocks]
        hit_dram_only = next((i for i, resident in enumerate(in_dram) if not resident), len(blocks))
        hit = next(
            (i for i, b in enumerate(blocks) if not in_dram[i] and b not in ssd),
            len(blocks),
        )
        from_dram = sum(in_dram[:hit])
        dram_hit += from_dram
        ssd_hit += hit - from_dram
        saved += min(hit * BLOCK_TOKENS, request["input_length"])
        saved_dram_only += min(hit_dram_only * BLOCK_TOKENS, request["input_length"])
        hits += hit > 0
        for block in blocks:
            if block in ssd:
                ssd.move_to_end(block)  # the lookup named it
        for block in set(blocks):
            named[block] = named.get(block, 0) + 1
        # DRAM: exactly evict_sim.simulate's calls (they depend on DRAM alone).
        written += serve(core, blocks, now)[1]
        for effect in core.tick(now):
            assert isinstance(effect, EvictBatch)
            for victim in effect.victims:
                core.removed(victim)
                evicted += 1
                if demote == "none" or (demote == "reused" and named.get(victim, 0) < REUSED_MIN_REQUESTS):
                    dropped += 1
                    continue
                if victim in ssd:
                    ssd.move_to_end(victim)
                    demote_skipped += 1
                    continue
                if ssd_blocks == 0:
                    dropped += 1
                    continue
                ssd[victim] = None
                demoted += 1
                while len(ssd) > ssd_blocks:
                    ssd.popitem(last=False)
                    ssd_evicted += 1
    added_blocks = (saved - saved_dram_only) / BLOCK_TOKENS
    return {
        "request_hit_rate": hits / len(requests),
        "prefill_saved_share": saved / total,
        "prefill_tokens_saved": saved,
        "dram_only_saved_share": saved_dram_only / total,
        "dram_only_tokens_saved": saved_dram_only,
        "ssd_added_points": (saved - saved_dram_only) / total,
        "dram_hit_blocks": dram_hit,
        "ssd_hit_blocks": ssd_hit,
        "blocks_written": written,
        "evictions": evicted,
        "blocks_demoted": demoted,
        "demotions_already_on_ssd": demote_skipped,
        "victims_dropped": dropped,
        "ssd_evictions": ssd_evicted,
        "ssd_write_amplification": demoted / added_blocks if added_blocks else (0.0 if not demoted else None),
    }


def parse_tiers(text: str) -> list[tuple[float, float]]:
    """`5+50,10+0` -> [(5, 50), (10, 0)]: DRAM and SSD shares of the unique blocks, in %."""
    pairs = []
    for item in text.split(","):
        dram, _, ssd = item.partition("+")
        pairs.append((float(dram), float(ssd or 0)))
    return pairs


def _pct(x: float) -> str:
    return f"{x:g}%"


def table(results: list[dict[str, Any]], command: str) -> list[str]:
    lines = [
        command,
        "",
        "| trace | DRAM | SSD | demote | prefill tokens saved | DRAM alone | SSD adds (points) | hit blocks"
        " DRAM / SSD | blocks demoted | SSD evictions | write amplification |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        amp = "—" if r["ssd_write_amplification"] is None else f"{r['ssd_write_amplification']:.2f}"
        lines.append(
            f"| {r['trace']} | {_pct(r['dram_pct'])} ({r['dram_blocks']}) | {_pct(r['ssd_pct'])}"
            f" ({r['ssd_blocks']}) | {r['demote']} | {100 * r['prefill_saved_share']:.2f}% |"
            f" {100 * r['dram_only_saved_share']:.2f}% | {100 * r['ssd_added_points']:+.2f} |"
            f" {r['dram_hit_blocks']} / {r['ssd_hit_blocks']} | {r['blocks_demoted']} |"
            f" {r['ssd_evictions']} | {amp} |"
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--traces", nargs="*", default=sorted(glob.glob(str(REPO.parent / "shared" / "traces" / "*.jsonl")))
    )
    parser.add_argument("--tiers", default=DEFAULT_TIERS, help="DRAM%%+SSD%% pairs (default %(default)s)")
    parser.add_argument("--demote", default="all,reused", help=f"comma-separated, of {DEMOTE_POLICIES}")
    parser.add_argument(
        "--max-requests", type=int, default=0, help="replay the first N requests only (0: all)"
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "ssd_tiers")
    args = parser.parse_args()
    if not args.traces:
        print("no traces found", file=sys.stderr)
        return 2
    tiers = parse_tiers(args.tiers)
    demotes = args.demote.split(",")
    results: list[dict[str, Any]] = []
    started = time.perf_counter()
    for trace_path in map(Path, args.traces):
        requests = full_chunks(load_trace(trace_path))
        if args.max_requests:
            requests = requests[: args.max_requests]
        unique = len({b for r in requests for b in r["hash_ids"]})
        for dram_pct, ssd_pct in tiers:
            for demote in demotes if ssd_pct else ["none"]:
                dram_blocks = max(1, int(unique * dram_pct / 100))
                ssd_blocks = int(unique * ssd_pct / 100)
                row = simulate_tiers(requests, dram_blocks, ssd_blocks, demote)
                results.append(
                    {
                        "trace": trace_path.stem,
                        "requests": len(requests),
                        "unique_blocks": unique,
                        "dram_pct": dram_pct,
                        "ssd_pct": ssd_pct,
                        "dram_blocks": dram_blocks,
                        "ssd_blocks": ssd_blocks,
                        "demote": demote,
                        **row,
                    }
                )
                print(
                    f"{trace_path.stem} {dram_pct:g}+{ssd_pct:g} {demote}: saved"
                    f" {100 * row['prefill_saved_share']:.2f}%",
                    file=sys.stderr,
                )
    flags = f" --tiers {args.tiers} --demote {args.demote}"
    if args.max_requests:
        flags += f" --max-requests {args.max_requests}"
    elapsed_s = time.perf_counter() - started
    command = (
        f"`python tools/evict_sim_tiers.py{flags}` ({time.strftime('%Y-%m-%d')}, {elapsed_s:.0f} s on a"
        " shared 2-core VM)"
    )
    lines = table(results, command)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    Path(str(args.out) + ".md").write_text("\n".join(lines) + "\n")
    Path(str(args.out) + ".json").write_text(json.dumps(results, indent=2))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
