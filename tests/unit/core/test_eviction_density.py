"""The hit-density predictor (`kvfabric.core.eviction_density`) and the `density` policy of the
eviction core: what it learns from reuse gaps, how it ranks, admits and explains, its bounds."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfabric.core.eviction import Admitted, EvictBatch, EvictionConfig, EvictionCore, Refused
from kvfabric.core.eviction_density import (
    DENSITY_AGE_BUCKETS,
    DENSITY_GHOST_FLOOR,
    DENSITY_GHOST_PER_OBJECT,
    DENSITY_LENGTH_CLASSES,
    DENSITY_NAMING_CLASSES,
    DensityPredictor,
    _credit,
    _pack,
    _unpack,
    age_bucket,
    density_class,
)
from kvfabric.format.invariant import InvariantViolation


def test_age_buckets_are_log_spaced_and_capped() -> None:
    assert [age_bucket(a) for a in (-5, 0, 999, 1000, 1499, 1500, 2249, 2250)] == [0, 0, 0, 1, 1, 2, 2, 3]
    assert age_bucket(10**12) == DENSITY_AGE_BUCKETS - 1


def test_classes_bucket_namings_and_prompt_length() -> None:
    assert density_class(1, 1) == (1, 1)
    assert density_class(3, 8) == (3, 4)
    assert density_class(9, 10_000) == (4, 7)  # namings and length capped
    assert density_class(0, 0) == (1, 1)


def _teach(predictor: DensityPredictor, gap_ms: int | None, prompt_chunks: int, n: int, tag: str) -> None:
    """`n` ids named once, and again `gap_ms` later (None: never again)."""
    for i in range(n):
        predictor.name((tag, i), i * 100_000, prompt_chunks)
        if gap_ms is not None:
            predictor.name((tag, i), i * 100_000 + gap_ms, prompt_chunks)


def test_untrained_classes_are_kept_and_learned_densities_follow_the_gaps() -> None:
    predictor = DensityPredictor(recompute_every=1_000_000)
    short, long, never = (1, 1), (1, 3), (1, 5)
    assert predictor.density(short, 0) == math.inf  # no evidence: keep (LRU among equals)
    _teach(predictor, 2_000, 1, 100, "short")  # class (1, 1): named again 2 s later
    _teach(predictor, 60_000, 4, 100, "long")  # class (1, 3): named again a minute later
    _teach(predictor, None, 16, 100, "never")  # class (1, 5): never named again
    predictor.recompute()
    assert predictor.density(short, 0) > predictor.density(long, 0) > predictor.density(never, 0) == 0.0
    # past its gap a class is worth nothing; before it, a late reuse still pays
    assert predictor.density(short, 120_000) == 0.0
    assert predictor.density(long, 30_000) > 0.0
    assert predictor.classes()[short] == (100.0, 100.0)
    assert predictor.classes()[(2, 1)] == (0.0, 100.0)  # the second naming starts class 2
    predictor.check(resident_objects=0)


def test_a_naming_the_ghost_forgot_is_no_reuse_and_the_ghost_is_bounded() -> None:
    predictor = DensityPredictor()
    bound = DENSITY_GHOST_PER_OBJECT * DENSITY_GHOST_FLOOR
    for i in range(bound + 10):
        predictor.name(i, i, 1)
        predictor.trim(resident_objects=0)
        assert predictor.ghost_size() <= bound
    assert predictor.name(0, bound + 20, 1) == (1, 1)  # forgotten: a first naming again
    assert predictor.name(bound + 9, bound + 21, 1) == (2, 1)  # remembered: a reuse
    assert predictor.classes()[(1, 1)] == (1.0, bound + 11.0)


def test_the_ghost_check_catches_an_unbounded_ghost() -> None:
    predictor = DensityPredictor()
    for i in range(DENSITY_GHOST_PER_OBJECT * DENSITY_GHOST_FLOOR + 1):
        predictor.name(i, i, 1)
    with pytest.raises(InvariantViolation):
        predictor.check(resident_objects=0)


def _core(admission: str = "always", capacity: int = 8) -> EvictionCore:
    core = EvictionCore(
        EvictionConfig(
            policy="density",
            admission="predicted" if admission == "predicted" else "always",
            high_watermark=1.0,
            low_watermark=0.75,
            batch_max=100,
            density_recompute_every=1,
        )
    )
    core.set_capacity("p", capacity)
    return core


def _prompt(core: EvictionCore, ids: list[str], now_ms: int) -> list[bool]:
    """One request naming the chain `ids`: hits are accessed, misses written; admitted per chunk."""
    admitted = []
    for i, object_id in enumerate(ids):
        effects = core.insert(
            object_id,
            tenant="t",
            pool="p",
            size=1,
            parent=ids[i - 1] if i else None,
            chunk_index=i,
            now_ms=now_ms,
            prompt_chunks=len(ids),
        )
        admitted.append(isinstance(effects[0], Admitted))
    return admitted


def _evict(core: EvictionCore, now_ms: int) -> list[str]:
    victims: list[str] = []
    for effect in core.tick(now_ms):
        assert isinstance(effect, EvictBatch)
        assert set(effect.victim_reasons) == {"lowest_hit_density"}
        for victim in effect.victims:
            core.removed(victim)
            victims.append(str(victim))
    return victims


def test_the_lowest_density_leaf_goes_first_even_when_more_recent_and_tails_before_heads() -> None:
    core = _core(capacity=1000)
    t = 0
    for i in range(200):  # one-chunk prompts are named again 1 s later; 2-chunk ones never
        _prompt(core, [f"s{i}"], t)
        _prompt(core, [f"s{i}"], t + 1_000)
        _prompt(core, [f"l{i}a", f"l{i}b"], t + 1_000)
        t += 5_000
    for object_id in list(f"s{i}" for i in range(200)) + [f"l{i}{c}" for i in range(200) for c in "ab"]:
        core.removed(object_id)
    core.set_capacity("p", 4)
    _prompt(core, ["x"], t)  # a one-chunk prompt (class (1, 1): reused, dense) ...
    _prompt(core, ["ya", "yb"], t + 10)  # ... and a newer 2-chunk one (class (1, 2): never reused)
    _prompt(core, ["z"], t + 20)
    _prompt(core, ["w"], t + 30)  # over capacity (4 of 4 at high watermark 1.0: 5 > 4)
    victims = _evict(core, t + 30)
    assert victims[:2] == ["yb", "ya"]  # the newer, sparse prefix goes, tail before head
    assert "x" in core and core.explain("x") is not None
    explained = core.explain("x")
    assert explained is not None and explained["density_class"] == (1, 1)
    assert explained["hit_density_per_byte_ms"] > 0
    core.check_invariants()


def test_predicted_admission_refuses_orphans_and_chunks_below_the_frontier() -> None:
    core = _core("predicted", capacity=1000)
    t = 0
    for i in range(200):  # as above: one-chunk prompts reused, 2-chunk prompts never
        _prompt(core, [f"s{i}"], t)
        _prompt(core, [f"s{i}"], t + 1_000)
        _prompt(core, [f"l{i}a", f"l{i}b"], t + 1_000)
        t += 5_000
    for object_id in list(f"s{i}" for i in range(200)) + [f"l{i}{c}" for i in range(200) for c in "ab"]:
        core.removed(object_id)
    core.set_capacity("p", 4)
    assert _prompt(core, ["a"], t) == [True]  # room below the low watermark
    assert _prompt(core, ["b"], t) == [True]
    assert _prompt(core, ["c"], t) == [True]
    assert _prompt(core, ["d"], t) == [True]  # 4 of 4: above the low watermark from now on
    effects = core.insert(
        "ya", tenant="t", pool="p", size=1, parent=None, chunk_index=0, now_ms=t, prompt_chunks=2
    )
    assert effects == [Refused("ya")] and effects[0].reason == "below_frontier"  # sparse: bypassed
    effects = core.insert(
        "yb", tenant="t", pool="p", size=1, parent="ya", chunk_index=1, now_ms=t, prompt_chunks=2
    )
    assert effects == [Refused("yb")] and effects[0].reason == "parent_absent"
    assert core.counters["admission_refused_below_frontier_total"] == 1
    assert _prompt(core, ["e"], t + 10) == [True]  # as dense as the residents at age 0: admitted
    core.check_invariants()


def test_class_heaps_stay_bounded_without_evictions() -> None:
    core = _core(capacity=10_000)
    _prompt(core, ["a", "b", "c"], 0)
    for t in range(1, 5_000):
        core.access("a", t)
        core.access("c", t)
    core.check_invariants()  # entries counted ...
    assert sum(map(len, core._class_heaps.values())) <= 4 * len(core) + 1024  # ... and compacted


def test_density_recompute_every_must_be_positive() -> None:
    with pytest.raises(InvariantViolation):
        EvictionConfig(policy="density", density_recompute_every=0)
    with pytest.raises(InvariantViolation):
        EvictionConfig(policy="lru", admission="predicted")  # predicted needs reuse or density


def test_a_class_set_aside_while_a_take_compacts_the_heaps_is_pushed_back() -> None:
    """A leaf of another pool is set aside (its class heap then empty) while the class heaps sit
    at their compaction bound (stale entries of removed objects); taking a victim pushes its
    parent, which compacts them and drops the empty class. The set-aside entry goes back all the
    same (it raised KeyError, ending the policy's ticker)."""
    core = EvictionCore(EvictionConfig(policy="density", high_watermark=0.5, low_watermark=0.1, batch_max=10))
    core.set_capacity("p", 100)
    core.set_capacity("q", 1000)
    core.insert("A", tenant="t", pool="q", size=1, parent=None, chunk_index=0, now_ms=0, prompt_chunks=64)
    core.insert("P", tenant="t", pool="p", size=30, parent=None, chunk_index=0, now_ms=1, prompt_chunks=2)
    core.insert("C", tenant="t", pool="p", size=30, parent="P", chunk_index=1, now_ms=1, prompt_chunks=2)
    now, junk = 2, 0
    while core._class_entries < 4 * len(core) + 1024:
        core.insert(f"x{junk}", tenant="t", pool="r", size=1, parent=None, chunk_index=0, now_ms=now)
        core.removed(f"x{junk}")
        now, junk = now + 1, junk + 1
    batches = [e for e in core.tick(now) if isinstance(e, EvictBatch)]
    assert [(b.pool, b.victims) for b in batches] == [("p", ("C", "P"))]
    core.check_invariants()
    core.set_capacity("q", 1)  # A, set aside above, is still ranked: q's victim now
    assert [b.victims for b in core.tick(now + 1) if isinstance(b, EvictBatch)] == [("A",)]


@given(
    st.integers(1, DENSITY_NAMING_CLASSES),
    st.integers(0, DENSITY_LENGTH_CLASSES - 1),
    st.integers(-(2**45), 2**45),
    st.integers(1, DENSITY_NAMING_CLASSES),
    st.integers(0, 100_000),
)
def test_a_ghost_entry_packs_into_one_int_and_back(
    namings_cls: int, length_cls: int, ms: int, namings: int, halvings: int
) -> None:
    packed = _pack((namings_cls, length_cls), ms, namings, halvings)
    unpacked = ((namings_cls, length_cls), ms, namings, halvings % (1 << 16))
    assert isinstance(packed, int) and _unpack(packed) == unpacked


def test_reuses_of_namings_from_before_a_halving_are_halved_too() -> None:
    """A class halves at `DENSITY_HALVE_AT` namings; its namings still in the ghost were then
    credited whole when reused (review, stop 68): 70,000 namings then each reused left 37,232
    namings and 70,000 reuses, negative survivors and densities ~1e11 times too high. Now a
    class's reuses never exceed its namings and its densities stay below a hit per ms."""
    predictor = DensityPredictor(recompute_every=1 << 30)
    n = 70_000
    for i in range(n):
        predictor.name(("a", i), i, 1)
        predictor.trim(10**6)
    for i in range(n):
        predictor.name(("a", i), n + 60_000 + i // 2, 1)  # reused 95-130 s later
    reused, named = predictor.classes()[(1, 1)]
    assert reused <= named
    predictor.recompute()
    table = predictor.table((1, 1))
    assert table is not None and max(table) < 1.0
    predictor.check(10**6)


def test_a_reuse_of_a_naming_many_halvings_old_is_worth_nothing() -> None:
    """Kept mod 256, a naming 256 halvings old was credited whole again (review of the fix)."""
    assert _credit(256, 0) == 0.0 and _credit(257, 0) == 0.0 and _credit(65, 0) == 0.0
    assert _credit(3, 1) == 0.25 and _credit(70_000, 70_000 - 1) == 0.5
