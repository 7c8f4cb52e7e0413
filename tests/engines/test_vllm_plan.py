"""The vLLM connector's load planning (`kvfabric.engines.vllm_plan`), without vLLM: a hit the
request's block list does not cover is never dropped silently; its blocks are reported as load
errors so vLLM recomputes them (issue 20, item 6). The connector refuses to start when vLLM would
fail a request whose load failed instead of recomputing it (issue 22, item 1)."""

from __future__ import annotations

import pytest

from kvfabric.engines.vllm_plan import POLICY_SETTING, LoadPlan, plan_load, policy_refusal


def test_covered_hit_loads_its_blocks_past_what_vllm_has() -> None:
    assert plan_load([10, 11, 12, 13, 14], first_chunk=0, hit_chunks=4) == LoadPlan(blocks=(10, 11, 12, 13))
    assert plan_load([10, 11, 12, 13, 14], first_chunk=2, hit_chunks=4) == LoadPlan(blocks=(12, 13))


def test_nothing_beyond_what_vllm_has_plans_nothing() -> None:
    assert plan_load([10, 11], first_chunk=2, hit_chunks=2) == LoadPlan()
    assert plan_load([], first_chunk=0, hit_chunks=0) == LoadPlan()


def test_short_block_list_reports_the_covered_blocks_of_the_hit() -> None:
    """vLLM was told chunks 1..4 are external; the list has blocks for chunks 0..2 only."""
    plan = plan_load([10, 11, 12], first_chunk=1, hit_chunks=5)
    assert plan.blocks == ()  # nothing loaded: the connector's view is not vLLM's
    assert plan.error_blocks == (11, 12)  # vLLM recomputes from chunk 1 on
    assert plan.mismatch and not plan.unreportable


def test_block_list_ending_before_the_hit_reports_its_last_block() -> None:
    """No block inside the hit's range: recompute from the last block vLLM has (more, never less)."""
    plan = plan_load([10, 11], first_chunk=3, hit_chunks=6)
    assert plan == LoadPlan(error_blocks=(11,), mismatch=True)


def test_empty_block_list_is_a_mismatch_nobody_can_be_told_of() -> None:
    plan = plan_load([], first_chunk=0, hit_chunks=3)
    assert plan.mismatch and plan.unreportable and plan.blocks == ()


def test_negative_chunks_are_a_caller_bug() -> None:
    with pytest.raises(ValueError, match="chunk indexes"):
        plan_load([1, 2], first_chunk=-1, hit_chunks=2)


def test_a_scheduler_that_recomputes_failed_loads_starts_whatever_was_configured() -> None:
    assert policy_refusal("fail", True) is None  # vLLM's default, set to "recompute" in time
    assert policy_refusal("recompute", True) is None
    assert policy_refusal("recompute", None) is None  # cannot see it, but the user asked for it


def test_a_scheduler_that_would_fail_the_request_refuses_to_start_naming_the_setting() -> None:
    for configured, decided in (("fail", False), ("fail", None), (None, None), ("recompute", False)):
        problem = policy_refusal(configured, decided)
        assert problem is not None and f"set {POLICY_SETTING}='recompute'" in problem, (configured, decided)
    assert "read" in (policy_refusal("fail", False) or "")
    assert "cannot see" in (policy_refusal("fail", None) or "")
