"""Memfd staging files (`kvfabric.dataplane.staging`): the segment maps a writer's sealed memfd
and copies from the mapping, which is safe only because the file cannot shrink; every other
file a `/proc/<pid>/fd/<n>` link can name is refused before it is mapped (or opened, where the
link's name already says it is not a staging memfd)."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import secrets
from collections.abc import Iterator

import pytest

from kvfabric.dataplane.staging import (
    F_SEAL_FUTURE_WRITE,
    FILES_PER_CONNECTION_MAX,
    MEMFD_SEALS,
    STAGING_BYTES_MAX,
    STAGING_HEADER_BYTES,
    STAGING_MAGIC,
    StagingFile,
    StagingFiles,
)
from kvfabric.format.checksum import checksum
from kvfabric.format.errors import BadRequest, KvfError, Unauthorized
from kvfabric.proto.dataplane import StagedBytes

CONN = 3


@pytest.fixture
def files() -> Iterator[StagingFiles]:
    files = StagingFiles("/dev/shm")
    try:
        yield files
    finally:
        files.close(CONN)


def test_a_memfd_is_mapped_and_copied_into_the_slot(
    files: StagingFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_preadv(*args: object) -> int:
        raise AssertionError("a memfd is copied from its mapping, not read (preadv: 2.4x slower)")

    monkeypatch.setattr(os, "preadv", no_preadv)
    staging = StagingFile("/dev/shm", 3 << 20)
    try:
        data = os.urandom((2 << 20) + 12345)  # more than one piece, not a whole one
        staged = staging.stage(memoryview(data), at=4096)
        slot = bytearray(len(data))
        assert files.read_into(CONN, staged, memoryview(slot)) == checksum(data)
        assert slot == data
        # a second object of the same file, at another offset: the same mapping
        again = staging.stage(memoryview(data[:100]))
        assert files.read_into(CONN, again, memoryview(bytearray(100))) == checksum(data[:100])
    finally:
        staging.close()


def test_a_writer_cannot_shrink_grow_or_punch_its_memfd() -> None:
    """What makes the mapping safe: a truncation that would fault the segment's copy fails, and
    so does a hole punched under it (the page the copy then faulted in would be the segment's
    to pay for); the writer still writes through its own mapping."""
    staging = StagingFile("/dev/shm", 8192)
    try:
        for size in (0, STAGING_HEADER_BYTES, 1 << 30):
            with pytest.raises(PermissionError):
                os.truncate(staging.path, size)
        libc = ctypes.CDLL(None, use_errno=True)
        punch = 0x01 | 0x02  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE
        assert libc.fallocate(staging._fd, punch, ctypes.c_long(4096), ctypes.c_long(4096)) == -1
        assert ctypes.get_errno() == errno.EPERM
        with pytest.raises(PermissionError):
            os.pwrite(staging._fd, b"x", 4096)
        staging.stage(memoryview(b"still writable"))
    finally:
        staging.close()


def memfd(
    name: str | None = None, *, seals: int = MEMFD_SEALS, data_bytes: int = 8192, flags: int = 0
) -> tuple[int, StagedBytes]:
    """A hand-made memfd with a staging header; returns its descriptor and a reference to it."""
    name = name if name is not None else f"kvf-stage-{secrets.token_hex(16)}"
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | flags)
    nonce = secrets.token_bytes(16)
    os.ftruncate(fd, STAGING_HEADER_BYTES + data_bytes)
    os.pwrite(fd, STAGING_MAGIC + nonce, 0)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd, StagedBytes(f"/proc/{os.getpid()}/fd/{fd}", nonce, STAGING_HEADER_BYTES)


def refused(files: StagingFiles, staged: StagedBytes, size: int = 10) -> KvfError:
    with pytest.raises(KvfError) as caught:
        files.read_into(CONN, staged, memoryview(bytearray(size)))
    assert caught.value.details.get("staging") is True
    assert not files._files.get(CONN)  # nothing kept open
    return caught.value


def test_a_memfd_that_could_shrink_grow_or_be_punched_is_refused(files: StagingFiles) -> None:
    shrink, grow = fcntl.F_SEAL_SHRINK, fcntl.F_SEAL_GROW
    for seals in (0, grow, fcntl.F_SEAL_SEAL, shrink, shrink | grow, shrink | F_SEAL_FUTURE_WRITE):
        fd, staged = memfd(seals=seals)
        try:
            assert isinstance(refused(files, staged), BadRequest), seals
        finally:
            os.close(fd)
    fd, staged = memfd(seals=MEMFD_SEALS)  # the control: the same file sealed is read
    try:
        assert files.read_into(CONN, staged, memoryview(bytearray(10))) == checksum(bytes(10))
    finally:
        os.close(fd)


def test_files_a_proc_link_can_name_that_are_not_staging_memfds_are_refused(
    files: StagingFiles, tmp_path: os.PathLike[str]
) -> None:
    regular = os.open(os.path.join(tmp_path, "kvf-stage-" + "ab" * 16), os.O_RDWR | os.O_CREAT, 0o600)
    os.pwrite(regular, STAGING_MAGIC + bytes(16) + bytes(8192), 0)
    read_end, write_end = os.pipe()
    other_name, other = memfd(name="someone-else")
    too_big, big = memfd(data_bytes=STAGING_BYTES_MAX + 4096)  # sparse: costs no memory
    cases = {
        "a regular file": StagedBytes(f"/proc/{os.getpid()}/fd/{regular}", bytes(16), STAGING_HEADER_BYTES),
        "/proc/self": StagedBytes(f"/proc/self/fd/{other_name}", bytes(16), STAGING_HEADER_BYTES),
        "a pipe": StagedBytes(f"/proc/{os.getpid()}/fd/{read_end}", bytes(16), STAGING_HEADER_BYTES),
        "another memfd's name": other,
        "over the size bound": big,
        "no such descriptor": StagedBytes(f"/proc/{os.getpid()}/fd/999999", bytes(16), STAGING_HEADER_BYTES),
        "a /proc path of another shape": StagedBytes(f"/proc/{os.getpid()}/root/dev/shm/x", b"", 4096),
    }
    try:
        for what, staged in cases.items():
            assert isinstance(refused(files, staged), BadRequest), what
    finally:
        for fd in (regular, read_end, write_end, other_name, too_big):
            os.close(fd)


def test_a_hugetlb_memfd_is_refused(files: StagingFiles) -> None:
    """A hugetlb page fault fails with SIGBUS when the pool is empty: never mapped (refused on its
    filesystem, before its header is read: a hugetlb file takes no `pwrite`, so it has none)."""
    fd = os.memfd_create("kvf-stage-" + "cd" * 16, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | os.MFD_HUGETLB)
    try:
        os.ftruncate(fd, 2 << 20)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        error = refused(files, StagedBytes(f"/proc/{os.getpid()}/fd/{fd}", bytes(16), STAGING_HEADER_BYTES))
        assert isinstance(error, BadRequest) and not isinstance(error, Unauthorized)
    finally:
        os.close(fd)


def test_a_memfd_is_read_only_with_its_nonce_and_inside_it(files: StagingFiles) -> None:
    staging = StagingFile("/dev/shm", 8192)
    try:
        staging.stage(memoryview(b"x" * 10))
        forged = StagedBytes(staging.path, bytes(16), STAGING_HEADER_BYTES)
        assert isinstance(refused(files, forged), Unauthorized)
        header = StagedBytes(staging.path, staging.nonce, 0)
        past_end = StagedBytes(staging.path, staging.nonce, STAGING_HEADER_BYTES + 8190)
        for staged in (header, past_end):
            with pytest.raises(BadRequest) as caught:
                files.read_into(CONN, staged, memoryview(bytearray(10)))
            assert caught.value.details.get("staging") is True
    finally:
        staging.close()


def test_the_mapping_goes_with_the_connection(files: StagingFiles) -> None:
    staging = StagingFile("/dev/shm", 8192)
    try:
        files.read_into(CONN, staging.stage(memoryview(b"y" * 10)), memoryview(bytearray(10)))
        (held,) = files._files[CONN].values()
        assert held.shared is not None
        mapping = held.shared.mapping
        files.close(CONN)
        assert mapping.closed and CONN not in files._files
        with pytest.raises(OSError, match="Bad file descriptor"):
            os.fstat(held.fd)
    finally:
        staging.close()


def test_a_link_that_names_no_staging_memfd_is_never_opened(
    files: StagingFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Opening can have effects of its own (a device, a FIFO): the link's name is checked first."""
    read_end, write_end = os.pipe()
    opened: list[str] = []
    real_open = os.open

    def recording_open(path: str, *args: int) -> int:
        opened.append(path)
        return real_open(path, *args)

    monkeypatch.setattr(os, "open", recording_open)
    try:
        refused(files, StagedBytes(f"/proc/{os.getpid()}/fd/{read_end}", bytes(16), STAGING_HEADER_BYTES))
        assert opened == []
    finally:
        os.close(read_end)
        os.close(write_end)


def test_a_link_swapped_after_its_check_is_refused(
    files: StagingFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer's process may replace the descriptor between the check of its link and the
    open: the segment's own descriptor is checked again. Here the first check is told a staging
    memfd's name; the descriptor is a sealed memfd of another name with a valid header."""
    fd, staged = memfd(name="someone-else")
    real_readlink = os.readlink

    def swapped(path: str) -> str:
        return f"/memfd:kvf-stage-{'ef' * 16} (deleted)" if path == staged.path else real_readlink(path)

    monkeypatch.setattr(os, "readlink", swapped)
    try:
        assert isinstance(refused(files, staged), BadRequest)
    finally:
        os.close(fd)


def test_a_connection_holds_a_bounded_number_of_files(files: StagingFiles) -> None:
    """Save memories are each opened once and kept; past the bound the least recently used is
    closed (and opened again when named again)."""
    stagings = [StagingFile("/dev/shm", 8192, save_memory=True) for _ in range(FILES_PER_CONNECTION_MAX + 1)]
    try:
        for round_ in range(2):
            for i, staging in enumerate(stagings[:FILES_PER_CONNECTION_MAX]):
                data = bytes([round_, i]) * 50
                got = files.read_into(CONN, staging.stage(memoryview(data)), memoryview(bytearray(100)))
                assert got == checksum(data)
        held = files._files[CONN]
        first = held[stagings[0].path]
        assert list(held) == [s.path for s in stagings[:FILES_PER_CONNECTION_MAX]]  # opened once each
        files.read_into(CONN, stagings[-1].stage(memoryview(b"z" * 10)), memoryview(bytearray(10)))
        assert len(held) == FILES_PER_CONNECTION_MAX and stagings[0].path not in held
        assert first.shared is None and not any(m.users > 1 for m in files._mappings.values())
        assert len(files._mappings) == FILES_PER_CONNECTION_MAX
    finally:
        for staging in stagings:
            staging.close()


def test_a_hole_is_read_not_faulted_in(files: StagingFiles, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages the writer never wrote are read with preadv: a read fault through the mapping would
    allocate them (in the writer's file, charged to the segment)."""
    staging = StagingFile("/dev/shm", 8 << 20)
    try:
        data = os.urandom(1 << 20)
        staging.stage(memoryview(data))  # written: [0, 1 MiB); the rest is a hole
        blocks = os.fstat(staging._fd).st_blocks
        hole = StagedBytes(staging.path, staging.nonce, STAGING_HEADER_BYTES + (4 << 20))
        assert files.read_into(CONN, hole, memoryview(bytearray(1 << 20))) == checksum(bytes(1 << 20))
        half = StagedBytes(staging.path, staging.nonce, STAGING_HEADER_BYTES + (512 << 10))  # data, then hole
        expected = data[512 << 10 :] + bytes(512 << 10)
        assert files.read_into(CONN, half, memoryview(bytearray(1 << 20))) == checksum(expected)
        assert os.fstat(staging._fd).st_blocks == blocks  # nothing allocated
        written = StagedBytes(staging.path, staging.nonce, STAGING_HEADER_BYTES)

        def no_preadv(*args: object) -> int:
            raise AssertionError("written bytes are copied from the mapping")

        monkeypatch.setattr(os, "preadv", no_preadv)
        assert files.read_into(CONN, written, memoryview(bytearray(1 << 20))) == checksum(data)
    finally:
        staging.close()


def test_connections_share_one_mapping_of_a_file(files: StagingFiles) -> None:
    memory = StagingFile("/dev/shm", 8192, save_memory=True)
    try:
        staged = memory.stage(memoryview(b"s" * 10))
        for conn in (CONN, CONN + 1):
            assert files.read_into(conn, staged, memoryview(bytearray(10))) == checksum(b"s" * 10)
        (shared,) = files._mappings.values()
        assert shared.users == 2
        files.close(CONN)
        assert shared.users == 1 and not shared.mapping.closed
        files.close(CONN + 1)
        assert not files._mappings and shared.mapping.closed
    finally:
        memory.close()


def test_a_connection_keeps_one_file_of_its_own_and_its_save_memory(files: StagingFiles) -> None:
    """A connection's new own file (the writer outgrew the old) closes the old one; save memory
    stays open beside it."""
    memory = StagingFile("/dev/shm", 8192, save_memory=True)
    own = [StagingFile("/dev/shm", 8192) for _ in range(2)]
    try:
        for staging in (memory, own[0], own[1]):
            files.read_into(CONN, staging.stage(memoryview(b"o" * 10)), memoryview(bytearray(10)))
        assert list(files._files[CONN]) == [memory.path, own[1].path]
    finally:
        for staging in (memory, *own):
            staging.close()


def test_a_link_swapped_to_a_fifo_is_only_ever_taken_as_a_path(
    files: StagingFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every name check is made to pass (as a writer racing the checks could): the FIFO is taken
    as an O_PATH descriptor, refused on its mount before anything asks its filesystem (a FUSE
    file's fstat would wait on the writer's daemon), and never opened for reading."""
    read_end, write_end = os.pipe()
    opened: list[int] = []
    statted: list[int] = []
    real_open, real_fstat = os.open, os.fstat

    def recording_open(path: str, flags: int, *args: int) -> int:
        opened.append(flags)
        return real_open(path, flags, *args)

    def recording_fstat(fd: int) -> os.stat_result:
        statted.append(fd)
        return real_fstat(fd)

    monkeypatch.setattr(os, "readlink", lambda path: f"/memfd:kvf-stage-{'ab' * 16} (deleted)")
    monkeypatch.setattr(os, "open", recording_open)
    monkeypatch.setattr(os, "fstat", recording_fstat)
    try:
        refused(files, StagedBytes(f"/proc/{os.getpid()}/fd/{read_end}", bytes(16), STAGING_HEADER_BYTES))
        assert opened and all(flags & os.O_PATH for flags in opened)
        assert statted == []
    finally:
        os.close(read_end)
        os.close(write_end)
