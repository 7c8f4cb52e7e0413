"""Shared by the staged-put tests: a real `ArenaBackend` served over TCP (confirms answered in
process, receipts signed, no NATS) and a segment that refuses memfd staging files."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvfabric.core.segment_slots import SlotTable
from kvfabric.dataplane.staging import StagingFiles, _Held
from kvfabric.dataplane.tcp import TcpDataClient, TcpDataServer
from kvfabric.format.checksum import checksum
from kvfabric.format.errors import BadRequest
from kvfabric.format.ids import ObjectKey
from kvfabric.proto.dataplane import ReadRef, StagedBytes
from kvfabric.proto.directory import WriteTicket
from kvfabric.proto.tickets import sign_ticket
from kvfabric.segment_storage.arena import Arena
from kvfabric.segment_storage.backend import ArenaBackend

SECRET = b"unit-staged-secret-0123456789"
ARENA_BYTES = 16 << 20
NOW_MS = 1_000_000
INCARNATION = 7
SEGMENT = "seg-staged"


@dataclass
class Segment:
    backend: ArenaBackend
    server: TcpDataServer
    dir: Path

    def ticket(self, data: bytes, *, key: bytes = b"k", digest: bytes | None = None) -> WriteTicket:
        ticket = WriteTicket(
            ticket_id=1,
            key=ObjectKey(key),
            segment_id=SEGMENT,
            incarnation=INCARNATION,
            size_bytes=len(data),
            checksum=digest if digest is not None else checksum(data),
            writer_id="w",
            deadline_ms=NOW_MS + 30_000,
            epoch=1,
            data_addr=self.server.address,
        )
        return sign_ticket(ticket, SECRET)

    def read(self, slot: int, generation: int, size: int) -> bytes:
        with TcpDataClient.connect(self.server.address) as client:
            dest = bytearray(size)
            (result,) = client.get([ReadRef(INCARNATION, slot, generation, size)], [dest])
        assert result.status == "ok"
        return bytes(dest)


@pytest.fixture
def segment(tmp_path: Path) -> Iterator[Segment]:
    arena = Arena(tmp_path, SEGMENT, INCARNATION, ARENA_BYTES)
    backend = ArenaBackend(
        arena,
        SlotTable(ARENA_BYTES),
        segment_id=SEGMENT,
        incarnation=INCARNATION,
        secret=SECRET,
        confirm=lambda *args, **kw: "ok",
        confirm_later=lambda *args, **kw: None,  # receipted writes (nobody commits them here)
        clock_ms=lambda: NOW_MS,
    )
    server = TcpDataServer(backend)
    server.start()
    try:
        yield Segment(backend, server, tmp_path)
    finally:
        server.stop()
        arena.close()


class NoMemfds(StagingFiles):
    """A segment that cannot open its writers' `/proc` links (another pid namespace sharing the
    arena's folder, say), as an older segment refuses a memfd's path."""

    def _open_memfd(self, staged: StagedBytes) -> _Held:
        raise BadRequest("not beside the arena", staging=True)
