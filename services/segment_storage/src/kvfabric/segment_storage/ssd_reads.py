"""What a disk-tier read hands its caller: `SsdRead` (the bytes, read and checked) and `SsdStream`
(the bytes still landing, checked after they are sent). Both are made by `SsdTier.read` /
`SsdTier.read_stream`; buffer ownership and release order are told in `kvfabric.segment_storage.ssd`.
"""

from __future__ import annotations

import contextlib
import mmap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from kvfabric.format.checksum import StreamingChecksum
from kvfabric.segment_storage.ssd_io import ReadPiece

if TYPE_CHECKING:
    from kvfabric.segment_storage.ssd import SsdTier

__all__ = ["ReadStatus", "SsdRead", "SsdStream", "release_reads"]

ReadStatus = Literal["ok", "stale_generation", "not_found", "wrong_size", "corrupt"]


@dataclass(slots=True)
class SsdRead:
    """One read from the disk tier: `view` (the object's bytes, in a private buffer the caller
    owns until `release`, which also gives its bytes back to `read_bytes_max`) and the stored
    `checksum`, when `status` is ok."""

    status: ReadStatus
    view: memoryview | None = None
    checksum: bytes = b""
    key: bytes = b""
    generation: int = 0
    on_release: Callable[[], None] | None = None

    def release(self) -> None:
        if self.view is not None:
            self.view.release()
            self.view = None
        if self.on_release is not None:
            self.on_release()
            self.on_release = None


class SsdStream:
    """A disk read still landing, for a GET that sends the bytes as they arrive and its verdict
    after them (`SsdTier.read_stream`). Its pieces are read by the I/O engine at once; `wait(n)`
    blocks until the first `n` bytes are in `view`, hashing each piece in order as it lands (a
    piece that failed is zero-filled, so a sender stays in step, and the verdict is then not ok);
    `verdict()` waits for all of it and says whether the bytes match the stored checksum — a
    mismatch or an I/O error frees the slot at once and counts it, as `read` does (the caller
    reports it). `release()` (exactly as `SsdRead.release`, after the transport is done with the
    view) cancels pieces not started (`cancel_pending`), waits for the running ones, lets go of
    the slot's read reference if no verdict did, and gives the buffer back; several at once go
    through `release_reads`. Used by one thread at a time."""

    def __init__(
        self,
        tier: SsdTier,
        slot: int,
        generation: int,
        size: int,
        stored: bytes,
        key: bytes,
        buf: mmap.mmap,
        pieces: list[tuple[int, int, ReadPiece]],
        give_back: Callable[[], None],
    ) -> None:
        self.status: ReadStatus = "ok"  # the verdict: until `verdict()` says otherwise
        self.view: memoryview | None = memoryview(buf)[:size]
        self.checksum = stored
        self.key = key
        self.generation = generation
        self._tier, self._slot, self._size = tier, slot, size
        self._whole = memoryview(buf)
        self._pieces = pieces
        self._next = 0  # pieces hashed so far
        self._digest = StreamingChecksum()
        self._failed = False
        self._held = True  # the slot's read reference
        self._give_back: Callable[[], None] | None = give_back
        self._started = time.perf_counter()

    def wait(self, end: int) -> int:
        """Until bytes [0, end) of `view` are in place (read, or zero-filled after a failure);
        returns how many are (`end` or more: later pieces already read are taken too)."""
        pieces = self._pieces
        while self._next < len(pieces) and (pieces[self._next][0] < end or pieces[self._next][2].done()):
            start, stop, future = pieces[self._next]
            try:
                future.result()
            except Exception as exc:  # an I/O error or a cancelled piece: failed
                if not self._failed and isinstance(exc, OSError):
                    self._tier.count("read_errors_total")
                self._failed = True
                self._whole[start:stop] = bytes(stop - start)
            if not self._failed:
                self._digest.update(self._whole[start : min(stop, self._size)])
            self._next += 1
        done = pieces[self._next - 1][1] if self._next else 0
        return min(done, self._size)

    def verdict(self) -> bool:
        """Whether the whole object was read and matches its checksum (once; later calls repeat
        it). Not ok: the slot is freed here (its generation moves on) and `status` is `corrupt`."""
        if not self._held:
            return self.status == "ok"
        self.wait(self._size)
        ok = not self._failed and self._digest.digest() == self.checksum
        tier = self._tier
        with tier.lock:
            tier.table.release(tier.local(self._slot), self.generation)
            self._held = False
            if ok:
                seconds = time.perf_counter() - self._started
                tier._count("reads_total")
                tier._count("reads_streamed_total")
                tier._count("read_bytes_total", self._size)
                tier._count("read_us_total", int(seconds * 1e6))
                tier._observe("read", seconds)
        if not ok:
            self.status = "corrupt"
            tier.count("read_corrupt_total")
            tier.free_many([(self._slot, self.generation)])
        return ok

    def cancel_pending(self) -> None:
        """Cancel the pieces not started: they never run, and leave the I/O queue now (its
        bound, its tenant's share). Queued ones running go on (`release` waits for them); a
        piece its reader reads itself (`InlinePiece`) is not running unless another thread is in
        its read, whose end its `cancel` waits for (its buffer is in use)."""
        for _, _, future in self._pieces:
            future.cancel()

    def release(self) -> None:
        self.cancel_pending()
        for _, _, future in self._pieces:
            with contextlib.suppress(BaseException):
                future.exception()  # running: ends before the buffer goes back
        if self._held:
            tier = self._tier
            with tier.lock:
                tier.table.release(tier.local(self._slot), self.generation)
                self._held = False
        if self.view is not None:
            self.view.release()
            self.view = None
        self._whole.release()
        if self._give_back is not None:
            self._give_back()
            self._give_back = None


def release_reads(reads: Sequence[SsdRead | SsdStream]) -> None:
    """Give back several reads at once (a GET's, refused or ended, or a closed connection's):
    every stream's pieces not yet started are cancelled first, then each read is released (a
    stream waits for its running pieces only). Released one after another, each stream cancelled
    only its own pieces, then waited for its running ones while the I/O threads started the later
    streams' queued pieces: the walk kept pace with the threads, and a streamed GET of 250
    one-piece disk objects refused `busy` after its 2 s wait was answered after 39 s, its
    connection's thread and its tenant's read bytes held meanwhile (review, 2026-12-07)."""
    for read in reads:
        if isinstance(read, SsdStream):
            read.cancel_pending()
    for read in reads:
        read.release()
