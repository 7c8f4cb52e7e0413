"""A pressed pool with nothing it may evict costs a tick O(1), not a walk over every leaf.
Review, 2026-12-06: with 200,000 groups elsewhere and a pressed pool's own groups all cooling
down after refusals (leased, pinned) or kept by their tenant's guaranteed share, every 200 ms
tick popped and pushed back all 200,100 leaves (one ranking for every pool), 266-500 ms a tick.
A pass that runs out of leaves before it frees what it needs is now parked until the earliest
cooldown it passed over ends, or something that may go lands in its pool
(`EvictionCore._park`; `candidates_examined_total` counts the leaves a pass looks at)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvfabric.core.eviction import EvictBatch, EvictionConfig, EvictionCore, PolicyName, TenantQuota

POLICIES: tuple[PolicyName, ...] = ("lru", "density")  # heap policies: a queue policy is never parked
ELSEWHERE = 2_000  # leaves in another pool, all ranked after the pressed pool's
BATCH = 8


def examined(core: EvictionCore) -> int:
    return core.counters.get("candidates_examined_total", 0)


def victims_of(effects: Sequence[object]) -> list[object]:
    out: list[object] = []
    for effect in effects:
        assert isinstance(effect, EvictBatch)
        out.extend(effect.victims)
    return out


def pressed_core(policy: PolicyName) -> EvictionCore:
    """Pool "b" (capacity 100) holds 100 bytes: 50 of tenant "g", whose guaranteed share is
    all of them, and 50 of tenant "t"; pool "a" holds `ELSEWHERE` leaves, far below its
    watermarks. The first tick takes t's oldest two of b, which the directory refuses."""
    core = EvictionCore(
        EvictionConfig(policy=policy, batch_max=BATCH, refused_cooldown_ms=5_000),
        {"g": TenantQuota(guaranteed_bytes=50)},
    )
    core.set_capacity("a", 10**9)
    core.set_capacity("b", 100)
    now = 0
    for tenant in ("t", "g"):
        for i in range(5):
            now += 1
            core.insert((tenant, i), tenant=tenant, pool="b", size=10, parent=None, chunk_index=0, now_ms=now)
    for i in range(ELSEWHERE):
        now += 1
        core.insert(("a", i), tenant="t", pool="a", size=10, parent=None, chunk_index=0, now_ms=now)
    return core


def refuse_all(core: EvictionCore, effects: Sequence[object], now: int) -> list[object]:
    victims = victims_of(effects)
    for victim in victims:
        core.refused(victim, now)
    return victims


@pytest.mark.parametrize("policy", POLICIES)
def test_a_pressed_pool_with_nothing_it_may_evict_is_not_walked_every_tick(policy: PolicyName) -> None:
    core = pressed_core(policy)
    now = 10_000
    # Until t's five groups in b are all refused (cooling down): b over its high watermark
    # again after each refusal, g's groups kept by its share.
    refused: set[object] = set()
    while len(refused) < 5:
        now += 200
        refused.update(refuse_all(core, core.tick(now), now))
        core.check_invariants()
        assert now < 11_000
    assert all(isinstance(victim, tuple) and victim[0] == "t" for victim in refused)
    # Every tick within the cooldown: at most one pass over every leaf (the one that finds
    # none may go), then none. Before: ELSEWHERE + 10 leaves looked at every tick.
    walks = []
    for _ in range(15):
        now += 200
        before = examined(core)
        assert core.tick(now) == []
        walks.append(examined(core) - before)
        core.check_invariants()
    assert sum(1 for n in walks if n > BATCH) <= 1, walks
    assert walks[-1] == 0, walks
    assert core.counters["passes_parked_total"] >= 13
    # A leaf landing in b ends the wait at once: it goes at the next tick.
    core.insert("new", tenant="t", pool="b", size=10, parent=None, chunk_index=0, now_ms=now)
    now += 200
    assert victims_of(core.tick(now)) == ["new"]
    core.check_invariants()
    # So does the earliest cooldown's end: the refused ones are asked again.
    core.refused("new", now)
    now += 5_000
    assert set(victims_of(core.tick(now))) <= refused and victims_of(core.tick(now + 1)) == []
    core.check_invariants()


@pytest.mark.parametrize("policy", POLICIES)
def test_a_pool_parked_by_a_tenants_share_looks_again_once_that_tenant_grows(policy: PolicyName) -> None:
    core = EvictionCore(
        EvictionConfig(policy=policy, batch_max=BATCH), {"g": TenantQuota(guaranteed_bytes=50)}
    )
    core.set_capacity("a", 10**9)
    core.set_capacity("b", 50)
    for i in range(5):
        core.insert(("g", i), tenant="g", pool="b", size=10, parent=None, chunk_index=0, now_ms=i)
    for i in range(ELSEWHERE):
        core.insert(("a", i), tenant="t", pool="a", size=10, parent=None, chunk_index=0, now_ms=10 + i)
    assert core.tick(5_000) == []  # b is full, but all of it is g's guaranteed share
    before = examined(core)
    assert core.tick(5_200) == [] and examined(core) == before  # parked
    core.check_invariants()
    # g stores 10 more bytes in the other pool: one of its groups in b may go now.
    core.insert("g-more", tenant="g", pool="a", size=10, parent=None, chunk_index=0, now_ms=5_300)
    core.check_invariants()
    assert victims_of(core.tick(5_400)) == [("g", 0)]


@pytest.mark.parametrize("policy", ["wtinylfu", "s3fifo", "sieve"])
def test_a_queue_policys_pool_is_never_parked_on_a_bounded_scan(policy: str) -> None:
    """A queue policy's `choose` also stops at its scan bound (other pools' objects count as
    refused there): parked then, pool b kept leaves it could evict and nothing woke it — once its
    arena was full no save landed in it (review of f9cfe43)."""
    core = EvictionCore(EvictionConfig(policy=policy, batch_max=64))  # type: ignore[arg-type]
    core.set_capacity("a", 10**9)
    core.set_capacity("b", 100)
    now = 0
    for i in range(2_000):
        now += 1
        core.insert(("a", i), tenant="t", pool="a", size=10, parent=None, chunk_index=0, now_ms=now)
    for i in range(10):
        now += 1
        core.insert(("b", i), tenant="t", pool="b", size=10, parent=None, chunk_index=0, now_ms=now)
    chosen = 0
    for _ in range(60):
        now += 200
        chosen += sum(len(e.victims) for e in core.tick(now) if isinstance(e, EvictBatch))
        core.check_invariants()
    assert chosen > 0


def test_a_pool_parked_on_a_tenants_share_wakes_after_another_pool_is_dropped() -> None:
    """The pass measured the tenant's need at X's size in two pools; `drop_pool` shrank X, and
    the tenant's later growth never reached the stale need (review of f9cfe43)."""
    core = EvictionCore(EvictionConfig(policy="lru", batch_max=8), {"g": TenantQuota(guaranteed_bytes=50)})
    for pool, capacity in (("a", 10**9), ("b", 50), ("c", 10**9)):
        core.set_capacity(pool, capacity)
    core.insert("X", tenant="g", pools={"b": 10, "c": 10}, parent=None, chunk_index=0, now_ms=1)
    core.insert("Y", tenant="g", pools={"b": 40}, parent=None, chunk_index=0, now_ms=2)
    assert not [e for e in core.tick(1_000) if isinstance(e, EvictBatch)]  # g at its share
    core.drop_pool("c")
    core.insert("Z", tenant="g", pool="a", size=10, parent=None, chunk_index=0, now_ms=2_000)
    core.check_invariants()  # nothing parked that may go
    victims = [v for e in core.tick(3_000) if isinstance(e, EvictBatch) for v in e.victims]
    assert "X" in victims
