"""UCX options next to the raw socket and the TCP transport, in one run (issue 20, item 5).

Why: the UCX transport ran at 0.3-0.5 x the raw socket at 1-4 MiB (about 0.7 ms fixed cost per
request). This measures, on the same sizes and in the same run, each option that could change
that, one at a time:

- the transports (`baseline`): raw socket (send+ack, request+recv), the TCP transport
  (`TcpDataClient`) and the UCX transport (`UcxClient` on an event loop, `UcxSyncClient` blocking,
  against `UcxServer`): GET of 1 and 4 objects per request, PUT;
- ucxx's own asyncio API (`ucxx.create_endpoint`, what `ucx.py` was built on) in each of its
  progress modes (`UCXPY_PROGRESS_MODE` thread / thread-polling / polling / blocking, with and
  without `UCXPY_ENABLE_PYTHON_FUTURE`, `UCXPY_ENABLE_DELAYED_SUBMISSION=0`), and in the default
  mode: a plain request/reply on the endpoint's tag (the endpoint is persistent, as in the
  transport), receives pre-posted (the reply's receive posted before the request is sent, the
  server's next request receive posted before it replies), the active-message API
  (`am_send`/`am_recv`, the reply copied into the caller's buffer) and 4 objects per request;
- `driven`: ucxx's low-level worker (`ucxx._lib.libucxx`) progressed by the caller, no ucxx
  threads: asyncio (the worker's epoll fd registered with the event loop; progress until idle,
  complete the requests, re-arm) or synchronous (progress in the calling thread, block in epoll
  when idle), with the same variants, and with UCX knobs (`UCX_RNDV_THRESH`, TCP segment size,
  `UCX_TLS` unset so same-host peers may use shared memory).

Every UCX configuration runs with `ucx_env_defaults()`, `UCX_TLS=tcp` (what a remote peer sees)
and `UCXPY_ENABLE_PYTHON_FUTURE=1` (read by the ucxx asyncio rows only) unless its row says
otherwise. All rows are GETs of `size` bytes per object unless named put.
Each configuration is a fresh server process and client process (ucxx reads its environment once
per process); one round runs every configuration once (order rotated per round), the rounds are
interleaved, so a slow spell of the machine hits every row alike. GB/s = 1e9 bytes/s, the median
round; p50 per request pooled over rounds. Servers answer from one buffer (objects in cache) and
the transports' backend does no checksums: this measures the transports, not the arena.

Run: `.venv/bin/python -m bench.ucx_options` from the repository root (about 8 minutes on a
shared 2-core VM with `--trial-mib 24`). Writes bench/results/ucx_options.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import select
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from kvfabric.format.ids import ObjectKey

RESULTS: Final = Path(__file__).resolve().parent / "results"
REPO: Final = Path(__file__).resolve().parent.parent
KiB: Final = 1 << 10
MiB: Final = 1 << 20
SIZES: Final = (256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB)
BATCH: Final = 4  # objects per request in the ×4 rows
TRIAL_BYTES: Final = 48 * MiB  # per (row, size, round), at least MIN_OPS requests
MIN_OPS: Final = 6
WARMUP_OPS: Final = 3
BUFFER_BYTES: Final = 16 * MiB  # the largest object; servers answer every read from it
START_TIMEOUT_S: Final = 60.0
CLIENT_TIMEOUT_S: Final = 300.0
IO_TIMEOUT_S: Final = 30.0
IDLE_THRESHOLD: Final = 0.5  # start a configuration once the machine was this idle (or after 5 s)

RAW_HEADER: Final = struct.Struct("<cQ")  # op (P put / G get), size
REQUEST: Final = struct.Struct("<cxxxIQ")  # ucxx / driven rows: mode, objects, size per object
HANDSHAKE: Final = struct.Struct("<QQ")  # driven rows: client -> server tag, server -> client tag


@dataclass(frozen=True)
class Row:
    name: str
    what: str
    op: str = "get"  # get | put
    batch: int = 1


ROWS: Final = {
    r.name: r
    for r in (
        Row("raw_get", "raw socket: request + recv_into (limit)"),
        Row("raw_put", "raw socket: send + 1-byte ack (limit)", "put"),
        Row("tcp_get", "TCP transport `TcpDataClient.get`"),
        Row("tcp_get_x4", f"TCP transport, {BATCH} objects per request", batch=BATCH),
        Row("tcp_put", "TCP transport `TcpDataClient.put`", "put"),
        Row("ucx_get", "UCX transport `UcxClient.get`"),
        Row("ucx_get_x4", f"UCX transport, {BATCH} objects per request", batch=BATCH),
        Row("ucx_put", "UCX transport `UcxClient.put`", "put"),
        Row("ucx_sync_get", "UCX transport, blocking `UcxSyncClient.get`"),
        Row("ucx_sync_get_x4", f"UCX transport, blocking, {BATCH} objects per request", batch=BATCH),
        Row("ucx_sync_put", "UCX transport, blocking `UcxSyncClient.put`", "put"),
        Row("ucxx_tag", "ucxx asyncio: send request, then recv reply (tag)"),
        Row("ucxx_pre", "ucxx asyncio: receives pre-posted (both sides)"),
        Row("ucxx_am", "ucxx asyncio: active messages (`am_send`/`am_recv`, copied to the buffer)"),
        Row("ucxx_tag_x4", f"ucxx asyncio: {BATCH} objects per request", batch=BATCH),
        Row("driven_tag", "driven asyncio: send request, then recv reply (tag)"),
        Row("driven_pre", "driven asyncio: receives pre-posted (both sides)"),
        Row("driven_am", "driven asyncio: active messages (copied to the buffer)"),
        Row("driven_tag_x4", f"driven asyncio: {BATCH} objects per request", batch=BATCH),
        Row("driven_sync", "driven synchronous client (progress + epoll in the caller)"),
    )
}


@dataclass(frozen=True)
class Config:
    name: str
    env: dict[str, str | None]  # over ucx_env_defaults() + UCX_TLS=tcp; None removes a variable
    rows: tuple[str, ...]


CONFIGS: Final = (
    Config(
        "baseline",
        {},
        (
            "raw_get",
            "raw_put",
            "tcp_get",
            "tcp_get_x4",
            "tcp_put",
            "ucx_get",
            "ucx_get_x4",
            "ucx_put",
            "ucx_sync_get",
            "ucx_sync_get_x4",
            "ucx_sync_put",
        ),
    ),
    Config("ucxx thread+future", {}, ("ucxx_tag", "ucxx_pre", "ucxx_am", "ucxx_tag_x4")),
    Config(
        "ucxx thread+future, no delayed submission",
        {"UCXPY_ENABLE_DELAYED_SUBMISSION": "0"},
        ("ucxx_tag", "ucxx_pre"),
    ),
    Config("ucxx thread-polling+future", {"UCXPY_PROGRESS_MODE": "thread-polling"}, ("ucxx_tag",)),
    Config("ucxx thread, no future", {"UCXPY_ENABLE_PYTHON_FUTURE": "0"}, ("ucxx_tag",)),
    Config(
        "ucxx polling", {"UCXPY_PROGRESS_MODE": "polling", "UCXPY_ENABLE_PYTHON_FUTURE": "0"}, ("ucxx_tag",)
    ),
    Config(
        "ucxx blocking",
        {"UCXPY_PROGRESS_MODE": "blocking", "UCXPY_ENABLE_PYTHON_FUTURE": "0"},
        ("ucxx_tag",),
    ),
    Config("driven", {}, ("driven_tag", "driven_pre", "driven_am", "driven_tag_x4", "driven_sync")),
    Config("driven, UCX_RNDV_THRESH=8192", {"UCX_RNDV_THRESH": "8192"}, ("driven_tag",)),
    Config(
        "driven, UCX_TCP_{TX,RX}_SEG_SIZE=256K",
        {"UCX_TCP_TX_SEG_SIZE": "256K", "UCX_TCP_RX_SEG_SIZE": "256K"},
        ("driven_tag",),
    ),
    Config("driven, UCX_TLS unset (same host: shared memory)", {"UCX_TLS": None}, ("driven_tag",)),
)


def config_env(config: Config) -> dict[str, str]:
    from kvfabric.dataplane.ucx import ucx_env_defaults  # does not import ucxx

    env = {k: v for k, v in os.environ.items() if not k.startswith(("UCX_", "UCXPY_"))}
    env.update(ucx_env_defaults())
    env.update({"UCX_TLS": "tcp", "UCX_WARN_UNUSED_ENV_VARS": "n", "PYTHONUNBUFFERED": "1"})
    # ucxx asyncio rows: completions through its notifier thread unless a row says otherwise (the
    # mode the transport used before it drove its own worker; other rows do not read UCXPY_*)
    env["UCXPY_ENABLE_PYTHON_FUTURE"] = "1"
    for key, value in config.env.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def size_label(size: int) -> str:
    return f"{size // MiB} MiB" if size >= MiB else f"{size // KiB} KiB"


# ---- the driven engine (bench-local: ucxx's low-level worker, progressed by its owner) ----------


def _libucxx() -> Any:
    import ucxx._lib.libucxx as libucxx

    return libucxx


def _array(buf: Any) -> Any:
    from ucxx._lib.arr import Array

    return Array(buf)


class AsyncDriven:
    """One UCX context + worker driven from an asyncio loop: no ucxx threads.

    The worker's epoll fd is a reader of the loop; each turn progresses until idle, completes the
    requests that finished (their futures), then re-arms. A posted request schedules a turn."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        u = _libucxx()
        self.u = u
        self.ctx = u.UCXContext({})
        self.worker = u.UCXWorker(self.ctx, enable_delayed_submission=False, enable_python_future=False)
        self.worker.init_blocking_progress_mode()
        self.loop = loop
        self.pending: list[tuple[Any, asyncio.Future[Any], tuple[Any, ...]]] = []
        self.scheduled = False
        loop.add_reader(self.worker.epoll_file_descriptor, self.turn)

    def post(self, request: Any, *buffers: Any) -> asyncio.Future[Any]:
        """A future for the request; `buffers` (its `Array`s) stay referenced until it completes:
        UCX may still read or write them (a send is queued until the endpoint is wired up)."""
        fut: asyncio.Future[Any] = self.loop.create_future()
        self.pending.append((request, fut, buffers))
        if not self.scheduled:
            self.scheduled = True
            self.loop.call_soon(self.turn)
        return fut

    def turn(self) -> None:
        self.scheduled = False
        while True:
            while self.worker.progress_once():
                pass
            if self.pending:
                keep = []
                for request, fut, buffers in self.pending:
                    if not request.completed:
                        keep.append((request, fut, buffers))
                        continue
                    try:
                        request.check_error()
                        fut.set_result(request)
                    except Exception as exc:
                        fut.set_exception(exc)
                self.pending = keep
            if self.worker.arm():
                return

    def tags(self) -> tuple[Any, Any]:
        return self.u.UCXXTag(int.from_bytes(os.urandom(8), "little")), self.u.UCXXTagMaskFull


class SyncDriven:
    """One UCX context + worker progressed by the calling thread (epoll when idle)."""

    def __init__(self) -> None:
        u = _libucxx()
        self.u = u
        self.ctx = u.UCXContext({})
        self.worker = u.UCXWorker(self.ctx, enable_delayed_submission=False, enable_python_future=False)
        self.worker.init_blocking_progress_mode()
        self.epoll = select.epoll()
        self.epoll.register(self.worker.epoll_file_descriptor, select.EPOLLIN)

    def wait(self, requests: list[Any], timeout_s: float = IO_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not all(r.completed for r in requests):
            if self.worker.progress_once():
                continue
            if self.worker.arm():
                if time.monotonic() > deadline:
                    raise TimeoutError("driven sync: no completion")
                self.epoll.poll(0.1)
        for r in requests:
            r.check_error()


# ---- server process ------------------------------------------------------------------------------


class OneBufferBackend:
    """A `SegmentBackend` that stores nothing: every read is answered from one buffer, every write
    lands in it. No checksums (the transports are measured, not the arena)."""

    def __init__(self, nbytes: int) -> None:
        self.arena = bytearray(b"\x5a" * nbytes)
        self.generation = 0

    def begin_put(self, ticket: Any, conn: int, claim: Any = None) -> Any:
        from kvfabric.dataplane.backend import PutSlot

        self.generation += 1
        return PutSlot(0, self.generation, memoryview(self.arena)[: ticket.size_bytes], ticket, 0)

    def finish_put(self, put: Any, conn: int) -> tuple[int, int]:
        return 0, put.slot_generation

    def abort_put(self, put: Any, conn: int) -> None:
        pass

    def begin_get(self, reads: list[Any], conn: int) -> Any:
        from kvfabric.dataplane.backend import GetGrant

        views: list[memoryview | None] = [memoryview(self.arena)[: r.size_bytes].toreadonly() for r in reads]
        return GetGrant(1, ["ok"] * len(reads), [b""] * len(reads), views)

    def end_get(self, grant: Any, conn: int) -> None:
        pass

    def map_info(self) -> Any:
        raise NotImplementedError

    def pin_local(self, reads: list[Any], conn: int) -> Any:
        raise NotImplementedError

    def unpin_local(self, grant_id: int, conn: int) -> int:
        raise NotImplementedError

    def close_connection(self, conn: int) -> None:
        pass

    def connection_leaked(self, conn: int) -> None:
        """(Nothing to end: this benchmark's backend counts no GETs.)"""


def _recv_exact(sock: socket.socket, view: memoryview) -> bool:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


def _raw_serve(sock: socket.socket, buf: memoryview) -> None:
    from kvfabric.dataplane.tcp import tune_socket

    tune_socket(sock)
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


def _start_raw_sink(buf: memoryview) -> int:
    listener = socket.create_server(("127.0.0.1", 0), backlog=16)

    def accept() -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=_raw_serve, args=(sock, buf), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return int(listener.getsockname()[1])


async def _ucxx_handler(ep: Any, payload: memoryview) -> None:
    """ucxx asyncio rows: the first request names the mode for the connection (tag, pre-posted, am)."""
    req = bytearray(REQUEST.size)
    try:
        await ep.recv(req)
        mode = REQUEST.unpack(req)[0]
        if mode == b"A":
            while True:
                msg = await ep.am_recv()
                _, count, size = REQUEST.unpack(bytes(msg))
                for _ in range(count):
                    await ep.am_send(payload[:size])
        elif mode == b"P":
            bufs = [bytearray(REQUEST.size), bytearray(REQUEST.size)]
            nxt = asyncio.ensure_future(ep.recv(bufs[0]))
            i = 0
            while True:
                await nxt
                cur = bufs[i % 2]
                i += 1
                nxt = asyncio.ensure_future(ep.recv(bufs[i % 2]))  # next request's receive first
                _, count, size = REQUEST.unpack(cur)
                await asyncio.gather(*(ep.send(payload[:size]) for _ in range(count)))
        else:
            while True:
                await ep.recv(req)
                _, count, size = REQUEST.unpack(req)
                await asyncio.gather(*(ep.send(payload[:size]) for _ in range(count)))
    except Exception:
        return


async def _driven_handler(d: AsyncDriven, ep: Any, payload: memoryview) -> None:
    """Driven rows: handshake (the client's tags), then as `_ucxx_handler`."""
    u = d.u
    try:
        hs = bytearray(HANDSHAKE.size)
        hs_array = _array(hs)
        await d.post(ep.stream_recv(hs_array), hs_array)
        c2s, s2c = HANDSHAKE.unpack(hs)
        rtag, stag, mask = u.UCXXTag(c2s), u.UCXXTag(s2c), u.UCXXTagMaskFull
        req = bytearray(REQUEST.size)
        arr = _array(req)
        await d.post(ep.tag_recv(arr, rtag, mask), arr)
        mode = REQUEST.unpack(req)[0]
        replies = {}  # size -> Array over the payload

        def reply(size: int) -> Any:
            if size not in replies:
                replies[size] = _array(payload[:size])
            return replies[size]

        if mode == b"A":
            while True:
                request = await d.post(ep.am_recv())
                _, count, size = REQUEST.unpack(bytes(request.recv_buffer))
                for _ in range(count):
                    await d.post(ep.am_send(reply(size)), reply(size))
        elif mode == b"P":
            bufs = [bytearray(REQUEST.size), bytearray(REQUEST.size)]
            arrs = [_array(b) for b in bufs]
            nxt = d.post(ep.tag_recv(arrs[0], rtag, mask), arrs[0])
            i = 0
            while True:
                await nxt
                cur = bufs[i % 2]
                i += 1
                nxt = d.post(ep.tag_recv(arrs[i % 2], rtag, mask), arrs[i % 2])
                _, count, size = REQUEST.unpack(cur)
                a = reply(size)
                await asyncio.gather(*(d.post(ep.tag_send(a, stag), a) for _ in range(count)))
        else:
            while True:
                await d.post(ep.tag_recv(arr, rtag, mask), arr)
                _, count, size = REQUEST.unpack(req)
                a = reply(size)
                await asyncio.gather(*(d.post(ep.tag_send(a, stag), a) for _ in range(count)))
    except Exception:
        return


async def serve(config: Config) -> None:
    rows = set(config.rows)
    buf = bytearray(b"\x5a" * BUFFER_BYTES)
    payload = memoryview(buf).toreadonly()
    ports: dict[str, int] = {}
    keep: list[Any] = []  # listeners and servers stay referenced until exit
    if rows & {"raw_get", "raw_put"}:
        ports["raw"] = _start_raw_sink(memoryview(buf))
    backend = OneBufferBackend(BUFFER_BYTES)
    if any(r.startswith("tcp_") for r in rows):
        from kvfabric.dataplane.tcp import TcpDataServer

        tcp = TcpDataServer(backend)
        tcp.start()
        ports["tcp"] = int(tcp.port)
        keep.append(tcp)
    if any(r.startswith("ucx_") for r in rows):
        from kvfabric.dataplane.ucx import UcxServer

        server = UcxServer(backend)
        await server.start()
        ports["ucx"] = int(server.port)
        keep.append(server)
    if any(r.startswith("ucxx_") for r in rows):
        from kvfabric.dataplane.ucx import apply_ucx_env_defaults

        apply_ucx_env_defaults()
        import ucxx

        async def on_ucxx_connect(ep: Any) -> None:  # ucxx awaits only coroutine functions
            await _ucxx_handler(ep, payload)

        listener = ucxx.create_listener(on_ucxx_connect, 0)
        ports["ucxx"] = int(listener.port)
        keep.append(listener)
    if any(r.startswith("driven_") for r in rows):
        loop = asyncio.get_running_loop()
        d = AsyncDriven(loop)
        tasks: set[asyncio.Task[None]] = set()

        def on_connect(ep: Any) -> None:
            task = loop.create_task(_driven_handler(d, ep, payload))
            tasks.add(task)
            keep.append(ep)

        listener = d.u.UCXListener.create(
            worker=d.worker, port=0, cb_func=on_connect, cb_args=(), deliver_endpoint=True
        )
        ports["driven"] = int(listener.port)
        keep.extend([d, listener, tasks])
    print("READY " + json.dumps(ports), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the bench is done


# ---- client process ------------------------------------------------------------------------------


Op = Callable[[], Any]  # one request; returns an awaitable for async rows


@dataclass
class ClientRun:
    ports: dict[str, int]
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)
    closers: list[Callable[[], None]] = field(default_factory=list)
    driven: AsyncDriven | None = None
    sync_driven: SyncDriven | None = None

    def close(self) -> None:
        for close in reversed(self.closers):
            with contextlib.suppress(Exception):
                close()

    # each returns a function doing one request of `size` bytes per object
    def make(self, row: Row, size: int) -> tuple[Op, bool]:
        name, n = row.name, row.batch
        dests = [bytearray(b"\x01" * size) for _ in range(n)]
        src = bytes(b"\x33" * size)
        if name in ("raw_get", "raw_put"):
            return self._raw(name, size, dests[0], src), False
        if name.startswith("tcp_"):
            return self._tcp(name, size, dests, src), False
        if name.startswith("ucx_sync_"):
            return self._ucx_sync(name, size, dests, src), False
        if name.startswith("ucx_"):
            return self._ucx(name, size, dests, src), True
        if name.startswith("ucxx_"):
            return self._ucxx(name, size, dests), True
        if name == "driven_sync":
            return self._driven_sync(size, dests[0]), False
        return self._driven(name, size, dests), True

    def _raw(self, name: str, size: int, dest: bytearray, src: bytes) -> Op:
        from kvfabric.dataplane.tcp import tune_socket

        sock = socket.create_connection(("127.0.0.1", self.ports["raw"]), timeout=IO_TIMEOUT_S)
        tune_socket(sock)
        self.closers.append(sock.close)
        view, ack = memoryview(dest), memoryview(bytearray(1))
        if name == "raw_put":
            header = RAW_HEADER.pack(b"P", size)

            def raw_put() -> None:
                sock.sendall(header)
                sock.sendall(src)
                if sock.recv_into(ack) != 1:
                    raise RuntimeError("raw sink closed")

            return raw_put
        header = RAW_HEADER.pack(b"G", size)

        def raw_get() -> None:
            sock.sendall(header)
            if not _recv_exact(sock, view):
                raise RuntimeError("raw sink closed")

        return raw_get

    def _tcp(self, name: str, size: int, dests: list[bytearray], src: bytes) -> Op:
        from kvfabric.dataplane.tcp import TcpDataClient

        client = TcpDataClient("127.0.0.1", self.ports["tcp"], timeout_s=IO_TIMEOUT_S)
        self.closers.append(client.close)
        if name == "tcp_put":
            ticket = _ticket(size)
            return lambda: client.put(ticket, src)
        reads = _reads(size, len(dests))

        def tcp_get() -> None:
            if any(r.status != "ok" for r in client.get(reads, dests)):
                raise RuntimeError("tcp get failed")

        return tcp_get

    def _ucx(self, name: str, size: int, dests: list[bytearray], src: bytes) -> Op:
        from kvfabric.dataplane.ucx import UcxClient

        client = UcxClient("127.0.0.1", self.ports["ucx"], io_timeout_s=IO_TIMEOUT_S)
        self.loop.run_until_complete(client.connect())
        self.closers.append(client.close)
        if name == "ucx_put":
            ticket = _ticket(size)
            return lambda: client.put(ticket, src)
        reads = _reads(size, len(dests))

        async def ucx_get() -> None:
            if any(r.status != "ok" for r in await client.get(reads, dests)):
                raise RuntimeError("ucx get failed")

        return ucx_get

    def _ucx_sync(self, name: str, size: int, dests: list[bytearray], src: bytes) -> Op:
        from kvfabric.dataplane.ucx import UcxSyncClient

        client = UcxSyncClient("127.0.0.1", self.ports["ucx"], io_timeout_s=IO_TIMEOUT_S)
        client.connect()
        self.closers.append(client.close)
        if name == "ucx_sync_put":
            ticket = _ticket(size)
            return lambda: client.put(ticket, src)
        reads = _reads(size, len(dests))

        def ucx_sync_get() -> None:
            if any(r.status != "ok" for r in client.get(reads, dests)):
                raise RuntimeError("ucx get failed")

        return ucx_sync_get

    def _ucxx(self, name: str, size: int, dests: list[bytearray]) -> Op:
        from kvfabric.dataplane.ucx import apply_ucx_env_defaults

        apply_ucx_env_defaults()
        import ucxx

        ep = self.loop.run_until_complete(ucxx.create_endpoint("127.0.0.1", self.ports["ucxx"]))
        self.closers.append(ep.abort)
        mode = {"ucxx_pre": b"P", "ucxx_am": b"A"}.get(name, b"T")
        req = REQUEST.pack(mode, len(dests), size)
        self.loop.run_until_complete(ep.send(req))  # names the mode for the connection
        if name == "ucxx_am":
            view = memoryview(dests[0])

            async def am() -> None:
                await ep.am_send(req)
                reply = await ep.am_recv()
                view[:] = memoryview(reply).cast("B")  # to the caller's buffer, as the transport must

            return am
        if name == "ucxx_pre":

            async def pre() -> None:
                recvs = [asyncio.ensure_future(ep.recv(d)) for d in dests]  # posted before the request
                await ep.send(req)
                await asyncio.gather(*recvs)

            return pre

        async def tag() -> None:
            await ep.send(req)
            await asyncio.gather(*(ep.recv(d) for d in dests))

        return tag

    def _driven(self, name: str, size: int, dests: list[bytearray]) -> Op:
        if self.driven is None:
            self.driven = AsyncDriven(self.loop)
        d = self.driven
        ep = d.u.UCXEndpoint.create(d.worker, "127.0.0.1", self.ports["driven"], True)
        self.closers.append(lambda: ep.close_blocking(period=10**9, max_attempts=1))
        (stag, mask), (rtag, _) = d.tags(), d.tags()
        hs = _array(HANDSHAKE.pack(stag.value, rtag.value))
        self.loop.run_until_complete(d.post(ep.stream_send(hs), hs))
        mode = {"driven_pre": b"P", "driven_am": b"A"}.get(name, b"T")
        req = _array(REQUEST.pack(mode, len(dests), size))
        self.loop.run_until_complete(d.post(ep.tag_send(req, stag), req))
        arrays = [_array(x) for x in dests]
        if name == "driven_am":
            view = memoryview(dests[0])

            async def am() -> None:
                await d.post(ep.am_send(req), req)
                reply = await d.post(ep.am_recv())
                view[:] = memoryview(reply.recv_buffer).cast("B")

            return am
        if name == "driven_pre":

            async def pre() -> None:
                recvs = [d.post(ep.tag_recv(a, rtag, mask), a) for a in arrays]
                await d.post(ep.tag_send(req, stag), req)
                await asyncio.gather(*recvs)

            return pre

        async def tag() -> None:
            await d.post(ep.tag_send(req, stag), req)
            await asyncio.gather(*(d.post(ep.tag_recv(a, rtag, mask), a) for a in arrays))

        return tag

    def _driven_sync(self, size: int, dest: bytearray) -> Op:
        if self.sync_driven is None:
            self.sync_driven = SyncDriven()
        d = self.sync_driven
        u = d.u
        ep = u.UCXEndpoint.create(d.worker, "127.0.0.1", self.ports["driven"], True)
        self.closers.append(lambda: ep.close_blocking(period=10**9, max_attempts=1))
        stag = u.UCXXTag(int.from_bytes(os.urandom(8), "little"))
        rtag = u.UCXXTag(int.from_bytes(os.urandom(8), "little"))
        hs = _array(HANDSHAKE.pack(stag.value, rtag.value))  # referenced until sent
        d.wait([ep.stream_send(hs)])
        req = _array(REQUEST.pack(b"P", 1, size))
        d.wait([ep.tag_send(req, stag)])
        arr, mask = _array(dest), u.UCXXTagMaskFull

        def sync_get() -> None:
            recv = ep.tag_recv(arr, rtag, mask)  # posted before the request
            d.wait([ep.tag_send(req, stag), recv])

        return sync_get


def _ticket(size: int) -> Any:
    from kvfabric.proto.directory import WriteTicket

    return WriteTicket(
        ticket_id=1,
        key=ObjectKey(b"k" * 16),
        segment_id="bench",
        incarnation=1,
        size_bytes=size,
        checksum=bytes(16),  # unchecked here (one without needs a receipt: not over UCX)
        writer_id="w",
        deadline_ms=2**40,
        epoch=1,
    )


def _reads(size: int, n: int) -> list[Any]:
    from kvfabric.proto.dataplane import ReadRef

    return [ReadRef(1, i, 1, size) for i in range(n)]


def _timed(run: ClientRun, op: Op, is_async: bool, n: int) -> tuple[float, list[float]]:
    perf = time.perf_counter
    lat: list[float] = []
    if is_async:

        async def go() -> float:
            t0 = perf()
            for _ in range(n):
                s = perf()
                await op()
                lat.append(perf() - s)
            return perf() - t0

        return run.loop.run_until_complete(asyncio.wait_for(go(), CLIENT_TIMEOUT_S)), lat
    t0 = perf()
    for _ in range(n):
        s = perf()
        op()
        lat.append(perf() - s)
    return perf() - t0, lat


def client(config: Config, ports: dict[str, int], sizes: list[int], trial_bytes: int) -> None:
    run = ClientRun(ports)
    try:
        for name in config.rows:
            row = ROWS[name]
            for size in sizes:
                out: dict[str, Any] = {"row": name, "size": size}
                try:
                    op, is_async = run.make(row, size)
                    per_op = size * row.batch
                    n = max(MIN_OPS, math.ceil(trial_bytes / per_op))
                    _timed(run, op, is_async, WARMUP_OPS)
                    elapsed, lat = _timed(run, op, is_async, n)
                    out.update(gbps=n * per_op / elapsed / 1e9, lat_s=lat)
                except Exception as exc:
                    out["error"] = f"{type(exc).__name__}: {exc}"[:300]
                print("RESULT " + json.dumps(out), flush=True)
    finally:
        run.close()


# ---- the bench ---------------------------------------------------------------------------------


def _cpu_times() -> tuple[int, int]:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return fields[3] + fields[4], sum(fields[:8])


def wait_idle(threshold: float, window_s: float = 0.5, max_wait_s: float = 5.0) -> float:
    """Wait until the machine was ≥ threshold idle over window_s (at most max_wait_s); returns
    the idle share of the last window."""
    start = time.monotonic()
    while True:
        i0, t0 = _cpu_times()
        time.sleep(window_s)
        i1, t1 = _cpu_times()
        idle = (i1 - i0) / (t1 - t0) if t1 > t0 else 1.0
        if idle >= threshold or time.monotonic() - start > max_wait_s:
            return idle


def _lines(proc: subprocess.Popen[str], prefix: str, timeout_s: float) -> Any:
    """The lines of a child's stdout starting with prefix (UCX may print warnings there too)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            return
        if line.startswith(prefix):
            yield line[len(prefix) :]


def run_config(config: Config, sizes: list[int], trial_bytes: int) -> tuple[list[dict[str, Any]], str]:
    env = config_env(config)
    cmd = [sys.executable, "-m", "bench.ucx_options"]
    server = subprocess.Popen(
        [*cmd, "--serve", config.name],
        env=env,
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        ready = next(_lines(server, "READY ", START_TIMEOUT_S), None)
        if ready is None:
            return [], f"server did not start (exit {server.poll()})"
        spec = json.dumps({"ports": json.loads(ready), "sizes": sizes, "trial_bytes": trial_bytes})
        proc = subprocess.Popen(
            [*cmd, "--client", config.name, "--spec", spec],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        results = [json.loads(line) for line in _lines(proc, "RESULT ", CLIENT_TIMEOUT_S)]
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        err = ""
        if len(results) < len(config.rows) * len(sizes):
            assert proc.stderr is not None
            err = f"client exit {proc.poll()}: " + proc.stderr.read()[-300:]
        return results, err
    finally:
        with contextlib.suppress(Exception):
            assert server.stdin is not None
            server.stdin.close()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(5)


@dataclass
class Cell:
    runs: list[float] = field(default_factory=list)
    lat_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.lat_s)
        return {
            "gbps": round(statistics.median(self.runs), 3) if self.runs else None,
            "gbps_runs": [round(r, 3) for r in self.runs],
            "p50_ms": round(lat[len(lat) // 2] * 1e3, 3) if lat else None,
            "errors": sorted(set(self.errors)),
        }


def machine() -> dict[str, Any]:
    cpu = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
    }


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("ucxx-cu12", "libucxx-cu12", "libucx-cu12"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "not installed"
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def reference(row: Row) -> str:
    """The TCP transport row a row is compared with (same op, same objects per request)."""
    if row.op == "put":
        return "tcp_put"
    return "tcp_get_x4" if row.batch > 1 else "tcp_get"


def markdown(result: dict[str, Any]) -> str:
    sizes = result["sizes"]
    cells = {(c["config"], c["row"], c["size"]): c for c in result["cells"]}
    base = {(c["row"], c["size"]): c for c in result["cells"] if c["config"] == "baseline"}
    m = result["machine"]
    head = " | ".join(size_label(s) for s in sizes)
    lines = [
        f"### UCX options ({result['date']}; {m['cpu']}, {m['cores']} cores, Linux {m['kernel']}, "
        f"Python {m['python']}, ucxx {result['versions'].get('ucxx-cu12')})",
        "",
        f"`{result['command']}`, {result['elapsed_s']:.0f} s, {result['rounds']} interleaved rounds. "
        "Cells: GB/s (median round) / p50 ms per request; `÷ tcp`: GB/s over the TCP transport's "
        "(same op, same objects per request) measured in the same run. Load average "
        f"{result['load_start']} at the start, {result['load_end']} at the end; median idle share "
        f"of the machine just before each configuration: {result['idle_median']:.0%}.",
        "",
        f"| configuration | row | {head} | ÷ tcp ({', '.join(size_label(s) for s in sizes)}) |",
        "|---|---|" + "---:|" * len(sizes) + "---|",
    ]
    for config in result["configs"]:
        for name in config["rows"]:
            row = ROWS[name]
            vals, ratios = [], []
            for s in sizes:
                c = cells.get((config["name"], name, s))
                if c is None or c["gbps"] is None:
                    err = (c["errors"][0] if c and c["errors"] else "not measured").replace("|", "\\|")
                    vals.append(f"error: {err[:80]}")
                    ratios.append("–")
                    continue
                vals.append(f"{c['gbps']:.2f} / {c['p50_ms']:.3f}")
                ref = base.get((reference(row), s))
                r = ratio(c["gbps"], ref["gbps"] if ref else None)
                ratios.append("–" if r is None else f"{r:.2f}")
            lines.append(f"| {config['name']} | {row.what} | {' | '.join(vals)} | {' / '.join(ratios)} |")
    raw = {s: base.get(("raw_get", s)) for s in sizes}
    lines += ["", "Against the raw socket (request + recv_into), same run:", ""]
    lines += [f"| row | {head} |", "|---|" + "---:|" * len(sizes)]
    for config, name in (("baseline", "tcp_get"), ("baseline", "ucx_get")):
        vals = []
        for s in sizes:
            c, r = cells.get((config, name, s)), raw[s]
            x = ratio(c["gbps"] if c else None, r["gbps"] if r else None)
            vals.append("–" if x is None else f"{x:.2f}")
        lines.append(f"| {ROWS[name].what} | {' | '.join(vals)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--sizes", default=",".join(str(s) for s in SIZES), help="object sizes, bytes")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--trial-mib", type=float, default=TRIAL_BYTES / MiB, help="MiB per row, size, round")
    parser.add_argument("--configs", default="", help="comma-separated configuration names (default all)")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--client", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    by_name = {c.name: c for c in CONFIGS}
    if args.serve:
        asyncio.run(serve(by_name[args.serve]))
        os._exit(0)  # ucxx's notifier thread (asyncio rows) never lets the interpreter exit
    if args.client:
        spec = json.loads(args.spec)
        client(by_name[args.client], spec["ports"], spec["sizes"], spec["trial_bytes"])
        os._exit(0)

    sizes = [int(s) for s in args.sizes.split(",")]
    configs = [by_name[n] for n in args.configs.split(",")] if args.configs else list(CONFIGS)
    if "baseline" not in {c.name for c in configs}:
        configs.insert(0, by_name["baseline"])  # the reference of every ratio
    trial_bytes = int(args.trial_mib * MiB)
    command = "python -m bench.ucx_options" + (" " + " ".join(sys.argv[1:]) if sys.argv[1:] else "")
    started = time.monotonic()
    load_start = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    cells: dict[tuple[str, str, int], Cell] = {}
    idles: list[float] = []
    for r in range(args.rounds):
        order = configs[r % len(configs) :] + configs[: r % len(configs)]
        for config in order:
            idles.append(wait_idle(IDLE_THRESHOLD))
            results, err = run_config(config, sizes, trial_bytes)
            for res in results:
                cell = cells.setdefault((config.name, res["row"], res["size"]), Cell())
                if "error" in res:
                    cell.errors.append(res["error"])
                else:
                    cell.runs.append(res["gbps"])
                    cell.lat_s.extend(res["lat_s"])
            if err:
                for name in config.rows:
                    for s in sizes:
                        cells.setdefault((config.name, name, s), Cell()).errors.append(err)
            done = [f"{res['row']}@{size_label(res['size'])}" for res in results if "error" in res]
            print(
                f"round {r + 1} {config.name}: {len(results)} results{' ERR ' + err if err else ''}"
                f"{' failed: ' + ', '.join(done) if done else ''}",
                flush=True,
            )
    result: dict[str, Any] = {
        "bench": "ucx_options",
        "date": time.strftime("%Y-%m-%d"),
        "command": command,
        "machine": machine(),
        "versions": versions(),
        "sizes": sizes,
        "rounds": args.rounds,
        "trial_bytes": trial_bytes,
        "load_start": load_start,
        "load_end": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
        "idle_median": statistics.median(idles) if idles else 1.0,
        "configs": [
            {
                "name": c.name,
                "env": {k: v for k, v in config_env(c).items() if k.startswith(("UCX", "UCXPY"))},
                "rows": list(c.rows),
            }
            for c in configs
        ],
        "rows": {name: {"what": r.what, "op": r.op, "batch": r.batch} for name, r in ROWS.items()},
        "cells": [
            {"config": c, "row": name, "size": s, **cell.summary()} for (c, name, s), cell in cells.items()
        ],
        "elapsed_s": round(time.monotonic() - started, 1),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ucx_options.json").write_text(json.dumps(result, indent=2) + "\n")
    md = markdown(result)
    (out / "ucx_options.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
