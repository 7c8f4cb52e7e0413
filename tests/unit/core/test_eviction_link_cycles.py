"""Parent links that close a cycle through a parent stored after its child. Review, 2026-12-06:
group a (chunk 0) names b as its parent while b is not stored yet (the link is kept, waiting:
a sharded directory's events come in any order); then b (chunk 1) names a, stored and before
it, so kept too. Each was the other's parent, neither ever a leaf: ticks returned nothing for
good, over the tenant's hard quota as over the pool's watermarks. The core now cuts, when a
parent arrives, the waiting links of children not after it in a prefix, and a parent removed
while its children stay takes at most its old chunk index when it comes back; every stored
link points at a lower chunk index (`check_invariants`)."""

from __future__ import annotations

import pytest

from kvfabric.core.eviction import EvictionConfig, EvictionCore, PolicyName, TenantQuota
from tests.unit.core.test_eviction_parent_links import victims_after_pressure

POLICIES: list[PolicyName] = ["lru", "density", "sieve"]


def chosen(core: EvictionCore, now: int) -> list[object]:
    """The victims of one tick, each then removed (the directory evicts them)."""
    out = victims_after_pressure(core, now)
    core.check_invariants()
    return out


def quota_core(policy: PolicyName) -> EvictionCore:
    core = EvictionCore(EvictionConfig(policy=policy), {"evil": TenantQuota(hard_bytes=10)})
    core.set_capacity("pool", 1_000)  # far from its watermarks: only the quota evicts
    return core


@pytest.mark.parametrize("policy", POLICIES)
def test_two_groups_naming_each_other_across_an_early_link_are_still_victims(policy: PolicyName) -> None:
    core = quota_core(policy)
    core.insert("a", tenant="evil", pool="pool", size=20, parent="b", chunk_index=0, now_ms=1)
    core.insert("b", tenant="evil", pool="pool", size=20, parent="a", chunk_index=1, now_ms=2)
    victims = chosen(core, 10)  # 40 bytes over a 10-byte quota: before, none ever
    assert victims == ["b", "a"], victims  # b's link to a kept (a is before it): b goes first
    assert core.counters["parent_refused_total"] == 1  # a's link to b, cut as b arrived
    assert core.tenant_bytes("evil") == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_a_parent_back_at_a_later_chunk_index_naming_its_waiting_child_is_still_a_victim(
    policy: PolicyName,
) -> None:
    core = quota_core(policy)
    core.insert("p", tenant="evil", pool="pool", size=5, parent=None, chunk_index=0, now_ms=1)
    core.insert("x", tenant="evil", pool="pool", size=5, parent="p", chunk_index=1, now_ms=2)
    core.removed("p")  # freed elsewhere while its tail stays: x waits for it
    # Back, claiming chunk 5 and x (chunk 1) as its parent: x was linked as after p's chunk 0.
    core.insert("p", tenant="evil", pool="pool", size=20, parent="x", chunk_index=5, now_ms=3)
    explained = core.explain("p")
    victims = chosen(core, 10)  # 25 bytes over a 10-byte quota: before, none ever
    assert victims == ["x", "p"], victims
    assert explained is not None and explained["chunk_index"] == 0  # p's chunk index when x was linked
    assert core.counters["chunk_index_lowered_total"] == 1
