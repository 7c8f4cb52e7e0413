"""The I/O engine's queue bound (`SsdIo`, `KVF_SEGMENT_SSD_IO_QUEUE_MAX` pieces queued or running)
and an object of more pieces than that (review, 2026-12-06): it was `Busy` every time, so it was
never written (objects may be up to 1 GiB, the bound 256 pieces of 1 MiB) and the policy asked to
demote it again forever, its arena bytes never reclaimed. Now one call always may when nothing is
in flight, as one disk read always may; while it runs every other call is still refused."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from kvfabric.core.disk_records import BLOCK_BYTES
from kvfabric.format.checksum import checksum
from kvfabric.format.errors import Busy
from kvfabric.segment_storage.ssd import SsdIo, SsdTier

from .test_ssd_backend import SEGMENT

QUEUE_MAX = 4


def test_a_call_of_more_pieces_than_the_queue_runs_when_nothing_is_in_flight(tmp_path: Path) -> None:
    io = SsdIo(0, QUEUE_MAX, BLOCK_BYTES)
    fd = os.open(tmp_path / "file", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        data = os.urandom((QUEUE_MAX + 1) * BLOCK_BYTES)  # 5 pieces, the bound 4
        io.pwrite(fd, memoryview(data), 0)
        back = bytearray(len(data))
        io.pread(fd, memoryview(back), 0)
        assert bytes(back) == data
        assert (io.pieces_in_flight, io.busy_total) == (0, 0)
    finally:
        os.close(fd)
        io.close()


def test_while_an_oversized_call_runs_every_other_call_is_refused(tmp_path: Path) -> None:
    io = SsdIo(2, QUEUE_MAX, BLOCK_BYTES)
    fd = os.open(tmp_path / "file", os.O_RDWR | os.O_CREAT, 0o600)
    entered, release = threading.Event(), threading.Event()
    real = io._piece

    def held(fd: int, view: memoryview, offset: int, write: bool) -> None:
        if offset == 0:  # the oversized call's first piece: held until released
            entered.set()
            release.wait(10)
        real(fd, view, offset, write)

    io._piece = held  # type: ignore[method-assign]
    errors: list[BaseException] = []

    def oversized() -> None:
        try:
            io.pwrite(fd, memoryview(bytes((QUEUE_MAX + 1) * BLOCK_BYTES)), 0)
        except BaseException as exc:
            errors.append(exc)

    writer = threading.Thread(target=oversized)
    try:
        writer.start()
        assert entered.wait(10)
        assert io.pieces_in_flight == QUEUE_MAX + 1
        with pytest.raises(Busy):  # one piece more: refused while the oversized call runs
            io.pwrite(fd, memoryview(bytes(BLOCK_BYTES)), 64 * BLOCK_BYTES)
        with pytest.raises(Busy):
            io.pread(fd, memoryview(bytearray(BLOCK_BYTES)), 64 * BLOCK_BYTES)
        assert io.busy_total == 2
    finally:
        release.set()
        writer.join(10)
    try:
        assert errors == [] and io.pieces_in_flight == 0
        # ... and an oversized call is admitted only when nothing is in flight
        entered.clear()
        release.clear()
        small = threading.Thread(target=io.pwrite, args=(fd, memoryview(bytes(BLOCK_BYTES)), 0))
        small.start()
        assert entered.wait(10)
        with pytest.raises(Busy):
            io.pwrite(fd, memoryview(bytes((QUEUE_MAX + 1) * BLOCK_BYTES)), 64 * BLOCK_BYTES)
        release.set()
        small.join(10)
    finally:
        release.set()
        os.close(fd)
        io.close()


def test_the_disk_tier_stores_and_reads_an_object_of_more_pieces_than_the_queue(tmp_path: Path) -> None:
    io = SsdIo(2, QUEUE_MAX, BLOCK_BYTES)
    tier = SsdTier(tmp_path / "ssd", SEGMENT, 1 << 20, 16, direct=False, io=io, read_bytes_max=1 << 20)
    try:
        data = os.urandom(QUEUE_MAX * BLOCK_BYTES + 100)  # 5 pieces
        slot, generation = tier.write(memoryview(data), b"key-big", checksum(data))
        read = tier.read(slot, generation, len(data))
        assert read.status == "ok" and read.view is not None and bytes(read.view) == data
        read.release()
    finally:
        tier.close()
        io.close()
