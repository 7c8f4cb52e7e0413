"""The local path: a client on the segment's host maps the arena read-only and copies out.

The segment's `/dev/shm` arena file is mapped once (read-only, `PROT_READ`), and so is its slot
board (`kvfabric.dataplane.slotboard`), which says where each stored slot is. A read then needs
no round trip: it checks the slot's board entry, copies the object out of the map into the
caller's buffer (one memcpy, no socket), and checks the entry again (seqlock-style): a free that
came meanwhile makes it `stale_generation`. The caller verifies the checksum before handing
bytes to an engine — `get_hashed` hashes each block right after copying it, while it is still
in cache, instead of re-reading the whole object afterwards.

Without a board (an older segment, or a slot id beyond it), a read asks the segment over the
data connection to pin the slots instead (`PIN_LOCAL`: a transfer reference per slot, held by
that connection, so a free that arrives meanwhile is deferred), copies, then unpins. The unpin is
pipelined: its frame goes out at once (the pins drop when it arrives) and its reply is read
before the connection's next request. If the connection dies, the segment drops the pins itself.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Sequence
from typing import Final

from kvfabric.dataplane.slotboard import SlotBoardReader, board_usable
from kvfabric.dataplane.tcp import TcpDataClient, destination_views, verified
from kvfabric.format.checksum import StreamingChecksum, checksum
from kvfabric.format.errors import KvfError, Unavailable
from kvfabric.proto.dataplane import ObjectResult, ReadRef

__all__ = ["ShmReader", "verify"]

# Copy + hash granularity of `get_hashed`: each block is hashed right after it is copied, while
# it is still in cache. 1 MiB, not smaller: measured on this AMD EPYC, glibc copies 2 KiB–512 KiB
# blocks with `rep movsb`, which ran at half speed when the destination was not 64-byte aligned
# to the source (a plain bytearray); from 1 MiB it takes the vector loop (fused 1 MiB blocks:
# 10.4 GB/s at 64 MiB vs 8.9 for copy-then-hash; equal from 1 to 4 MiB).
COPY_HASH_BLOCK_BYTES: Final = 1 << 20


def verify(results: Sequence[ObjectResult], dests: Sequence[memoryview | bytearray]) -> list[bool]:
    """Per object: True when it was read (`ok`) and its bytes match the stored checksum."""
    return [r.status == "ok" and checksum(d) == r.checksum for r, d in zip(results, dests, strict=True)]


class ShmReader:
    """Reads a co-located segment's objects from its shared-memory arena. Not thread-safe."""

    def __init__(self, control: TcpDataClient, *, use_board: bool = True) -> None:
        """`use_board=False`: pin every read through the segment (also the default off x86-64,
        where the board's seqlock read is not sound; see `kvfabric.dataplane.slotboard`)."""
        self.control = control
        info = control.map_info()
        try:
            fd = os.open(info.arena_path, os.O_RDONLY)
        except OSError as exc:
            raise Unavailable(f"cannot open the segment arena {info.arena_path!r}: {exc}") from exc
        try:
            self._map = mmap.mmap(fd, info.arena_bytes, prot=mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        # Kept open to notice when the segment unlinks the arena (it stopped, or a new
        # incarnation removed a killed one's files): the mapping would keep those pages alive.
        self._fd = fd
        self._view = memoryview(self._map)
        self.incarnation = info.incarnation
        self.board: SlotBoardReader | None = None
        if info.board_path and use_board and board_usable():
            try:
                self.board = SlotBoardReader(info.board_path, info.incarnation)
            except (KvfError, OSError, ValueError, struct.error):
                self.board = None  # unreadable here: every read pins through the segment

    def gone(self) -> bool:
        """The segment's arena file was removed: this incarnation is over, stop reading it."""
        try:
            return os.fstat(self._fd).st_nlink == 0
        except OSError:
            return True

    def close(self) -> None:
        try:
            if self.board is not None:
                self.board.close()
            self._view.release()
            self._map.close()
        finally:  # even if a view is still exported (BufferError): the fd never leaks
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1  # a second close must not close a reused fd number

    def get(self, reads: list[ReadRef], dests: Sequence[memoryview | bytearray]) -> list[ObjectResult]:
        """Copy objects into `dests`; only `ok` results were written (verify before use)."""
        return [result for result, _ in self._get(reads, dests, hashed=False)]

    def get_hashed(
        self, reads: list[ReadRef], dests: Sequence[memoryview | bytearray]
    ) -> list[tuple[ObjectResult, bytes]]:
        """`get`, each object hashed block by block as it is copied: per read, its result and the
        checksum of the bytes now in its destination (b"" when not `ok`)."""
        return self._get(reads, dests, hashed=True)

    def get_verified(self, reads: list[ReadRef], dests: Sequence[memoryview | bytearray]) -> list[bool]:
        """Per read, True only when it was read and its bytes match the stored checksum."""
        return verified(self.get_hashed(reads, dests))

    def _get(
        self, reads: list[ReadRef], dests: Sequence[memoryview | bytearray], *, hashed: bool
    ) -> list[tuple[ObjectResult, bytes]]:
        views = destination_views(reads, dests)
        if self.gone():
            raise Unavailable("the segment's arena was removed (the segment stopped or restarted)")
        copy = _copy_hashed if hashed else _copy
        board = self.board
        if board is not None and all(board.covers(ref) for ref in reads):
            out: list[tuple[ObjectResult, bytes]] = []
            for ref, view in zip(reads, views, strict=True):
                status, stored, digest = board.read_into(ref, self._view, view, copy)
                out.append((ObjectResult(status, stored), digest))
            return out
        pinned = self.control.pin_local(reads)
        digests: list[bytes] = []
        try:
            for ref, grant, view in zip(reads, pinned.grants, views, strict=True):
                digest = b""
                if grant.status == "ok":
                    source = self._view[grant.offset : grant.offset + ref.size_bytes]
                    digest = copy(source, view)
                digests.append(digest)
        finally:
            # The copies are done: nothing reads the map for these slots any more.
            self.control.unpin_local_nowait(pinned.grant_id)
        return [(ObjectResult(g.status, g.checksum), d) for g, d in zip(pinned.grants, digests, strict=True)]


def _copy(source: memoryview, dest: memoryview) -> bytes:
    dest[:] = source
    return b""


def _copy_hashed(source: memoryview, dest: memoryview) -> bytes:
    digest = StreamingChecksum()
    size = len(source)
    for start in range(0, size, COPY_HASH_BLOCK_BYTES):
        end = min(start + COPY_HASH_BLOCK_BYTES, size)
        block = dest[start:end]
        block[:] = source[start:end]
        digest.update(block)  # the copy just wrote it: hashed from cache
    return digest.digest()
