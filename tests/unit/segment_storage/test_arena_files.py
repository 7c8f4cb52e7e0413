"""Arena files: a segment's start removes what its killed earlier incarnations left in tmpfs
(arena + slot board), and nothing of another segment or of its own newer/current incarnation;
one process per segment id and host holds the id's lock, so no live segment's files are removed;
the prefault thread faults every page in without changing a byte, and stops before the unmap."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kvfabric.runtime.config import SettingsError
from kvfabric.segment_storage import arena as arena_module
from kvfabric.segment_storage.arena import (
    ARENA_BYTES_MIN,
    PREFAULT_JOIN_S,
    Arena,
    ArenaNoSpace,
    SegmentIdInUse,
    lock_path,
    lock_segment_id,
    remove_stale_arenas,
    unlock_segment_id,
)
from kvfabric.segment_storage.settings import load_segment_settings


def test_start_removes_only_this_segments_older_incarnations(tmp_path: Path) -> None:
    names = [
        "kvf-seg-1-100",  # an older incarnation of seg-1, killed: removed
        "kvf-seg-1-100.slots",
        "kvf-seg-1-2-50",  # another segment ("seg-1-2"), older number: kept
        "kvf-seg-10-50",  # another segment ("seg-10"): kept
        "kvf-seg-1-900",  # newer than the starting incarnation (clock skew?): kept
        "kvf-seg-1-abc",  # not an incarnation: kept
        "unrelated",
    ]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    removed = remove_stale_arenas(tmp_path, "seg-1", 500)
    assert [p.name for p in removed] == ["kvf-seg-1-100", "kvf-seg-1-100.slots"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(set(names) - {p.name for p in removed})


def test_an_arena_and_its_board_live_and_die_together(tmp_path: Path) -> None:
    arena = Arena(tmp_path, "seg-a", 7, 1 << 16, board_slots=16)
    assert {p.name for p in tmp_path.iterdir()} == {"kvf-seg-a-7", "kvf-seg-a-7.slots"}
    assert arena.board.path == tmp_path / "kvf-seg-a-7.slots"
    arena.close()
    assert list(tmp_path.iterdir()) == []


def test_one_process_per_segment_id_holds_its_lock(tmp_path: Path) -> None:
    fd = lock_segment_id(tmp_path, "seg-1")
    other = lock_segment_id(tmp_path, "seg-1-2")  # another id: its own lock
    with pytest.raises(SegmentIdInUse, match="seg-1"):
        lock_segment_id(tmp_path, "seg-1")  # a second holder (flock is per open file: also here)
    assert remove_stale_arenas(tmp_path, "seg-1", 1 << 60) == []  # never a lock file
    unlock_segment_id(tmp_path, "seg-1", fd)
    assert not lock_path(tmp_path, "seg-1").exists()
    again = lock_segment_id(tmp_path, "seg-1")  # free after a clean stop
    unlock_segment_id(tmp_path, "seg-1", again)
    unlock_segment_id(tmp_path, "seg-1-2", other)
    assert list(tmp_path.iterdir()) == []


def test_a_lock_on_a_file_unlinked_meanwhile_is_taken_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start that opened the lock file just before a stopping holder unlinked it must not
    keep a lock on the dead inode (a third start would then lock a new file: two holders)."""
    path = lock_path(tmp_path, "seg-1")
    real_open, opened = os.open, []

    def open_then_holder_unlinks(name: str, flags: int, mode: int = 0o777) -> int:
        fd = real_open(name, flags, mode)
        opened.append(fd)
        if len(opened) == 1:
            os.unlink(path)  # the holder's clean stop, between our open and our flock
        return fd

    monkeypatch.setattr(os, "open", open_then_holder_unlinks)  # the arena module calls os.open
    fd = lock_segment_id(tmp_path, "seg-1")
    monkeypatch.undo()
    assert len(opened) == 2 and fd == opened[1]  # took it again, on the file that is there
    assert os.fstat(fd).st_ino == os.stat(path).st_ino
    with pytest.raises(SegmentIdInUse):
        lock_segment_id(tmp_path, "seg-1")
    unlock_segment_id(tmp_path, "seg-1", fd)


def _shm_arena(size_bytes: int) -> Arena:
    # tmpfs, as deployed: a page there exists only once something faulted it in
    return Arena(Path("/dev/shm"), f"test-prefault-{os.getpid()}-{time.monotonic_ns()}", 1, size_bytes, 16)


def _wait_prefaulted(arena: Arena, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    thread = arena._prefault_thread
    while arena.prefaulted_bytes < arena.size_bytes:
        assert thread is not None and (thread.is_alive() or arena.prefaulted_bytes == arena.size_bytes), (
            "the prefault thread stopped early (see its log line)"
        )
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_prefault_faults_every_page_in_and_changes_no_byte() -> None:
    size = 16 << 20
    arena = _shm_arena(size)
    try:
        assert arena.path.stat().st_blocks * 512 < size  # lazily allocated until touched
        arena.slice(0, 4096)[:] = b"a" * 4096  # written before the prefault starts
        arena.start_prefault()
        arena.slice(size - (1 << 20), 4096)[:] = b"z" * 4096  # and while it runs (a write landing)
        _wait_prefaulted(arena)
        assert arena.path.stat().st_blocks * 512 >= size
        assert bytes(arena.slice(0, 4096)) == b"a" * 4096
        assert bytes(arena.slice(size - (1 << 20), 4096)) == b"z" * 4096
        assert bytes(arena.slice(1 << 20, 4096)) == bytes(4096)  # untouched pages stay zero
    finally:
        arena.close()
    assert not arena.path.exists()


def test_close_stops_a_prefault_midway_and_waits_for_it() -> None:
    size = 1 << 30  # ~0.7 s of one core to fault in: close() comes long before
    arena = _shm_arena(size)
    arena.start_prefault()
    thread = arena._prefault_thread
    assert thread is not None
    started = time.monotonic()
    arena.close()
    assert time.monotonic() - started < PREFAULT_JOIN_S
    assert not thread.is_alive()  # joined before the unmap: no madvise can outlive the mapping
    assert arena.prefaulted_bytes < size
    assert not arena.path.exists()


def test_no_prefault_when_the_folder_cannot_hold_the_arena(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An arena larger than its folder's free space is not faulted in (that would fill the
    folder and starve its other users, e.g. co-located clients' staging files): skipped, logged."""
    arena = Arena(tmp_path, "seg-big", 1, 1 << 20, board_slots=16)
    full = os.statvfs_result((4096, 4096, 1 << 20, 10, 10, 100, 10, 10, 0, 255))  # 40 KiB free
    monkeypatch.setattr(arena_module.os, "statvfs", lambda _: full)  # type: ignore[attr-defined]
    try:
        arena.start_prefault()
        assert arena._prefault_thread is None and arena.prefaulted_bytes == 0
    finally:
        arena.close()


PAGE = 4096


def test_an_arena_larger_than_its_folders_free_space_is_made_to_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Created whole (review, stop 68), the segment registered a capacity the tmpfs could not
    hold and, once it was full, a write into an untouched page killed it with SIGBUS. Now the
    arena is what the free pages hold beside what its slot board can fill (64 bytes per slot id,
    at most one id per 64 arena bytes), each in whole pages; a restart is not refused (a reader
    still mapping a killed incarnation's arena holds its pages a while); below `ARENA_BYTES_MIN`
    it is refused, for good only when the whole folder is too small; nothing is left behind."""
    space = {"free": 0, "total": 1 << 18}  # in pages

    def statvfs(_: object) -> os.statvfs_result:
        pages = (PAGE, PAGE, space["total"], space["free"], space["free"], 100, 10, 10, 0, 255)
        return os.statvfs_result(pages)

    def fits(arena: Arena, slots: int) -> bool:
        board = 64 + 64 * min(slots, arena.size_bytes // 64)
        return -(-arena.size_bytes // PAGE) + -(-board // PAGE) <= space["free"]

    monkeypatch.setattr(arena_module.os, "statvfs", statvfs)  # type: ignore[attr-defined]
    space["free"] = 1024 + 1  # 4 MiB and one page for a board of 16 slot ids
    whole = Arena(tmp_path, "seg-fits", 1, 4 << 20, board_slots=16)
    assert whole.size_bytes == 4 << 20 and fits(whole, 16)
    whole.close()
    big = Arena(tmp_path, "seg-big", 1, 8 << 20, board_slots=16)
    assert (big.requested_bytes, big.size_bytes) == (8 << 20, (4 << 20) - 2 * PAGE) and fits(big, 16)
    assert big.path.stat().st_size == big.size_bytes
    big.close()
    # A small arena on a small tmpfs (Docker's 64 MiB): its board fills at most as much as it
    # holds ids, not the 64 MiB of a million slot ids (review of the fix: it never started).
    space["free"] = (64 << 20) // PAGE
    small = Arena(tmp_path, "seg-small", 1, 16 << 20)  # 1M board slots by default
    assert small.size_bytes == 16 << 20 and fits(small, 1 << 20)
    small.close()
    space["free"] = (20 << 20) // PAGE + 1  # not enough for 16 MiB and its fullest board: half each
    half = Arena(tmp_path, "seg-half", 1, 16 << 20)
    assert half.size_bytes == (10 << 20) - PAGE and fits(half, 1 << 20)
    half.close()
    space["free"] = ARENA_BYTES_MIN // PAGE
    with pytest.raises(ArenaNoSpace, match="not even") as refused:
        Arena(tmp_path, "seg-none", 1, 8 << 20, board_slots=16)
    assert not refused.value.permanent  # the folder is large: its pages may come back
    space["total"] = ARENA_BYTES_MIN // PAGE
    with pytest.raises(ArenaNoSpace) as refused:
        Arena(tmp_path, "seg-none", 1, 8 << 20, board_slots=16)
    assert refused.value.permanent  # the whole folder is too small: a configuration error
    assert list(tmp_path.iterdir()) == []


def test_an_arena_size_is_rounded_down_to_the_slot_alignment() -> None:
    """`KVF_SEGMENT_BYTES` not a multiple of 64 passed, and the start crashed on the slot table's
    invariant with a traceback, its new arena files left behind (review, stop 68)."""
    env = {"KVF_SEGMENT_ID": "seg-a", "KVF_CLUSTER_SECRET": "s" * 32, "KVF_SEGMENT_BYTES": str((1 << 30) + 1)}
    assert load_segment_settings(env).arena_bytes == 1 << 30


@pytest.mark.parametrize(("value", "expected"), [(None, True), ("1", True), ("0", False)])
def test_the_prefault_setting(value: str | None, expected: bool) -> None:
    env = {"KVF_SEGMENT_ID": "seg-a", "KVF_CLUSTER_SECRET": "s" * 32}
    if value is not None:
        env["KVF_SEGMENT_ARENA_PREFAULT"] = value
    assert load_segment_settings(env).arena_prefault is expected


def test_the_prefault_setting_refuses_other_values() -> None:
    env = {"KVF_SEGMENT_ID": "seg-a", "KVF_CLUSTER_SECRET": "s" * 32, "KVF_SEGMENT_ARENA_PREFAULT": "2"}
    with pytest.raises(SettingsError):
        load_segment_settings(env)
