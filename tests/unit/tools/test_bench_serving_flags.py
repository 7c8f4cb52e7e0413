"""`bench.serving` never reports a run silently in which kvfabric served nothing (issue 24: the
2026-12-01 22:27 run's (c), (d) and calibration loaded 0 tokens from kvfabric, unflagged), nor
one in which a segment was declared down or restarted outside (e)'s fault."""

from __future__ import annotations

from typing import Any

from bench.serving import flags_of, markdown, run_flags, verdicts


def row(config: str, p50: float, external: float, downs: int = 0, restarts: int = 0) -> dict[str, Any]:
    return {
        "config": config,
        "label": config,
        "ttft_p50_s": p50,
        "goodput_rps": 1.0,
        "slo_met_fraction": 0.9,
        "requests": 100,
        "ok": 100,
        "failed": 0,
        "refused": 0,
        "failures": [],
        "vllm_counters": {"prompt_tokens": 1000.0, "local_hit_tokens": 10.0, "external_hit_tokens": external},
        "cluster_events": {
            "segment_down": downs,
            "segment_down_events": [{"reason": "heartbeat_timeout"}] * downs,
            "segment_restarts": restarts,
            "segment_exit_codes": [75] * restarts,
        },
    }


def test_a_kvfabric_configuration_that_loaded_nothing_is_flagged() -> None:
    assert flags_of("c", row("c", 0.2, 0.0)) == [
        "(c): kvfabric loaded 0 tokens (vLLM external prefix-cache hits 0)"
    ]
    assert flags_of("d", row("d", 0.2, 1280.0)) == []
    assert flags_of("b", row("b", 0.2, 0.0)) == []  # no kvfabric in (a), (b)


def test_a_segment_down_or_restart_outside_the_fault_is_flagged() -> None:
    assert flags_of("a", row("a", 0.2, 0.0, downs=1, restarts=1)) == [
        "(a): 1 segment_down (heartbeat_timeout), 1 segment restarts (expected 0)"
    ]
    assert flags_of("e", row("e", 0.2, 512.0, downs=2, restarts=2)) == []  # the two it killed
    assert flags_of("e", row("e", 0.2, 512.0, downs=2, restarts=4)) != []


def test_the_calibration_is_flagged_when_its_hits_loaded_nothing() -> None:
    samples = [
        {"kind": "miss", "tokens": 257, "cached": 0, "ttft_s": 0.2},
        {"kind": "kvfabric_hit", "tokens": 257, "cached": 0, "ttft_s": 0.2},
    ]
    report: dict[str, Any] = {"configs": {}, "calibration": {"samples": samples}}
    assert run_flags(report) == [
        "calibration: kvfabric loaded 0 tokens (every 'kvfabric hit' computed its prompt)"
    ]
    samples[1]["cached"] = 256
    assert run_flags(report) == []


def test_no_verdict_on_d_when_c_or_d_had_no_kvfabric_and_the_report_says_so() -> None:
    rows = {
        k: row(k, p50, ext) for k, p50, ext in (("a", 0.4, 0), ("b", 0.2, 0), ("c", 0.19, 0), ("d", 0.14, 0))
    }
    for k, r in rows.items():
        r["flags"] = flags_of(k, r)
    got = {name: met for name, met, _ in verdicts(rows)}
    assert got["(d) beats the best of (a)-(c) on TTFT p50 by >= 20%"] is None  # -26 %, but meaningless
    rows["c"]["vllm_counters"]["external_hit_tokens"] = rows["d"]["vllm_counters"]["external_hit_tokens"] = (
        99.0
    )
    for k, r in rows.items():
        r["flags"] = flags_of(k, r)
    got = {name: met for name, met, _ in verdicts(rows)}
    assert got["(d) beats the best of (a)-(c) on TTFT p50 by >= 20%"] is True
    rows["c"]["vllm_counters"]["external_hit_tokens"] = 0.0
    rows["c"]["flags"] = flags_of("c", rows["c"])
    for r in rows.values():
        r.update(
            span_s=1.0, ttft_p90_s=0.5, ttft_p99_s=0.9, e2e_p50_s=0.3, e2e_p99_s=1.0,
            output_tokens_per_s=10.0, prompt_tokens_computed=900, prompt_tokens_saved=100,
            estimate_abs_error_p50_s=0.05, loadavg_start=[2.0], loadavg_end=[3.0], per_instance={},
        )  # fmt: skip
    report: dict[str, Any] = {
        "command": "python -m bench.serving",
        "when": "2026-12-01",
        "machine": "test",
        "slo_ttft_s": 1.0,
        "workload": {
            "requests": 100,
            "conversations": 50,
            "trace": "t",
            "rate_rps": 1.8,
            "time_scale": 1.0,
            "blocks_max": 24,
            "prompt_tokens_p50": 10,
            "prompt_tokens_total": 1000,
            "output_tokens_p50": 16,
            "ideal_hit_fraction": 0.5,
            "ideal_saved_tokens": 500,
        },
        "configs": rows,
    }
    report["flags"] = run_flags(report)
    report["verdicts"] = verdicts(rows)
    text = markdown(report)
    assert "**FLAGGED**" in text and "(c): kvfabric loaded 0 tokens" in text
    assert "NO VERDICT: (d) beats the best of (a)-(c) on TTFT p50" in text
