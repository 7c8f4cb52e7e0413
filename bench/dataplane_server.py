"""The processes the data-plane bench (`bench/dataplane.py`) measures against, each its own process.

- `segment_main`: a segment without NATS: an `Arena` in /dev/shm (pre-faulted), a `SlotTable`, an
  `ArenaBackend` whose `confirm` is a stub answering "ok" (the directory round trip is measured by
  `bench/directory_core.py`, not here), serving `TcpDataServer` and `UcxServer` at once. Commands
  over a pipe: `("free", [(slot, generation), ...])`, `("stats",)`, `("stop",)`.
- `raw_sink_main`: the raw-socket limit: a thread per connection; per message a 9-byte header
  (op `P`/`G`, size), then `P`: `recv_into` a preallocated buffer + 1-byte ack, `G`: send `size`
  bytes from a preallocated buffer. Same socket options as the TCP transport (`tune_socket`).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Final

from kvfabric.core.segment_slots import SlotTable
from kvfabric.dataplane.tcp import TcpDataServer, tune_socket
from kvfabric.proto.directory import WriteTicket
from kvfabric.segment_storage.arena import Arena
from kvfabric.segment_storage.backend import ArenaBackend

SEGMENT_ID: Final = "bench0"
RAW_HEADER: Final = struct.Struct("<cQ")
RAW_BUFFER_BYTES: Final = 64 << 20
PREFAULT_CHUNK: Final = 64 << 20


@dataclass(frozen=True)
class SegmentInfo:
    host: str
    tcp_port: int
    ucx_port: int | None
    ucx_error: str
    incarnation: int
    arena_path: str
    arena_bytes: int
    prefault_s: float


def _confirm_ok(
    ticket: WriteTicket, slot: int, generation: int, trace_id: str = "", save_writes: int = 0
) -> str:
    return "ok"


def _prefault(arena: Arena) -> float:
    """Touch every page once: puts land in resident memory, as in a segment that has been running."""
    t0 = time.perf_counter()
    zeros = bytes(PREFAULT_CHUNK)
    for offset in range(0, arena.size_bytes, PREFAULT_CHUNK):
        n = min(PREFAULT_CHUNK, arena.size_bytes - offset)
        arena.view[offset : offset + n] = zeros[:n]
    return time.perf_counter() - t0


def segment_main(conn: Connection, arena_bytes: int, secret: bytes, with_ucx: bool) -> None:
    asyncio.run(_segment(conn, arena_bytes, secret, with_ucx))


async def _segment(conn: Connection, arena_bytes: int, secret: bytes, with_ucx: bool) -> None:
    incarnation = time.time_ns() // 1_000
    arena = Arena(Path("/dev/shm"), SEGMENT_ID, incarnation, arena_bytes)
    ucx_server: Any = None
    tcp: TcpDataServer | None = None
    try:
        prefault_s = _prefault(arena)
        slots = SlotTable(arena_bytes)
        backend = ArenaBackend(
            arena,
            slots,
            segment_id=SEGMENT_ID,
            incarnation=incarnation,
            secret=secret,
            confirm=_confirm_ok,
            read_tokens_required=True,  # as deployed: every read pays the token check
        )
        tcp = TcpDataServer(backend)
        tcp.start()
        ucx_port: int | None = None
        ucx_error = "" if with_ucx else "disabled (--no-ucx)"
        if with_ucx:
            try:
                from kvfabric.dataplane.ucx import UcxServer

                ucx_server = UcxServer(backend)
                await ucx_server.start()
                ucx_port = int(ucx_server.port)
            except Exception as exc:  # any failure: recorded in the results instead of numbers
                ucx_error = f"{type(exc).__name__}: {exc}"
                ucx_server = None
        conn.send(
            SegmentInfo(
                host=tcp.host,
                tcp_port=tcp.port,
                ucx_port=ucx_port,
                ucx_error=ucx_error,
                incarnation=incarnation,
                arena_path=str(arena.path),
                arena_bytes=arena_bytes,
                prefault_s=prefault_s,
            )
        )
        loop = asyncio.get_running_loop()
        while True:
            try:
                cmd = await loop.run_in_executor(None, conn.recv)
            except EOFError:  # the bench went away
                break
            if cmd[0] == "free":
                conn.send(len(backend.free_slots(cmd[1])))
            elif cmd[0] == "stats":
                conn.send(
                    {
                        "used_bytes": slots.used_bytes,
                        "slots_in_use": slots.slots_in_use,
                        "counters": dict(backend.counters),
                    }
                )
            else:
                break
    finally:
        if ucx_server is not None:
            with contextlib.suppress(Exception):
                await ucx_server.stop()
        if tcp is not None:
            tcp.stop()
        arena.close()


# ---- raw socket limit --------------------------------------------------------------------------


def _recv_exact(sock: socket.socket, view: memoryview) -> bool:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


def _raw_serve(sock: socket.socket) -> None:
    tune_socket(sock)
    buf = memoryview(bytearray(b"\x5a" * RAW_BUFFER_BYTES))  # preallocated and touched
    header = memoryview(bytearray(RAW_HEADER.size))
    with sock:
        while _recv_exact(sock, header):
            op, size = RAW_HEADER.unpack(header)
            if op == b"P":
                if not _recv_exact(sock, buf[:size]):
                    return
                sock.sendall(b"\x01")
            else:
                sock.sendall(buf[:size])


def raw_sink_main(conn: Connection) -> None:
    listener = socket.create_server(("127.0.0.1", 0), backlog=16)
    conn.send(listener.getsockname()[1])

    def accept() -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=_raw_serve, args=(sock,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    with contextlib.suppress(EOFError):
        conn.recv()
    listener.close()
