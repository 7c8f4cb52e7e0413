"""The latency_budget chaos checker (issue 27): the p99 of the loads that succeeded stays within
the drill's budget; recomputes and drills without a budget are not judged."""

from __future__ import annotations

from tests.unit.tools.toolkit import load_tool

c = load_tool("chaos_checks")


def loads(ms: list[float], outcome: str = "hit") -> list[object]:
    return [
        c.Op(prefix=i, round=1, start_s=0.0, end_s=1.0, outcome=outcome, load_ms=x) for i, x in enumerate(ms)
    ]


def test_loads_within_the_budget_pass() -> None:
    assert c.check_latency_budget(loads([100.0] * 200 + [1400.0]), 1500.0) == []


def test_a_p99_over_the_budget_fails() -> None:
    slow = loads([100.0] * 95 + [4000.0] * 5)  # 5% of loads waited 4 s
    problems = c.check_latency_budget(slow, 1500.0)
    assert problems and "4000 ms > budget 1500 ms" in problems[0]
    assert c.check_all(slow, c.FinalState(read_leases=0), {"load_p99_ms_max": 1500})["latency_budget"]


def test_only_successful_loads_count_and_no_budget_means_no_check() -> None:
    assert c.check_latency_budget(loads([9000.0] * 10, outcome="recompute"), 1500.0) == []
    assert c.check_latency_budget(loads([9000.0] * 10), None) == []
    assert c.check_all(loads([9000.0] * 10), c.FinalState(read_leases=0), {})["latency_budget"] == []


def test_events_published_fails_when_a_late_save_has_no_event() -> None:
    stuck = c.FinalState(read_leases=0, unpublished_prefixes=[1_000_030, 1_000_031])
    assert c.check_events_published(stuck, 12.0)
    assert c.check_all([], stuck, {"events_published_after_s": 12.0})["events_published"]
    assert c.check_events_published(c.FinalState(read_leases=0), 12.0) == []
    assert c.check_events_published(stuck, None) == []
