"""The disk tier's I/O engine (`SsdIo`: bounded, chunked `preadv`/`pwritev` on a thread pool) and
its shared `fdatasync` (`GroupSync`). Neither knows slots or records: `SsdTier` asks them for I/O.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from collections.abc import Callable

from kvfabric.core.disk_records import BLOCK_BYTES
from kvfabric.format.errors import Busy, Unavailable
from kvfabric.format.invariant import invariant

__all__ = ["GroupSync", "SsdIo"]


class SsdIo:
    """The I/O engine: `os.preadv`/`os.pwritev` in pieces of at most `chunk_bytes`, run by a pool
    of `threads` (0: every piece on the calling thread), at most `queue_max` pieces queued or
    running in all; a call that would exceed it is `Busy` before it starts. A call returns when
    all its pieces are done (its buffer is free again), and raises the first `OSError`."""

    def __init__(self, threads: int, queue_max: int, chunk_bytes: int) -> None:
        invariant(threads >= 0 and queue_max >= 1 and chunk_bytes >= BLOCK_BYTES, "bad I/O engine bounds")
        invariant(chunk_bytes % BLOCK_BYTES == 0, "chunk bytes must be whole blocks", chunk_bytes=chunk_bytes)
        self.threads = threads
        self.queue_max = queue_max
        self.chunk_bytes = chunk_bytes
        self._pool = (
            concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="kvf-ssd-io")
            if threads
            else None
        )
        self._lock = threading.Lock()
        self.pieces_in_flight = 0
        self.busy_total = 0

    def pwrite(self, fd: int, view: memoryview, offset: int) -> None:
        self._run(fd, view, offset, write=True)

    def write_record(self, fd: int, view: memoryview, offset: int) -> None:
        """One index record (a sector), on the calling thread, outside the queue bound."""
        self._piece(fd, view, offset, True)

    def _piece(self, fd: int, view: memoryview, offset: int, write: bool) -> None:
        _io_piece(fd, view, offset, write)

    def pread(self, fd: int, view: memoryview, offset: int) -> None:
        self._run(fd, view, offset, write=False)

    def _admit(self, pieces: int) -> None:
        """`pieces` more in flight, or `Busy` (counted) when that would go over `queue_max`."""
        with self._lock:
            if self.pieces_in_flight + pieces > self.queue_max:
                self.busy_total += 1
                raise Busy(
                    "disk tier I/O queue full", queue_max=self.queue_max, in_flight=self.pieces_in_flight
                )
            self.pieces_in_flight += pieces

    def _run(self, fd: int, view: memoryview, offset: int, *, write: bool) -> None:
        pieces = [(i, min(self.chunk_bytes, len(view) - i)) for i in range(0, len(view), self.chunk_bytes)]
        self._admit(len(pieces))
        try:
            if self._pool is None or len(pieces) == 1:
                for start, length in pieces:
                    self._piece(fd, view[start : start + length], offset + start, write)
                return
            futures = [
                self._pool.submit(self._piece, fd, view[start : start + length], offset + start, write)
                for start, length in pieces[1:]
            ]
            error: BaseException | None = None
            try:
                start, length = pieces[0]
                self._piece(fd, view[start : start + length], offset + start, write)
            except BaseException as exc:
                error = exc
            for future in futures:  # every piece ends before the buffer is handed back
                failed = future.exception()
                if failed is not None and error is None:
                    error = failed
            if error is not None:
                raise error
        finally:
            with self._lock:
                self.pieces_in_flight -= len(pieces)

    def submit_read(
        self, fd: int, view: memoryview, offset: int, piece_bytes: int, *, inline_first: bool = True
    ) -> list[tuple[int, int, concurrent.futures.Future[None]]]:
        """Start reading all of `view` in pieces of `piece_bytes` (whole blocks) and return at
        with the first piece read: per piece (start, end, its future), in order. The others are
        queued on the threads first, then the first is read on the calling thread (it is what a
        sender waits for first; a one-piece read costs no hand-off). `inline_first=False`: every
        piece is queued and this returns at once (an object a sender gets to only after others:
        it is read while they are sent). The same bounds as `pread` (`Busy` before anything
        starts); a piece leaves the bound when it ends or is cancelled. Without threads every
        piece is read now, on the calling thread."""
        invariant(piece_bytes >= BLOCK_BYTES and piece_bytes % BLOCK_BYTES == 0, "bad read piece size")
        spans = [(i, min(i + piece_bytes, len(view))) for i in range(0, len(view), piece_bytes)]
        self._admit(len(spans))

        def done(_: concurrent.futures.Future[None]) -> None:
            with self._lock:
                self.pieces_in_flight -= 1

        out: list[tuple[int, int, concurrent.futures.Future[None]]] = []
        order = [*spans[1:], spans[0]] if inline_first else spans
        for n, (start, end) in enumerate(order):
            if self._pool is None or (inline_first and n == len(spans) - 1):
                future: concurrent.futures.Future[None] = concurrent.futures.Future()
                try:
                    self._piece(fd, view[start:end], offset + start, False)
                    future.set_result(None)
                except BaseException as exc:  # the reader sees it when it waits for this piece
                    future.set_exception(exc)
            else:
                try:
                    future = self._pool.submit(self._piece, fd, view[start:end], offset + start, False)
                except RuntimeError as exc:  # the pool shut down: this piece fails, the bound is kept
                    future = concurrent.futures.Future()
                    future.set_exception(exc)
            future.add_done_callback(done)
            out.append((start, end, future))
        return [out[-1], *out[:-1]] if inline_first else out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _io_piece(fd: int, view: memoryview, offset: int, write: bool) -> None:
    """All of `view` to/from `offset`, looping over short transfers."""
    done = 0
    while done < len(view):
        part = view[done:]
        n = os.pwritev(fd, [part], offset + done) if write else os.preadv(fd, [part], offset + done)
        if n <= 0:
            raise OSError(f"{'write' if write else 'read'} returned {n} at offset {offset + done}")
        done += n


class GroupSync:
    """`fdatasync` shared by concurrent callers: `sync()` returns once a sync that *started after
    the call* has finished, so one sync covers every write completed before it began. After a
    failed sync every later call raises `Unavailable` (the kernel may have dropped dirty pages)."""

    def __init__(self, fd: int, sync: Callable[[int], None] = os.fdatasync) -> None:
        self._fd = fd
        self._sync = sync
        self._cond = threading.Condition()
        self._started = 0
        self._done = 0
        self._running = False
        self.failed: OSError | None = None
        self.syncs_total = 0
        self.sync_seconds_total = 0.0

    def sync(self) -> None:
        with self._cond:
            target = self._started + 1
            while self._done < target and self.failed is None:
                if self._running:
                    self._cond.wait()
                    continue
                self._running = True
                self._started += 1
                number = self._started
                self._cond.release()
                started = time.perf_counter()
                error: OSError | None = None
                try:
                    self._sync(self._fd)
                except OSError as exc:
                    error = exc
                finally:
                    self._cond.acquire()
                self._running = False
                self._done = number
                self.syncs_total += 1
                self.sync_seconds_total += time.perf_counter() - started
                if error is not None:
                    self.failed = error
                self._cond.notify_all()
            if self.failed is not None:
                raise Unavailable(
                    f"the disk tier's sync failed: {self.failed!r}; no more writes until restart",
                    reason="ssd_failed",
                )
