"""The two-tier (DRAM + SSD) simulator: hand traces with known answers, and its two properties
(with no SSD it is the one-tier simulator's LRU; a larger SSD never saves fewer tokens)."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.tools.toolkit import load_tool

BLOCK = 512


def _requests(chains: list[list[int]]) -> list[dict[str, Any]]:
    return [
        {"timestamp": t, "input_length": BLOCK * len(blocks), "hash_ids": blocks}
        for t, blocks in enumerate(chains)
    ]


def test_a_demoted_block_is_read_back_from_the_ssd_and_counted_by_tier() -> None:
    tiers = load_tool("evict_sim_tiers")
    requests = _requests([[1, 2], [3], [1, 2], [3]])
    # DRAM of 2 blocks evicts in batches down to its low watermark (0.99 x 2), so 2 victims a
    # time. Request 1: DRAM evicts 2 then 1 -> SSD [2, 1]. Request 2: 1 and 2 hit on the SSD
    # (promoted into DRAM, which evicts 3 -> SSD, evicting the SSD's least recent, 1; and 2,
    # still on the SSD: not written again). Request 3: 3 hits on the SSD.
    row = tiers.simulate_tiers(requests, 2, 2, "all")
    assert row["prefill_tokens_saved"] == 2 * BLOCK + BLOCK
    assert row["dram_only_tokens_saved"] == 0
    assert (row["dram_hit_blocks"], row["ssd_hit_blocks"]) == (0, 3)
    assert row["blocks_demoted"] == 3 and row["demotions_already_on_ssd"] == 1
    assert row["ssd_evictions"] == 1 and row["evictions"] == 4
    assert row["ssd_write_amplification"] == 1.0  # 3 blocks written for 3 blocks of prefill added
    dropped = tiers.simulate_tiers(requests, 2, 2, "none")
    assert dropped["prefill_tokens_saved"] == 0 and dropped["blocks_demoted"] == 0
    assert dropped["victims_dropped"] == 4


def test_the_ssd_evicts_its_least_recent_block_and_a_missing_head_makes_the_rest_useless() -> None:
    tiers = load_tool("evict_sim_tiers")
    requests = _requests([[1, 2], [3], [4], [1, 2], [5, 2]])
    # Request 1 demotes 2 then 1; an SSD of 1 block keeps 1 only, so request 3 hits 1 on the SSD
    # and stops at 2. Block 2 under another head (request 4) is no hit. An SSD of 2 keeps both.
    row = tiers.simulate_tiers(requests, 2, 1, "all")
    assert (row["dram_hit_blocks"], row["ssd_hit_blocks"]) == (0, 1)
    assert row["prefill_tokens_saved"] == BLOCK and row["ssd_evictions"] == 6
    big = tiers.simulate_tiers(requests, 2, 2, "all")
    assert big["prefill_tokens_saved"] == 2 * BLOCK and big["ssd_hit_blocks"] == 2


def test_reused_demotes_only_blocks_named_by_two_requests() -> None:
    tiers = load_tool("evict_sim_tiers")
    once = tiers.simulate_tiers(_requests([[1, 2], [3], [1, 2]]), 2, 4, "reused")
    # 2 and 1 (named once) and 3 are dropped; 2 is demoted after its second request, too late.
    assert once["prefill_tokens_saved"] == 0 and once["victims_dropped"] == 3
    assert once["blocks_demoted"] == 1 and once["ssd_write_amplification"] is None  # writes, no gain
    twice = tiers.simulate_tiers(_requests([[1, 2], [1, 2], [3], [1, 2]]), 2, 4, "reused")
    assert twice["blocks_demoted"] == 2 and twice["ssd_hit_blocks"] == 2
    assert twice["prefill_tokens_saved"] == 4 * BLOCK and twice["dram_only_tokens_saved"] == 2 * BLOCK


def test_parse_tiers_and_bad_arguments() -> None:
    tiers = load_tool("evict_sim_tiers")
    assert tiers.parse_tiers("5+50,10") == [(5.0, 50.0), (10.0, 0.0)]
    for bad in ((0, 1, "all"), (1, -1, "all"), (1, 1, "sometimes")):
        try:
            tiers.simulate_tiers(_requests([[1]]), *bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad} accepted")


# Prefix-chained traces: a block id names its whole prefix (as the traces' hash ids do).
_paths = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=5), min_size=1, max_size=40)


def _chained(paths: list[list[int]]) -> list[dict[str, Any]]:
    ids: dict[tuple[int, ...], int] = {}
    chains = [[ids.setdefault(tuple(p[: i + 1]), len(ids)) for i in range(len(p))] for p in paths]
    return _requests(chains)


@settings(max_examples=150, deadline=None)
@given(paths=_paths, dram=st.integers(1, 6), demote=st.sampled_from(["all", "reused", "none"]))
def test_without_an_ssd_it_is_the_one_tier_simulators_lru(
    paths: list[list[int]], dram: int, demote: str
) -> None:
    sim, tiers = load_tool("evict_sim"), load_tool("evict_sim_tiers")
    requests = _chained(paths)
    one = sim.simulate(requests, dram, sim.POLICIES["lru"])
    two = tiers.simulate_tiers(requests, dram, 0, demote)
    for field in ("prefill_tokens_saved", "blocks_written", "evictions", "request_hit_rate"):
        assert two[field] == one[field], field
    assert two["dram_only_tokens_saved"] == one["prefill_tokens_saved"]
    assert two["ssd_hit_blocks"] == 0 and two["blocks_demoted"] == 0


@settings(max_examples=150, deadline=None)
@given(
    paths=_paths,
    dram=st.integers(1, 5),
    ssd=st.lists(st.integers(0, 12), min_size=2, max_size=4),
    demote=st.sampled_from(["all", "reused"]),
)
def test_saved_tokens_never_decrease_when_the_ssd_grows(
    paths: list[list[int]], dram: int, ssd: list[int], demote: str
) -> None:
    tiers = load_tool("evict_sim_tiers")
    requests = _chained(paths)
    rows = [tiers.simulate_tiers(requests, dram, s, demote) for s in sorted(ssd)]
    saved = [r["prefill_tokens_saved"] for r in rows]
    assert saved == sorted(saved)
    assert all(r["prefill_tokens_saved"] >= r["dram_only_tokens_saved"] for r in rows)
    assert len({r["dram_only_tokens_saved"] for r in rows}) == 1  # DRAM does not depend on the SSD
