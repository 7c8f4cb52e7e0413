"""The disk tier's read buffers (`ReadBufferPool`): pre-faulted, page-aligned, reused; never lent
twice; lent and idle together within `read_bytes_max`; given back after every outcome of a read
(ok then released, corrupt, I/O error, busy, an exception) and after a GET's end or its
connection's close; reads from reused buffers still verified byte for byte."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest

from kvfabric.format.checksum import checksum
from kvfabric.format.errors import Busy
from kvfabric.format.invariant import InvariantViolation
from kvfabric.segment_storage.ssd import ReadBufferPool, SsdIo, SsdTier

from .test_ssd_backend import close, make

KiB = 1024


def test_pool_reuses_buffers_and_never_lends_one_twice() -> None:
    pool = ReadBufferPool(256 * KiB)
    a, b = pool.take(64 * KiB), pool.take(60 * KiB)  # 60 KiB rounds up to whole blocks: 60 KiB
    assert a is not b and len(a) == 64 * KiB and len(b) == 60 * KiB
    address = int(np.frombuffer(a, dtype=np.uint8).ctypes.data)
    assert address % os.sysconf("SC_PAGE_SIZE") == 0  # page-aligned (O_DIRECT)
    pool.give(a)
    again = pool.take(64 * KiB)
    assert again is a and pool.reused_total == 1 and pool.made_total == 2
    c = pool.take(64 * KiB)  # `a` is lent: a new one
    assert c is not a and c is not b
    pool.give(c)
    with pytest.raises(InvariantViolation):
        pool.give(c)  # given back twice
    pool.give(a)
    pool.give(b)
    assert pool.lent() == 0 and pool.lent_bytes == 0


def test_pool_stays_within_its_bound() -> None:
    pool = ReadBufferPool(128 * KiB)
    small = [pool.take(32 * KiB) for _ in range(4)]
    for buf in small:
        pool.give(buf)
    assert pool.idle_bytes == 128 * KiB
    big = pool.take(64 * KiB)  # idle buffers of another size are unmapped to make room
    assert pool.lent_bytes + pool.idle_bytes <= 128 * KiB and pool.unmapped_total == 2
    pool.give(big)
    huge = pool.take(512 * KiB)  # admitted above the bound by the caller ("one read always may")
    pool.give(huge)  # not kept
    assert pool.lent_bytes + pool.idle_bytes <= 128 * KiB
    assert pool.take(512 * KiB) is not huge


def test_pool_under_threads_lends_each_buffer_to_one_holder() -> None:
    pool = ReadBufferPool(1 << 20)
    holders: dict[int, int] = {}
    errors: list[str] = []
    lock = threading.Lock()

    def work(me: int) -> None:
        for _ in range(300):
            buf = pool.take(16 * KiB)
            with lock:
                if id(buf) in holders:
                    errors.append(f"buffer lent to {holders[id(buf)]} and {me}")
                holders[id(buf)] = me
            buf[0] = me
            with lock:
                del holders[id(buf)]
            pool.give(buf)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and pool.lent() == 0
    assert pool.made_total <= 4 and pool.lent_bytes + pool.idle_bytes <= 1 << 20


@pytest.fixture(params=[True, False], ids=["direct", "buffered"])
def tier(tmp_path: Path, request: pytest.FixtureRequest) -> SsdTier:
    io = SsdIo(2, 64, 64 * KiB)
    return SsdTier(tmp_path, "seg", 4 << 20, 32, direct=request.param, io=io, read_bytes_max=1 << 20)


def test_tier_reads_reuse_buffers_and_stay_verified(tier: SsdTier) -> None:
    objects = [os.urandom(100 * KiB + 1 + i) for i in range(3)]  # one extent (104 KiB), other bytes
    placed = [tier.write(memoryview(d), b"k%d" % i, checksum(d)) for i, d in enumerate(objects)]
    for _ in range(3):
        for data, (slot, generation) in zip(objects, placed, strict=True):
            read = tier.read(slot, generation, len(data))
            assert read.status == "ok" and read.view is not None
            assert bytes(read.view) == data and read.checksum == checksum(data)
            read.release()
            read.release()  # idempotent: given back once
    pool = tier.read_buffers
    assert pool.made_total == 1 and pool.reused_total == 8 and pool.lent() == 0
    # Two reads held at once get two buffers.
    first = tier.read(*placed[0], len(objects[0]))
    second = tier.read(*placed[1], len(objects[1]))
    assert first.view is not None and second.view is not None
    assert bytes(first.view) == objects[0] and bytes(second.view) == objects[1]
    first.release()
    second.release()
    assert pool.lent() == 0 and tier.stats()["read_bytes_in_flight"] == 0
    tier.close()
    tier.io.close()


def test_buffers_come_back_after_corrupt_reads_errors_and_busy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    io = SsdIo(0, 64, 64 * KiB)
    tier = SsdTier(tmp_path, "seg", 4 << 20, 32, direct=False, io=io, read_bytes_max=1 << 20)
    pool = tier.read_buffers
    data = [os.urandom(8 * KiB) for _ in range(4)]
    placed = [tier.write(memoryview(d), b"k%d" % i, checksum(d)) for i, d in enumerate(data)]
    ok = tier.read(*placed[0], len(data[0]))
    ok.release()
    # A flipped byte on disk: corrupt (freed), the buffer back, the bytes never handed out.
    local = tier.local(placed[1][0])
    grant = tier.table.acquire(local, placed[1][1], len(data[1]))
    tier.table.release(local, placed[1][1])
    at = tier.geometry.data_offset + grant.offset
    fd = os.open(tier.path, os.O_RDWR)
    try:
        os.pwrite(fd, bytes([data[1][0] ^ 0xFF]), at)
    finally:
        os.close(fd)
    bad = tier.read(*placed[1], len(data[1]))
    assert bad.status == "corrupt" and bad.view is None and pool.lent() == 0

    def fail(*_: object, **__: object) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(io, "pread", fail)
    assert tier.read(*placed[2], len(data[2])).status == "corrupt" and pool.lent() == 0

    def busy(*_: object, **__: object) -> None:
        raise Busy("queue full")

    monkeypatch.setattr(io, "pread", busy)
    with pytest.raises(Busy):
        tier.read(*placed[3], len(data[3]))
    assert pool.lent() == 0

    def interrupted(*_: object, **__: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(io, "pread", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tier.read(*placed[3], len(data[3]))
    assert pool.lent() == 0 and tier.stats()["read_bytes_in_flight"] == 0
    monkeypatch.undo()
    good = tier.read(*placed[3], len(data[3]))  # a reused buffer: the right bytes, verified
    assert good.view is not None and bytes(good.view) == data[3]
    good.release()
    assert pool.made_total == 1 and pool.lent() == 0
    tier.close()
    io.close()


def test_a_get_holds_its_buffer_until_end_get_or_the_connection_closes(tmp_path: Path) -> None:
    seg = make(tmp_path)
    try:
        data = os.urandom(64 * KiB)
        ref = seg.demote(seg.store(data, b"key-pool"))
        pool = seg.ssd.read_buffers
        grant = seg.backend.begin_get([ref], conn=1)
        assert grant.statuses == ["ok"] and pool.lent() == 1  # held while the transport sends
        view = grant.views[0]
        assert view is not None and bytes(view) == data
        second = seg.backend.begin_get([ref], conn=1)
        assert pool.lent() == 2  # a second GET of the same object: another buffer
        seg.backend.end_get(grant, conn=1)
        assert pool.lent() == 1
        seg.backend.close_connection(1)  # the second GET's connection died: given back too
        assert pool.lent() == 0 and second.statuses == ["ok"]
        third = seg.backend.begin_get([ref], conn=2)
        assert pool.reused_total >= 1 and third.views[0] is not None and bytes(third.views[0]) == data
        seg.backend.end_get(third, conn=2)
        assert pool.lent() == 0
    finally:
        close(seg)
