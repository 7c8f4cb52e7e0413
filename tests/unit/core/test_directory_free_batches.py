"""Frees go to a segment batched: one FreeSlots per segment incarnation per call, not one per
slot (the live eviction replay, stop 33: an eviction of 256 slots sent 256 requests at once, the
segment's lane of 64 answered the rest `busy`, and a third of the writes failed for space)."""

from __future__ import annotations

from kvfabric.core.directory import DirectoryConfig, DirectoryCore, Effect, EmitEvent, FreeSlots
from kvfabric.core.directory.frees import FREE_SLOTS_PER_REQUEST_MAX, batch_frees
from kvfabric.format.ids import ObjectKey
from kvfabric.proto import directory as m

from .dirkit import SECRET, groups, key, put, register


def slot(n: int) -> m.FreedSlot:
    return m.FreedSlot(ObjectKey(b""), n, 1)


def test_an_eviction_frees_each_segment_in_one_request() -> None:
    core = DirectoryCore(DirectoryConfig(ticket_secret=SECRET, replicas_default=2))
    register(core, "s1")
    register(core, "s2")
    gs = groups(40)
    assert {r.status for r in put(core, [key(g) for g in gs]).results} == {"published"}
    evicted = core.handle(m.Evict(groups=[g.group_id() for g in gs]), 10)
    frees = [e for e in evicted.effects if isinstance(e, FreeSlots)]
    assert sorted(f.segment_id for f in frees) == ["s1", "s2"]  # was 80 requests
    assert all(len(f.slots) == 40 for f in frees)
    for f in frees:  # every slot acknowledged from the batches: nothing left reserved
        core.handle(m.SlotsFreed(segment_id=f.segment_id, incarnation=1, freed=list(f.slots)), 20)
    assert not core.evicting
    core.check_invariants()


def test_retries_after_a_lost_batch_come_batched_too() -> None:
    core = DirectoryCore(DirectoryConfig(ticket_secret=SECRET, free_retry_ms=1_000))
    register(core, "s1")
    gs = groups(30)
    put(core, [key(g) for g in gs])
    core.handle(m.Evict(groups=[g.group_id() for g in gs]), 10)  # its FreeSlots lost
    core.tick(100)  # stamps them sent
    retried = [e for e in core.tick(1_200) if isinstance(e, FreeSlots)]
    assert len(retried) == 1 and len(retried[0].slots) == 30


def test_batches_keep_order_and_split_at_the_bound() -> None:
    event = EmitEvent("evicted", m.SlotsFreed(segment_id="x", incarnation=1, freed=[]))
    n = FREE_SLOTS_PER_REQUEST_MAX + 5
    effects: list[Effect] = [
        FreeSlots("a", 1, (slot(0),)),
        event,
        FreeSlots("b", 1, (slot(1),)),
        *[FreeSlots("a", 1, (slot(i),)) for i in range(1, n)],
        FreeSlots("a", 2, (slot(9),)),  # another incarnation: its own request
    ]
    merged = batch_frees(effects)
    assert [(type(e).__name__, getattr(e, "segment_id", "")) for e in merged] == [
        ("FreeSlots", "a"),
        ("EmitEvent", ""),
        ("FreeSlots", "b"),
        ("FreeSlots", "a"),  # the rest of a's slots past the bound
        ("FreeSlots", "a"),
    ]
    a1 = [
        s.slot
        for e in merged
        if isinstance(e, FreeSlots) and e.segment_id == "a" and e.incarnation == 1
        for s in e.slots
    ]
    assert a1 == list(range(n))
    assert [len(e.slots) for e in merged if isinstance(e, FreeSlots)] == [FREE_SLOTS_PER_REQUEST_MAX, 1, 5, 1]
    single: list[Effect] = [FreeSlots("a", 1, (slot(0),))]
    assert batch_frees(single) is single
