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


def test_the_reference_evicts_the_block_used_furthest_and_bypasses_blocks_used_later() -> None:
    sim = load_tool("evict_sim")
    requests = [
        {"timestamp": 0, "input_length": 1024, "hash_ids": [1, 2]},
        {"timestamp": 1, "input_length": 512, "hash_ids": [3]},  # never again: bypassed, not written
        {"timestamp": 2, "input_length": 1024, "hash_ids": [1, 2]},  # both still resident
        {"timestamp": 3, "input_length": 512, "hash_ids": [4]},  # used next at 5, before 1 (6), 2 (never)
        {"timestamp": 4, "input_length": 512, "hash_ids": [5]},  # used at 7, after 1 and 4: bypassed
        {"timestamp": 5, "input_length": 512, "hash_ids": [4]},
        {"timestamp": 6, "input_length": 512, "hash_ids": [1]},
        {"timestamp": 7, "input_length": 512, "hash_ids": [5]},
    ]
    row = sim.simulate_reference(requests, 2)
    assert row["blocks_written"] == 3  # 1, 2, then 4 in place of 2 (after request 2, never used again)
    assert row["evictions"] == 1  # 3 and both 5s bypassed: no use sooner than a resident block's
    assert row["prefill_tokens_saved"] == 2 * 512 + 512 + 512  # requests 2, 5 and 6
    lru = sim.simulate(requests, 2, EvictionConfig(policy="lru"))
    assert lru["prefill_tokens_saved"] < row["prefill_tokens_saved"]


def test_the_infinite_cache_keeps_every_block_and_gap_closed_is_measured_from_lru() -> None:
    sim = load_tool("evict_sim")
    requests = [
        {"timestamp": 0, "input_length": 1536, "hash_ids": [1, 2, 3]},
        {"timestamp": 1, "input_length": 1536, "hash_ids": [1, 2, 4]},
        {"timestamp": 2, "input_length": 1000, "hash_ids": [9, 2]},
    ]
    row = sim.simulate_infinite(requests)
    assert row["prefill_tokens_saved"] == 2 * 512 and row["blocks_written"] == 5 and row["evictions"] == 0
    assert sim.gap_closed(30, 20, 40) == 0.5 and sim.gap_closed(20, 20, 40) == 0.0
    assert sim.gap_closed(15, 20, 40) == -0.25 and sim.gap_closed(30, 20, 20) is None
    assert sim.gap_closed(30, 20, 40, min_gap=20) is None  # a gap this small gives no share


def test_the_client_saves_full_chunks_only() -> None:
    sim = load_tool("evict_sim")
    requests = [
        {"timestamp": 0, "input_length": 1500, "hash_ids": [1, 2, 3]},  # 3rd block: 476 tokens
        {"timestamp": 1, "input_length": 1024, "hash_ids": [1, 2]},
        {"timestamp": 2, "input_length": 1500, "hash_ids": [1, 2, 3]},
    ]
    full = sim.full_chunks(requests)
    assert [r["hash_ids"] for r in full] == [[1, 2], [1, 2], [1, 2]]
    row = sim.simulate(full, 100, EvictionConfig(policy="lru"))
    assert row["blocks_written"] == 2 and row["prefill_tokens_saved"] == 2 * 1024  # never block 3


def test_reuse_by_accesses_counts_what_a_later_request_names_again() -> None:
    sim = load_tool("evict_sim")
    requests = [
        {"timestamp": 0, "input_length": 1024, "hash_ids": [1, 2]},
        {"timestamp": 1, "input_length": 512, "hash_ids": [1]},
        {"timestamp": 2, "input_length": 1024, "hash_ids": [1, 3]},
    ]
    # 1st requests: 1 (again), 2 (never), 3 (never); 2nd: 1 at t1 (again); 3rd: 1 at t2 (never)
    assert sim.reuse_by_accesses(requests) == {1: (3, 1), 2: (1, 1), 3: (1, 0)}


def test_the_oracles_split_the_reference_into_admission_and_victim_order() -> None:
    sim = load_tool("evict_sim")
    requests = [
        {"timestamp": 0, "input_length": 1024, "hash_ids": [1, 2]},  # 1 used again at 2, 2 never
        {"timestamp": 1, "input_length": 512, "hash_ids": [3]},  # used again at 3
        {"timestamp": 2, "input_length": 512, "hash_ids": [1]},
        {"timestamp": 3, "input_length": 512, "hash_ids": [3]},
    ]
    # capacity 2: over it, the core evicts down to int(0.99 x 2) = 1 block
    lru = sim.simulate(requests, 2, EvictionConfig(policy="lru"))
    assert lru["prefill_tokens_saved"] == 512  # 3 pushes out 2 and then 1 (tail first): only 3 hits
    admission = sim.simulate(requests, 2, EvictionConfig(policy="lru"), sim.next_uses(requests))
    # 2 (never used again) is not written: 1 and 3 both fit and both hit
    assert admission["blocks_written"] == 2 and admission["prefill_tokens_saved"] == 1024
    order = sim.simulate_next_use_order(requests, 2)
    # everything written; on overflow 2 (never used) goes, not 1 or 3: both hit
    assert order["blocks_written"] == 3 and order["prefill_tokens_saved"] == 1024


def test_the_reuse_policy_reports_refusals_by_reason() -> None:
    sim = load_tool("evict_sim")
    requests = [
        {"timestamp": 1000 * t, "input_length": 2048, "hash_ids": [100 * t + i for i in range(4)]}
        for t in range(40)
    ]
    row = sim.simulate(requests, 6, sim.POLICIES["reuse+admission"])
    assert set(row["not_admitted"]) <= {"parent_absent", "below_frontier"}
    assert row["blocks_written"] + sum(row["not_admitted"].values()) == 4 * 40
    assert row["reuse_classes"]  # what the predictor learned, per class
