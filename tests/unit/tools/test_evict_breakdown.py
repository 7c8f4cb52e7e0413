"""The gap breakdown (tools/evict_breakdown.py) and the simulator's time halves (tools/evict_sim.py)."""

from __future__ import annotations

from kvfabric.core.eviction import EvictionConfig
from tests.unit.tools.toolkit import load_tool


def _request(t_ms: int, blocks: list[int]) -> dict[str, object]:
    return {"timestamp": t_ms, "input_length": 512 * len(blocks), "hash_ids": blocks}


def test_the_breakdown_attributes_the_reference_gain_to_the_block_ending_the_reusable_prefix() -> None:
    breakdown = load_tool("evict_breakdown")
    # capacity 2: LRU cycles a, b, c (each named again after the two others: always gone);
    # the reference keeps what comes back first and bypasses the rest
    requests = [_request(t * 1000, [b]) for t, b in enumerate([1, 2, 3, 1, 2, 3, 1, 2, 3])]
    assert sum(breakdown.lru_hits(requests, 2)) == 0
    assert sum(breakdown.reference_hits(requests, 2)) > 0
    shares = breakdown.breakdown(requests, 2)
    assert shares["gap 0"] == 1.0  # every gain came 3 s after the last naming (< 30 s)
    assert abs(sum(v for k, v in shares.items() if k.startswith("named")) - 1.0) < 1e-9


def test_the_simulator_splits_each_trace_by_time_into_a_tuning_and_an_evaluation_half() -> None:
    sim = load_tool("evict_sim")
    requests = [_request(t, [1, 2]) for t in range(10)]
    row = sim.simulate(requests, 100, EvictionConfig(policy="lru"), split_ms=5)
    assert row["late_input_tokens"] == 5 * 1024 and row["early_input_tokens"] == 5 * 1024
    assert row["early_tokens_saved"] == 4 * 1024 and row["late_tokens_saved"] == 5 * 1024
    reference = sim.simulate_reference(requests, 100, 5)
    assert reference["late_tokens_saved"] == row["late_tokens_saved"]
    assert sim.simulate_infinite(requests, 5)["early_tokens_saved"] == 4 * 1024
