"""A free of a disk slot is acknowledged (returned by `SsdTier.free_many`, so the directory stops
asking) only once its free record is durable, and the slot is never handed out again before that.

The tier returned every pair it was given, also those whose free record's write or sync had
failed: the directory forgot the replica while its commit record was still the slot's record on
disk, and a restart before a retry landed recovered the object (docs/ssd-tier.md, "Frees")."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvfabric.core.disk_records import RECORD_BYTES, Record
from kvfabric.core.disk_slots import DiskSlotTable
from kvfabric.format.checksum import checksum
from kvfabric.format.errors import NoCapacity, Unavailable
from kvfabric.proto.segment import SSD_SLOT_BASE
from kvfabric.segment_storage import ssd
from kvfabric.segment_storage.ssd import SsdIo, SsdTier
from tests.unit.segment_storage.test_ssd_backend import FlakyIo  # fails the next `fail_records` record writes

SEGMENT = "freeseg"
DATA_BYTES = 1 << 20


class BadSectorIo(SsdIo):
    """The I/O engine on the calling thread; every write that covers `bad_offset` fails (a bad
    index sector: the one record there fails at every retry, the others land)."""

    def __init__(self) -> None:
        super().__init__(0, 64, 1 << 20)
        self.bad_offset: int | None = None

    def write_record(self, fd: int, view: memoryview, offset: int) -> None:
        if self.bad_offset is not None and offset <= self.bad_offset < offset + len(view):
            raise OSError(5, "Input/output error")
        super().write_record(fd, view, offset)


class FakeClock:
    """The tier's monotonic clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FlakySync:
    """`fdatasync`, failing while `fail` is set."""

    def __init__(self) -> None:
        self.fail = False

    def __call__(self, fd: int) -> None:
        if self.fail:
            raise OSError(5, "Input/output error")
        os.fdatasync(fd)


def open_tier(
    directory: Path,
    io: SsdIo,
    slots_max: int = 1,
    sync: FlakySync | None = None,
    clock: FakeClock | None = None,
) -> SsdTier:
    return SsdTier(
        directory,
        SEGMENT,
        DATA_BYTES,
        slots_max,
        direct=False,
        io=io,
        read_bytes_max=1 << 20,
        sync=sync if sync is not None else os.fdatasync,
        clock=clock if clock is not None else FakeClock(),
    )


def bad_sector_of(tier: SsdTier, wire_slot: int) -> int:
    """The file offset of a slot's index record."""
    return tier.geometry.index_offset + tier.local(wire_slot) * RECORD_BYTES


def store(tier: SsdTier, data: bytes, key: bytes) -> tuple[int, int]:
    return tier.write(memoryview(data), key, checksum(data))


def test_a_free_whose_record_write_failed_is_acknowledged_once_a_retry_made_it_durable(
    tmp_path: Path,
) -> None:
    io = FlakyIo()
    tier = open_tier(tmp_path, io)  # one slot id: a reuse would have to be this one
    try:
        old = store(tier, os.urandom(10_000), b"old")
        io.fail_records = 1
        assert tier.free_many([old]) == []  # not durable: not freed, the directory asks again
        assert tier.unlinks_pending and tier.stats()["used_bytes"] == 12288
        assert tier.free_many([old]) == []  # asked again before the retry: still not durable
        with pytest.raises(NoCapacity):  # the slot is not handed out before its free is durable
            store(tier, b"n" * 5000, b"new")
        assert tier.retry_unlinks() == 1 and not tier.unlinks_pending
        assert tier.free_many([old]) == [old]  # durable now: the directory may stop asking
        new_data = os.urandom(5000)
        new = store(tier, new_data, b"new")
        assert new == (old[0], old[1] + 1)  # the slot again, its next generation
    finally:
        io.close()
        tier.close()
    # A restart recovers the slot's newest record: the new object, never the freed one.
    io = FlakyIo()
    tier = open_tier(tmp_path, io)
    try:
        (held,) = tier.held()
        assert (held.slot, held.generation, held.key) == (*new, b"new")
        result = tier.read(held.slot, held.generation, held.size)
        assert result.status == "ok" and result.view is not None and bytes(result.view) == new_data
        result.release()
    finally:
        io.close()
        tier.close()


def test_a_free_not_acknowledged_is_what_a_restart_before_the_retry_recovers(tmp_path: Path) -> None:
    """Why an acknowledged free was wrong: the process ends before the retry lands, the slot's
    record on disk is still the commit record, and the object is recovered — the directory must
    not have been told it was gone. The other record of its batch is written, synced and
    acknowledged: it is not recovered."""
    io = FlakyIo()
    tier = open_tier(tmp_path, io, slots_max=4)
    try:
        first = store(tier, os.urandom(4096), b"first")
        second = store(tier, os.urandom(4096), b"second")
        io.fail_records = 1
        assert tier.free_many([first, second]) == [second]
    finally:
        io.close()
        tier.close()  # no retry: the process ended
    io = FlakyIo()
    tier = open_tier(tmp_path, io, slots_max=4)
    try:
        assert [(h.slot, h.generation, h.key) for h in tier.held()] == [(*first, b"first")]
        assert tier.free_many([first, second]) == [first, second]  # the recovered one freed now
        assert tier.held() == []
    finally:
        io.close()
        tier.close()


def test_after_a_failed_sync_frees_are_acknowledged_as_a_crash_would_leave_them(tmp_path: Path) -> None:
    """A failed `fdatasync` fails the tier for writes until restart (docs/segment.md, "Disk
    tier"): no free record can be made durable after it. Held unanswered, each group with a
    disk replica here stayed `evicting` at the directory for good (its keys refused, its bytes
    counted; review of the change), so they are acknowledged, counted, as a crash would leave
    them (the restart reports what its recovery brings back). Their slots stay held here."""
    io = FlakyIo()
    sync = FlakySync()
    tier = open_tier(tmp_path, io, slots_max=4, sync=sync)
    try:
        first = store(tier, os.urandom(5000), b"first")
        second = store(tier, os.urandom(5000), b"second")
        sync.fail = True
        assert tier.free_many([first]) == [first]
        sync.fail = False  # a later sync that "works" proves nothing
        assert tier.free_many([second]) == [second]
        assert tier.retry_unlinks() == 0  # nothing written after a failed sync counts
        assert tier.stats()["failed"] == 1 and tier.stats()["used_bytes"] == 2 * 8192
        assert tier.counters["frees_acknowledged_undurable_total"] == 2
        with pytest.raises(Unavailable):
            store(tier, b"x" * 100, b"third")
    finally:
        io.close()
        tier.close()


def test_a_bad_sectors_free_is_acknowledged_after_the_give_up_time_despite_other_frees(
    tmp_path: Path,
) -> None:
    """A free record on a bad index sector fails at every retry. A count of failed writes in a
    row, shared by the tier, was reset by every unrelated free that landed meanwhile, so the
    bad sector's free was never acknowledged (its group `evicting` at the directory for good).
    Each record's own first failure counts: after `UNLINK_GIVE_UP_S` it is acknowledged, not
    before, whatever else landed; its record is still retried."""
    io = BadSectorIo()
    clock = FakeClock()
    tier = open_tier(tmp_path, io, slots_max=8, clock=clock)
    try:
        bad = store(tier, os.urandom(5000), b"bad")
        io.bad_offset = bad_sector_of(tier, bad[0])
        assert tier.free_many([bad]) == []
        failed_at = clock.now
        for second in range(1, 100):  # a second each: the retry, then the directory asks again
            clock.now = failed_at + second
            assert tier.retry_unlinks() == 1
            if second % 5 == 0:  # unrelated frees land meanwhile
                other = store(tier, os.urandom(5000), b"other")
                assert tier.free_many([other]) == [other]
            got = tier.free_many([bad])
            if second < ssd.UNLINK_GIVE_UP_S:
                assert got == [], second
            else:
                assert got == [bad], second
                break
        assert clock.now == failed_at + ssd.UNLINK_GIVE_UP_S
        assert tier.counters["frees_acknowledged_undurable_total"] == 1
        assert tier.all_counters()["ssd_frees_acknowledged_undurable_total"] == 1
        assert tier.unlinks_pending and tier.retry_unlinks() == 1  # still written again
        io.bad_offset = None  # the sector is remapped: it lands, the slot is free again
        assert tier.retry_unlinks() == 1 and not tier.unlinks_pending
        assert tier.free_many([bad]) == [bad]  # durable now: not counted again
        assert tier.counters["frees_acknowledged_undurable_total"] == 1
        assert tier.stats()["used_bytes"] == 0 and tier._unlink_failing == {}
    finally:
        io.close()
        tier.close()


def test_a_good_record_sorted_after_a_bad_one_is_written_and_acknowledged(tmp_path: Path) -> None:
    """`_unlink` stopped at the first record that failed, and the retries hand records back by
    slot: a bad sector's record led every retry batch, and a good record after it was never
    written, its free never acknowledged, its space held. It is written at once now, and only
    the bad one is retried."""
    io = BadSectorIo()
    tier = open_tier(tmp_path, io, slots_max=8)
    try:
        bad, good = (store(tier, os.urandom(5000), key) for key in (b"bad", b"good"))
        assert bad[0] < good[0]
        io.bad_offset = bad_sector_of(tier, bad[0])
        assert tier.free_many([bad, good]) == [good]
        assert tier.counters["unlinks_failed_total"] == 1  # the bad one alone
        for _ in range(3):  # the retries carry the bad one alone
            assert tier.retry_unlinks() == 1
            assert tier.free_many([bad, good]) == [good]
        assert tier.stats()["used_bytes"] == 8192  # the good one's extent is free again
    finally:
        io.close()
        tier.close()
    io = BadSectorIo()
    tier = open_tier(tmp_path, io, slots_max=8)
    try:  # a restart brings back the bad one's object alone
        assert [(h.slot, h.generation, h.key) for h in tier.held()] == [(*bad, b"bad")]
    finally:
        io.close()
        tier.close()


def test_a_burst_of_failures_within_a_second_acknowledges_nothing(tmp_path: Path) -> None:
    """30 failed record writes from concurrent free batches piled up in under a second and the
    frees were acknowledged, though the next retry would have landed. Time counts, per record,
    not failures."""
    io = FlakyIo()
    clock = FakeClock()
    tier = open_tier(tmp_path, io, slots_max=64, clock=clock)
    try:
        objects = [store(tier, os.urandom(1000), b"k%d" % i) for i in range(40)]
        io.fail_records = 10_000  # every record write fails, for now
        for n, one in enumerate(objects):  # 40 failing batches within half a second
            clock.now += 0.01
            assert tier.free_many([one]) == []
            assert tier.free_many(objects[: n + 1]) == []  # asked again: none acknowledged
        assert tier.counters["unlinks_failed_total"] == 40
        assert "frees_acknowledged_undurable_total" not in tier.counters
        io.fail_records = 0
        clock.now += 1.0  # the next second's retry lands
        assert tier.retry_unlinks() == 40
        assert tier.free_many(objects) == objects  # durable, every one
        assert "frees_acknowledged_undurable_total" not in tier.counters
    finally:
        io.close()
        tier.close()


def test_unknown_and_long_freed_slots_are_still_acknowledged(tmp_path: Path) -> None:
    io = FlakyIo()
    tier = open_tier(tmp_path, io, slots_max=4)
    try:
        a = store(tier, os.urandom(5000), b"a")
        assert tier.free_many([a]) == [a]
        never = (SSD_SLOT_BASE + 3, 1)
        assert tier.free_many([a, never]) == [a, never]  # freed already; never held here
    finally:
        io.close()
        tier.close()


def test_the_table_says_when_a_free_is_durable() -> None:
    t = DiskSlotTable(1 << 16, 4)
    sum16 = b"c" * 16
    w = t.alloc(100, b"w")
    assert not t.free_durable(w.slot, w.generation)  # being written
    assert t.free(w.slot, w.generation).record is None  # fenced: the writer finds out
    assert not t.free_durable(w.slot, w.generation)  # its writer has not yet
    assert t.begin_commit(w.slot, w.generation, sum16) is None  # no commit record: nothing on disk
    assert t.free_durable(w.slot, w.generation)

    w = t.alloc(100, b"w")
    assert t.begin_commit(w.slot, w.generation, sum16) is not None
    assert t.free(w.slot, w.generation).record is None  # fenced while committing
    assert not t.free_durable(w.slot, w.generation)  # its commit record may be on disk
    unlink = t.end_commit(w.slot, w.generation, durable=True)
    assert unlink == Record("free", w.slot, w.generation + 1)
    assert not t.free_durable(w.slot, w.generation)
    t.unlinked(w.slot, unlink.generation)
    assert t.free_durable(w.slot, w.generation)

    s = t.alloc(100, b"s")
    t.begin_commit(s.slot, s.generation, sum16)
    assert t.end_commit(s.slot, s.generation, durable=True) is None
    assert not t.free_durable(s.slot, s.generation)  # stored
    t.acquire(s.slot, s.generation, 100)
    freed = t.free(s.slot, s.generation).record
    assert freed is not None and not t.free_durable(s.slot, s.generation)
    t.unlink_failed([freed])
    assert not t.free_durable(s.slot, s.generation)
    (again,) = t.take_failed_unlinks()
    t.unlinked(s.slot, again.generation)
    assert t.free_durable(s.slot, s.generation)  # durable; the reader still holds the extent
    t.release(s.slot, s.generation)
    assert t.free_durable(s.slot, s.generation) and t.free_durable(3, 1)  # reclaimed; never used
    t.check_invariants()
