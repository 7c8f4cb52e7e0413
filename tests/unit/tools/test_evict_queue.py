"""tools/evict_queue.py: with no queue it is the simulator's replay (same figures), and a block a
queued request names is refused as a victim, so that request hits."""

from __future__ import annotations

import random
from typing import Any

from tests.unit.tools.toolkit import load_tool


def req(t: int, blocks: list[int]) -> dict[str, Any]:
    return {"timestamp": t, "input_length": 512 * len(blocks), "hash_ids": blocks}


def test_with_no_queue_it_replays_as_the_simulator() -> None:
    queue, sim = load_tool("evict_queue"), load_tool("evict_sim")
    rng = random.Random(7)
    prompts = [[100 * p + i for i in range(rng.randint(1, 6))] for p in range(30)]
    requests = [req(50 * t, prompts[rng.randrange(len(prompts))]) for t in range(400)]
    for name in ("lru", "density"):
        ours = queue.simulate_queue(requests, 20, sim.POLICIES[name], 0.0)
        theirs = sim.simulate(requests, 20, sim.POLICIES[name])
        assert ours["evictions_refused"] == 0
        for key in ("prefill_tokens_saved", "blocks_written", "evictions", "request_hit_rate"):
            assert ours[key] == theirs[key], (name, key)


def test_a_queued_requests_blocks_are_kept_and_it_hits() -> None:
    queue, sim = load_tool("evict_queue"), load_tool("evict_sim")
    requests = [req(0, [1, 2]), req(1000, [3, 4]), req(2000, [5, 6]), req(2500, [1, 2])]
    alone = queue.simulate_queue(requests, 4, sim.POLICIES["lru"], 0.0)
    queued = queue.simulate_queue(requests, 4, sim.POLICIES["lru"], 1000.0)  # [1, 2] queued at 2000
    too_late = queue.simulate_queue(requests, 4, sim.POLICIES["lru"], 400.0)  # not queued yet at 2000
    assert alone["prefill_tokens_saved"] == too_late["prefill_tokens_saved"] == 0
    assert queued["prefill_tokens_saved"] == 2 * 512 and queued["evictions_refused"] == 2
    assert queued["over_capacity_max"] == 0.0  # [3, 4] went instead


def test_a_queued_request_looked_up_on_enqueue_keeps_its_prefix_recent() -> None:
    queue, sim = load_tool("evict_queue"), load_tool("evict_sim")
    requests = [req(0, [1, 2]), req(1000, [3, 4]), req(2000, [5, 6]), req(2500, [1, 2])]
    alone = queue.simulate_queue(requests, 5, sim.POLICIES["lru"], 0.0, mode="touch")
    touched = queue.simulate_queue(requests, 5, sim.POLICIES["lru"], 1000.0, mode="touch")
    assert alone["prefill_tokens_saved"] == 0  # [1, 2] was the least recent: it went
    assert touched["prefill_tokens_saved"] == 2 * 512 and touched["evictions_refused"] == 0
    assert touched["over_capacity_max"] == 0.0


def test_a_block_is_kept_only_while_a_queued_request_names_it() -> None:
    queue, sim = load_tool("evict_queue"), load_tool("evict_sim")
    requests = [
        req(0, [1, 2]),
        req(1000, [3, 4]),
        req(2000, [5, 6]),  # [1, 2] queued: [3, 4] goes instead
        req(2500, [1, 2]),  # served: no longer pinned
        req(2600, [7, 8]),  # [5, 6] is the least recent now ...
        req(2700, [9, 10]),  # ... then [1, 2]: nothing queued names it (no 5 s after a refusal)
        req(10_000, [1, 2]),  # too late to be queued at 2700
    ]
    row = queue.simulate_queue(requests, 4, sim.POLICIES["lru"], 1000.0)
    assert row["prefill_tokens_saved"] == 2 * 512  # the fourth request hit, the last did not
