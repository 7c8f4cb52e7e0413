"""Each chaos checker passes a clean history and fails one that breaks its invariant."""

from __future__ import annotations

from pathlib import Path

from tests.unit.tools.toolkit import load_tool

REPO = Path(__file__).resolve().parents[3]


def test_clean_history_passes_every_checker() -> None:
    c = load_tool("chaos_checks")
    history = [
        c.Op(prefix=p, round=r, start_s=0.0, end_s=0.1, outcome="hit" if r else "recompute")
        for p in range(3)
        for r in range(3)
    ]
    final = c.FinalState(
        read_leases=0, segments=[{"segment_id": "s", "reserved_bytes": 10, "reported_used_bytes": 10}]
    )
    violations = c.check_all(history, final, {"max_recompute_rate": 0.0, "min_hit_rate_last_round": 1.0})
    assert violations == {k: [] for k in violations}


def test_each_checker_fails_when_its_invariant_breaks() -> None:
    c = load_tool("chaos_checks")
    ok = c.FinalState(read_leases=0)
    expect = {"max_recompute_rate": 0.2, "min_hit_rate_last_round": 0.9}
    base = [
        c.Op(prefix=0, round=r, start_s=0.0, end_s=1.0, outcome="hit" if r else "recompute") for r in range(3)
    ]

    wrong = [*base, c.Op(prefix=1, round=2, start_s=0.0, end_s=1.0, outcome="hit", wrong_chunks=1)]
    assert c.check_all(wrong, ok, expect)["wrong_bytes"]
    hung = [*base, c.Op(prefix=1, round=2, start_s=0.0)]
    assert c.check_all(hung, ok, expect)["all_ended"]
    raised = [*base, c.Op(prefix=1, round=2, start_s=0.0, end_s=1.0, outcome="error", cause="boom")]
    assert c.check_all(raised, ok, expect)["all_ended"]
    recomputing = [
        *base,
        *(c.Op(prefix=p, round=1, start_s=0.0, end_s=1.0, outcome="recompute") for p in range(1, 4)),
    ]
    assert c.check_all(recomputing, ok, expect)["recompute_budget"]
    not_serving = [*base, c.Op(prefix=1, round=2, start_s=0.0, end_s=1.0, outcome="recompute")]
    assert c.check_all(not_serving, ok, expect)["serving"]
    acked = [*base, c.Op(prefix=5, round=1, start_s=0.0, end_s=1.0, outcome="recompute", acked_chunks=4)]
    lost = c.FinalState(read_leases=0, served_chunks={5: 2})
    assert c.check_all(acked, lost, expect)["durability"]
    assert not c.check_all(acked, lost, {**expect, "may_lose_acknowledged": True})["durability"]
    # The policy evicted chunk 2 (the first missing one): explained. Evicting only chunk 3 is not.
    evicted = c.FinalState(read_leases=0, served_chunks={5: 2}, evicted_chunks={5: {2, 3}})
    assert not c.check_all(acked, evicted, expect)["durability"]
    tail_only = c.FinalState(read_leases=0, served_chunks={5: 2}, evicted_chunks={5: {3}})
    assert c.check_all(acked, tail_only, expect)["durability"]
    repaired = c.FinalState(read_leases=0, object_replicas=[2, 2, 3])
    short = c.FinalState(read_leases=0, object_replicas=[2, 1, 2])
    assert not c.check_all(base, repaired, {**expect, "replicas_restored": 2})["replicas_restored"]
    assert c.check_all(base, short, {**expect, "replicas_restored": 2})["replicas_restored"]
    assert not c.check_all(base, short, expect)["replicas_restored"]  # not asked for
    leaked = c.FinalState(
        read_leases=2, segments=[{"segment_id": "s", "reserved_bytes": 1, "reported_used_bytes": 9}]
    )
    assert len(c.check_all(base, leaked, expect)["no_leaks"]) == 2


def test_the_retry_budget_checker_fails_when_the_budget_is_exceeded() -> None:
    c = load_tool("chaos_checks")
    assert c.check_retry_budget(10, 100, 0.5) == []
    assert c.check_retry_budget(60, 100, 0.5)  # 0.6 per request > 0.5
    assert c.check_retry_budget(60, 100, None) == []  # no budget asked for
