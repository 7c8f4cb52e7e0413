"""What the router's queue of pending requests would close (issue 25): the production eviction
core, with every block a queued request names kept from eviction, on both traces.

    python tools/evict_queue.py [--traces ../shared/traces/*.jsonl] [--capacities 5,10]
                                [--lookahead-s 0,1,5,30] [--policies lru,density]
                                [--out bench/results/eviction_queue]

**The hint.** A router that queues requests before an engine takes them knows, at time t, every
request that arrived before t and is not served yet. Here a request is served at its trace
timestamp, so "queued at t" is modelled as *arriving within the next L seconds* (L = the queue
wait): the blocks of every later request with a timestamp up to t + L (one at t itself too,
after this one in the trace) are pending at t. L = 0 is the
policy alone. Waits of 1-5 s are a loaded serving system; 30 s is not a queue any more (it
bounds what a "keep for N seconds" hint from the application could do). Longer L is slow here
(a pinned block at the head of the order is refused again at every request) and pins more
than the cache holds.

**The policy.** The production core (`kvfabric.core.eviction.EvictionCore`, as in
`tools/evict_sim.py`: same replay, accounting and capacities in full blocks); a victim it picks
that a pending request names is refused (`EvictionCore.refused`, as a lease or pin makes the
directory refuse it live: resident again, cooled down, another victim chosen on the next tick),
at most `TICKS_PER_REQUEST_MAX` ticks per request (mode `pin`); its refusal cooldown is 1 ms, so
a block is kept only while a queued request names it. Refused blocks (and their heads:
only leaves go) can keep the cache over its capacity, as pins do live: that is a bigger cache,
so the rows say by how much (mean and peak, after each request's ticks). Mode `touch` keeps the
capacity hard: when a request is queued, the router looks it up, and the resident prefix it
names is accessed then (a lookup on enqueue, no pin; as a live lookup, it is a naming the
`density` predictor learns from). A pending block that is already gone is
not brought back. L = 0 is no queue at all (the simulator's figures, tested).

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
    replay_config,
    resident_prefix,
    serve,
    simulate,
    simulate_reference,
)

from kvfabric.core.eviction import EvictBatch, EvictionConfig, EvictionCore
from kvfabric.format.invariant import invariant

REPO: Final = Path(__file__).resolve().parents[1]
TICKS_PER_REQUEST_MAX: Final = 8  # refused victims are replaced on the next tick, this many times
MODES: Final = ("pin", "touch")


def simulate_queue(
    requests: Sequence[dict[str, Any]],
    capacity_blocks: int,
    base: EvictionConfig,
    lookahead_ms: float,
    split_ms: float = NEVER,
    mode: str = "pin",
) -> dict[str, Any]:
    """`tools/evict_sim.simulate` (no admission oracle) with the requests in (now, now +
    `lookahead_ms`] queued: `pin`, every block they name is refused as a victim; `touch`, the
    resident prefix of each is looked up (accessed) when it is queued (module docstring)."""
    invariant(mode in MODES, "a mode", mode=mode)
    # A refused block is chosen again at the next request's tick: pinned while it is queued, not
    # the live 5 s after a refusal (every tick of one request runs at the same `now`).
    core = EvictionCore(replay_config(base, (1.0, 0.99), refused_cooldown_ms=1))
    core.set_capacity("pool", capacity_blocks)
    pending: Counter[Hashable] = Counter()  # block -> queued requests naming it
    queued: deque[int] = deque()  # indexes of the queued requests, in order
    next_in = 0  # the first request not queued yet
    saved = total = written = evicted = hits = refused = over_sum = over_max = 0
    late = [0, 0]
    for r, request in enumerate(requests):
        now = int(request["timestamp"])
        while queued and queued[0] <= r:  # served now (or before): no longer pending
            served = queued.popleft()
            if mode == "pin":
                pending.subtract(set(requests[served]["hash_ids"]))
        next_in = max(next_in, r + 1)
        while (
            lookahead_ms > 0
            and next_in < len(requests)
            and requests[next_in]["timestamp"] <= now + lookahead_ms
        ):
            if mode == "pin":
                pending.update(set(requests[next_in]["hash_ids"]))
            else:  # the router looks the queued prompt up: its resident prefix is accessed now
                queued_blocks = requests[next_in]["hash_ids"]
                for block in queued_blocks[: resident_prefix(core, queued_blocks)]:
                    core.access(block, now)
            queued.append(next_in)
            next_in += 1
        blocks = request["hash_ids"]
        total += request["input_length"]
        hit, wrote = serve(core, blocks, now)
        written += wrote
        saved += min(hit * BLOCK_TOKENS, request["input_length"])
        _tally(late, request, hit, split_ms)
        hits += hit > 0
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
        over = max(0, core.used_bytes("pool") - capacity_blocks)  # pins kept it over: a bigger cache
        over_sum += over
        over_max = max(over_max, over)
    row: dict[str, Any] = _row(list(requests), hits, saved, total, written, evicted, late)
    row["evictions_refused"] = refused
    row["over_capacity_mean"] = over_sum / max(1, len(requests)) / capacity_blocks
    row["over_capacity_max"] = over_max / capacity_blocks
    return row


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--traces", default=str(REPO.parent / "shared" / "traces" / "*.jsonl"))
    parser.add_argument("--capacities", default="5,10")
    parser.add_argument("--lookahead-s", default="0,1,5,30", help="the queue wait L, seconds")
    parser.add_argument("--policies", default="lru,density")
    parser.add_argument("--modes", default="pin,touch")
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
                for mode, lookahead_s in [(m, x) for m in args.modes.split(",") for x in lookaheads]:
                    if lookahead_s == 0 and mode != MODES[0]:
                        continue  # no queue: one row
                    ms = lookahead_s * 1000
                    row = simulate_queue(requests, capacity, POLICIES[name], ms, split_ms, mode)
                    rows.append(
                        {
                            "trace": path.stem,
                            "capacity_pct": pct,
                            "policy": name,
                            "mode": mode if lookahead_s else "none",
                            "lookahead_s": lookahead_s,
                            **row,
                            "gap_closed": gap_closed(row["prefill_tokens_saved"], lru, reference),
                            "lru_tokens_saved": lru,
                            "reference_tokens_saved": reference,
                        }
                    )
    lines = [
        f"`python tools/evict_queue.py --capacities {args.capacities} --lookahead-s {args.lookahead_s}"
        f" --policies {args.policies} --modes {args.modes}` ({time.strftime('%Y-%m-%d', time.gmtime())},"
        f" {time.perf_counter() - started:.0f} s, shared 2-core VM)",
        "",
        "| trace | capacity | policy | hint | queue wait L | prefill saved | gap closed | evictions refused"
        " | over capacity, mean / peak | blocks written |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        gap = "—" if row["gap_closed"] is None else f"{100 * row['gap_closed']:.0f} %"
        lines.append(
            f"| {row['trace'].removesuffix('_trace')} | {row['capacity_pct']} % | {row['policy']}"
            f" | {row['mode']} | {row['lookahead_s']:g} s | {100 * row['prefill_saved_share']:.2f} % | {gap}"
            f" | {row['evictions_refused']} | {100 * row['over_capacity_mean']:.1f} %"
            f" / {100 * row['over_capacity_max']:.0f} % | {row['blocks_written']} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    Path(str(args.out) + ".md").write_text("\n".join(lines) + "\n")
    Path(str(args.out) + ".json").write_text(json.dumps(rows, indent=2))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
