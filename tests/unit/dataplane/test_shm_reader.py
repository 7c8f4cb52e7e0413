"""`ShmReader` on a real arena and slot board (no segment process): reads through the board, and
a reader whose segment removed its arena (stopped, or restarted and cleaned up) stops reading
that memory and lets its map go, so a dead incarnation's tmpfs pages are not kept alive."""

from __future__ import annotations

import os
from pathlib import Path
from typing import cast

import pytest

from kvfabric.dataplane.shm import ShmReader
from kvfabric.dataplane.tcp import TcpDataClient
from kvfabric.format.checksum import checksum
from kvfabric.format.errors import Unavailable
from kvfabric.proto.dataplane import MapReply, ReadRef
from kvfabric.segment_storage.arena import Arena

INCARNATION = 5
ARENA_BYTES = 1 << 20


class StubControl:
    """What ShmReader asks its control connection for (MAP only, on the board path)."""

    def __init__(self, arena: Arena) -> None:
        self.arena = arena

    def map_info(self, **credential: object) -> MapReply:
        return MapReply(
            arena_path=str(self.arena.path),
            arena_bytes=self.arena.size_bytes,
            incarnation=INCARNATION,
            board_path=str(self.arena.board.path),
        )


def test_reads_through_the_board_until_the_arena_is_removed(tmp_path: Path) -> None:
    arena = Arena(tmp_path, "seg-r", INCARNATION, ARENA_BYTES, board_slots=4)
    data = os.urandom(3000)
    arena.view[4096 : 4096 + len(data)] = data
    arena.board.publish(2, 1, 4096, len(data), checksum(data))
    reader = ShmReader(cast(TcpDataClient, StubControl(arena)))
    ref = ReadRef(INCARNATION, 2, 1, len(data), b"", 0)
    try:
        assert reader.board is not None and not reader.gone()
        dest = bytearray(len(data))
        ((result, digest),) = reader.get_hashed([ref], [dest])
        assert result.status == "ok" and digest == result.checksum == checksum(data) and dest == data
        arena.close()  # the segment stops: both files are unlinked
        assert reader.gone()
        with pytest.raises(Unavailable):
            reader.get([ref], [bytearray(len(data))])
    finally:
        reader.close()
    assert list(tmp_path.iterdir()) == []
