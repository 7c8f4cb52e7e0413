"""The slot board: a segment's stored slots, published in shared memory for lock-free local reads.

A co-located client maps the arena read-only (`kvfabric.dataplane.shm`). To read an object it
must know where the slot is and be sure the bytes were not freed and reused while it copied
them. Asking the segment to pin the slot costs a round trip per read, longer than copying a
1 MiB object. The board answers both without one: a second file next to the arena
(`<arena file>.slots`, the arena's lifecycle: created exclusively per incarnation, mode 0600,
unlinked on close), with one 64-byte entry per slot id:

    u64 state     (generation << 1) | 1 while the slot is STORED at that generation;
                  (newer generation << 1) once it is freed (the extent may be reused)
    u64 offset    \
    u64 size       > valid while `state` says stored
    16 B checksum /

and a 64-byte header: magic, layout version, incarnation, slot count.

**Writer** (the segment, under its backend lock): `publish` writes offset, size and checksum,
then the state; `withdraw` overwrites the state when a free of the slot is accepted, which is
before its extent can be handed to any new writer (allocation takes the same lock). The state
is one aligned 8-byte store and load (`memoryview.cast("Q")`), never torn.

**Reader** (seqlock-style, `read_into`): read the state, which must be the ref's generation
and stored; read offset, size, checksum; copy the bytes out; read the state again. Unchanged
means the bytes were not reused during the copy: on x86 (TSO) loads are not reordered with
older loads, and a new writer's bytes land only after the withdraw that preceded its
allocation. A changed state is `stale_generation`; the copy must not be used. Other memory
models would need barriers Python cannot express, so `board_usable()` is false off x86-64 and
readers pin through the segment there. An entry whose offset or size falls outside the arena
reads as `not_found`. The caller still
verifies the checksum (of the copy, against the directory's) before handing bytes to an engine.

No segment-side reference is taken: a free during a local read is never deferred by it (the
read detects the free instead: docs/design.md invariant 3's "local reference while a transfer runs"
is replaced by detection for these reads; the directory still frees nothing under a lease), and
read tokens are not checked (whoever maps the arena can read all of it anyway; see the arena's
file mode).
"""

from __future__ import annotations

import mmap
import os
import platform
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Final, TypeVar

from kvfabric.format.errors import BadRequest
from kvfabric.proto.dataplane import ObjectStatus, ReadRef

__all__ = [
    "BOARD_SUFFIX",
    "ENTRY_BYTES",
    "SlotBoard",
    "SlotBoardReader",
    "board_bytes_of",
    "board_path_of",
    "board_usable",
]

BOARD_SUFFIX: Final = ".slots"
ENTRY_BYTES: Final = 64  # one cache line per slot: a publish never straddles two
HEADER_BYTES: Final = 64
MAGIC: Final = b"KVFSLOTS"
LAYOUT_VERSION: Final = 1
_HEADER: Final = struct.Struct("<8sQQQ")  # magic, version, incarnation, slots
_FIELDS: Final = struct.Struct("<QQ16s")  # offset, size, checksum (after the 8-byte state)
STATE_BYTES: Final = 8
STORED: Final = 1
# States hold generation << 1 in 64 bits: a generation past this is never published (unreachable:
# a slot freed a billion times a second for 292 years); such a slot is read by pinning.
STATE_GENERATION_MAX: Final = (1 << 63) - 1
_X86_64: Final = frozenset({"x86_64", "amd64", "x64"})
D = TypeVar("D")  # a read's destination, opaque here: only `copy(source, dest)` writes it


def board_bytes_of(slots: int) -> int:
    """The size of a board file covering `slots` slot ids."""
    return HEADER_BYTES + slots * ENTRY_BYTES


def board_path_of(arena_path: Path) -> Path:
    return arena_path.parent / (arena_path.name + BOARD_SUFFIX)


def _entry(slot: int) -> int:
    return HEADER_BYTES + slot * ENTRY_BYTES


def _state_index(slot: int) -> int:
    """Index of the slot's state in the board viewed as u64s (entries are 64-byte aligned)."""
    return _entry(slot) // STATE_BYTES


def board_usable() -> bool:
    """The seqlock read relies on x86-TSO load ordering (see the module docstring)."""
    return platform.machine().lower() in _X86_64


class SlotBoard:
    """The writer's side, owned by the segment's arena. Not thread-safe: call under the lock
    that orders every slot-table change."""

    def __init__(self, path: Path, incarnation: int, slots: int, file_mode: int) -> None:
        if slots <= 0:
            raise ValueError("a slot board needs at least one slot")
        self.path = path
        self.slots = slots
        size = board_bytes_of(slots)  # sparse: pages appear as slots are used
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, file_mode)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        _HEADER.pack_into(self._map, 0, MAGIC, LAYOUT_VERSION, incarnation, slots)
        self._states = memoryview(self._map).cast("Q")  # one aligned 8-byte store per state

    def publish(self, slot: int, generation: int, offset: int, size: int, checksum: bytes) -> None:
        """The slot is STORED at `generation`: readable from its entry from now on."""
        if slot >= self.slots or generation > STATE_GENERATION_MAX:
            return  # not on the board: local readers pin it through the segment
        _FIELDS.pack_into(self._map, _entry(slot) + STATE_BYTES, offset, size, checksum)
        self._states[_state_index(slot)] = generation << 1 | STORED  # last: validates the fields

    def withdraw(self, slot: int, generation: int) -> None:
        """A free of (slot, generation) was accepted (its generation is now generation + 1): no
        local read of it may succeed from now on, and one that is copying sees the change when
        it re-reads the state. 0 and every even state never match a stored one."""
        if slot < self.slots:
            self._states[_state_index(slot)] = min(generation + 1, STATE_GENERATION_MAX) << 1

    def close(self) -> None:
        self.path.unlink(missing_ok=True)
        self._states.release()
        self._map.close()


class SlotBoardReader:
    """A co-located client's read-only map of a segment's board."""

    def __init__(self, path: str, incarnation: int) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES + ENTRY_BYTES or size % STATE_BYTES:
                raise BadRequest(f"{path!r} is not a slot board ({size} bytes)")
            self._map = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        magic, version, board_incarnation, slots = _HEADER.unpack_from(self._map, 0)
        problem = ""
        if (magic, version) != (MAGIC, LAYOUT_VERSION) or size < HEADER_BYTES + slots * ENTRY_BYTES:
            problem = f"{path!r} is not a slot board this client can read (version {version})"
        elif board_incarnation != incarnation:
            problem = f"the slot board {path!r} belongs to another incarnation"
        if problem:
            self._map.close()
            raise BadRequest(problem)
        self._states = memoryview(self._map).cast("Q")  # one aligned 8-byte load per state
        self.incarnation = incarnation
        self.slots = slots

    def close(self) -> None:
        self._states.release()
        self._map.close()

    def covers(self, ref: ReadRef) -> bool:
        return ref.incarnation == self.incarnation and 0 <= ref.slot < self.slots

    def read_into(
        self,
        ref: ReadRef,
        arena: memoryview,
        dest: D,
        copy: Callable[[memoryview, D], bytes],
    ) -> tuple[ObjectStatus, bytes, bytes]:
        """Copy `ref`'s object out of `arena` into `dest` with `copy(source, dest) -> digest`.
        Returns (status, stored checksum, digest); only "ok" means `dest` holds the object."""
        index = _state_index(ref.slot)
        state = self._states[index]
        if state != ref.slot_generation << 1 | STORED:
            return self._miss(state, ref), b"", b""
        offset, size, stored_checksum = _FIELDS.unpack_from(self._map, _entry(ref.slot) + STATE_BYTES)
        if size != ref.size_bytes:
            return "wrong_size", b"", b""
        if offset + size > len(arena):  # a board that does not match the arena: never read past it
            return "not_found", b"", b""
        digest = copy(arena[offset : offset + size], dest)
        again = self._states[index]
        if again != state:  # freed during the copy: the extent may have been rewritten
            return "stale_generation", b"", b""
        return "ok", stored_checksum, digest

    @staticmethod
    def _miss(state: int, ref: ReadRef) -> ObjectStatus:
        return "stale_generation" if state >> 1 > ref.slot_generation else "not_found"
