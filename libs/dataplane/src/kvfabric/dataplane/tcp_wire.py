"""The TCP data plane's socket framing, shared by `tcp_server` and `tcp_client`: frames out, exact
and hashed receives into caller buffers, vectored sends, socket tuning and shutdown by descriptor."""

from __future__ import annotations

import socket
import ssl
from collections.abc import Sequence
from typing import Final

import msgspec

from kvfabric.dataplane.frames import Op, pack_header
from kvfabric.dataplane.scatter import ScatterDest
from kvfabric.format.checksum import StreamingChecksum
from kvfabric.proto.codec import encode

Destination = memoryview | bytearray | ScatterDest
"""Where one read's bytes go: a writable buffer of exactly its size, or a `ScatterDest`."""

# Receive + hash granularity: small enough that a piece is still in L2/L3 when hashed.
HASH_CHUNK_BYTES: Final = 1 << 20
SOCKET_BUFFER_BYTES: Final = 4 << 20
IOV_MAX: Final = 512  # buffers per sendmsg call (Linux IOV_MAX is 1024)


class PeerClosed(Exception):
    """The peer closed the connection."""


def tune_socket(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    got, size = 0, len(view)
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise PeerClosed
        got += n


def recv_hashed(sock: socket.socket, view: memoryview) -> bytes:
    """`recv_exact`, hashing each piece right after it lands (still in cache). Returns the digest."""
    digest = StreamingChecksum()
    got, size = 0, len(view)
    while got < size:
        n = sock.recv_into(view[got : got + HASH_CHUNK_BYTES])
        if n == 0:
            raise PeerClosed
        digest.update(view[got : got + n])
        got += n
    return digest.digest()


def recv_discard(sock: socket.socket, size: int) -> None:
    scratch = memoryview(bytearray(min(size, 1 << 20)))
    while size:
        n = sock.recv_into(scratch[: min(size, len(scratch))])
        if n == 0:
            raise PeerClosed
        size -= n


def recv_bytes(sock: socket.socket, size: int) -> bytes:
    buf = bytearray(size)
    recv_exact(sock, memoryview(buf))
    return bytes(buf)


def send_all(sock: socket.socket, buffers: Sequence[bytes | memoryview]) -> None:
    """sendmsg every buffer completely, IOV_MAX at a time, resuming after partial sends
    (TLS sockets have no sendmsg: one sendall per buffer, encrypted from the caller's memory)."""
    pending = [memoryview(b).cast("B") for b in buffers if len(b)]
    if isinstance(sock, ssl.SSLSocket):
        for view in pending:
            sock.sendall(view)
        return
    while pending:
        sent = sock.sendmsg(pending[:IOV_MAX])
        while sent:
            head = pending[0]
            if sent >= len(head):
                sent -= len(head)
                pending.pop(0)
            else:
                pending[0] = head[sent:]
                sent = 0


def encode_frame(op: Op, request_id: int, meta: msgspec.Struct, payload_count: int = 0) -> list[bytes]:
    body = encode(meta)
    return [pack_header(op, request_id, len(body), payload_count), body]


def shutdown_fd(fd: int) -> None:
    """Shut a connection down by its descriptor (a TLS socket shares its raw socket's fd): a
    thread blocked in recv/send on it returns at once. Never closes the descriptor (its owner
    does); the caller makes sure the fd is still that connection's (here: the server lock, as a
    connection's entry is dropped under it before its socket closes; the client's attempt
    watchdog: armed until its owner disarms)."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.detach()
