"""Staged puts: a co-located writer hands a PUT's bytes over shared memory, not through a socket.

The writer (`StagingFile`, one per data connection, and the engine's save memory,
`kvfabric.client.save_memory`) owns a file of its own, maps it read-write and copies an object
into it (or the engine gathered it there); its PUT then carries `StagedBytes(path, nonce,
offset)` and no payload. Two kinds of file:

- **A sealed memfd** (the default): `memfd_create("kvf-stage-<32 hex>")` (`kvf-save-` for save
  memory), mode 0600, mapped by its writer and then sealed against shrinking, growing and any
  write other than through that mapping (`MEMFD_SEALS`) before anyone else sees it, named to
  the segment as `/proc/<writer pid>/fd/<fd>`. The segment takes that link as an `O_PATH`
  descriptor (which opens nothing: the link could name a device, a FIFO or a FUSE file of the
  writer's, and the writer can swap the descriptor behind the number at any time) and checks
  the file through it: its name (`/memfd:kvf-stage-<32 hex> (deleted)`), then its mount (read
  from `/proc/self/fdinfo`, which asks the file's filesystem nothing: the kernel's internal
  memfd mount, so no FUSE daemon is ever waited on), a regular file on tmpfs (not hugetlbfs,
  whose faults can fail with SIGBUS). Only then does it open that same file read-only (through
  its own `/proc/self/fd` link), require the seals, check the size and the header, and **map**
  it read-only — one mapping a file, shared by every connection that holds it, so its pages
  are faulted into the segment once — and copy each object into the slot with numpy (GIL
  released). A mapping is safe here because the file can never become shorter than the
  mapping: a writer cannot make the segment fault (SIGBUS) by truncating it. An object whose
  range has a hole (a page never written: the seals forbid punching one later) is read with
  `preadv` instead (`mincore` over its pages): a read fault through the mapping would allocate
  that page in the writer's file, charged to the segment. The copy from a mapping runs at
  memcpy speed: 11.4 GB/s against 4.8 for `preadv` from the same tmpfs pages on the dev VM
  (2026-12-05, 8 × 16 MiB, median of 10), which bounded a co-located save's large objects.
  Nothing is ever named in /dev/shm, so a writer killed at any instant leaks nothing.
- **A file beside the arena** (`/dev/shm/kvf-stage-<32 hex>`, mode 0600, created `O_EXCL`):
  for a segment that cannot open the writer's `/proc` links (another pid namespace sharing the
  arena's folder, another user) or is older than memfd staging. The segment opens it read-only
  (`O_NOFOLLOW`, a regular file in the arena's directory, a `kvf-stage-` name) and reads the
  object into the slot with `os.preadv`: never mapped, so a writer that truncates its file
  mid-copy causes a short read, not a SIGBUS in the segment. The writer removes the name as
  soon as the segment has it open (after the first staged put of the connection).

Either way the segment checks the random nonce in the file's header against the one in the
request (only the process that wrote the file knows it: naming another writer's file gets
`unauthorized`), hashes each piece of the *slot* right after it landed — never the staging
bytes, which the writer could change during the copy — and `finish_put` checks that digest
against the ticket's checksum, exactly as for a TCP put (a ticket without one: that digest
becomes the object's). So a staged put goes through the same
ticket check, allocation, verification and confirm as any other; what changes is a memcpy into
the staging file here and one copy from it into the slot there, instead of a socket's two
copies and its stack. Nobody maps the arena writable outside the segment: a tenant can only
offer bytes, never place them.

Bounds: per connection, one open file of its own (a new one closes the old: the writer grows
its file by making a new one) and its client's save memory, at most `FILES_PER_CONNECTION_MAX`
in all (a further one closes the least recently used); at most `STAGING_BYTES_MAX` of data in
each (a larger memfd is refused, so a mapping costs the segment at most that much address
space); descriptors go with the connection, a mapping with its last holder. A segment that
offers staged puts says so in its `MapReply` (`staged_puts`); an older one never sees a staged
PUT (it would wait for payload bytes that never come). A refusal about the file carries the
detail `staging=True`: the client sends that write's bytes, and then stages that segment's
writes in the other kind of file, or not at all (`kvfabric.client.transfers.SegmentPool`).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hmac
import mmap
import os
import re
import secrets
import stat
import threading
from collections import OrderedDict
from dataclasses import dataclass
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
# A memfd staging file as the writer names it, and as the segment's own link to it reads.
MEMFD_PATH: Final = re.compile(r"/proc/[1-9][0-9]{0,9}/fd/[0-9]{1,9}\Z")
MEMFD_LINK: Final = re.compile(r"/memfd:kvf-(stage|save)-[0-9a-f]{32} \(deleted\)\Z")
# Staging files one connection holds open at the segment: its own, and save memory the client's
# engine fills (`kvfabric.client.save_memory`); more are closed least recently used first.
FILES_PER_CONNECTION_MAX: Final = 8
# What a staging memfd must be sealed against: shrinking (a mapping past the end would SIGBUS),
# growing (its size is its mapping's), and writes other than through the writer's own mapping
# (F_SEAL_FUTURE_WRITE, Linux 5.1; not in Python 3.11's fcntl): no hole can be punched, so the
# segment's copy never faults in a page the writer's file did not hold when it was checked.
F_SEAL_FUTURE_WRITE: Final = 0x0010
MEMFD_SEALS: Final = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE
TMPFS_MAGIC: Final = 0x01021994  # memfds live on the kernel's internal tmpfs (hugetlbfs: 0x958458F6)
READ_PIECE_BYTES: Final = 1 << 20  # read, then hashed while in cache (the TCP receive's piece size)


def copy_into(dest: memoryview, source: memoryview) -> None:
    """`dest[:] = source` through numpy, which releases the GIL for the copy (as
    `kvfabric.dataplane.scatter` does)."""
    if len(dest) != len(source):
        raise ValueError("copy_into: sizes differ")
    np.copyto(np.frombuffer(dest, np.uint8), np.frombuffer(source, np.uint8))


class StagingFile:
    """The writer's side: one file, one object at a time (the connection's lock orders them).
    `memfd`: a sealed memfd the segment maps (the default), else a file in `directory`."""

    def __init__(
        self, directory: str, data_bytes: int, *, memfd: bool = True, save_memory: bool = False
    ) -> None:
        if not 0 < data_bytes <= STAGING_BYTES_MAX:
            raise BadRequest(f"a staging file holds 1..{STAGING_BYTES_MAX} bytes, not {data_bytes}")
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self.data_bytes = data_bytes
        self.memfd = memfd or save_memory
        # A connection's own file is "stage" (the segment keeps one a connection: a new one
        # replaces it), an engine's save memory "save" (kept, several: `FILES_PER_CONNECTION_MAX`).
        name = f"kvf-{'save' if save_memory else 'stage'}-{secrets.token_hex(16)}"
        total = STAGING_HEADER_BYTES + data_bytes
        self._fd = -1  # a memfd's descriptor, held: the path names it
        if self.memfd:
            fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            self.path = f"/proc/{os.getpid()}/fd/{fd}"
        else:
            self.path = os.path.join(directory, name)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            if self.memfd:
                os.fchmod(fd, 0o600)  # a memfd is made 0777: only its writer's user may open it
            os.ftruncate(fd, total)
            self._map = mmap.mmap(fd, total)  # before the seals: FUTURE_WRITE refuses new writable maps
            if self.memfd:  # sealed before anyone else can open it (`MEMFD_SEALS`): the segment may map it
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, MEMFD_SEALS | fcntl.F_SEAL_SEAL)
        except BaseException:
            if hasattr(self, "_map"):
                self._map.close()
            os.close(fd)
            if not self.memfd:
                os.unlink(self.path)
            raise
        if self.memfd:
            self._fd = fd
        else:
            os.close(fd)
        self._view = memoryview(self._map)
        self._view[: len(STAGING_MAGIC) + NONCE_BYTES] = STAGING_MAGIC + self.nonce
        self.unlinked = self.memfd  # a memfd has no name to remove

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
        that dies leaks nothing in /dev/shm. A memfd never had a name."""
        if not self.unlinked:
            self.unlinked = True
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def data_view(self) -> memoryview:
        """The data bytes (after the header), writable: save memory's view for its engine."""
        return self._view[STAGING_HEADER_BYTES : STAGING_HEADER_BYTES + self.data_bytes]

    def close(self) -> None:
        """Unmap and close; `BufferError` (still open, usable) while views of it are held."""
        self._view.release()
        try:
            self._map.close()
        except BufferError:
            self._view = memoryview(self._map)
            raise
        finally:
            self.unlink()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


@dataclass(slots=True)
class _Mapping:
    """One read-only mapping of a memfd, shared by every connection that holds the file open: its
    pages are faulted into the segment once, not once a connection (a first copy out of a fresh
    mapping of 128 MiB ran at 5.6-7.0 GB/s, then 12.9, on the dev VM)."""

    mapping: mmap.mmap
    mapped: np.ndarray | None  # numpy's view of it (the copies' source)
    users: int = 1


@dataclass(slots=True)
class _Held:
    """A connection's open staging file at the segment: `shared` (a read-only mapping) for a
    memfd, None for a file beside the arena (read with `os.preadv`)."""

    path: str
    nonce: bytes
    fd: int
    size: int  # the file's bytes, header included (a memfd's cannot change: sealed)
    save_memory: bool = False  # an engine's save memory (kept, several), not a connection's own file
    key: tuple[int, int, bytes] = (0, 0, b"")  # (st_dev, st_ino, nonce): the shared mapping's key
    shared: _Mapping | None = None


class StagingFiles:
    """The segment's side: per connection, open read-only descriptors of the writer's staging
    files. A sealed memfd is mapped read-only (one mapping a file, shared by connections) and
    copied from; a file beside the arena is *read* (`os.preadv` straight into the slot), never
    mapped: a writer that truncates it meanwhile costs a short read (`bad_request`), not a
    SIGBUS in the segment."""

    def __init__(self, directory: str) -> None:
        self.directory = os.path.realpath(directory)
        # The folders a writer may name, as this segment knows its arena's: the peer's path is
        # compared as a string, never resolved (resolving it walked the peer's own folders, a
        # FUSE mount's lookup could hang the thread, and a symlink swapped between the check and
        # the open escaped the arena's folder: review, stop 66).
        # (as given: the writer names it as the segment's `arena_path` does, "" for ".", ".."
        # kept; normalized; resolved)
        self._folders = {directory, os.path.normpath(directory), self.directory}
        # conn -> its open files by path, least recently used first (at most FILES_PER_CONNECTION_MAX)
        self._files: dict[int, OrderedDict[str, _Held]] = {}
        self._mappings: dict[tuple[int, int, bytes], _Mapping] = {}
        self._lock = threading.Lock()

    def read_into(self, conn: int, staged: StagedBytes, dest: memoryview) -> bytes:
        """Fill `dest` from `staged.offset` of the connection's staging file (opened and checked
        on first use), `READ_PIECE_BYTES` at a time, each piece hashed right after it landed in
        `dest` (still in cache; `dest` is the segment's own slot, which the writer cannot
        change): returns the digest of what `dest` now holds. `bad_request` for a file the
        segment will not read or bytes it does not hold, `unauthorized` for a wrong nonce; both
        with the detail `staging=True` (the writer then sends its bytes instead)."""
        held = self._held(conn, staged)
        end = staged.offset + len(dest)
        if staged.offset < STAGING_HEADER_BYTES or end > min(
            held.size, STAGING_HEADER_BYTES + STAGING_BYTES_MAX
        ):
            raise BadRequest("staged bytes outside the staging file", staging=True, offset=staged.offset)
        mapped = held.shared.mapped if held.shared is not None else None
        # A hole (a page never written; the seals forbid punching one later) is read with preadv:
        # through the mapping its read fault would allocate a page of the writer's file, charged
        # to the segment. (mincore: the object's pages only; lseek(SEEK_HOLE) walks every page up
        # to the file's first hole, 0.65 ms per 100 MiB.)
        if mapped is not None and not _resident(mapped, staged.offset, len(dest)):
            mapped = None
        digest = StreamingChecksum()
        done = 0
        while done < len(dest):  # the GIL is released for each copy or read
            piece = dest[done : done + READ_PIECE_BYTES]
            at = staged.offset + done
            if mapped is not None:
                np.copyto(np.frombuffer(piece, np.uint8), mapped[at : at + len(piece)])
                got = len(piece)
            else:
                got = os.preadv(held.fd, [piece], at)
                if got <= 0:
                    raise BadRequest(
                        "staged bytes outside the staging file", staging=True, offset=staged.offset
                    )
            digest.update(dest[done : done + got])
            done += got
        return digest.digest()

    def _held(self, conn: int, staged: StagedBytes) -> _Held:
        """The connection's open file `staged` names, opened (and checked) if it is not yet. A
        connection keeps one file of its own (a new one closes the old: the writer outgrew it)
        and its client's save memory, at most `FILES_PER_CONNECTION_MAX` in all (the least
        recently used closed first)."""
        with self._lock:
            files = self._files.setdefault(conn, OrderedDict())
            held = files.get(staged.path)
            if held is not None and hmac.compare_digest(held.nonce, staged.nonce):
                files.move_to_end(staged.path)
                return held
            stale = [files.pop(staged.path)] if held is not None else []
        try:
            held = self._open(staged)
        finally:
            self._close_all(stale)
        with self._lock:
            files = self._files.setdefault(conn, OrderedDict())
            if not held.save_memory:
                stale = [files.pop(path) for path, h in list(files.items()) if not h.save_memory]
            while len(files) >= FILES_PER_CONNECTION_MAX:
                stale.append(files.popitem(last=False)[1])
            files[staged.path] = held
        self._close_all(stale)
        return held

    def _open(self, staged: StagedBytes) -> _Held:
        if MEMFD_PATH.match(staged.path):
            return self._open_memfd(staged)
        folder, name = os.path.split(staged.path)
        if folder not in self._folders or not STAGING_NAME.match(name):  # (a NUL matches neither)
            raise BadRequest(
                "a staging file is a sealed kvf-stage memfd or a kvf-stage-<32 hex> file beside the arena",
                staging=True,
            )
        try:  # in the arena's own folder, by the segment's name of it; the file no symlink
            path = os.path.join(self.directory, name)
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            raise BadRequest(f"cannot open the staging file: {exc.strerror}", staging=True) from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):  # not a FIFO or a device (O_NONBLOCK: no hang)
                raise BadRequest("a staging file must be a regular file", staging=True)
            self._check_header(fd, staged)
        except BaseException:
            os.close(fd)
            raise
        return _Held(staged.path, staged.nonce, fd, STAGING_HEADER_BYTES + STAGING_BYTES_MAX)

    def _open_memfd(self, staged: StagedBytes) -> _Held:
        """The writer's sealed memfd through its `/proc/<pid>/fd/<n>` link. The link could name
        any file its process holds (a device, a FIFO, a FUSE file whose open would wait on the
        writer), and the writer can swap the descriptor at any time: so the link is taken as an
        `O_PATH` descriptor (no open of the file itself), checked through that (its name, the
        memfd mount before anything asks the file's filesystem, a regular file on tmpfs, not
        hugetlbfs, whose faults can fail with SIGBUS), and only that
        file is then opened read-only (through the segment's own `/proc/self/fd` link: the
        writer's descriptor table is not looked at again). Then its seals, size and header; then
        its shared mapping."""
        if not _is_staging_memfd(staged.path):  # cheap first refusal: nothing resolved
            raise BadRequest("not a kvf-stage memfd", staging=True)
        try:
            path_fd = os.open(staged.path, os.O_PATH | os.O_CLOEXEC)
        except OSError as exc:
            raise BadRequest(f"cannot open the staging memfd: {exc.strerror}", staging=True) from None
        try:
            match = _memfd_name(f"/proc/self/fd/{path_fd}")
            # The mount first (read from /proc, which asks the file's filesystem nothing): a FUSE
            # file's fstat would wait on its daemon, the writer's.
            if (
                match is None
                or _mount_id(path_fd) != _memfd_mount_id()
                or not stat.S_ISREG(os.fstat(path_fd).st_mode)
                or _fs_type(path_fd) != TMPFS_MAGIC
            ):
                raise BadRequest("not a kvf-stage memfd", staging=True)
            try:
                fd = os.open(
                    f"/proc/self/fd/{path_fd}", os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
                )
            except OSError as exc:
                raise BadRequest(f"cannot open the staging memfd: {exc.strerror}", staging=True) from None
        finally:
            os.close(path_fd)
        try:
            info = os.fstat(fd)
            if _seals(fd) & MEMFD_SEALS != MEMFD_SEALS or not (
                STAGING_HEADER_BYTES < info.st_size <= STAGING_HEADER_BYTES + STAGING_BYTES_MAX
            ):
                raise BadRequest(
                    "a staging memfd must be sealed against shrinking, growing and new writes, "
                    f"1..{STAGING_BYTES_MAX} data bytes",
                    staging=True,
                )
            self._check_header(fd, staged)
            held = _Held(
                staged.path,
                staged.nonce,
                fd,
                info.st_size,
                save_memory=match.group(1) == "save",
                key=(info.st_dev, info.st_ino, staged.nonce),
            )
            held.shared = self._share_mapping(held)
        except BaseException:
            os.close(fd)
            raise
        return held

    def _share_mapping(self, held: _Held) -> _Mapping:
        """The file's mapping, made on its first holder (an inode lives while any holder keeps
        its descriptor open, so the key cannot name another file meanwhile)."""
        with self._lock:
            shared = self._mappings.get(held.key)
            if shared is not None:
                if len(shared.mapping) != held.size:  # sealed against it: never, but never copy past it
                    raise BadRequest("the staging memfd changed size", staging=True)
                shared.users += 1
                return shared
            mapping = mmap.mmap(held.fd, held.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            shared = self._mappings[held.key] = _Mapping(mapping, np.frombuffer(mapping, np.uint8))
            return shared

    @staticmethod
    def _check_header(fd: int, staged: StagedBytes) -> None:
        head = os.pread(fd, len(STAGING_MAGIC) + NONCE_BYTES, 0)
        if head[: len(STAGING_MAGIC)] != STAGING_MAGIC or not hmac.compare_digest(
            head[len(STAGING_MAGIC) :], staged.nonce
        ):
            raise Unauthorized("the staging file's nonce does not match", staging=True)

    def close(self, conn: int) -> None:
        with self._lock:
            files = self._files.pop(conn, None)
        self._close_all(list((files or {}).values()))

    def _close_all(self, held: list[_Held]) -> None:
        """Close each descriptor, and each mapping its last holder let go of (every one tried)."""
        unmap = []
        with self._lock:
            for h in held:
                if h.shared is not None:
                    h.shared.users -= 1
                    if h.shared.users == 0:
                        del self._mappings[h.key]
                        unmap.append(h.shared)
                    h.shared = None
        for shared in unmap:
            shared.mapped = None  # numpy's export of the mapping goes first, or close() refuses
            with contextlib.suppress(BufferError):  # a copy still running: unmapped when it ends
                shared.mapping.close()
        for h in held:
            with contextlib.suppress(OSError):
                os.close(h.fd)


def _memfd_name(link: str) -> re.Match[str] | None:
    """The staging memfd name the `/proc/.../fd/N` link reads, or None."""
    try:
        return MEMFD_LINK.match(os.readlink(link))
    except OSError:
        return None


def _mount_id(fd: int) -> int:
    """The mount of `fd`'s file (`/proc/self/fdinfo`: answered by procfs alone), or -1."""
    with contextlib.suppress(OSError, ValueError), open(f"/proc/self/fdinfo/{fd}") as info:
        for line in info:
            if line.startswith("mnt_id:"):
                return int(line.split()[1])
    return -1


@functools.cache
def _memfd_mount_id() -> int:
    """The kernel's internal mount every memfd lives on (one of our own, asked once)."""
    fd = os.memfd_create("kvf-mount-probe", os.MFD_CLOEXEC)
    try:
        return _mount_id(fd)
    finally:
        os.close(fd)


def _is_staging_memfd(link: str) -> bool:
    return _memfd_name(link) is not None


_libc = ctypes.CDLL(None, use_errno=True)
_STATFS_BYTES: Final = 256  # struct statfs is 120 bytes on x86-64 and arm64; f_type first


def _fs_type(fd: int) -> int:
    """The filesystem magic of `fd`'s file (fstatfs; 0 when it cannot be read)."""
    buf = ctypes.create_string_buffer(_STATFS_BYTES)
    if _libc.fstatfs(fd, buf) != 0:
        return 0
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def _resident(mapped: np.ndarray, at: int, size: int) -> bool:
    """Whether every page of `mapped[at : at + size]` is in memory (`mincore`: for a shared
    mapping of tmpfs, whether the file holds it: not a hole, not swapped out). Faults nothing."""
    start = at - at % mmap.PAGESIZE
    pages = -(-(at + size - start) // mmap.PAGESIZE)
    flags = np.empty(pages, np.uint8)
    if _libc.mincore(mapped.ctypes.data + start, at + size - start, flags.ctypes.data) != 0:
        return False
    return bool(np.all(flags & 1))


def _seals(fd: int) -> int:
    """The file's seals (0 for a file that takes none: only shmem and hugetlbfs files do)."""
    try:
        return fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        return 0
