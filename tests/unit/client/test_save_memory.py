"""Save memory (issue 20; `kvfabric.client.save_memory`): objects an engine gathered into it are
staged by reference to a co-located segment, never copied into a staging file; they land and
read back like any other; a segment that cannot map memfds gets them copied as before; the
engine owns the memory and cannot close it under a save. A real `ArenaBackend` served over TCP,
confirms answered in process (no NATS)."""

from __future__ import annotations

import concurrent.futures
import os

import numpy as np
import pytest

from kvfabric.client.save_memory import SAVE_MEMORY_MAX, SaveMemoryRegistry, SaveSlots
from kvfabric.client.transfers import SegmentPool
from kvfabric.dataplane.staging import STAGING_BYTES_MAX, STAGING_HEADER_BYTES, StagingFile
from kvfabric.format.errors import BadRequest
from tests.unit.client.conftest import NoMemfds, Segment


def copies_forbidden(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make any copy into a staging file fail the test; returns the sizes copied (none)."""
    copied: list[int] = []

    def stage(self: StagingFile, data: memoryview, at: int = 0) -> object:
        copied.append(len(data))
        raise AssertionError("an object in save memory was copied into a staging file")

    monkeypatch.setattr(StagingFile, "stage", stage)
    return copied


@pytest.mark.parametrize("streamed", [False, True])
def test_objects_in_save_memory_are_staged_by_reference_and_read_back(
    segment: Segment, monkeypatch: pytest.MonkeyPatch, streamed: bool
) -> None:
    pool = SegmentPool(connections_per_segment_max=2, timeout_s=5.0, use_shm=True)
    memory = pool.save_memory.allocate(1 << 20)
    try:
        copies_forbidden(monkeypatch)
        blobs = [os.urandom(n) for n in (4096, 100_000, 3)]
        views, at = [], 0
        for data in blobs:  # the engine gathers its objects into the memory
            memory.view[at : at + len(data)] = data
            views.append(memory.view[at : at + len(data)])
            at += len(data) + 17  # not aligned: any offset works
        tickets = [segment.ticket(data, key=b"m%d" % i) for i, data in enumerate(blobs)]
        if streamed:
            writes = [(t, v, "", 0) for t, v in zip(tickets, views, strict=True)]
            results = pool.write_many(writes, receipt=True)
            del writes
        else:
            results = [pool.write(t, v, "", receipt=True) for t, v in zip(tickets, views, strict=True)]
        for view in views:
            view.release()
        assert [code for code, _ in results] == ["ok"] * 3
        assert pool.save_memory_puts == pool.staged_puts == 3
        memory.view[:] = bytes(len(memory.view))  # the engine reuses its memory: the slots keep theirs
        for (_, receipt), data in zip(results, blobs, strict=True):
            assert receipt is not None
            assert segment.read(receipt.slot, receipt.slot_generation, len(data)) == data
    finally:
        memory.close()
        pool.close()


def test_a_stream_mixing_save_memory_and_other_memory_copies_only_the_other(segment: Segment) -> None:
    pool = SegmentPool(connections_per_segment_max=2, timeout_s=5.0, use_shm=True)
    memory = pool.save_memory.allocate(8192)
    try:
        inside, outside = os.urandom(5000), os.urandom(6000)
        memory.view[: len(inside)] = inside
        view = memory.view[: len(inside)]
        writes = [
            (segment.ticket(inside, key=b"in"), view, "", 0),
            (segment.ticket(outside, key=b"out"), memoryview(outside), "", 0),
        ]
        outcomes = pool.write_many(writes, receipt=True)
        del writes
        view.release()
        assert [code for code, _ in outcomes] == ["ok", "ok"]
        assert pool.save_memory_puts == 1 and pool.staged_puts == 2
        for (_, receipt), data in zip(outcomes, (inside, outside), strict=True):
            assert receipt is not None
            assert segment.read(receipt.slot, receipt.slot_generation, len(data)) == data
    finally:
        memory.close()
        pool.close()


def test_save_memory_lands_intact(segment: Segment) -> None:
    """Every byte that landed is the engine's, read back from the segment's slot."""
    pool = SegmentPool(connections_per_segment_max=2, timeout_s=5.0, use_shm=True)
    memory = pool.save_memory.allocate(3 << 20)
    try:
        data = np.random.default_rng(5).integers(0, 256, (2 << 20) + 999, dtype=np.uint8).tobytes()
        memory.view[100 : 100 + len(data)] = data
        view = memory.view[100 : 100 + len(data)]
        ((code, receipt),) = pool.write_many([(segment.ticket(data), view, "", 0)], receipt=True)
        view.release()
        assert code == "ok" and receipt is not None and pool.save_memory_puts == 1
        assert segment.read(receipt.slot, receipt.slot_generation, len(data)) == data
    finally:
        memory.close()
        pool.close()


def test_a_segment_that_maps_no_memfds_gets_save_memory_copied(segment: Segment) -> None:
    segment.server._staging = NoMemfds(str(segment.dir))
    pool = SegmentPool(connections_per_segment_max=2, timeout_s=5.0, use_shm=True)
    memory = pool.save_memory.allocate(8192)
    try:
        for i in range(3):
            data = os.urandom(4000)
            memory.view[: len(data)] = data
            view = memory.view[: len(data)]
            ((code, receipt),) = pool.write_many(
                [(segment.ticket(data, key=b"%d" % i), view, "", 0)], receipt=True
            )
            view.release()
            assert code == "ok" and receipt is not None
            assert segment.read(receipt.slot, receipt.slot_generation, len(data)) == data
        # the first was refused by reference and sent; the others copied beside the arena
        assert pool.save_memory_puts == 0 and pool.staged_puts == 2
        assert pool._memfd_refused.addresses() == {segment.server.address}
    finally:
        memory.close()
        pool.close()


def test_save_memory_cannot_be_closed_under_a_view_and_is_bounded() -> None:
    registry = SaveMemoryRegistry()
    for bad in (0, -1, STAGING_BYTES_MAX + 1):
        with pytest.raises(BadRequest):
            registry.allocate(bad)
    memories = [registry.allocate(4096) for _ in range(SAVE_MEMORY_MAX)]
    with pytest.raises(BadRequest, match="at most"):
        registry.allocate(4096)
    held = memories[0].view[10:20]  # a save (or the engine) still viewing it
    with pytest.raises(BufferError):
        memories[0].close()
    memories[0].view[10:12] = b"ok"  # still open and usable
    assert bytes(held[:2]) == b"ok"
    assert registry.staged(held) is not None
    held.release()
    memories[0].close()
    assert memories[0].closed
    other = registry.allocate(4096)  # the closed one no longer counts
    registry.close()
    assert all(m.closed for m in (*memories, other))
    assert registry.staged(memoryview(bytearray(10))) is None


def test_a_view_is_staged_by_the_memory_that_holds_it_only() -> None:
    """Each memory claims only views inside it (whichever lies higher in the address space)."""
    registry = SaveMemoryRegistry()
    first, second = registry.allocate(8192), registry.allocate(8192)
    try:
        for memory, other in ((first, second), (second, first)):
            inside = memory.view[100:200]
            assert other.staged(inside) is None and other.staged(memory.view) is None
            ref = registry.staged(inside)
            assert ref is not None and ref == memory.staged(inside)
            assert ref.offset == STAGING_HEADER_BYTES + 100
            inside.release()
        assert registry.staged(memoryview(bytearray(100))) is None
    finally:
        registry.close()


def test_save_slots_are_taken_last_in_first_out_and_given_back() -> None:
    registry = SaveMemoryRegistry()
    slots = SaveSlots(registry.allocate(3 * 4096 + 100), 4096)  # the tail is no slot
    try:
        assert slots.count == 3
        taken = [slots.take() for _ in range(3)]
        assert taken == [0, 1, 2] and slots.take() is None  # none free: gather elsewhere
        slots.array(1)[:] = 7
        assert bytes(slots.memory.view[4096:4100]) == b"\x07" * 4
        ref = registry.staged(slots.array(1).data)
        assert ref is not None and ref.offset == STAGING_HEADER_BYTES + 4096
        slots.give_back([2, 0])
        assert slots.free() == 2 and slots.take() == 2  # the first of those given back: LIFO order
        with pytest.raises(BadRequest):
            SaveSlots(registry.allocate(100), 4096)
    finally:
        slots.close()
        registry.close()
    assert slots.memory.closed and slots.take() is None
    with pytest.raises(ValueError, match="closed"):
        slots.array(0)


def test_save_slots_go_back_when_their_save_is_done_or_dropped() -> None:
    registry = SaveMemoryRegistry()
    slots = SaveSlots(registry.allocate(4 * 4096), 4096)
    try:
        taken = [slots.take(), slots.take()]
        assert None not in taken and slots.free() == 2
        future: concurrent.futures.Future[object] = concurrent.futures.Future()
        slots.give_back_when_done(future, [s for s in taken if s is not None])
        assert slots.free() == 2  # the save still reads them
        future.set_result(None)
        assert slots.free() == 4
        dropped = slots.take()
        assert dropped is not None
        slots.give_back_when_done(None, [dropped])  # the client dropped that save
        assert slots.free() == 4
    finally:
        slots.close()
        registry.close()
