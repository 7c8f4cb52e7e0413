"""The router's HTTP connections before authentication (`kvfabric.router.http_server`): a
connection that never sends a whole request head in time is closed, however slowly it sends; a
request head past `HEAD_BYTES_MAX` is refused; requests sent in time are served, kept
connections included (review, stop 66: silent sockets took every connection place for good, and
request heads of any size were read)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route

from kvfabric.router.http_server import HEAD_BYTES_MAX, BoundedH11Protocol

DEADLINE_S = 0.5


class _Quick(BoundedH11Protocol):
    head_deadline_s = DEADLINE_S
    write_stall_s = DEADLINE_S


async def _ok(request: Request) -> PlainTextResponse:
    return PlainTextResponse("ok")


async def _refused(request: Request) -> PlainTextResponse:  # answered before its body is read
    return PlainTextResponse("no", status_code=401)


async def _big(request: Request) -> StreamingResponse:  # more than a socket buffers
    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(4096):
            yield b"x" * 65536

    return StreamingResponse(chunks())


async def _closed_within(sock: socket.socket, seconds: float, trickle: bytes = b"") -> float | None:
    """When the server closed `sock` (seconds from now), sending `trickle` every 0.1 s; None if
    it was still open after `seconds`."""
    loop = asyncio.get_running_loop()
    sock.setblocking(False)
    began = time.monotonic()
    while time.monotonic() - began < seconds:
        if trickle:
            try:
                sock.send(trickle)
            except OSError:
                return time.monotonic() - began
        try:
            data = await asyncio.wait_for(loop.sock_recv(sock, 65536), 0.1)
        except TimeoutError:
            continue
        except OSError:
            return time.monotonic() - began
        if not data:
            return time.monotonic() - began
    return None


def test_request_heads_are_bounded_in_time_and_bytes() -> None:
    async def main() -> None:
        app = Starlette(
            routes=[Route("/", _ok), Route("/refused", _refused, methods=["POST"]), Route("/big", _big)]
        )
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        port = sock.getsockname()[1]
        config = uvicorn.Config(
            app,
            log_level="critical",
            lifespan="off",
            http=_Quick,
            h11_max_incomplete_event_size=HEAD_BYTES_MAX,
        )
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        for _ in range(1000):  # up within 10 s
            if server.started:
                break
            await asyncio.sleep(0.01)
        try:
            silent = socket.create_connection(("127.0.0.1", port))
            closed = await _closed_within(silent, 5 * DEADLINE_S)
            assert closed is not None and closed < 4 * DEADLINE_S
            slow = socket.create_connection(("127.0.0.1", port))
            slow.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
            closed = await _closed_within(slow, 5 * DEADLINE_S, trickle=b"X")  # a byte every 0.1 s
            assert closed is not None and closed < 4 * DEADLINE_S
            big = socket.create_connection(("127.0.0.1", port))
            big.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * (HEAD_BYTES_MAX + 1024))
            big.setblocking(False)
            answer = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(big, 65536), 5)
            assert answer.startswith(b"HTTP/1.1 400")
            kept = socket.create_connection(("127.0.0.1", port))
            for _ in range(3):  # one kept connection, a request each half deadline: all served
                kept.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                kept.setblocking(False)
                answer = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(kept, 65536), 5)
                assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"ok")
                await asyncio.sleep(DEADLINE_S / 2)
            trickler = socket.create_connection(("127.0.0.1", port))  # its body after a 401
            trickler.sendall(b"POST /refused HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
            closed = await _closed_within(trickler, 8 * DEADLINE_S, trickle=b"1\r\nX\r\n")  # a valid chunk
            assert closed is not None
            reader = socket.socket()  # asks for a big answer, reads none of it
            reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            reader.connect(("127.0.0.1", port))
            reader.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
            for _ in range(100):  # aborted once its writes stalled past write_stall_s
                await asyncio.sleep(0.05)
                if not server.server_state.connections:
                    break
            assert not server.server_state.connections
            for s in (silent, slow, big, kept, trickler, reader):
                s.close()
        finally:
            server.should_exit = True
            await asyncio.wait_for(task, 10)

    asyncio.run(main())
