"""The slot board (lock-free local reads): a read succeeds only for the stored generation, and a
free that lands while a reader copies makes that read fail, whatever the copy saw.

A Hypothesis state machine drives publish/withdraw/read against a model of what is stored; a
read may also be interleaved with a free and a rewrite of the extent in the middle of its copy.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvfabric.dataplane.slotboard import (
    ENTRY_BYTES,
    HEADER_BYTES,
    STATE_GENERATION_MAX,
    SlotBoard,
    SlotBoardReader,
    board_path_of,
)
from kvfabric.format.checksum import checksum
from kvfabric.format.errors import BadRequest
from kvfabric.proto.dataplane import ReadRef

INCARNATION = 77
SLOTS = 8
OBJECT_BYTES = 256
ARENA_BYTES = SLOTS * OBJECT_BYTES


def ref(slot: int, generation: int, size: int = OBJECT_BYTES, incarnation: int = INCARNATION) -> ReadRef:
    return ReadRef(incarnation, slot, generation, size, b"", 0)


def plain_copy(source: memoryview, dest: memoryview) -> bytes:
    dest[:] = source
    return checksum(dest)


def test_board_file_lifecycle_and_header_checks(tmp_path: Path) -> None:
    path = board_path_of(tmp_path / "kvf-seg-1")
    assert path.name == "kvf-seg-1.slots"
    board = SlotBoard(path, INCARNATION, SLOTS, 0o600)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.stat(path).st_size == HEADER_BYTES + SLOTS * ENTRY_BYTES
    with pytest.raises(FileExistsError):  # one board per incarnation, created exclusively
        SlotBoard(path, INCARNATION, SLOTS, 0o600)
    with pytest.raises(BadRequest):  # a reader that expects another incarnation refuses it
        SlotBoardReader(str(path), INCARNATION + 1)
    reader = SlotBoardReader(str(path), INCARNATION)
    assert reader.covers(ref(SLOTS - 1, 1)) and not reader.covers(ref(SLOTS, 1))
    assert not reader.covers(ref(0, 1, incarnation=INCARNATION + 1))
    reader.close()
    board.close()
    assert not path.exists()
    (tmp_path / "junk").write_bytes(b"\0" * 4096)
    with pytest.raises(BadRequest):
        SlotBoardReader(str(tmp_path / "junk"), INCARNATION)
    (tmp_path / "short").write_bytes(b"KVFSLOTS")  # shorter than a header and one entry
    with pytest.raises(BadRequest):
        SlotBoardReader(str(tmp_path / "short"), INCARNATION)


def test_an_entry_pointing_outside_the_arena_reads_nothing(tmp_path: Path) -> None:
    board = SlotBoard(tmp_path / "b", INCARNATION, SLOTS, 0o600)
    reader = SlotBoardReader(str(tmp_path / "b"), INCARNATION)
    arena = memoryview(bytearray(ARENA_BYTES))
    board.publish(0, 1, ARENA_BYTES - OBJECT_BYTES // 2, OBJECT_BYTES, b"c" * 16)  # runs past the end
    dest = memoryview(bytearray(OBJECT_BYTES))
    assert reader.read_into(ref(0, 1), arena, dest, plain_copy)[0] == "not_found"
    reader.close()
    board.close()


def test_generations_beyond_the_state_width_stay_off_the_board(tmp_path: Path) -> None:
    board = SlotBoard(tmp_path / "b", INCARNATION, SLOTS, 0o600)
    reader = SlotBoardReader(str(tmp_path / "b"), INCARNATION)
    arena = memoryview(bytearray(ARENA_BYTES))
    huge = STATE_GENERATION_MAX + 1
    board.publish(0, huge, 0, OBJECT_BYTES, b"c" * 16)  # not published: read by pinning instead
    board.withdraw(0, huge)  # no overflow
    dest = memoryview(bytearray(OBJECT_BYTES))
    assert reader.read_into(ref(0, huge), arena, dest, plain_copy)[0] != "ok"
    reader.close()
    board.close()


def test_slots_beyond_the_board_are_ignored_by_the_writer(tmp_path: Path) -> None:
    board = SlotBoard(tmp_path / "b", INCARNATION, 1, 0o600)
    board.publish(5, 1, 0, 10, b"x" * 16)  # no entry: readers pin such slots through the segment
    board.withdraw(5, 1)
    board.close()


class BoardMachine(RuleBasedStateMachine):
    """Model: slot -> (generation, stored?) and the bytes each stored object should read as."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvf-board-{os.getpid()}-{id(self)}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.board = SlotBoard(self.dir / "b.slots", INCARNATION, SLOTS, 0o600)
        self.reader = SlotBoardReader(str(self.dir / "b.slots"), INCARNATION)
        self.arena = bytearray(ARENA_BYTES)
        self.generation = [1] * SLOTS  # the slot table's current generation per slot id
        self.stored: dict[int, bytes] = {}  # slot -> its object's bytes (at generation[slot])

    def teardown(self) -> None:
        self.reader.close()
        self.board.close()
        self.dir.rmdir()

    @rule(slot=st.integers(0, SLOTS - 1), fill=st.integers(0, 255))
    def store(self, slot: int, fill: int) -> None:
        if slot in self.stored:
            return
        data = bytes([fill]) * OBJECT_BYTES
        offset = slot * OBJECT_BYTES
        self.arena[offset : offset + OBJECT_BYTES] = data
        self.board.publish(slot, self.generation[slot], offset, OBJECT_BYTES, checksum(data))
        self.stored[slot] = data

    @rule(slot=st.integers(0, SLOTS - 1))
    def free(self, slot: int) -> None:
        if slot in self.stored:
            self.board.withdraw(slot, self.generation[slot])
            self.generation[slot] += 1
            del self.stored[slot]

    @rule(slot=st.integers(0, SLOTS - 1), back=st.integers(0, 2), size_off=st.sampled_from([0, 0, 1]))
    def read(self, slot: int, back: int, size_off: int) -> None:
        generation = max(1, self.generation[slot] - back)
        dest = bytearray(OBJECT_BYTES + size_off)
        status, stored, digest = self.reader.read_into(
            ref(slot, generation, OBJECT_BYTES + size_off),
            memoryview(self.arena),
            memoryview(dest),
            plain_copy,
        )
        current = generation == self.generation[slot]
        if current and slot in self.stored and size_off == 0:
            assert status == "ok" and dest == self.stored[slot] and digest == stored == checksum(dest)
        elif current and slot in self.stored:
            assert status == "wrong_size"
        elif generation < self.generation[slot]:
            assert status == "stale_generation"
        else:
            assert status == "not_found"

    @rule(slot=st.integers(0, SLOTS - 1), rewrite=st.booleans())
    def free_during_copy(self, slot: int, rewrite: bool) -> None:
        """The segment frees (and maybe reuses) the slot while a local reader is copying it."""
        if slot not in self.stored:
            return
        generation = self.generation[slot]

        def racing_copy(source: memoryview, dest: memoryview) -> bytes:
            half = len(source) // 2
            dest[:half] = source[:half]
            self.free(slot)  # the free lands mid-copy...
            if rewrite:  # ...and a new writer reuses the extent
                offset = slot * OBJECT_BYTES
                self.arena[offset : offset + OBJECT_BYTES] = b"\xee" * OBJECT_BYTES
            dest[half:] = source[half:]
            return checksum(dest)

        status, _, _ = self.reader.read_into(
            ref(slot, generation), memoryview(self.arena), memoryview(bytearray(OBJECT_BYTES)), racing_copy
        )
        assert status == "stale_generation"

    @invariant()
    def every_stored_object_reads_back(self) -> None:
        for slot, data in self.stored.items():
            dest = bytearray(OBJECT_BYTES)
            status, stored, _ = self.reader.read_into(
                ref(slot, self.generation[slot]), memoryview(self.arena), memoryview(dest), plain_copy
            )
            assert status == "ok" and dest == data and stored == checksum(data)


BoardMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestBoardMachine = BoardMachine.TestCase
