"""The tarpit's core (`kvfabric.runtime.tarpit_core`): who is tarpitted, for how long, and the
bound on what it remembers; a Hypothesis run checks its invariants over any refusal pattern."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric.runtime.tarpit_core import TarpitConfig, TarpitCore

CONFIG = TarpitConfig(refusals_max=4, window_s=1.0, duration_s=2.0, duration_max_s=8.0, forgive_s=10.0)


def refuse(core: TarpitCore, tenant: str, times: int, now_s: float) -> list[bool]:
    return [core.note_refusal(tenant, now_s) for _ in range(times)]


def test_a_tenant_is_tarpitted_at_the_threshold_within_one_window() -> None:
    core = TarpitCore(CONFIG)
    assert refuse(core, "bob", 4, 0.0) == [False, False, False, True]
    assert core.tarpitted() == {"bob"} and core.until_s("bob") == 2.0
    assert refuse(core, "bob", 10, 0.5) == [False] * 10  # already in: no second entry
    assert core.entries_total == 1 and core.next_expiry_s() == 2.0


def test_refusals_spread_over_windows_never_tarpit() -> None:
    core = TarpitCore(CONFIG)
    for second in range(20):  # 3 a second: below 4 in every window
        assert refuse(core, "alice", 3, float(second)) == [False] * 3
    assert core.tarpitted() == frozenset()


def test_a_tarpit_ends_and_a_repeat_within_forgive_doubles_up_to_the_max() -> None:
    core = TarpitCore(CONFIG)
    now, durations = 0.0, []
    for _ in range(4):
        refuse(core, "bob", 4, now)
        until = core.until_s("bob")
        assert until is not None
        durations.append(until - now)
        assert core.expire(until - 0.01) == []
        assert core.expire(until) == ["bob"] and core.tarpitted() == frozenset()
        now = until + 1.0  # back within forgive_s
    assert durations == [2.0, 4.0, 8.0, 8.0]
    refuse(core, "bob", 4, now + CONFIG.forgive_s + 1)  # forgiven: the first duration again
    assert core.until_s("bob") == now + CONFIG.forgive_s + 1 + 2.0


def test_one_tenant_in_the_tarpit_leaves_the_others_free() -> None:
    core = TarpitCore(CONFIG)
    refuse(core, "bob", 4, 0.0)
    assert refuse(core, "alice", 3, 0.0) == [False] * 3
    assert core.tarpitted() == {"bob"}


def test_memory_is_bounded_and_tarpitted_tenants_are_never_forgotten() -> None:
    core = TarpitCore(TarpitConfig(refusals_max=2, tenants_max=3))
    refuse(core, "bob", 2, 0.0)  # tarpitted
    for i in range(10):
        core.note_refusal(f"t{i}", 0.0)
    assert core.tracked() == 3 and core.tarpitted() == {"bob"}
    carol = TarpitCore(TarpitConfig(refusals_max=1, tenants_max=2))
    assert carol.note_refusal("a", 0.0) and carol.note_refusal("b", 0.0)
    assert not carol.note_refusal("c", 0.0)  # full of tarpitted tenants: not tracked
    assert carol.tracked() == 2


events = st.lists(
    st.tuples(st.sampled_from(["a", "b", "c", "d"]), st.floats(min_value=0, max_value=3), st.booleans()),
    max_size=300,
)


@settings(max_examples=200, deadline=None)
@given(events)
def test_invariants_over_any_refusal_pattern(steps: list[tuple[str, float, bool]]) -> None:
    config = TarpitConfig(refusals_max=3, window_s=1.0, duration_s=0.5, duration_max_s=4.0, tenants_max=3)
    core = TarpitCore(config)
    now = 0.0
    for tenant, advance, expire in steps:
        now += advance
        before = core.until_s(tenant)
        entered = core.note_refusal(tenant, now)
        until = core.until_s(tenant)
        if entered:
            assert before is None and until is not None
            assert config.duration_s <= until - now <= config.duration_max_s
        else:
            assert until == before or (before is None and until is None)
        if expire:
            for ended in core.expire(now):
                assert core.until_s(ended) is None
        assert core.tracked() <= config.tenants_max
        assert all((core.until_s(t) or 0) <= now + config.duration_max_s for t in core.tarpitted())
