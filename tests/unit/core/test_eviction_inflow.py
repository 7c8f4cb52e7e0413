"""A writer faster than the ticks: each tick measures a pool's inflow and lowers both watermarks
by what that inflow stores in `inflow_horizon_ms` (`kvfabric.core.eviction`, "Writers faster
than the ticks"). Off (0) the watermarks are the configured ones."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvfabric.core.eviction import (
    INFLOW_HALF_LIFE_MS,
    WRITER_GAP_MS,
    EvictBatch,
    EvictionConfig,
    EvictionCore,
)

CAPACITY = 1_000


def core_with(horizon_ms: int, **config: object) -> EvictionCore:
    core = EvictionCore(
        EvictionConfig(
            policy="lru",
            high_watermark=0.9,
            low_watermark=0.8,
            batch_max=1_000,
            inflow_horizon_ms=horizon_ms,
            **config,  # type: ignore[arg-type]
        )
    )
    core.set_capacity("p", CAPACITY)
    return core


class Writer:
    """One-chunk objects of `size` bytes, ids counting up (so the oldest is the LRU victim)."""

    def __init__(self, core: EvictionCore) -> None:
        self.core, self.next_id = core, 0

    def write(self, nbytes: int, now_ms: int, size: int = 10) -> None:
        for _ in range(nbytes // size):
            self.core.insert(
                self.next_id, tenant="t", pool="p", size=size, parent=None, chunk_index=0, now_ms=now_ms
            )
            self.next_id += 1


def victims_bytes(effects: Sequence[object], size: int = 10) -> int:
    return sum(len(e.victims) * size for e in effects if isinstance(e, EvictBatch))


def test_off_the_watermarks_are_the_configured_ones_whatever_the_writers_do() -> None:
    core = core_with(0)
    writer = Writer(core)
    core.tick(0)
    writer.write(850, 100)
    assert core.tick(200) == []  # 85 % < 90 %
    assert core.inflow("p") == pytest.approx(850 * 1000 / 200)  # measured all the same
    assert core.margin_bytes("p") == 0
    core.check_invariants()


def test_a_fast_writer_makes_the_pool_evict_earlier_and_further() -> None:
    core = core_with(400)
    writer = Writer(core)
    core.tick(0)  # starts the count
    writer.write(500, 100)
    assert core.tick(200) == []  # 50 %: 2,500 B/s x 0.4 s = a margin of 400 (the cap) ...
    assert core.inflow("p") == pytest.approx(2_500)
    assert core.margin_bytes("p") == 400  # ... at most half the low watermark's 800
    writer.write(100, 300)
    # 60 % > 90 % - 40 %: pressed, down to 80 % - 40 % = 400 bytes
    effects = core.tick(400)
    assert core.margin_bytes("p") == 400  # the slower second tick keeps most of the first's rate
    assert victims_bytes(effects) == 600 - 400
    core.check_invariants()


def test_the_margin_is_the_inflow_over_the_horizon() -> None:
    core = core_with(200)
    writer = Writer(core)
    writer.write(560, 0)  # before the first tick: not a rate
    core.tick(0)
    writer.write(140, 50)  # 140 B in 0.1 s: 1,400 B/s, 280 B in the 200 ms horizon
    effects = core.tick(100)
    assert core.margin_bytes("p") == 280
    # 700 > 900 - 280 = 620: evicts down to 800 - 280 = 520
    assert victims_bytes(effects) == 180
    core.check_invariants()


def test_ticks_further_apart_than_the_horizon_stretch_it() -> None:
    """A service performs a tick's victims before the next tick: a slow batch (a demotion)
    spaces the ticks, and victims then land later: twice the interval is the horizon."""
    core = core_with(200)
    writer = Writer(core)
    core.tick(0)
    writer.write(100, 100)
    core.tick(500)  # 200 B/s over ticks 500 ms apart: a horizon of 1 s, not 200 ms
    assert core.inflow("p") == pytest.approx(200)
    assert core.margin_bytes("p") == 200
    writer.write(20, 550)
    core.tick(600)  # 100 ms apart again: the configured 200 ms
    assert core.margin_bytes("p") == int(core.inflow("p") * 0.2)
    core.check_invariants()


def test_the_first_tick_only_starts_the_count() -> None:
    """A service ticks once it has replayed its history: a replay is not a writer's rate."""
    core = core_with(400)
    Writer(core).write(850, 0)
    assert core.tick(10) == []  # 85 %, no margin yet
    assert core.inflow("p") == 0 and core.margin_bytes("p") == 0
    assert core.tick(210) == []  # nothing new since: still no margin
    core.check_invariants()


def test_objects_found_stored_are_not_inflow() -> None:
    core = core_with(400)
    core.tick(0)
    for i in range(85):  # adopted from a listing: stored before, last used then
        core.insert(
            i, tenant="t", pool="p", size=10, parent=None, chunk_index=0, now_ms=100, last_access_ms=50
        )
    assert core.tick(200) == [] and core.inflow("p") == 0
    core.check_invariants()


def test_the_inflow_follows_a_lower_rate_with_its_half_life() -> None:
    core = core_with(100)
    writer = Writer(core)
    core.tick(0)
    writer.write(200, 100)
    core.tick(1_000)  # 200 B/s
    assert core.inflow("p") == pytest.approx(200)
    core.tick(1_000 + INFLOW_HALF_LIFE_MS)  # nothing written for one half-life
    assert core.inflow("p") == pytest.approx(100)
    writer.write(1_000, 2_100)
    core.tick(2_000 + INFLOW_HALF_LIFE_MS)  # a faster rate is taken at once
    assert core.inflow("p") == pytest.approx(1_000)
    for step in range(1, 30):  # no writer: back to the configured watermarks
        core.tick(3_000 + step * INFLOW_HALF_LIFE_MS)
    assert core.margin_bytes("p") == 0
    core.check_invariants()


def test_a_tick_at_the_same_time_keeps_the_bytes_for_the_next() -> None:
    core = core_with(1_000)
    writer = Writer(core)
    core.tick(0)
    writer.write(100, 0)
    core.tick(0)  # no time passed: nothing measured, nothing reset
    assert core.inflow("p") == 0
    core.tick(1_000)
    assert core.inflow("p") == pytest.approx(100)
    core.check_invariants()


def test_a_refused_victim_rearms_the_pool_against_its_lowered_target() -> None:
    core = core_with(400, refused_cooldown_ms=10)
    writer = Writer(core)
    core.tick(0)
    writer.write(600, 100)
    (batch,) = core.tick(200)  # margin 400 (capped): 600 > 500, down to 400
    assert isinstance(batch, EvictBatch) and len(batch.victims) == 20
    core.refused(batch.victims[0], 200)  # leased: it stays
    for victim in batch.victims[1:]:
        core.removed(victim)
    assert core.used_bytes("p") == 410  # above the lowered low watermark (400): still pressed
    (again,) = core.tick(210)
    assert isinstance(again, EvictBatch) and len(again.victims) == 1
    core.check_invariants()


def test_a_negative_horizon_is_refused() -> None:
    with pytest.raises(AssertionError, match="inflow_horizon_ms"):
        EvictionConfig(inflow_horizon_ms=-1)


def test_how_long_a_pool_has_been_written_at_every_tick() -> None:
    core = core_with(400)
    writer = Writer(core)
    core.tick(0)
    assert core.writing_for_ms("p", 0) == 0
    writer.write(10, 50)
    core.tick(200)
    assert core.writing_for_ms("p", 200) == 200  # since the tick before the one that saw it
    writer.write(10, 250)
    core.tick(400)
    assert core.writing_for_ms("p", 500) == 500
    core.tick(600)  # a tick without a new object: a gap, not yet an end
    assert core.writing_for_ms("p", 600) == 600
    core.tick(400 + WRITER_GAP_MS)  # nothing new for WRITER_GAP_MS: stopped
    assert core.writing_for_ms("p", 400 + WRITER_GAP_MS) == 0
    assert core.writing_for_ms("absent", 600) == 0
