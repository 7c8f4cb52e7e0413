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
    probation = TarpitCore(CONFIG)
    refuse(probation, "bob", 4, 0.0)
    probation.expire(2.0)
    assert refuse(probation, "bob", 1, 2.5) == [True]  # on probation: a quarter of the threshold
    refuse(core, "bob", 4, now + CONFIG.forgive_s + 1)  # forgiven: the first duration again
    assert core.until_s("bob") == now + CONFIG.forgive_s + 1 + 2.0


def test_one_tenant_in_the_tarpit_leaves_the_others_free() -> None:
    core = TarpitCore(CONFIG)
    refuse(core, "bob", 4, 0.0)
    assert refuse(core, "alice", 3, 0.0) == [False] * 3
    assert core.tarpitted() == {"bob"}


def test_memory_is_bounded_and_tarpitted_tenants_are_never_forgotten() -> None:
    core = TarpitCore(TarpitConfig(refusals_max=2, tarpitted_max=2, tenants_max=3))
    refuse(core, "bob", 2, 0.0)  # tarpitted
    for i in range(10):
        core.note_refusal(f"t{i}", 0.0)
    assert core.tracked() == 3 and core.tarpitted() == {"bob"}
    carol = TarpitCore(TarpitConfig(refusals_max=1, tarpitted_max=2, tenants_max=2))
    assert carol.note_refusal("a", 0.0) and carol.note_refusal("b", 0.0)
    assert not carol.note_refusal("c", 0.0)  # full of tarpitted tenants: not tracked
    assert carol.tracked() == 2


def test_at_most_tarpitted_max_at_once() -> None:
    core = TarpitCore(TarpitConfig(refusals_max=1, tarpitted_max=2))
    assert [core.note_refusal(t, 0.0) for t in "abc"] == [True, True, False]
    assert core.tarpitted() == {"a", "b"}
    assert core.expire(10.0) == ["a", "b"] and core.note_refusal("c", 10.0)


class Model:
    """What the core must do, written the simple way: per tenant the refusals of its current
    window, its tarpit's end, its last release and duration (no memory bound: the test keeps
    to fewer tenants than `tenants_max`)."""

    def __init__(self, config: TarpitConfig) -> None:
        self.c = config
        self.window: dict[str, tuple[float, int]] = {}
        self.until: dict[str, float] = {}
        self.released: dict[str, tuple[float, float]] = {}  # tenant -> (when, last duration)

    def refuse(self, tenant: str, now: float) -> bool:
        if tenant in self.until:
            return False
        start, count = self.window.get(tenant, (now, 0))
        if now - start >= self.c.window_s:
            start, count = now, 0
        count += 1
        self.window[tenant] = (start, count)
        probation = tenant in self.released and now - self.released[tenant][0] < self.c.forgive_s
        threshold = max(1, self.c.refusals_max // 4) if probation else self.c.refusals_max
        if count < threshold or len(self.until) >= self.c.tarpitted_max:
            return False
        duration = self.c.duration_s
        if probation:
            duration = min(self.released[tenant][1] * 2, self.c.duration_max_s)
        self.until[tenant] = now + duration
        self.released[tenant] = (self.released.get(tenant, (0.0, 0.0))[0], duration)
        self.window[tenant] = (start, 0)
        return True

    def expire(self, now: float) -> list[str]:
        ended = sorted(t for t, u in self.until.items() if u <= now)
        for tenant in ended:
            del self.until[tenant]
            self.released[tenant] = (now, self.released[tenant][1])
            self.window[tenant] = (now, 0)
        return ended


events = st.lists(
    st.tuples(st.sampled_from(["a", "b", "c", "d"]), st.floats(min_value=0, max_value=3), st.booleans()),
    max_size=300,
)


@settings(max_examples=300, deadline=None)
@given(events, st.integers(min_value=1, max_value=4))
def test_the_core_does_what_the_model_does(steps: list[tuple[str, float, bool]], most: int) -> None:
    config = TarpitConfig(
        refusals_max=8, window_s=1.0, duration_s=0.5, duration_max_s=4.0, forgive_s=5.0, tarpitted_max=most
    )
    core, model = TarpitCore(config), Model(config)
    now = 0.0
    for tenant, advance, expire in steps:
        now += advance
        assert core.note_refusal(tenant, now) == model.refuse(tenant, now)
        if expire:
            assert core.expire(now) == model.expire(now)
        assert core.tarpitted() == set(model.until)
        assert all(core.until_s(t) == u for t, u in model.until.items())
        assert len(core.tarpitted()) <= most
        assert all(u - now <= config.duration_max_s for u in model.until.values())


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.floats(min_value=0, max_value=2)), max_size=300))
def test_memory_stays_bounded_and_keeps_every_tarpitted_tenant(steps: list[tuple[int, float]]) -> None:
    core = TarpitCore(TarpitConfig(refusals_max=2, tarpitted_max=3, tenants_max=5, duration_s=1.0))
    now = 0.0
    for tenant, advance in steps:
        now += advance
        core.note_refusal(f"t{tenant}", now)
        core.expire(now)
        assert core.tracked() <= 5
        assert all(core.until_s(t) is not None for t in core.tarpitted())
