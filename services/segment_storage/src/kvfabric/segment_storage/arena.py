"""The arena: one shared-memory file per segment incarnation, mapped read-write by the segment.

The file lives under `/dev/shm` by default (`kvf-<segment id>-<incarnation>`), so a co-located
client can map it read-only (`kvfabric.dataplane.shm`). Mode 0600: only processes of the
segment's own OS user can map it — whoever can holds every tenant's bytes, so only engines
trusted with all of them should run as that user (docs/security.md); others read over TCP.
It is created exclusively, sized with `ftruncate` (pages are allocated lazily by the kernel),
and unlinked on close: a new incarnation never sees an old one's bytes. A segment that was
killed cannot unlink its files, and tmpfs keeps their pages: the next start of the same
segment id removes its older incarnations' files (`remove_stale_arenas`) before creating its own
(a reader that still maps one keeps its pages until it unmaps; nothing else is affected). That is
safe only while one process runs per segment id and host: a segment holds `kvf-<id>.lock`
(`flock`, dropped by the kernel when the process dies; the file is removed at a clean stop) for
its whole life, and a second one started with the same id is refused (`SegmentIdInUse`) before
it touches any file. Its slot board
(`kvfabric.dataplane.slotboard`: where each stored slot is, for lock-free local reads) lives
and dies with it.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
from pathlib import Path

from kvfabric.dataplane.slotboard import BOARD_SUFFIX, SlotBoard, board_path_of

__all__ = [
    "ARENA_FILE_MODE",
    "Arena",
    "SegmentIdInUse",
    "lock_path",
    "lock_segment_id",
    "remove_stale_arenas",
    "unlock_segment_id",
]

ARENA_FILE_MODE = 0o600
LOCK_ATTEMPTS_MAX = 5


def arena_name(segment_id: str, incarnation: int) -> str:
    return f"kvf-{segment_id}-{incarnation}"


class SegmentIdInUse(RuntimeError):
    """Another live process on this host runs a segment with this id (a misconfiguration)."""


def lock_path(directory: Path, segment_id: str) -> Path:
    return directory / f"kvf-{segment_id}.lock"  # ids have no ".": no arena or board name


def lock_segment_id(directory: Path, segment_id: str) -> int:
    """Take `kvf-<id>.lock` exclusively, without waiting; returns its fd. The caller owns it
    until `unlock_segment_id` (a killed process leaves the file, unlocked: the next start
    takes it). A lock won on a file a stopping segment unlinked meanwhile is taken again on
    the new file, so two live processes never both hold the id."""
    path = lock_path(directory, segment_id)
    for _ in range(LOCK_ATTEMPTS_MAX):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, ARENA_FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SegmentIdInUse(
                f"segment id {segment_id!r} is in use by another process on this host "
                f"(it holds {path}); give each segment its own KVF_SEGMENT_ID"
            ) from None
        try:
            current = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            current = False
        if current:
            return fd
        os.close(fd)
    raise SegmentIdInUse(f"segment id {segment_id!r}: {path} keeps being replaced")


def unlock_segment_id(directory: Path, segment_id: str, fd: int) -> None:
    """Remove the lock file while still holding it, then release it (see `lock_segment_id`)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(lock_path(directory, segment_id))
    os.close(fd)


def remove_stale_arenas(directory: Path, segment_id: str, incarnation: int) -> list[Path]:
    """Unlink the arena and slot-board files of this segment id's incarnations older than
    `incarnation` (left by a killed process). Returns what was removed. Call it only while
    holding the id's lock (`lock_segment_id`): otherwise a live segment's files may go."""
    prefix = f"kvf-{segment_id}-"
    removed = []
    for path in directory.glob(f"{prefix}*"):
        rest = path.name.removeprefix(prefix).removesuffix(BOARD_SUFFIX)
        if rest.isdigit() and int(rest) < incarnation:  # another segment id's name has a "-" here
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(path)
    return sorted(removed)


class Arena:
    def __init__(
        self, directory: Path, segment_id: str, incarnation: int, size_bytes: int, board_slots: int = 1 << 20
    ) -> None:
        """`board_slots`: slot ids the board covers (the slot table's `slots_max`)."""
        if size_bytes <= 0:
            raise ValueError("arena size must be positive")
        self.path = directory / arena_name(segment_id, incarnation)
        self.size_bytes = size_bytes
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, ARENA_FILE_MODE)
        try:
            os.ftruncate(fd, size_bytes)
            self._map = mmap.mmap(fd, size_bytes, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self.view = memoryview(self._map)
        try:
            self.board = SlotBoard(board_path_of(self.path), incarnation, board_slots, ARENA_FILE_MODE)
        except BaseException:
            self.close()
            raise

    def slice(self, offset: int, size: int) -> memoryview:
        return self.view[offset : offset + size]

    def close(self) -> None:
        """Unmap and unlink. Callers make sure no transfer still uses a view of the arena."""
        self.path.unlink(missing_ok=True)
        board = getattr(self, "board", None)
        if board is not None:
            board.close()
        try:
            self.view.release()
            self._map.close()
        except BufferError:  # a view still exported (a stuck transfer): the map dies with the process
            pass
