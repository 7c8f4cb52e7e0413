"""The arena: one shared-memory file per segment incarnation, mapped read-write by the segment.

The file lives under `/dev/shm` by default (`kvf-<segment id>-<incarnation>`), so a co-located
client can map it read-only (`kvfabric.dataplane.shm`). Mode 0600: only processes of the
segment's own OS user can map it — whoever can holds every tenant's bytes, so only engines
trusted with all of them should run as that user (docs/security.md); others read over TCP.
It is created exclusively, sized with `ftruncate` (pages are allocated lazily by the kernel),
and unlinked on close: a new incarnation never sees an old one's bytes. A segment that was
killed cannot unlink its files, and tmpfs keeps their pages: the next start of the same
segment id removes its older incarnations' files (`remove_stale_arenas`) before creating its own
(a reader that still maps one keeps its pages until it unmaps; meanwhile a new arena that the
folder's free space cannot hold is made smaller: `Arena._fitted`). That is
safe only while one process runs per segment id and host: a segment holds `kvf-<id>.lock`
(`flock`, dropped by the kernel when the process dies; the file is removed at a clean stop) for
its whole life, and a second one started with the same id is refused (`SegmentIdInUse`) before
it touches any file. Its slot board
(`kvfabric.dataplane.slotboard`: where each stored slot is, for lock-free local reads) lives
and dies with it.

Prefault (`start_prefault`, `KVF_SEGMENT_ARENA_PREFAULT`, on by default): a write into a page
nobody has touched yet makes the kernel allocate and zero it first — on this machine a 4 MiB
write into fresh arena pages took 2.9 ms, into faulted ones 0.2 ms, so a new segment's first
fill ran every save at a fraction of memcpy speed. A thread of the segment's own faults every page
in with `MADV_POPULATE_WRITE` (Linux >= 5.14; elsewhere it logs and stops), lowest offset first —
the order the slot table hands extents out (best fit, lowest offset on a tie) — in
`PREFAULT_PIECE_BYTES` pieces, at the lowest CPU priority, with the GIL released (libc's `madvise`
through ctypes). Populating never changes a page's bytes, so it runs while writes land. The
arena then holds its whole size in memory from the start instead of as it fills (it would at the
first full fill anyway). `close()` stops the thread between two pieces and waits for it before
unmapping (a madvise on an unmapped range could land in whatever maps there next).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import threading
import time
from pathlib import Path
from typing import Final

from kvfabric.core.segment_slots import ALIGNMENT_DEFAULT as ARENA_ALIGN_BYTES
from kvfabric.dataplane.slotboard import BOARD_SUFFIX, SlotBoard, board_bytes_of, board_path_of
from kvfabric.runtime.logs import get_logger
from kvfabric.segment_storage.ssd_buffers import MADV_POPULATE_WRITE

__all__ = [
    "ARENA_BYTES_MIN",
    "ARENA_FILE_MODE",
    "PREFAULT_JOIN_S",
    "Arena",
    "ArenaNoSpace",
    "SegmentIdInUse",
    "lock_path",
    "lock_segment_id",
    "remove_stale_arenas",
    "unlock_segment_id",
]

ARENA_FILE_MODE = 0o600
LOCK_ATTEMPTS_MAX = 5
# One madvise: ~3 ms of a core, so close() waits for little even when a busy machine gives the
# thread (nice 19) a sliver of a core.
PREFAULT_PIECE_BYTES: Final = 4 << 20
PREFAULT_JOIN_S: Final = 5.0


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


# An arena smaller than this (after fitting the folder's free space) is not started.
ARENA_BYTES_MIN: Final = 1 << 20


class ArenaNoSpace(OSError):
    """The arena's folder (a tmpfs: /dev/shm) cannot hold even `ARENA_BYTES_MIN` of arena and
    its slot board. The message says how much is free. Often for a while only (`permanent`
    False): a co-located reader still mapping a killed incarnation's arena holds its pages until
    it notices; `permanent`: the whole folder is too small."""

    def __init__(self, message: str, *, permanent: bool) -> None:
        super().__init__(message)
        self.permanent = permanent


def _with_board(arena_bytes: int, board_slots: int, page: int) -> int:
    """The folder's bytes an arena and the most its slot board can fill take (one slot id per 64
    arena bytes at most: ids are reused lowest first), each in whole pages of `page` bytes (a
    tmpfs hands out pages: counted in bytes, the two could need one page more than was free)."""
    board = board_bytes_of(min(board_slots, arena_bytes // ARENA_ALIGN_BYTES))
    return -(-arena_bytes // page) * page + -(-board // page) * page


class Arena:
    def __init__(
        self, directory: Path, segment_id: str, incarnation: int, size_bytes: int, board_slots: int = 1 << 20
    ) -> None:
        """`board_slots`: slot ids the board covers (the slot table's `slots_max`)."""
        if size_bytes <= 0:
            raise ValueError("arena size must be positive")
        self.path = directory / arena_name(segment_id, incarnation)
        self.requested_bytes = size_bytes
        self.size_bytes = size_bytes = self._fitted(directory, size_bytes, board_slots)
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
        self.prefaulted_bytes = 0  # faulted in by the prefault thread so far (its metric, tests)
        self._prefault_stop = threading.Event()
        self._prefault_thread: threading.Thread | None = None
        try:
            self.board = SlotBoard(board_path_of(self.path), incarnation, board_slots, ARENA_FILE_MODE)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _fitted(directory: Path, size_bytes: int, board_slots: int) -> int:
        """The arena's size: `size_bytes`, or less when the folder cannot hold it and its slot
        board (both sparse, filled as objects are stored; the board 64 bytes per slot id in use,
        at most one id per 64 arena bytes). Created whole, the segment registered a capacity the
        tmpfs could not hold, and once it was full a write into an untouched page killed the
        segment with SIGBUS, every tenant's objects with it (review, stop 68). Not refused: a
        co-located reader still mapping a killed incarnation's arena holds its pages until it
        notices, and a restart refused meanwhile could wait for ever."""
        free = os.statvfs(directory)
        page = max(free.f_frsize, ARENA_ALIGN_BYTES)  # (a multiple of the alignment)
        free_bytes = free.f_bavail * free.f_frsize
        if free_bytes >= _with_board(size_bytes, board_slots, page):
            return size_bytes
        # Whole pages for both, one spare each for the board's header and rounding.
        fitted = (free_bytes - board_bytes_of(board_slots) - 2 * page) // page * page
        if fitted // ARENA_ALIGN_BYTES < board_slots:  # fewer ids than the board: half each
            fitted = (free_bytes - 2 * page) // 2 // page * page
        while fitted > 0 and _with_board(fitted, board_slots, page) > free_bytes:
            fitted -= page  # (at most a page or two: the sums above are within that)
        if fitted < ARENA_BYTES_MIN:
            total = free.f_blocks * free.f_frsize
            raise ArenaNoSpace(
                f"{directory} has {free_bytes} bytes free of {total}: not even {ARENA_BYTES_MIN} bytes of "
                "arena and its slot board fit (make the tmpfs larger)",
                permanent=total < _with_board(ARENA_BYTES_MIN, board_slots, page),
            )
        get_logger(__name__).warning(
            "arena_shrunk",
            requested_bytes=size_bytes,
            arena_bytes=fitted,
            reason="its folder has less free space than the arena (KVF_SEGMENT_BYTES) and its slot board",
        )
        return fitted

    def slice(self, offset: int, size: int) -> memoryview:
        return self.view[offset : offset + size]

    def start_prefault(self) -> None:
        """Fault the whole arena in on a thread of its own (module docstring: Prefault)."""
        if self._prefault_thread is not None:
            return
        free = os.statvfs(self.path.parent)
        if free.f_bavail * free.f_frsize < self.size_bytes:  # filling it would starve the others
            get_logger(__name__).warning(
                "arena_prefault_skipped", reason="its folder has less free space than the arena"
            )
            return
        anchor = ctypes.c_char.from_buffer(self._map)  # an export of the map only for this line
        address = ctypes.addressof(anchor)
        del anchor
        self._prefault_thread = threading.Thread(
            target=self._prefault, args=(address,), name="kvf-arena-prefault", daemon=True
        )
        self._prefault_thread.start()

    def _prefault(self, address: int) -> None:
        with contextlib.suppress(OSError):  # lowest priority: serving threads go first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        libc = ctypes.CDLL(None, use_errno=True)  # CDLL: the GIL is released during the call
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        started = time.monotonic()
        offset = 0
        while offset < self.size_bytes and not self._prefault_stop.is_set():
            piece = min(PREFAULT_PIECE_BYTES, self.size_bytes - offset)
            if libc.madvise(address + offset, piece, MADV_POPULATE_WRITE) != 0:
                error = os.strerror(ctypes.get_errno())
                get_logger(__name__).warning("arena_prefault_stopped", at_bytes=offset, error=error)
                return
            offset += piece
            self.prefaulted_bytes = offset
        seconds = round(time.monotonic() - started, 3)
        event = "arena_prefaulted" if offset == self.size_bytes else "arena_prefault_cancelled"
        get_logger(__name__).info(event, bytes=offset, seconds=seconds)

    def close(self) -> None:
        """Unmap and unlink. Callers make sure no transfer still uses a view of the arena."""
        self.path.unlink(missing_ok=True)
        board = getattr(self, "board", None)
        if board is not None:
            board.close()
        if self._prefault_thread is not None:
            self._prefault_stop.set()
            self._prefault_thread.join(PREFAULT_JOIN_S)
            if self._prefault_thread.is_alive():  # still in a madvise: the map dies with the process
                return
        try:
            self.view.release()
            self._map.close()
        except BufferError:  # a view still exported (a stuck transfer): the map dies with the process
            pass
