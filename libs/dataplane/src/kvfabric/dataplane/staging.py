"""Staged puts: a co-located writer hands a PUT's bytes over shared memory, not through a socket.

The writer (`StagingFile`, one per data connection) owns a file of its own next to the segment's
arena (`/dev/shm/kvf-stage-<32 hex>`, mode 0600, created `O_EXCL`), maps it read-write and copies
an object into it; its PUT then carries `StagedBytes(path, nonce, offset)` and no payload. The
segment (`StagingFiles`, per connection) opens that file read-only (`O_NOFOLLOW`, a regular file
in the arena's directory, a `kvf-stage-` name), checks the random nonce in its header against the
one in the request (only the process that wrote the file knows it: naming another writer's file
gets `unauthorized`) and reads the object straight into the slot `begin_put` allocated
(`os.preadv`: never mapped, so a writer that truncates its file mid-copy causes a short read, not
a SIGBUS in the segment), hashing each piece of the *slot* right after it landed — never the
staging bytes, which the writer could change during the copy — and `finish_put` checks that
digest against the ticket's checksum, exactly as for a TCP put. So a staged put goes through the
same ticket check, allocation, verification and confirm as any other; what changes is a memcpy
into the staging file here and one read from it into the slot there, instead of a socket's two
copies and its stack. Nobody maps the arena writable
outside the segment: a tenant can only offer bytes, never place them.

Lifetime: the writer removes the file's name as soon as the segment has it open (after the first
staged put of the connection); the memory goes when both close it, so a writer killed later
leaks nothing (only one killed between creating the file and that first put leaves it behind).

Bounds: one open staging file per connection (a new file replaces the old one: the writer grows
its file by making a new one), reads at most `STAGING_BYTES_MAX` into it; the descriptor goes
with the connection. A segment that offers staged puts says so in its `MapReply`
(`staged_puts`); an older one never sees a staged PUT (it would wait for payload bytes that
never come).
"""

from __future__ import annotations

import contextlib
import hmac
import mmap
import os
import re
import secrets
import stat
import threading
from typing import Final

import numpy as np

from kvfabric.format.checksum import StreamingChecksum
from kvfabric.format.errors import BadRequest, Unauthorized
from kvfabric.proto.dataplane import StagedBytes

__all__ = [
    "STAGING_BYTES_MAX",
    "STAGING_HEADER_BYTES",
    "StagingFile",
    "StagingFiles",
    "copy_into",
]

STAGING_MAGIC: Final = b"KVFSTG01"
NONCE_BYTES: Final = 16
STAGING_HEADER_BYTES: Final = 4096  # magic + nonce, then the data from a page boundary
STAGING_BYTES_MAX: Final = 1 << 30  # data bytes of one staging file
STAGING_NAME: Final = re.compile(r"kvf-stage-[0-9a-f]{32}\Z")
READ_PIECE_BYTES: Final = 1 << 20  # read, then hashed while in cache (the TCP receive's piece size)


def copy_into(dest: memoryview, source: memoryview) -> None:
    """`dest[:] = source` through numpy, which releases the GIL for the copy (as
    `kvfabric.dataplane.scatter` does)."""
    if len(dest) != len(source):
        raise ValueError("copy_into: sizes differ")
    np.copyto(np.frombuffer(dest, np.uint8), np.frombuffer(source, np.uint8))


class StagingFile:
    """The writer's side: one file, one object at a time (the connection's lock orders them)."""

    def __init__(self, directory: str, data_bytes: int) -> None:
        if not 0 < data_bytes <= STAGING_BYTES_MAX:
            raise BadRequest(f"a staging file holds 1..{STAGING_BYTES_MAX} bytes, not {data_bytes}")
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self.path = os.path.join(directory, f"kvf-stage-{secrets.token_hex(16)}")
        self.data_bytes = data_bytes
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, STAGING_HEADER_BYTES + data_bytes)
            self._map = mmap.mmap(fd, STAGING_HEADER_BYTES + data_bytes)
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        os.close(fd)
        self._view = memoryview(self._map)
        self._view[: len(STAGING_MAGIC) + NONCE_BYTES] = STAGING_MAGIC + self.nonce
        self.unlinked = False

    def stage(self, data: memoryview, at: int = 0) -> StagedBytes:
        """Copy `data` in, `at` bytes into the data (several objects of pipelined PUTs each at
        its own place); the reference a PUT carries instead of the bytes."""
        size = len(data)
        if at < 0 or at + size > self.data_bytes:
            raise BadRequest(f"{size} bytes at {at} do not fit a {self.data_bytes}-byte staging file")
        start = STAGING_HEADER_BYTES + at
        copy_into(self._view[start : start + size], data.cast("B"))
        return StagedBytes(path=self.path, nonce=self.nonce, offset=start)

    def unlink(self) -> None:
        """Remove the name once the segment holds the file open (after its first staged put on
        this connection): the memory then lives only as long as the two of them, so a writer
        that dies leaks nothing in /dev/shm."""
        if not self.unlinked:
            self.unlinked = True
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def close(self) -> None:
        try:
            self._view.release()
            self._map.close()
        finally:
            self.unlink()


class StagingFiles:
    """The segment's side: per connection, an open read-only descriptor of the writer's staging
    file. Bytes are *read* from it (`os.preadv` straight into the slot), never mapped: a writer
    that truncates its file meanwhile costs a short read (`bad_request`), not a SIGBUS in the
    segment."""

    def __init__(self, directory: str) -> None:
        self.directory = os.path.realpath(directory)
        self._files: dict[int, tuple[str, bytes, int]] = {}  # conn -> (path, nonce, fd)
        self._lock = threading.Lock()

    def read_into(self, conn: int, staged: StagedBytes, dest: memoryview) -> bytes:
        """Fill `dest` from `staged.offset` of the connection's staging file (opened and checked
        on first use), `READ_PIECE_BYTES` at a time, each piece hashed right after it landed in
        `dest` (still in cache; `dest` is the segment's own slot, which the writer cannot
        change): returns the digest of what `dest` now holds. `bad_request` for a file the
        segment will not read or bytes it does not hold, `unauthorized` for a wrong nonce; both
        with the detail `staging=True` (the writer then sends its bytes instead)."""
        with self._lock:
            held = self._files.get(conn)
        if held is None or held[0] != staged.path or not hmac.compare_digest(held[1], staged.nonce):
            self.close(conn)
            held = self._open(staged)
            with self._lock:
                self._files[conn] = held
        if (
            staged.offset < STAGING_HEADER_BYTES
            or staged.offset + len(dest) > STAGING_HEADER_BYTES + STAGING_BYTES_MAX
        ):
            raise BadRequest("staged bytes outside the staging file", staging=True, offset=staged.offset)
        digest = StreamingChecksum()
        done = 0
        while done < len(dest):  # the GIL is released for each read
            piece = dest[done : done + READ_PIECE_BYTES]
            got = os.preadv(held[2], [piece], staged.offset + done)
            if got <= 0:
                raise BadRequest("staged bytes outside the staging file", staging=True, offset=staged.offset)
            digest.update(dest[done : done + got])
            done += got
        return digest.digest()

    def _open(self, staged: StagedBytes) -> tuple[str, bytes, int]:
        folder, name = os.path.split(staged.path)
        if os.path.realpath(folder) != self.directory or not STAGING_NAME.match(name):
            raise BadRequest("a staging file is a kvf-stage-<32 hex> file beside the arena", staging=True)
        try:
            fd = os.open(staged.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            raise BadRequest(f"cannot open the staging file: {exc.strerror}", staging=True) from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # not a FIFO or a device (O_NONBLOCK: no hang)
                raise BadRequest("a staging file must be a regular file", staging=True)
            head = os.pread(fd, len(STAGING_MAGIC) + NONCE_BYTES, 0)
            if head[: len(STAGING_MAGIC)] != STAGING_MAGIC or not hmac.compare_digest(
                head[len(STAGING_MAGIC) :], staged.nonce
            ):
                raise Unauthorized("the staging file's nonce does not match", staging=True)
        except BaseException:
            os.close(fd)
            raise
        return staged.path, staged.nonce, fd

    def close(self, conn: int) -> None:
        with self._lock:
            held = self._files.pop(conn, None)
        if held is not None:
            os.close(held[2])
