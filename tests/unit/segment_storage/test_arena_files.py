"""Arena files: a segment's start removes what its killed earlier incarnations left in tmpfs
(arena + slot board), and nothing of another segment or of its own newer/current incarnation."""

from __future__ import annotations

from pathlib import Path

from kvfabric.segment_storage.arena import Arena, remove_stale_arenas


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
