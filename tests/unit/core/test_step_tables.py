"""`step(event, now_ms)` (issue 26: one shape for every core) of the client's load table and the
segment's slot tables (arena and disk) is the method of the same meaning: a table driven through
`step` and one driven through the methods, given the same random run (the constants of each
table's Hypothesis machine; slots, generations and transfer ids drawn mostly from what came out,
sometimes stale or unknown, so refusals are compared too), answer alike (a `Reply` for every
method that returns a value; the same error when one refuses) and end every step in the same
state; time going backwards is refused before anything changes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric.core import client_loads_events as lo
from kvfabric.core import disk_slots_events as dk
from kvfabric.core import segment_slots_events as sl
from kvfabric.core.client_loads import Deliver, LoadTable, StartTransfer, TransferId
from kvfabric.core.disk_slots import DiskAlloc, DiskSlotTable
from kvfabric.core.segment_slots import Alloc, SlotTable
from kvfabric.core.step import Reply, Tick
from kvfabric.format.generations import RequestGeneration as G
from tests.unit.core import test_client_loads_machine as lom
from tests.unit.core import test_segment_slots_machine as slm
from tests.unit.core.stepkit import backwards_refused, run_both

EXAMPLES = settings(max_examples=100, deadline=None)


def handed(out: list[object], kind: type[Alloc] | type[DiskAlloc]) -> list[tuple[int, int]]:
    """(slot, generation) of every allocation answered so far, plus a stale and an unknown one."""
    slots = [
        (r.value.slot, r.value.generation) for r in out if isinstance(r, Reply) and isinstance(r.value, kind)
    ]
    return slots + [(slot, generation + 1) for slot, generation in slots[:1]] + [(7, 1)]


def held(table: Any, state: str | None = None, readers: bool = False) -> list[tuple[int, int]]:
    """(slot, generation) of the table's slots in `state` (or with readers): what the shell itself
    may name (naming another is its own bug, which the tables refuse with an invariant)."""
    return sorted(
        (slot, rec.generation)
        for slot, rec in table._slots.items()
        if (state is None or rec.state == state) and (rec.readers > 0 or not readers)
    )


# ---- the client's load table -----------------------------------------------------------------


LOAD_SIZES = dict(zip(lom.OBJECTS, (0, 10, 1 << 20), strict=True))  # one size per object


def deliverable(table: LoadTable, load_id: object, generation: G, dest_id: object) -> bool:
    """`may_write`, without counting a refusal (drawing an event must not change the table)."""
    waiter = table._waiters.get(load_id)
    return (
        waiter is not None
        and waiter.delivering
        and (waiter.generation, waiter.dest_id) == (generation, dest_id)
        and table._dest_generation.get(dest_id) == generation
    )


def load_event(data: st.DataObject, out: list[object], table: object) -> lo.LoadEvent:
    kind = data.draw(st.sampled_from(["want", "want", "want", "done", "done", "delivered", "cancel", "tick",
                                      "forget"]))  # fmt: skip
    load = f"l{data.draw(st.integers(0, 5))}"
    dest = data.draw(st.sampled_from(lom.DESTS))
    generation = G(data.draw(st.integers(1, 3)))
    assert isinstance(table, LoadTable)
    free_loads = [f"l{i}" for i in range(6) if f"l{i}" not in table._waiters]
    if kind == "want" and free_loads:  # a live load id or a held dest named again: the engine's bug
        obj = data.draw(st.sampled_from(lom.OBJECTS))
        dest = data.draw(st.sampled_from([d for d in lom.DESTS if d not in table._dest_holder] or [dest]))
        if data.draw(st.integers(0, 4)):  # mostly the dest's next generation; else a stale one
            current = table._dest_generation.get(dest)
            generation = G(1 if current is None else current.value + 1)
        return lo.Want(data.draw(st.sampled_from(free_loads)), generation, obj, dest,
                       deadline_ms=table._step_ms + data.draw(st.integers(0, 200)),
                       size_bytes=LOAD_SIZES[obj])  # fmt: skip
    if kind == "done":
        tids = [e.transfer_id for e in out if isinstance(e, StartTransfer)] + [TransferId(99)]
        return lo.TransferDone(data.draw(st.sampled_from(tids)), data.draw(st.booleans()),
                               data.draw(st.sampled_from(["error", "not_found"])))  # fmt: skip
    if kind == "delivered":
        delivering = [(d.load_id, d.generation, d.dest_id) for d in out if isinstance(d, Deliver)]
        live = [d for d in delivering if deliverable(table, *d)]
        if live:
            return lo.Delivered(*data.draw(st.sampled_from(live)))
        return lo.Cancel(load)
    if kind == "cancel":
        return lo.Cancel(load)
    if kind == "forget":
        return lo.ForgetDest(dest)
    return Tick()


def load_by_method(table: LoadTable, event: lo.LoadEvent, now_ms: int) -> Sequence[object]:
    if isinstance(event, Tick):
        return table.expire(now_ms)
    if isinstance(event, lo.Want):
        return table.want(event.load_id, event.generation, event.object_id, event.dest_id, now_ms=now_ms,
                          deadline_ms=event.deadline_ms, size_bytes=event.size_bytes)  # fmt: skip
    if isinstance(event, lo.TransferDone):
        return table.transfer_done(event.transfer_id, event.ok, event.cause)
    if isinstance(event, lo.Delivered):
        return table.delivered(event.load_id, event.generation, event.dest_id)
    if isinstance(event, lo.Cancel):
        return table.cancel(event.load_id)
    assert isinstance(event, lo.ForgetDest)
    table.forget_dest(event.dest_id)
    return []


@EXAMPLES
@given(data=st.data(), bytes_max=st.sampled_from([None, 1 << 20]))
def test_load_table_step_is_the_method_of_the_same_meaning(
    data: st.DataObject, bytes_max: int | None
) -> None:
    run_both(
        data,
        lambda: LoadTable(transfers_max=lom.TRANSFERS_MAX, inflight_bytes_max=bytes_max),
        load_event,
        load_by_method,
    )


# ---- a segment's arena slots -----------------------------------------------------------------


def slot_event(data: st.DataObject, out: list[object], table: Any) -> sl.SlotEvent:
    kind = data.draw(st.sampled_from(["alloc", "alloc", "stored", "stored", "abort", "acquire", "release",
                                      "free", "free", "tick"]))  # fmt: skip
    if kind == "alloc":
        ttl = data.draw(st.sampled_from(slm.TTLS_MS))
        deadline_ms = table._step_ms + data.draw(st.integers(0, 100)) + ttl
        return sl.AllocSlot(
            data.draw(st.integers(1, 40)), deadline_ms, key=data.draw(st.sampled_from([b"", b"k"]))
        )
    if kind == "tick":
        return Tick()
    writing, reading = held(table, "writing"), held(table, readers=True)
    if kind in ("stored", "abort") and writing:
        slot, generation = data.draw(st.sampled_from(writing))
        if kind == "stored":
            return sl.Stored(slot, generation, f"{slot}:{generation}".encode())
        return sl.Abort(slot, generation)
    if kind == "release" and reading:
        return sl.Release(*data.draw(st.sampled_from(reading)))
    slot, generation = data.draw(st.sampled_from(handed(out, Alloc)))
    if kind == "acquire":
        return sl.Acquire(slot, generation, data.draw(st.integers(1, 40)))
    return sl.Free(slot, generation)


def slot_by_method(table: SlotTable, event: sl.SlotEvent, now_ms: int) -> Sequence[object]:
    if isinstance(event, sl.AllocSlot):
        return [Reply(table.alloc(event.size, now_ms, event.deadline_ms, event.key))]
    if isinstance(event, sl.Acquire):
        return [Reply(table.acquire(event.slot, event.generation, event.size))]
    if isinstance(event, sl.Free):
        return [Reply(table.free(event.slot, event.generation))]
    if isinstance(event, Tick):
        return [Reply(table.expire_writes(now_ms))]
    if isinstance(event, sl.Stored):
        table.stored(event.slot, event.generation, event.checksum)
    elif isinstance(event, sl.Abort):
        table.abort(event.slot, event.generation)
    else:
        assert isinstance(event, sl.Release)
        table.release(event.slot, event.generation)
    return []


@EXAMPLES
@given(data=st.data(), alignment=st.sampled_from([1, 8]))
def test_slot_table_step_is_the_method_of_the_same_meaning(data: st.DataObject, alignment: int) -> None:
    run_both(data, lambda: SlotTable(128, alignment=alignment, slots_max=6), slot_event, slot_by_method)


# ---- a segment's disk slots ------------------------------------------------------------------


def disk_event(data: st.DataObject, out: list[object], table: object) -> dk.DiskSlotEvent:
    kind = data.draw(st.sampled_from(["alloc", "alloc", "begin", "begin", "end", "end", "abort", "free",
                                      "unlinked", "acquire", "release"]))  # fmt: skip
    if kind == "alloc":
        return dk.AllocSlot(data.draw(st.integers(1, 12)), data.draw(st.sampled_from([b"k0", b"k1"])))
    assert isinstance(table, DiskSlotTable)
    writing, committing, reading = (
        held(table, "writing"),
        held(table, "committing"),
        held(table, readers=True),
    )
    unlinks = [(r.slot, r.generation) for r in table.pending_unlinks()]
    if kind in ("begin", "abort") and writing:
        slot, generation = data.draw(st.sampled_from(writing))
        return dk.BeginCommit(slot, generation, b"c" * 16) if kind == "begin" else dk.Abort(slot, generation)
    if kind == "end" and committing:
        return dk.EndCommit(*data.draw(st.sampled_from(committing)), data.draw(st.booleans()))
    if kind == "unlinked" and unlinks:
        return dk.Unlinked(*data.draw(st.sampled_from(unlinks)))
    if kind == "release" and reading:
        return dk.Release(*data.draw(st.sampled_from(reading)))
    slot, generation = data.draw(st.sampled_from(handed(out, DiskAlloc)))
    if kind == "acquire":
        return dk.Acquire(slot, generation, data.draw(st.integers(1, 12)))
    return dk.Free(slot, generation)


def disk_by_method(table: DiskSlotTable, event: dk.DiskSlotEvent, now_ms: int) -> Sequence[object]:
    if isinstance(event, dk.AllocSlot):
        return [Reply(table.alloc(event.size, event.key))]
    if isinstance(event, dk.BeginCommit):
        return [Reply(table.begin_commit(event.slot, event.generation, event.checksum))]
    if isinstance(event, dk.EndCommit):
        return [Reply(table.end_commit(event.slot, event.generation, event.durable))]
    if isinstance(event, dk.Free):
        return [Reply(table.free(event.slot, event.generation))]
    if isinstance(event, dk.Acquire):
        return [Reply(table.acquire(event.slot, event.generation, event.size))]
    if isinstance(event, dk.Abort):
        table.abort(event.slot, event.generation)
    elif isinstance(event, dk.Unlinked):
        table.unlinked(event.slot, event.record_generation)
    else:
        assert isinstance(event, dk.Release)
        table.release(event.slot, event.generation)
    return []


@EXAMPLES
@given(data=st.data())
def test_disk_slot_table_step_is_the_method_of_the_same_meaning(data: st.DataObject) -> None:
    run_both(data, lambda: DiskSlotTable(48, 4, block_bytes=1), disk_event, disk_by_method)


# ---- time never goes backwards ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "first", "second"),
    [
        (lambda: LoadTable(transfers_max=2), Tick(), lo.Cancel("l0")),  # an event without a time
        (lambda: LoadTable(transfers_max=2), lo.ForgetDest("d0"), Tick()),
        (lambda: SlotTable(128), Tick(), sl.AllocSlot(8, 5_000)),
        (lambda: SlotTable(128), sl.AllocSlot(8, 5_000), Tick()),
        (lambda: DiskSlotTable(48, 4, block_bytes=1), dk.AllocSlot(4, b"k"), dk.AllocSlot(4, b"k")),
    ],
)
def test_time_going_backwards_is_refused(make: Any, first: object, second: object) -> None:
    backwards_refused(make(), first, second)
