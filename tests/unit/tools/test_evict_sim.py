"""The trace simulator replays through the production eviction core and accounts correctly."""

from __future__ import annotations

from pathlib import Path

from kvfabric.core.eviction import EvictionConfig
from tests.unit.tools.toolkit import load_tool

REPO = Path(__file__).resolve().parents[3]


def test_replay_counts_folded_prefix_hits_and_respects_capacity() -> None:
    sim = load_tool("evict_sim")
    shared = [1, 2, 3]
    requests = [
        {"timestamp": 0, "input_length": 2048, "hash_ids": [*shared, 10]},
        {"timestamp": 1, "input_length": 2048, "hash_ids": [*shared, 11]},  # hits 3 blocks
        {"timestamp": 2, "input_length": 1024, "hash_ids": [99, 2]},  # block 2 alone is useless
        {"timestamp": 3, "input_length": 1536, "hash_ids": shared},  # hits all 3
    ]
    big = sim.simulate(requests, 100, EvictionConfig(policy="lru"))
    assert big["prefill_tokens_saved"] == 3 * 512 + 3 * 512 and big["evictions"] == 0
    assert big["blocks_written"] == 6  # 1, 2, 3, 10, 11, 99: block 2 is resident already
    small = sim.simulate(requests, 3, EvictionConfig(policy="lru"))
    assert small["evictions"] > 0 and small["prefill_tokens_saved"] <= big["prefill_tokens_saved"]


def test_the_simulator_uses_the_production_core() -> None:
    source = (REPO / "tools" / "evict_sim.py").read_text()
    assert "from kvfabric.core.eviction import" in source and "class EvictionCore" not in source
