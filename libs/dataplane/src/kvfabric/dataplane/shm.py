"""The local path: a client on the segment's host maps the arena read-only and copies out.

The segment's `/dev/shm` arena file is mapped once (read-only, `PROT_READ`), and so is its slot
board (`kvfabric.dataplane.slotboard`), which says where each stored slot is. A read then needs
no round trip: it checks the slot's board entry, copies the object out of the map into the
caller's buffer (one memcpy, no socket), and checks the entry again (seqlock-style): a free that
came meanwhile makes it `stale_generation`. The caller verifies the checksum before handing
bytes to an engine — `get_hashed` hashes each block right after copying it, while it is still
in cache, instead of re-reading the whole object afterwards (`kvfabric.dataplane.scatter`: straight
into the engine's buffers, under their owner's gate, with the GIL released for the copy).

The arena's path is handed only to token holders: the first MAP on a connection carries a read
reference with its token (or a write ticket) for this segment.

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

from kvfabric.dataplane.scatter import ScatterDest, scatter_dests
from kvfabric.dataplane.slotboard import SlotBoardReader, board_usable
from kvfabric.dataplane.tcp import Destination, TcpDataClient, verified
from kvfabric.format.checksum import checksum
from kvfabric.format.errors import KvfError, Unavailable
from kvfabric.proto.dataplane import ObjectResult, ReadRef
from kvfabric.proto.directory import WriteTicket

__all__ = ["ArenaNotHere", "ShmReader", "verify"]


def verify(results: Sequence[ObjectResult], dests: Sequence[memoryview | bytearray]) -> list[bool]:
    """Per object: True when it was read (`ok`) and its bytes match the stored checksum."""
    return [r.status == "ok" and checksum(d) == r.checksum for r, d in zip(results, dests, strict=True)]


class ArenaNotHere(OSError):
    """The segment answered MAP, but its arena cannot be opened from this process (another
    host, another mount namespace): not co-located, its connection fine for TCP. (An OSError,
    as the local mapping's own failures: a `KvfError` out of `ShmReader` is the MAP request's.)"""


class ShmReader:
    """Reads a co-located segment's objects from its shared-memory arena. Not thread-safe."""

    def __init__(
        self,
        control: TcpDataClient,
        *,
        use_board: bool = True,
        reads: Sequence[ReadRef] = (),
        ticket: WriteTicket | None = None,
    ) -> None:
        """`use_board=False`: pin every read through the segment (also the default off x86-64,
        where the board's seqlock read is not sound; see `kvfabric.dataplane.slotboard`).
        `reads` (with their tokens) or `ticket`: the credential that gets the arena's path on a
        `control` connection that has made no request yet (the segment hands it only to token
        holders)."""
        self.control = control
        info = control.map_info(reads=reads, ticket=ticket)
        try:
            fd = os.open(info.arena_path, os.O_RDONLY)
        except OSError as exc:
            raise ArenaNotHere(f"cannot open the segment arena {info.arena_path!r}: {exc}") from exc
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
        # Writes may go through a staging file in the arena's folder (kvfabric.dataplane.staging).
        self.staged_puts = info.staged_puts
        self.arena_dir = os.path.dirname(info.arena_path)
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

    def get(self, reads: list[ReadRef], dests: Sequence[Destination]) -> list[ObjectResult]:
        """Copy objects into `dests`; only `ok` results were written (verify before use)."""
        return [result for result, _ in self._get(reads, dests, hashed=False)]

    def get_hashed(
        self, reads: list[ReadRef], dests: Sequence[Destination]
    ) -> list[tuple[ObjectResult, bytes]]:
        """`get`, each object hashed block by block as it is copied: per read, its result and the
        checksum of the bytes now in its destination (b"" when not `ok`)."""
        return self._get(reads, dests, hashed=True)

    def get_verified(self, reads: list[ReadRef], dests: Sequence[Destination]) -> list[bool]:
        """Per read, True only when it was read and its bytes match the stored checksum."""
        return verified(self.get_hashed(reads, dests))

    def _get(
        self, reads: list[ReadRef], dests: Sequence[Destination], *, hashed: bool
    ) -> list[tuple[ObjectResult, bytes]]:
        views = scatter_dests(dests, [ref.size_bytes for ref in reads])
        if self.gone():
            raise Unavailable("the segment's arena was removed (the segment stopped or restarted)")

        def copy(source: memoryview, dest: ScatterDest) -> bytes:
            return dest.write_from(source, hashed)

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
