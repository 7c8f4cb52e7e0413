"""The pure parts of `python -m bench.serving`: the workload drawn from a Mooncake trace, its token
blocks, the calibration fit, the summary's verdicts (the benchmark itself needs vLLM: not run)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from bench.serving import (
    BLOCK_TOKENS,
    block_tokens,
    coefficients_from_metrics,
    nonnegative_fit,
    prompt_of,
    router_records,
    select_workload,
    verdicts,
)

VOCAB = 4096


def trace() -> list[dict[str, Any]]:
    """Three conversations (second hash block 1, 10, 20) and a one-off; Mooncake's 512-token blocks."""
    return [
        {"timestamp": 0, "input_length": 1000, "output_length": 250, "hash_ids": [0, 1]},
        {"timestamp": 1000, "input_length": 3000, "output_length": 50, "hash_ids": [0, 10, 11, 12, 13, 14]},
        {"timestamp": 2000, "input_length": 1500, "output_length": 2000, "hash_ids": [0, 1, 2]},
        {"timestamp": 5000, "input_length": 400, "output_length": 1, "hash_ids": [7]},
        {"timestamp": 9000, "input_length": 2500, "output_length": 100, "hash_ids": [0, 1, 2, 3, 4]},
        {"timestamp": 10000, "input_length": 900, "output_length": 100, "hash_ids": [0, 20]},
    ]


def test_workload_takes_whole_conversations_scaled_to_the_rate() -> None:
    reqs, scale = select_workload(trace(), requests=6, rate=2.0, blocks_max=4, output_max=32)
    assert len(reqs) == 6
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    assert reqs[0].arrival_s == 0
    assert reqs[-1].arrival_s == pytest.approx(6 / 2.0)  # mean rate 2 req/s
    assert scale == pytest.approx(10.0 / 3.0)
    for r in reqs:
        assert len(r.hash_ids) <= 4  # cut at blocks_max
        assert (len(r.hash_ids) - 1) * BLOCK_TOKENS < r.prompt_tokens <= len(r.hash_ids) * BLOCK_TOKENS
        assert 1 <= r.output_tokens <= 32
    # 1000 Mooncake tokens -> 250 of ours; 2000 output tokens / 25 capped at 32
    assert reqs[0].prompt_tokens == 250
    assert reqs[2].output_tokens == 32
    # a conversation is taken whole: all three turns of conversation "1" or none
    first_blocks = [r.hash_ids[1] for r in reqs if len(r.hash_ids) > 1]
    assert first_blocks.count(1) in (0, 3)


def test_workload_stops_at_the_request_count_with_a_fixed_seed() -> None:
    a, _ = select_workload(trace(), requests=3, rate=1.0, blocks_max=8, output_max=8)
    b, _ = select_workload(trace(), requests=3, rate=1.0, blocks_max=8, output_max=8)
    assert a == b and len(a) == 3


def test_shared_hash_blocks_are_shared_token_prefixes() -> None:
    reqs, _ = select_workload(trace(), requests=6, rate=1.0, blocks_max=8, output_max=8)
    by_blocks = {r.hash_ids: prompt_of(r, 7, VOCAB) for r in reqs}
    short = by_blocks[(0, 1)]
    longer = by_blocks[(0, 1, 2, 3, 4)]
    assert longer[: len(short)] == short  # the first turn is a prefix of the third
    other = by_blocks[(0, 20)]
    assert other[:BLOCK_TOKENS] == short[:BLOCK_TOKENS]  # the system block
    assert other[BLOCK_TOKENS:] != short[BLOCK_TOKENS : len(other)]
    assert all(5 <= t < VOCAB for t in longer)
    # another salt (another configuration) shares nothing
    assert block_tokens(8, 0, VOCAB) != block_tokens(7, 0, VOCAB)
    assert block_tokens(7, 0, VOCAB) == block_tokens(7, 0, VOCAB)


def test_calibration_fit_recovers_the_terms_and_keeps_them_non_negative() -> None:
    # ttft = 0.05 + compute / 5000 + bytes / 1e9
    rows = [(n, b) for n in (257, 1025, 2049, 3073) for b in (0, 4096 * (n - 1))]
    x = np.array([[1.0, n if b == 0 else 1, b] for n, b in rows])
    y = x @ np.array([0.05, 1 / 5000, 1e-9])
    fit = nonnegative_fit(x, y)
    assert fit == pytest.approx([0.05, 1 / 5000, 1e-9], rel=1e-6)
    # loads faster than the noise: a negative load term is clamped to 0, not returned
    y2 = x @ np.array([0.05, 1 / 5000, 0.0]) - 1e-10 * x[:, 2]
    assert (nonnegative_fit(x, y2) >= 0).all()


def row(config: str, p50: float, goodput: float, failed: int = 0) -> dict[str, Any]:
    """100 requests over a 200 s replay: goodput x 200 of them within the SLO."""
    met = goodput * 200
    return {
        "config": config,
        "ttft_p50_s": p50,
        "goodput_rps": goodput,
        "slo_met_fraction": met / 100,
        "requests": 100,
        "failed": failed,
        "refused": 0,
    }


def test_verdicts_compare_d_with_the_best_of_a_to_c() -> None:
    rows = {"a": row("a", 1.0, 1.0), "b": row("b", 0.5, 1.2), "c": row("c", 0.6, 1.3)}
    rows["d"] = row("d", 0.35, 1.4)
    rows["e"] = row("e", 0.5, 1.0, failed=1)
    got = {name: met for name, met, _ in verdicts(rows)}
    assert got == {
        "(d) beats the best of (a)-(c) on TTFT p50 by >= 20%": True,  # 0.35 vs 0.5: -30 %
        "(d) beats the best of (a)-(c) on goodput": True,
        "(e) no failed request": False,
    }
    rows["d"] = row("d", 0.45, 1.3)
    got = {name: met for name, met, _ in verdicts(rows)}
    assert not got["(d) beats the best of (a)-(c) on TTFT p50 by >= 20%"]
    assert not got["(d) beats the best of (a)-(c) on goodput"]
    # as many requests within the SLO, a shorter span: no win
    rows["d"] = {**row("d", 0.35, 1.3), "goodput_rps": 1.31}
    got = {name: met for name, met, _ in verdicts(rows)}
    assert not got["(d) beats the best of (a)-(c) on goodput"]


def test_verdict_for_d_with_the_refit_and_its_coefficients() -> None:
    rows = {"c": row("c", 0.5, 1.3), "d": row("d", 0.45, 1.3), "f": row("f", 0.38, 1.3)}
    got = {name: met for name, met, _ in verdicts(rows)}
    assert got["(f) = (d) + refit beats the best of (a)-(c) on TTFT p50 by >= 20%"]  # -24 %
    assert not got["(d) beats the best of (a)-(c) on TTFT p50 by >= 20%"]
    rows["f"] = row("f", 0.45, 1.3)
    got = {name: met for name, met, _ in verdicts(rows)}
    assert not got["(f) = (d) + refit beats the best of (a)-(c) on TTFT p50 by >= 20%"]
    text = (
        "# TYPE kvfabric_router_coefficient gauge\n"
        'kvfabric_router_coefficient{name="running_s"} 0.075\n'
        'kvfabric_router_state{name="refit_fits"} 12.0\n'
        'kvfabric_router_state{name="queue_e1"} 1.0\n'
    )
    assert coefficients_from_metrics(text) == {"running_s": 0.075, "refit_fits": 12.0}


def test_router_records_per_request_from_the_routers_log() -> None:
    """The last `request_routed` (after a failover: the engine that answered) and the
    `request_done` of each trace id `{tag}-{index}`; other tags and lines ignored."""
    events = [
        {"event": "request_routed", "trace_id": "d-1", "instance": "e1", "estimate_s": 0.2, "running": 0},
        {"event": "request_routed", "trace_id": "d-0", "instance": "e2", "estimate_s": 0.3, "running": 1},
        {"event": "request_routed", "trace_id": "d-1", "instance": "e2", "estimate_s": 0.25, "running": 2},
        {"event": "request_done", "trace_id": "d-1", "ttft_s": 0.4, "outcome": "ok"},
        {"event": "request_done", "trace_id": "c-1", "ttft_s": 9.0, "outcome": "ok"},
        {"event": "router_http_listening", "port": 1},
    ]
    assert router_records(events, "d") == [
        {"index": 0, "instance": "e2", "estimate_s": 0.3, "running": 1},
        {
            "index": 1,
            "instance": "e2",
            "estimate_s": 0.25,
            "running": 2,
            "router_ttft_s": 0.4,
            "outcome": "ok",
        },
    ]
