"""The disk tier's memory: page-aligned (`O_DIRECT`-ready) buffers and the pool that lends them.

`ReadBufferPool` serves both the tier's read buffers (`read_bytes_max`) and its write bounce
buffers (`WRITE_BOUNCE_BYTES_MAX`); who holds a buffer when is told in `kvfabric.segment_storage.ssd`.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from typing import Final

from kvfabric.core.disk_records import BLOCK_BYTES
from kvfabric.format.invariant import invariant

__all__ = ["MADV_POPULATE_WRITE", "ReadBufferPool", "aligned_buffer", "prefaulted_buffer"]

MADV_POPULATE_WRITE: Final = 23  # Linux >= 5.14: fault a mapping's pages in, writable, now


def aligned_buffer(size: int) -> mmap.mmap:
    """A page-aligned, zero-filled anonymous buffer of `size` rounded up to the block size (what
    `O_DIRECT` needs for memory); freed when the last view of it goes."""
    return mmap.mmap(-1, max(BLOCK_BYTES, -(-size // BLOCK_BYTES) * BLOCK_BYTES))


def prefaulted_buffer(size: int) -> mmap.mmap:
    """`aligned_buffer` with every page faulted in (writable) now, so a read into it takes no
    page faults; one call on Linux >= 5.14, else one write per page."""
    buf = aligned_buffer(size)
    try:
        buf.madvise(MADV_POPULATE_WRITE)
    except (OSError, ValueError):
        for offset in range(0, len(buf), mmap.PAGESIZE):
            buf[offset] = 0
    return buf


class ReadBufferPool:
    """Pre-faulted, page-aligned read buffers, reused. `take(n)` lends one of `n` bytes (rounded up
    to whole blocks); `give` takes it back (an idle buffer of that size is reused by the next
    `take` of that size). Lent and idle buffers together hold at most `bytes_max` bytes: a `take`
    unmaps idle buffers of other sizes to make room, and past the bound (only when the caller
    admitted one read above it: `SsdTier.read`'s "one read always may") the buffer is made and
    unmapped on `give` rather than kept. A buffer is lent to one holder at a time: `give` of a
    buffer that is not lent is an invariant failure. Thread-safe."""

    def __init__(self, bytes_max: int) -> None:
        invariant(bytes_max >= BLOCK_BYTES, "read buffer pool bound below one block", bytes_max=bytes_max)
        self.bytes_max = bytes_max
        self._lock = threading.Lock()
        self._idle: dict[int, list[mmap.mmap]] = {}  # buffer bytes -> idle buffers, last given first
        self._lent: dict[int, mmap.mmap] = {}  # id(buffer) -> buffer
        self.idle_bytes = 0
        self.lent_bytes = 0
        self.made_total = 0
        self.reused_total = 0
        self.unmapped_total = 0

    @staticmethod
    def buffer_bytes(size: int) -> int:
        return max(BLOCK_BYTES, -(-size // BLOCK_BYTES) * BLOCK_BYTES)

    def take(self, size: int) -> mmap.mmap:
        n = self.buffer_bytes(size)
        unmap: list[mmap.mmap] = []
        with self._lock:
            stack = self._idle.get(n)
            if stack:
                buf = stack.pop()
                self.idle_bytes -= n
                self.reused_total += 1
                self._lend(buf)
                return buf
            for other in list(self._idle):  # room for a new one: unmap idle ones of other sizes
                pile = self._idle[other]
                while pile and self.lent_bytes + self.idle_bytes + n > self.bytes_max:
                    unmap.append(pile.pop())
                    self.idle_bytes -= other
                if not pile:
                    del self._idle[other]
            self.unmapped_total += len(unmap)
            self.lent_bytes += n  # reserved while it is made (outside the lock)
        unmap.clear()  # unmapped as their last reference goes (a stray view keeps its memory valid)
        try:
            buf = prefaulted_buffer(n)
        except BaseException:
            with self._lock:
                self.lent_bytes -= n
            raise
        with self._lock:
            self.lent_bytes -= n
            self.made_total += 1
            self._lend(buf)
        return buf

    def _lend(self, buf: mmap.mmap) -> None:
        invariant(id(buf) not in self._lent, "read buffer lent twice")
        self._lent[id(buf)] = buf
        self.lent_bytes += len(buf)

    def give(self, buf: mmap.mmap) -> None:
        n = len(buf)
        with self._lock:
            invariant(self._lent.pop(id(buf), None) is buf, "read buffer given back but not lent")
            self.lent_bytes -= n
            keep = self.lent_bytes + self.idle_bytes + n <= self.bytes_max
            if keep:
                self._idle.setdefault(n, []).append(buf)
                self.idle_bytes += n
            else:
                self.unmapped_total += 1  # unmapped as its last reference goes

    def lent(self) -> int:
        with self._lock:
            return len(self._lent)

    def close(self) -> None:
        """Unmap the idle buffers (lent ones go when their holders give them back)."""
        with self._lock:
            idle = [buf for pile in self._idle.values() for buf in pile]
            self._idle.clear()
            self.idle_bytes = 0
        for buf in idle:
            with contextlib.suppress(BufferError):
                buf.close()
