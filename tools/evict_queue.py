"""What the router's queue of pending requests would close (issue 25): the production eviction
core, with every block a queued request names kept from eviction, on both traces.

    python tools/evict_queue.py [--traces ../shared/traces/*.jsonl] [--capacities 5,10]
                                [--lookahead-s 0,1,5,30,120] [--policies lru,density]
                                [--out bench/results/eviction_queue]

**The hint.** A router that queues requests before an engine takes them knows, at time t, every
request that arrived before t and is not served yet. Here a request is served at its trace
timestamp, so "queued at t" is modelled as *arriving within the next L seconds* (L = the queue
wait): the blocks of every request with a timestamp in (t, t + L] are pending at t. L = 0 is the
policy alone. Waits of 1-5 s are a loaded serving system; 30 and 120 s are not a queue any more
(they bound what a longer-lived "keep for N seconds" hint from the application could do).

**The policy.** The production core (`kvfabric.core.eviction.EvictionCore`, as in
`tools/evict_sim.py`: same replay, accounting and capacities in full blocks); a victim it picks
that a pending request names is refused (`EvictionCore.refused`, as a lease or pin makes the
directory refuse it live: resident again, cooled down, another victim chosen on the next tick),
at most `TICKS_PER_REQUEST_MAX` ticks per request (the cache may stay over its capacity until
the next request, as it does live while evictions are refused). A pending block that is already
gone is not brought back.

Reported per trace, capacity, policy and L: prefill saved, the share of the LRU -> reference gap
closed (LRU and the reference as `tools/evict_sim.py` computes them, same requests), evictions
refused, blocks written.
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
import time
from collections import Counter, deque
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any, Final

from evict_sim import (  # type: ignore[import-not-found]
    BLOCK_TOKENS,
    NEVER,
    POLICIES,
    _row,
    _tally,
    full_chunks,
    gap_closed,
    load_trace,
    simulate,
    simulate_reference,
)

from kvfabric.core.eviction import EvictBatch, EvictionConfig, EvictionCore

REPO: Final = Path(__file__).resolve().parents[1]
TICKS_PER_REQUEST_MAX: Final = 8  # refused victims are replaced on the next tick, this many times


def simulate_queue(
    requests: Sequence[dict[str, Any]],
    capacity_blocks: int,
    base: EvictionConfig,
    lookahead_ms: float,
    split_ms: float = NEVER,
) -> dict[str, Any]:
    """`tools/evict_sim.simulate` (hard capacity, no admission oracle) with every block of the
    requests in (now, now + `lookahead_ms`] kept: a victim among them is refused."""
    config = EvictionConfig(
        policy=base.policy,
        admission=base.admission,
        high_watermark=1.0,
        low_watermark=0.99,
        batch_max=4096,
        tokens_per_chunk=BLOCK_TOKENS,
        position_weight=base.position_weight,
        prefix_order=base.prefix_order,
        reuse_horizon_ms=base.reuse_horizon_ms,
    )
    core = EvictionCore(config)
    core.set_capacity("pool", capacity_blocks)
    pending: Counter[Hashable] = Counter()  # block -> queued requests naming it
    queued: deque[int] = deque()  # indexes of the queued requests, in order
    next_in = 0  # the first request not queued yet
    saved = total = written = evicted = hits = refused = 0
    late = [0, 0]
    for r, request in enumerate(requests):
        now = int(request["timestamp"])
        while queued and queued[0] <= r:  # served now (or before): no longer pending
            pending.subtract(set(requests[queued.popleft()]["hash_ids"]))
        next_in = max(next_in, r + 1)
        while next_in < len(requests) and requests[next_in]["timestamp"] <= now + lookahead_ms:
            pending.update(set(requests[next_in]["hash_ids"]))
            queued.append(next_in)
            next_in += 1
        blocks = request["hash_ids"]
        total += request["input_length"]
        hit = 0
        for block in blocks:
            if block in core and not core.is_evicting(block):
                hit += 1
            else:
                break
        saved += min(hit * BLOCK_TOKENS, request["input_length"])
        _tally(late, request, hit, split_ms)
        hits += hit > 0
        for block in blocks:
            core.seen(block)
        for i, block in enumerate(blocks):
            if i < hit:
                core.access(block, now)
                continue
            stored = block in core
            core.insert(
                block,
                tenant="t",
                pool="pool",
                size=1,
                parent=blocks[i - 1] if i else None,
                chunk_index=i,
                now_ms=now,
                prompt_chunks=len(blocks),
            )
            written += not stored and block in core
        for _ in range(TICKS_PER_REQUEST_MAX):
            effects = core.tick(now)
            if not effects:
                break
            for effect in effects:
                assert isinstance(effect, EvictBatch)
                for victim in effect.victims:
                    if pending[victim] > 0:
                        core.refused(victim, now)
                        refused += 1
                    else:
                        core.removed(victim)
                        evicted += 1
    row: dict[str, Any] = _row(list(requests), hits, saved, total, written, evicted, late)
    row["evictions_refused"] = refused
    return row


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--traces", default=str(REPO.parent / "shared" / "traces" / "*.jsonl"))
    parser.add_argument("--capacities", default="5,10")
    parser.add_argument("--lookahead-s", default="0,1,5,30,120", help="the queue wait L, seconds")
    parser.add_argument("--policies", default="lru,density")
    parser.add_argument("--max-requests", type=int, default=0, help="only the first N requests (0: all)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "eviction_queue")
    args = parser.parse_args()
    started = time.perf_counter()
    lookaheads = [float(x) for x in args.lookahead_s.split(",")]
    rows: list[dict[str, Any]] = []
    for path in sorted(Path(p) for p in glob.glob(args.traces)):
        requests = full_chunks(load_trace(path))
        if args.max_requests:
            requests = requests[: args.max_requests]
        unique = len({b for r in requests for b in r["hash_ids"]})
        split_ms = float(requests[len(requests) // 2]["timestamp"])
        for pct in (int(c) for c in args.capacities.split(",")):
            capacity = max(1, unique * pct // 100)
            reference = simulate_reference(requests, capacity, split_ms)["prefill_tokens_saved"]
            lru = simulate(requests, capacity, POLICIES["lru"], split_ms=split_ms)["prefill_tokens_saved"]
            for name in args.policies.split(","):
                for lookahead_s in lookaheads:
                    row = simulate_queue(requests, capacity, POLICIES[name], lookahead_s * 1000, split_ms)
                    rows.append(
                        {
                            "trace": path.stem,
                            "capacity_pct": pct,
                            "policy": name,
                            "lookahead_s": lookahead_s,
                            **row,
                            "gap_closed": gap_closed(row["prefill_tokens_saved"], lru, reference),
                            "lru_tokens_saved": lru,
                            "reference_tokens_saved": reference,
                        }
                    )
    lines = [
        f"`python tools/evict_queue.py --capacities {args.capacities} --lookahead-s {args.lookahead_s}"
        f" --policies {args.policies}` ({time.strftime('%Y-%m-%d', time.gmtime())},"
        f" {time.perf_counter() - started:.0f} s, shared 2-core VM)",
        "",
        "| trace | capacity | policy | queue wait L | prefill saved | gap closed | evictions refused"
        " | blocks written |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        gap = "—" if row["gap_closed"] is None else f"{100 * row['gap_closed']:.0f} %"
        lines.append(
            f"| {row['trace'].removesuffix('_trace')} | {row['capacity_pct']} % | {row['policy']}"
            f" | {row['lookahead_s']:g} s | {100 * row['prefill_saved_share']:.2f} % | {gap}"
            f" | {row['evictions_refused']} | {row['blocks_written']} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    Path(str(args.out) + ".md").write_text("\n".join(lines) + "\n")
    Path(str(args.out) + ".json").write_text(json.dumps(rows, indent=2))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
