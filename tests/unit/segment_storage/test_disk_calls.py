"""The segment's stop closes the disk tier's files only once no free record's retry and no
suspect's check still runs on its thread (review, stop 65: cancelling `asyncio.to_thread` did not
stop the thread, and a retry still running wrote a free record through a descriptor number the
close had freed and another file had taken): `DiskCalls` counts them, and one that has not
started once the stop began touches nothing."""

from __future__ import annotations

import asyncio
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest

from kvfabric.format.checksum import checksum
from kvfabric.format.errors import NoCapacity
from kvfabric.segment_storage.disk_calls import DiskCalls, DiskClosing
from kvfabric.segment_storage.ssd import SsdIo, SsdTier


def test_the_stop_waits_for_a_call_running_and_one_not_started_touches_nothing() -> None:
    calls = DiskCalls()
    started, finish = threading.Event(), threading.Event()
    ran: list[str] = []

    def slow_retry() -> int:
        started.set()
        finish.wait(5)
        ran.append("retry")
        return 1

    async def run() -> None:
        retry = asyncio.ensure_future(calls.run(slow_retry))
        await asyncio.to_thread(started.wait, 5)
        retry.cancel()  # the shell's task is cancelled at stop: its thread goes on
        assert not calls.wait_idle(0.05)  # still writing: the files stay open
        finish.set()
        assert await asyncio.to_thread(calls.wait_idle, 5)
        with pytest.raises(DiskClosing):  # started after the stop began: nothing runs
            await calls.run(lambda: ran.append("late"))

    asyncio.run(run())
    assert ran == ["retry"] and calls.running == 0


def test_an_object_that_does_not_fit_leaves_the_rest_of_the_batch_tried() -> None:
    """`write_many` refused every object after one that found no extent (`no_capacity`), although
    a smaller one fitted a hole (review, stop 65: the eviction policy then dropped them all
    instead of demoting them)."""
    with tempfile.TemporaryDirectory() as d:
        tier = SsdTier(
            Path(d), "s1", 64 << 10, 64, direct=False, io=SsdIo(0, 64, 1 << 20), read_bytes_max=1 << 30
        )
        try:

            def item(k: int, n: int) -> tuple[memoryview, bytes, bytes]:
                data = bytes([k]) * n
                return memoryview(data), bytes([k]), checksum(data)

            placed = [tier.write(*item(i, 4096)) for i in range(16)]
            tier.free_many(placed[::2])  # 32 KiB free, in 4 KiB holes
            out = tier.write_many([item(100, 8192), item(101, 4096), item(102, 4096)])
            assert isinstance(out[0], NoCapacity)
            assert all(isinstance(o, tuple) for o in out[1:]), out
        finally:
            tier.close()


def test_an_index_the_disk_cannot_read_at_start_is_refused_with_what_to_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An I/O error reading the index at start (a bad sector) raised an `OSError` and the segment
    exited with a traceback, restarted into the same (review, stop 65); it is `SsdFileRefused`,
    which the segment's main says and exits 2 with, never serving from the file."""
    from kvfabric.segment_storage import ssd as ssd_module
    from kvfabric.segment_storage.ssd import SsdFileRefused

    with tempfile.TemporaryDirectory() as d:
        SsdTier(
            Path(d), "s1", 64 << 10, 64, direct=False, io=SsdIo(0, 64, 1 << 20), read_bytes_max=1 << 30
        ).close()

        def bad_sector(self: SsdTier) -> list[object]:
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(ssd_module.SsdTier, "_read_index", bad_sector)
        with pytest.raises(SsdFileRefused, match="could not be read"):
            SsdTier(
                Path(d), "s1", 64 << 10, 64, direct=False, io=SsdIo(0, 64, 1 << 20), read_bytes_max=1 << 30
            )


def test_a_failed_sync_while_recovering_the_index_is_refused_with_what_to_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A commit record recovery drops is superseded by a free record, synced before anything is
    allocated; a failed sync there (`Unavailable`) escaped as a traceback, the segment restarted
    into the same (review, stop 68). It is `SsdFileRefused`, as a failed read is."""
    from kvfabric.core.disk_records import Record
    from kvfabric.core.disk_slots import DiskSlotTable
    from kvfabric.segment_storage.ssd import SsdFileRefused

    def failing_sync(fd: int) -> None:
        raise OSError(5, "Input/output error")

    real_recover = DiskSlotTable.recover

    def one_dropped(data_bytes: int, records: Any, **kw: Any) -> Any:
        table, _ = real_recover(data_bytes, records, **kw)
        return table, [Record("free", 0, 2)]  # a record to supersede: written, then synced

    with tempfile.TemporaryDirectory() as d:
        SsdTier(
            Path(d), "s1", 64 << 10, 64, direct=False, io=SsdIo(0, 64, 1 << 20), read_bytes_max=1 << 30
        ).close()
        monkeypatch.setattr(DiskSlotTable, "recover", one_dropped)
        with pytest.raises(SsdFileRefused, match="could not be read"):
            SsdTier(
                Path(d),
                "s1",
                64 << 10,
                64,
                direct=False,
                io=SsdIo(0, 64, 1 << 20),
                read_bytes_max=1 << 30,
                sync=failing_sync,
            )
