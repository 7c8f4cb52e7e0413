"""Staging files beside the arena (`StagingFiles._open`, path form): the writer's path is compared
as a string with the arena's folder, never resolved, and the file is opened by the segment's own
name of that folder (review, stop 66: resolving the peer's path walked its own folders, where a
FUSE mount's lookup could hang the thread, and a symlink swapped between the check and the open
read a file outside the arena's folder). A defect in a request is answered `internal`, typed."""

from __future__ import annotations

import os
import secrets
import socket
import threading
from pathlib import Path
from typing import Any

import pytest

from kvfabric.dataplane.addresses import split_host_port
from kvfabric.dataplane.frames import Op
from kvfabric.dataplane.staging import STAGING_HEADER_BYTES, STAGING_MAGIC, StagingFiles
from kvfabric.dataplane.tcp import TcpDataServer
from kvfabric.format.errors import BadRequest
from kvfabric.format.ids import ObjectKey
from kvfabric.proto.dataplane import MapReply, PutRequest, StagedBytes
from kvfabric.proto.directory import WriteTicket
from tests.security.dataplane_kit import frame, read_frame

CONN = 5


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, Path, str, bytes]:
    """An arena folder, a folder outside it holding a valid staging file, its name and nonce."""
    arena, outside = tmp_path / "arena", tmp_path / "outside"
    (arena / "sub").mkdir(parents=True)
    (outside / "sub").mkdir(parents=True)
    name, nonce = "kvf-stage-" + secrets.token_hex(16), secrets.token_bytes(16)
    for folder in (arena, outside):
        with open(folder / name, "wb") as f:
            f.write(STAGING_MAGIC + nonce)
            f.truncate(STAGING_HEADER_BYTES + 4096)
    return arena, outside, name, nonce


def test_only_a_file_named_in_the_arenas_own_folder_is_opened(
    tree: tuple[Path, Path, str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    arena, outside, name, nonce = tree
    (arena / "sw").symlink_to(arena / "sub")  # sw/.. resolves to the arena's folder
    files = StagingFiles(str(arena))
    looked_at: list[str] = []
    real_lstat = os.lstat

    def spy(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        looked_at.append(str(path))
        return real_lstat(path, *args, **kwargs)

    monkeypatch.setattr(os, "lstat", spy)
    for path in (
        f"{arena}/sw/../{name}",  # resolved, it is the arena's folder: not as written
        f"{outside}/sub/../../arena/{name}",
        f"{outside}/{name}",
        f"{arena}\0/{name}",
        f"{arena}/{name}\0",
    ):
        with pytest.raises(BadRequest) as refused:
            files._open(StagedBytes(path=path, nonce=nonce, offset=STAGING_HEADER_BYTES))
        assert refused.value.details.get("staging") is True
    assert looked_at == []  # nothing of the peer's path was looked up
    held = files._open(StagedBytes(path=f"{arena}/{name}", nonce=nonce, offset=STAGING_HEADER_BYTES))
    try:
        assert os.readlink(f"/proc/self/fd/{held.fd}") == str(arena / name)
    finally:
        os.close(held.fd)


def test_the_file_is_opened_by_the_segments_name_of_its_folder(
    tree: tuple[Path, Path, str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever the writer's string, the open names the segment's folder: a swap of anything the
    peer could touch between the check and the open cannot lead elsewhere."""
    arena, _, name, nonce = tree
    alias = arena.parent / "alias"
    alias.symlink_to(arena)  # the arena's folder as the segment was told it (a symlinked /dev/shm)
    files = StagingFiles(str(alias))
    opened: list[str] = []
    real_open = os.open

    def record(path: Any, *args: Any, **kwargs: Any) -> int:
        opened.append(str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", record)
    for folder in (alias, arena):  # either name of the folder is the arena's
        held = files._open(StagedBytes(path=f"{folder}/{name}", nonce=nonce, offset=STAGING_HEADER_BYTES))
        os.close(held.fd)
    assert opened == [str(arena / name)] * 2


def test_the_folder_as_the_segment_names_it_is_the_arenas_too(
    tree: tuple[Path, Path, str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer names the folder as the segment's `arena_path` does (its dirname): with `..`
    in it, or none at all (an arena path relative to the working folder), it is still the
    arena's (review of the change: refused, the writer silently fell back to sending bytes)."""
    arena, _, name, nonce = tree
    with_dots = f"{arena}/sub/.."
    files = StagingFiles(with_dots)
    held = files._open(StagedBytes(path=f"{with_dots}/{name}", nonce=nonce, offset=STAGING_HEADER_BYTES))
    os.close(held.fd)
    monkeypatch.chdir(arena)
    here = StagingFiles(os.path.dirname("kvf-arena-1"))  # ""
    held = here._open(StagedBytes(path=os.path.join("", name), nonce=nonce, offset=STAGING_HEADER_BYTES))
    assert os.readlink(f"/proc/self/fd/{held.fd}") == str(arena / name)
    os.close(held.fd)


def test_a_request_that_raises_unexpectedly_is_answered_internal_and_the_connection_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A defect (here `begin_put` raising a ValueError) ends the connection with a typed
    `internal` answer, counted: before, the exception escaped the thread, no answer went out and
    every such request printed a traceback."""

    class Backend:
        closed = 0

        def map_info(self) -> MapReply:
            return MapReply(arena_path="/dev/shm/kvf-x-1", arena_bytes=1 << 20, incarnation=1)

        def begin_put(self, *args: object) -> object:
            raise ValueError("a defect")

        def close_connection(self, conn: int) -> None:
            Backend.closed += 1

    counted: list[str] = []
    escaped: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda a: escaped.append(a.exc_value))
    server = TcpDataServer(Backend(), authenticate=lambda meta: True, count=counted.append)  # type: ignore[arg-type]
    server.start()
    try:
        ticket = WriteTicket(
            ticket_id=1, key=ObjectKey(b"k" * 16), segment_id="s", incarnation=1, size_bytes=64,
            checksum=b"c" * 16, writer_id="w", deadline_ms=1 << 60, epoch=1,
        )  # fmt: skip
        host, port = split_host_port(server.address)
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(frame(Op.PUT, PutRequest(ticket=ticket)))
            answer = read_frame(s)
            assert answer is not None
            op, meta = answer
            assert op == Op.ERROR and getattr(meta, "code", "") == "internal"
            assert "ValueError" in getattr(meta, "message", "")
            assert s.recv(1) == b""  # closed
    finally:
        server.stop()
    assert escaped == [] and "dataplane_tcp_internal_errors_total" in counted
    assert Backend.closed == 1
