"""The disk tier's I/O engine (`SsdIo`: bounded, chunked `preadv`/`pwritev` on a thread pool) and
its shared `fdatasync` (`GroupSync`). Neither knows slots or records: `SsdTier` asks them for I/O.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from collections.abc import Callable
from typing import Final, Protocol

from kvfabric.core.disk_records import BLOCK_BYTES
from kvfabric.format.errors import Busy, Unavailable
from kvfabric.format.invariant import invariant

__all__ = [
    "IO_TENANT_SHARE_DIVISOR",
    "STREAM_HEAD_DIVISOR_DEFAULT",
    "STREAM_PIECE_MIN_BYTES",
    "GroupSync",
    "InlinePiece",
    "ReadPiece",
    "SsdIo",
    "stream_head_bytes",
]

# The smallest piece a streamed read is cut into (a head, `stream_head_bytes`); the data server
# sends a filling view in steps of this size (`kvfabric.dataplane.tcp_server`).
STREAM_PIECE_MIN_BYTES: Final = 64 << 10
# `KVF_SEGMENT_SSD_STREAM_HEAD_DIVISOR`: a GET's only disk object is read as a head of 1/N of it,
# then the rest; 1 (off): read whole. Off by default: on the shared 2-vCPU VM a head gained nothing
# at 1 MiB and lost at 256 KiB (docs/ssd-tier.md "Figures", 2026-12-02 11:25).
STREAM_HEAD_DIVISOR_DEFAULT: Final = 1
# One tenant's pieces queued or running always leave this share of `queue_max` to the others and
# to the segment's own I/O (the pieces of reads made for a tenant: `SsdTier.read`, `read_stream`),
# as its read bytes leave a share of `read_bytes_max` (`READ_TENANT_SHARE_DIVISOR`); the segment's
# own I/O (writes, `verify`) is no tenant's.
IO_TENANT_SHARE_DIVISOR: Final = 4


def stream_head_bytes(extent: int, chunk_bytes: int, divisor: int) -> int:
    """The head of an object's `extent` cut at about 1/`divisor` of it: whole multiples of
    `STREAM_PIECE_MIN_BYTES`, never more than the engine's `chunk_bytes`. At least `extent` (no
    head: read whole) when `divisor` is 1 or the object is at most `STREAM_PIECE_MIN_BYTES`."""
    want = -(-extent // max(divisor, 1))
    want = -(-want // STREAM_PIECE_MIN_BYTES) * STREAM_PIECE_MIN_BYTES
    return min(chunk_bytes, want)


class SsdIo:
    """The I/O engine: `os.preadv`/`os.pwritev` in pieces of at most `chunk_bytes`, run by a pool
    of `threads` (0: every piece on the calling thread), at most `queue_max` pieces queued or
    running in all; a call that would exceed it is `Busy` before it starts, unless nothing is in
    flight (one call always may, as one disk read always may: an object of more than `queue_max`
    pieces is otherwise never written). A call made for a tenant (`owner`: its share domain) is
    also `Busy` (counted: `busy_tenant_total`) when that tenant's pieces would go past
    `share_pieces` (three quarters of `queue_max`, `IO_TENANT_SHARE_DIVISOR`) while anything is in
    flight: the byte share of reads (`SsdTier.read_bytes_max`) did not bound pieces, and one
    tenant's GETs of many small disk objects (a piece each, far below its bytes) filled every
    slot, every other tenant's disk reads `busy` meanwhile. Whether or not another tenant reads:
    applied only while one did, a tenant reading alone took every slot, and a second tenant's
    read, and the segment's own demotion writes, were `busy` until that burst drained (review,
    2026-12-07). A read that may wait (`wait_until`: a streamed GET's disk objects, on its
    connection's thread) waits, until then at most, for its tenant's pieces to drain below the
    share rather than fail (counted: `share_waits_total`, and `share_wait_timeouts_total` for the
    waits that ended `Busy`): a GET's own earlier objects, queued on the threads, end in a disk
    read's time each, so one GET of more one-piece disk objects than the share (192 of the
    default queue of 256) is read whole, though not all of it queued at once. Writes and the
    segment's own reads neither count to a share nor are held to one. A call returns when all
    its pieces are done (its buffer is free again), and raises the first `OSError`."""

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
        # owner -> its pieces of `pieces_in_flight` (an entry only while it has some: bounded by
        # the pieces in flight)
        self._pieces_by_owner: dict[bytes, int] = {}
        self._owned_pieces = 0  # the sum of `_pieces_by_owner`: tenants' pieces in flight
        # the most pieces one tenant holds while anything is in flight (class docstring)
        self.share_pieces = queue_max - queue_max // IO_TENANT_SHARE_DIVISOR
        self._drained = threading.Condition(self._lock)  # a piece ended (for `_admit`'s waiters)
        self._waiters = 0  # `_admit` calls waiting on `_drained`
        self.busy_total = 0
        self.busy_tenant_total = 0  # calls refused at their tenant's share (not in `busy_total`)
        self.share_waits_total = 0  # calls that waited past their tenant's share (`wait_until`)
        self.share_wait_timeouts_total = 0  # ... of which ended `Busy` (either kind, above)

    def pwrite(self, fd: int, view: memoryview, offset: int) -> None:
        self._run(fd, view, offset, write=True, owner=None)

    def write_record(self, fd: int, view: memoryview, offset: int) -> None:
        """One index record (a sector), on the calling thread, outside the queue bound."""
        self._piece(fd, view, offset, True)

    def _piece(self, fd: int, view: memoryview, offset: int, write: bool) -> None:
        _io_piece(fd, view, offset, write)

    def pread(self, fd: int, view: memoryview, offset: int, *, owner: bytes | None = None) -> None:
        """Read all of `view`; `owner`: the tenant it is read for (its share, class docstring)."""
        self._run(fd, view, offset, write=False, owner=owner)

    def _admit(self, pieces: int, owner: bytes | None, wait_until: float = 0.0) -> None:
        """`pieces` more in flight, or `Busy` (counted) when that would go over `queue_max` and
        something is in flight already. One call always may: an object of more than `queue_max`
        pieces (up to 1 GiB, past `io_queue_max` x `chunk_bytes`, 256 MiB by default) was `Busy`
        every time, so its demotion was asked again forever and its arena bytes never reclaimed
        (review, 2026-12-06). Bounded: it is one object, and while it runs every other call is `Busy`.
        `owner`'s pieces are counted too, and kept to `share_pieces` whenever anything is in flight
        (class docstring): not a quarter *at most* (with tenants off every read is one tenant's).
        Past its share, a call with `wait_until` (`time.monotonic()` seconds) waits for pieces to
        end until then, then is `Busy` as any other; the queue's own bound never waits (that is
        the others' load, not its own). A call that waited is counted once (`share_waits_total`),
        and again if it then ends `Busy` (`share_wait_timeouts_total`: at `wait_until`, or the
        queue full when it woke)."""
        waited = False
        with self._lock:
            while True:
                in_flight = self.pieces_in_flight
                if in_flight and in_flight + pieces > self.queue_max:
                    self.busy_total += 1
                    self.share_wait_timeouts_total += int(waited)
                    raise Busy("disk tier I/O queue full", queue_max=self.queue_max, in_flight=in_flight)
                if owner is None:
                    break
                owner_in = self._pieces_by_owner.get(owner, 0)
                if not in_flight or owner_in + pieces <= self.share_pieces:
                    self._pieces_by_owner[owner] = owner_in + pieces
                    self._owned_pieces += pieces
                    break
                left = wait_until - time.monotonic()
                if left <= 0:
                    self.busy_tenant_total += 1
                    self.share_wait_timeouts_total += int(waited)
                    raise Busy(
                        "a tenant's disk tier I/O pieces queued at its share", share_pieces=self.share_pieces
                    )
                if not waited:
                    waited = True
                    self.share_waits_total += 1
                self._waiters += 1
                try:
                    self._drained.wait(left)  # (the lock is let go meanwhile)
                finally:
                    self._waiters -= 1
            self.pieces_in_flight += pieces

    def _ended(self, pieces: int, owner: bytes | None) -> None:
        """`pieces` of `owner`'s left the queue (call it with `_lock` held)."""
        self.pieces_in_flight -= pieces
        if owner is not None:
            left = self._pieces_by_owner.get(owner, 0) - pieces
            invariant(left >= 0, "a tenant's I/O pieces went below zero", left=left)
            self._owned_pieces -= pieces
            if left:
                self._pieces_by_owner[owner] = left
            else:
                del self._pieces_by_owner[owner]  # (no entry per tenant ever seen)
        if self._waiters:
            self._drained.notify_all()

    def _run(self, fd: int, view: memoryview, offset: int, *, write: bool, owner: bytes | None) -> None:
        pieces = [(i, min(self.chunk_bytes, len(view) - i)) for i in range(0, len(view), self.chunk_bytes)]
        self._admit(len(pieces), owner)
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
                self._ended(len(pieces), owner)

    def submit_read(
        self,
        fd: int,
        view: memoryview,
        offset: int,
        piece_bytes: int,
        *,
        inline_first: bool = True,
        head_bytes: int = 0,
        owner: bytes | None = None,
        wait_until: float = 0.0,
    ) -> list[tuple[int, int, ReadPiece]]:
        """Start reading all of `view` in pieces of `piece_bytes` (whole blocks): per piece (start,
        end, its `ReadPiece`), in order. Every piece but the first is queued on the threads at
        once; the first (`inline_first`) is the caller's own, read on its thread when it first
        asks for it (`ReadPiece.result`: no thread hand-off), so whatever the caller queues after
        this call (a GET's later objects) is read while it reads this one. `inline_first=False`:
        every piece is queued (an object a sender gets to only after others: it is read while
        they are sent). `head_bytes` (with `inline_first`; `view` of at most `piece_bytes`): two
        pieces, the head and the rest, both the caller's own, read in order as it asks for them
        — it can send the head before it reads the rest, so the rest is read while the head is
        taken off the socket. The same bounds as `pread` (`Busy` before anything starts; `owner`'s
        share too, waited for until `wait_until`: `_admit`); a piece leaves the bound when it
        ends or is cancelled. Without threads every piece is read now, on the calling thread."""
        invariant(piece_bytes >= BLOCK_BYTES and piece_bytes % BLOCK_BYTES == 0, "bad read piece size")
        lazy = inline_first and self._pool is not None
        head = head_bytes if lazy and 0 < head_bytes < len(view) else 0
        invariant(not head or (head % BLOCK_BYTES == 0 and len(view) <= piece_bytes), "bad read head")
        if head:
            spans = [(0, head), (head, len(view))]
        else:
            spans = [(i, min(i + piece_bytes, len(view))) for i in range(0, len(view), piece_bytes)]
        self._admit(len(spans), owner, wait_until)

        def done(_: object = None) -> None:
            with self._lock:
                self._ended(1, owner)

        out: list[tuple[int, int, ReadPiece]] = []
        if lazy:  # the first piece (with a head, both): read by its caller when it asks
            for start, end in spans[: 2 if head else 1]:
                out.append((start, end, InlinePiece(self, fd, view[start:end], offset + start, done)))
        for start, end in spans[len(out) :]:
            future: concurrent.futures.Future[None]
            if self._pool is None:
                future = concurrent.futures.Future()
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
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


class ReadPiece(Protocol):
    """What `SsdIo.submit_read` hands back per piece: a `concurrent.futures.Future` (a queued
    piece) or an `InlinePiece` (read by whoever asks for its result)."""

    def result(self, timeout: float | None = None) -> None: ...
    def done(self) -> bool: ...
    def cancel(self) -> bool: ...
    def exception(self, timeout: float | None = None) -> BaseException | None: ...


class InlinePiece:
    """A read piece done on the thread that asks for its result (`result`), once; `cancel` before
    that means it is never read, and a `cancel` from another thread while it is being read waits
    for the read to end (its buffer is in use), as a running future's does."""

    def __init__(self, io: SsdIo, fd: int, view: memoryview, offset: int, ended: Callable[[], None]) -> None:
        self._io, self._fd, self._view, self._offset, self._ended_cb = io, fd, view, offset, ended
        self._lock = threading.Lock()
        self._ended = False
        self._error: BaseException | None = None
        self._cancelled = False

    def _end(self) -> None:
        self._ended = True
        self._view.release()
        self._ended_cb()  # it leaves the I/O bound

    def result(self, timeout: float | None = None) -> None:
        with self._lock:
            if not self._ended:
                try:
                    self._io._piece(self._fd, self._view, self._offset, False)
                except BaseException as exc:
                    self._error = exc
                self._end()
        if self._cancelled:
            raise concurrent.futures.CancelledError
        if self._error is not None:
            raise self._error

    def done(self) -> bool:
        return self._ended

    def cancel(self) -> bool:
        with self._lock:
            if self._ended:
                return False
            self._cancelled = True
            self._end()
            return True

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if self._cancelled:
            raise concurrent.futures.CancelledError
        return self._error if self._ended else None


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
