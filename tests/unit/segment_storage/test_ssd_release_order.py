"""A GET's disk streams given back together (`release_reads`) cancel every stream's pieces not
started before waiting for the running ones (review, 2026-12-07). Released one after another,
each stream cancelled its own pieces and waited for its running ones while the I/O threads
started the later streams' queued pieces: the walk kept pace with the threads, and a streamed GET
of 250 one-piece disk objects (1.5 s a piece, 8 threads) refused `busy` after its 2 s share wait
was answered after 39 s, its connection's thread and its tenant's read bytes held meanwhile. The
same for a GET cut short (`end_get` before its bytes were sent) and a closed connection."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from kvfabric.core.segment_slots import SlotTable
from kvfabric.format.checksum import checksum
from kvfabric.format.errors import Busy
from kvfabric.proto.dataplane import ReadRef
from kvfabric.segment_storage import backend_reads
from kvfabric.segment_storage.arena import Arena
from kvfabric.segment_storage.backend import ArenaBackend
from kvfabric.segment_storage.ssd import IO_TENANT_SHARE_DIVISOR, SsdIo, SsdTier

from .test_ssd_backend import ARENA_BYTES, INCARNATION, NOW_MS, SECRET, SEGMENT, signed
from .test_ssd_read_share import key_of

THREADS = 4
QUEUE_MAX = 128  # a tenant's share: 96 pieces
PIECE_S = 0.25  # a slow disk: each read piece takes this long


class SlowIo(SsdIo):
    """Each read piece takes `delay` seconds (once set: the objects are written at full speed);
    `started` counts the read pieces the disk began."""

    def __init__(self, threads: int, queue_max: int, chunk_bytes: int) -> None:
        super().__init__(threads, queue_max, chunk_bytes)
        self.delay = 0.0
        self.started = 0
        self._started_lock = threading.Lock()

    def _piece(self, fd: int, view: memoryview, offset: int, write: bool) -> None:
        if not write and self.delay:
            with self._started_lock:
                self.started += 1
            time.sleep(self.delay)
        super()._piece(fd, view, offset, write)


class SlowDisk:
    """One tenant's `objects` disk objects (one piece each) behind a segment backend, on a disk of
    `THREADS` threads that reads a piece in `PIECE_S`."""

    def __init__(self, tmp: Path, objects: int) -> None:
        tmp.mkdir()
        self.io = SlowIo(THREADS, QUEUE_MAX, 1 << 20)
        self.tier = SsdTier(
            tmp / "ssd", SEGMENT, 1 << 26, 512, direct=False, io=self.io, read_bytes_max=256 << 20
        )
        self.backend = ArenaBackend(
            Arena(tmp, SEGMENT, INCARNATION, ARENA_BYTES),
            SlotTable(ARENA_BYTES),
            segment_id=SEGMENT,
            incarnation=INCARNATION,
            secret=SECRET,
            confirm=lambda *_: "ok",
            clock_ms=lambda: NOW_MS,
            read_tokens_required=True,
            ssd=self.tier,
        )
        datas = [os.urandom(16 << 10) for _ in range(objects)]
        self.refs = [
            signed(
                ReadRef(
                    INCARNATION, *self.tier.write(memoryview(d), key_of(b"alice", i), checksum(d)), len(d)
                )
            )
            for i, d in enumerate(datas)
        ]
        self.io.delay = PIECE_S

    def given_back(self) -> bool:
        io = self.io
        return io.pieces_in_flight == 0 and io._owned_pieces == 0 and self.tier.read_bytes_in_flight == 0

    def close(self) -> None:
        self.io.delay = 0.0
        self.backend.arena.close()
        self.tier.close()
        self.io.close()


def test_a_get_refused_busy_gives_its_streams_back_in_a_pieces_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A streamed GET of more one-piece objects than its tenant's share, on a disk too slow to
    drain them within its wait: `busy` once its wait ends and the pieces running then are read —
    not after the disk read every piece the GET had queued (96 of them, 6 s here)."""
    wait_s = 0.3
    monkeypatch.setattr(backend_reads, "DISK_SHARE_WAIT_S", wait_s)
    disk = SlowDisk(tmp_path / "disk", 200)
    share = QUEUE_MAX - QUEUE_MAX // IO_TENANT_SHARE_DIVISOR
    try:
        started = time.monotonic()
        with pytest.raises(Busy, match="share"):
            disk.backend.begin_get_streamed(disk.refs, conn=1)
        took = time.monotonic() - started
        assert disk.io.share_wait_timeouts_total == 1
        # the pieces running at the end of the wait (a round or two of the threads), not the
        # `share` queued (before: every one of them, a round of the threads after another)
        assert disk.io.started <= 4 * THREADS < share, disk.io.started
        assert took < wait_s + 3.0, took  # (before: 6 s; a loaded machine: slack)
        assert disk.given_back()
    finally:
        disk.close()


@pytest.mark.parametrize("how", ["end_get", "close_connection"])
def test_a_get_cut_short_gives_its_streams_back_in_a_pieces_time(tmp_path: Path, how: str) -> None:
    """A streamed GET whose later objects are still queued when it ends (its client went away
    mid-send: `end_get`, or the connection closed): its queued pieces are never read."""
    disk = SlowDisk(tmp_path / how, 60)  # under the share: every piece queued at once, granted
    try:
        grant = disk.backend.begin_get_streamed(disk.refs, conn=1)
        assert grant.statuses == ["ok"] * 60
        started = time.monotonic()
        if how == "end_get":
            disk.backend.end_get(grant, conn=1)
        else:
            disk.backend.close_connection(1)
        took = time.monotonic() - started
        # the first round of the threads at most (before: all 59 queued, 15 rounds, 3.7 s)
        assert disk.io.started <= 2 * THREADS, disk.io.started
        assert took < 2.0, took
        assert disk.given_back()
    finally:
        disk.close()
