"""Unacknowledged frees are resent `free_retry_ms` after they went, at most
`free_resend_batch_max` a tick, oldest first; a tick walks only the frees it sends (it walked every
outstanding free: 200,000 of them to a slow segment cost every 100 ms tick a walk of them all;
review, stop 67)."""

from __future__ import annotations

from typing import Any

from kvfabric.core.directory import DirectoryCore, FreeSlots
from kvfabric.format.ids import ObjectKey
from kvfabric.proto import directory as m
from tests.unit.core.dirkit import groups, key, new_core, put, register


def resent(effects: list[Any]) -> list[int]:
    return sorted(s.slot for e in effects if isinstance(e, FreeSlots) for s in e.slots)


def evict_all(core: DirectoryCore, n: int, now: int, seed: int = 71) -> list[int]:
    """Publish and evict `n` one-object groups on s1; returns their slots (the frees are lost)."""
    register(core, "s1", capacity=10_000_000)
    gs = groups(n, seed=seed)
    put(core, [key(g) for g in gs])
    effects = core.handle(m.Evict(groups=[g.group_id() for g in gs]), now).effects
    return resent(effects)


def adopted_at(core: DirectoryCore, segment_id: str, gs: list[Any], now: int) -> list[Any]:
    """A new leader adopts one object of each of `gs` on `segment_id` (incarnation 7; slot i for
    the i-th), its grace starting `now`; returns `gs`."""
    from kvfabric.core.directory.rebuild import SegmentHolding
    from kvfabric.proto.segment import HeldObject

    registration = m.RegisterSegment(
        segment_id=segment_id,
        incarnation=7,
        capacity_bytes=10_000,
        domain=m.FailureDomain(host=segment_id, zone=segment_id),
        data_addr=f"tcp://{segment_id}",
    )
    held = [HeldObject(key(g), i, 1, 100, b"g" * 16) for i, g in enumerate(gs)]
    assert core.adopt([SegmentHolding(registration, held)], now_ms=now) == []
    return gs


class NoWalk(dict[Any, Any]):
    """The frees table's entries, refusing to be walked."""

    def items(self) -> Any:
        raise AssertionError("a tick walked every outstanding free")

    def values(self) -> Any:
        raise AssertionError("a tick walked every outstanding free")

    def __iter__(self) -> Any:
        raise AssertionError("a tick walked every outstanding free")


def test_a_mass_resend_is_spread_over_ticks_oldest_first() -> None:
    core = new_core(free_retry_ms=1_000, free_resend_batch_max=8)
    slots = evict_all(core, 20, now=10)
    assert len(slots) == 20
    assert resent(core.tick(100)) == []  # stamped sent at 100
    first = resent(core.tick(1_100))
    second = resent(core.tick(1_200))
    third = resent(core.tick(1_300))
    assert (len(first), len(second), len(third)) == (8, 8, 4)
    assert sorted(first + second + third) == slots  # each once
    assert resent(core.tick(1_400)) == []
    # the first eight were sent again at 1,100: due again at 2,100, before the rest
    assert resent(core.tick(2_100)) == first
    assert resent(core.tick(2_200)) == second
    assert core.counters["free_retries_total"] == 36
    core.check_invariants()


def test_a_tick_does_not_walk_the_outstanding_frees() -> None:
    core = new_core(free_retry_ms=1_000)
    evict_all(core, 50, now=10)
    core.tick(100)  # stamped
    table = core.free_table
    table.pending = NoWalk(table.pending)
    for now in (200, 500, 900):  # none due: nothing sent, nothing walked
        assert resent(core.tick(now)) == []
    assert len(resent(core.tick(1_100))) == 50  # due: those sent are the ones looked at
    table.pending = dict(table.pending)
    core.check_invariants()


def test_acknowledged_frees_are_not_resent_and_leave_nothing_behind() -> None:
    core = new_core(free_retry_ms=1_000)
    slots = evict_all(core, 30, now=10)
    core.tick(100)
    acked = slots[:20]
    core.handle(
        m.SlotsFreed(
            segment_id="s1", incarnation=1, freed=[m.FreedSlot(ObjectKey(b""), s, 1) for s in acked]
        ),
        150,
    )
    assert resent(core.tick(1_100)) == slots[20:]
    core.handle(
        m.SlotsFreed(
            segment_id="s1", incarnation=1, freed=[m.FreedSlot(ObjectKey(b""), s, 1) for s in slots[20:]]
        ),
        1_150,
    )
    assert resent(core.tick(2_100)) == [] and not core.free_table.pending
    assert not core.evicting
    core.check_invariants()


def test_stale_items_of_acknowledged_frees_are_dropped() -> None:
    core = new_core(free_retry_ms=1_000_000)  # never due within the test
    for round_ in range(3):
        slots = evict_all(core, 600, now=10 + round_, seed=100 + round_)
        core.tick(100 + round_)
        core.handle(
            m.SlotsFreed(
                segment_id="s1", incarnation=1, freed=[m.FreedSlot(ObjectKey(b""), s, 1) for s in slots]
            ),
            200,
        )
    assert not core.free_table.pending
    assert len(core.free_table._due) <= 2 * len(core.free_table.pending) + 1_024


def test_frees_held_through_a_grace_go_in_batches_when_it_ends() -> None:
    core = new_core(lease_ttl_ms_max=500, free_resend_batch_max=4)
    gs = adopted_at(core, "s1", groups(10, seed=72), now=1_000)
    core.handle(m.Evict(groups=[g.group_id() for g in gs]), 1_100)  # adopted slots: held
    assert resent(core.tick(1_499)) == []
    core.check_invariants()
    sent = [resent(core.tick(now)) for now in (1_500, 1_600, 1_700, 1_800)]
    assert sent == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], []]
    core.check_invariants()


def test_frees_held_through_a_grace_go_before_due_resends() -> None:
    """After the due resends in a tick's budget, the queued frees (held through a grace, the
    oldest) starved while more resends were due each tick than the budget (review of the fix:
    0 of 10 sent in 54 s)."""
    core = new_core(lease_ttl_ms_max=500, free_retry_ms=100, free_resend_batch_max=4)
    adopted = adopted_at(core, "s0", groups(6, seed=81), now=1_000)
    core.handle(m.Evict(groups=[g.group_id() for g in adopted]), 1_010)  # held: the grace
    evict_all(core, 30, now=1_020, seed=82)  # s1's frees: sent, never acknowledged
    for now in range(1_100, 1_500, 100):  # s1's frees due again and again; heartbeats alive
        core.handle(m.Heartbeat(segment_id="s0", incarnation=7, used_bytes=0), now)
        core.handle(m.Heartbeat(segment_id="s1", incarnation=1, used_bytes=0), now)
        core.tick(now)
    sent_s0: list[int] = []
    for now in range(1_500, 1_800, 100):  # the grace is over
        core.handle(m.Heartbeat(segment_id="s0", incarnation=7, used_bytes=0), now)
        core.handle(m.Heartbeat(segment_id="s1", incarnation=1, used_bytes=0), now)
        sent_s0 += [
            s.slot
            for e in core.tick(now)
            if isinstance(e, FreeSlots) and e.segment_id == "s0"
            for s in e.slots
        ]
    assert sorted(sent_s0) == list(range(6))  # 4, then 2: before any due resend
    core.check_invariants()
