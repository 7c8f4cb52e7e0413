"""A writer names its group's parent, and a parent link keeps a group from being a leaf while
its child lives. Review, 2026-12-05: a group naming itself, or two naming each other, were never
victims whatever the pool's pressure, so a tenant could pin its data past its quota. The core
keeps a parent link only to an object before it in a prefix (a lower chunk index), and the
directory refuses a group naming itself."""

from __future__ import annotations

import pytest

from kvfabric.core.eviction import EvictionCore
from kvfabric.core.eviction_model import EvictBatch, EvictionConfig


def victims_after_pressure(core: EvictionCore, now: int) -> list[object]:
    out: list[object] = []
    for effect in core.tick(now):
        assert isinstance(effect, EvictBatch)
        out.extend(effect.victims)
        for victim in effect.victims:
            core.removed(victim)
    return out


@pytest.mark.parametrize("policy", ["lru", "density", "sieve"])
def test_a_group_naming_itself_or_a_cycle_of_groups_is_still_a_victim(policy: str) -> None:
    core = EvictionCore(EvictionConfig(policy=policy, high_watermark=0.5, low_watermark=0.1))  # type: ignore[arg-type]
    core.set_capacity("pool", 100)
    core.insert("self", tenant="evil", pool="pool", size=20, parent="self", chunk_index=5, now_ms=1)
    core.insert("a", tenant="evil", pool="pool", size=20, parent="b", chunk_index=5, now_ms=2)
    core.insert("b", tenant="evil", pool="pool", size=20, parent="a", chunk_index=5, now_ms=3)
    # b's link back to a (resident, not before it) at once; a's to b when b arrives (not before a)
    assert core.counters["parent_refused_total"] == 2
    core.check_invariants()
    chosen = victims_after_pressure(core, 10)
    assert "self" in chosen and "a" in chosen, chosen  # before: never leaves, never chosen
    core.check_invariants()


def test_a_real_prefix_keeps_its_order() -> None:
    core = EvictionCore(EvictionConfig(high_watermark=0.5, low_watermark=0.01))
    core.set_capacity("pool", 100)
    for i, key in enumerate(["h", "m", "t"]):
        core.insert(
            key,
            tenant="t",
            pool="pool",
            size=20,
            parent=["h", "m"][i - 1] if i else None,
            chunk_index=i,
            now_ms=1 + i,
        )
    assert victims_after_pressure(core, 10) == ["t", "m", "h"]  # tails before heads
    assert core.counters.get("parent_refused_total", 0) == 0


def test_the_directory_refuses_a_group_naming_itself_as_its_parent() -> None:
    from kvfabric.format.errors import BadRequest
    from kvfabric.format.ids import ChainHash
    from kvfabric.proto import directory as m
    from tests.unit.core.dirkit import groups, key, new_core, register

    core = new_core()
    register(core, "s1", capacity=10_000)
    (g,) = groups(1, seed=41)
    own_chain = ChainHash(bytes(g.group_id())[-32:])  # a group id ends with its chain hash
    spec = m.ObjectSpec(key=key(g), size_bytes=10, checksum=b"", parent=own_chain)
    with pytest.raises(BadRequest, match="its own parent"):
        core.handle(m.PutBegin(writer_id="w", request_id="r", objects=[spec]), 1)
    core.check_invariants()
