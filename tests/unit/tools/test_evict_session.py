"""tools/evict_session.py: the session hint reads only earlier requests, and the hold keeps a
held conversation's prompt over older unheld blocks (plain LRU otherwise)."""

from __future__ import annotations

from typing import Any

from tests.unit.tools.toolkit import load_tool


def req(t: int, blocks: list[int]) -> dict[str, Any]:
    return {"timestamp": t, "input_length": 512 * len(blocks), "hash_ids": blocks}


def test_the_hint_is_the_turn_and_the_gap_from_earlier_requests_only() -> None:
    session = load_tool("evict_session")
    requests = [
        req(0, [0, 1, 2]),  # turn 1
        req(10, [0, 5]),  # turn 1: shares only the first block (a system prompt)
        req(30, [0, 1, 2, 3]),  # turn 2 of the first, 30 ms later
        req(100, [0, 1, 2, 3, 4, 6]),  # turn 3, 70 ms later
        req(120, [0, 1, 2]),  # the first prompt again: no earlier prompt is a proper prefix of it
    ]
    hints = session.session_hints(requests)
    assert hints == [(1, 0.0), (1, 0.0), (2, 30.0), (3, 70.0), (1, 0.0)]
    for n in range(1, len(requests)):  # appending later requests never changes an earlier hint
        assert session.session_hints(requests[:n]) == hints[:n]


def test_without_a_hold_it_is_lru_tails_before_heads() -> None:
    session = load_tool("evict_session")
    requests = [req(0, [1, 2]), req(1, [3, 4]), req(2, [1, 2]), req(3, [5, 6]), req(4, [3, 4])]
    row = session.simulate_hold(requests, 4, 0.0)
    # capacity 4: [5, 6] evicts [3, 4] (least recent, tail first), so the last request misses
    assert row["prefill_tokens_saved"] == 2 * 512 and row["blocks_written"] == 8


def test_a_held_prompt_outlives_older_unheld_blocks() -> None:
    session = load_tool("evict_session")
    requests = [
        req(0, [0, 1, 2]),  # turn 1
        req(100, [0, 1, 2, 3]),  # turn 2, gap 100 ms: held until 100 + 2 x 100
        req(150, [0, 7, 8]),  # another conversation: unheld
        req(160, [0, 9, 10]),  # pressure: evicts something
        req(250, [0, 1, 2, 3, 4]),  # turn 3: hits its whole previous prompt only if it was held
    ]
    lru = session.simulate_hold(requests, 6, 0.0)
    held = session.simulate_hold(requests, 6, 2.0)
    # LRU evicted 3 and 2 (least recent), the hold takes 8 and 7 instead: blocks 2 and 3 hit
    assert held["prefill_tokens_saved"] == lru["prefill_tokens_saved"] + 2 * 512
