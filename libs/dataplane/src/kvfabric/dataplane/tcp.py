"""The plain TCP data-plane transport: a threaded server over a `SegmentBackend` and a blocking client.

Bytes move without intermediate copies: the server `recv_into`s a PUT's payload straight into the
arena slot the backend handed out, and sends a GET's objects straight from arena views with
`sendmsg`; the client sends from the caller's buffer and `recv_into`s the caller's destination
buffers. A GET whose client asks `verdicts_after` may get objects still being read (a disk
replica, `begin_get_streamed`): each piece is sent as it lands and a second `GetReply` with the
final results follows the payload; the client takes those. Threads, not asyncio: large
`recv_into`/`sendmsg` calls release the GIL, and a thread per connection (at most
`connections_max`) is the cheapest way to keep both cores busy.

Failure rules:
- A connection that drops mid-PUT aborts the slot (nothing visible, nothing leaked); any drop
  releases every reference the connection held (`backend.close_connection`).
- An error on a PUT (bad ticket, no capacity, checksum mismatch) is answered with an ERROR frame
  after the payload has been read and dropped (so the stream stays in step); the connection stays
  usable. A payload size outside 0..`OBJECT_BYTES_MAX` is not read: error, then the connection
  closes.
- An error on other ops is answered with an ERROR frame and the connection stays usable.

Before authentication (`kvfabric.dataplane.admission`, given an `authenticate` function, as the
segment does): the first request must carry a valid credential (a PUT's ticket, a GET's or
PIN_LOCAL's read tokens, a MAP's `reads`/`ticket`) within the auth deadline of the accept; a
request without one is answered `unauthorized` and the connection closed, before the backend
sees it. Every deadline is absolute: a watchdog thread shuts down a connection past it.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Final

import msgspec

from kvfabric.dataplane.addresses import pick_stream, split_host_port
from kvfabric.dataplane.admission import (
    CONNECTIONS_MAX_DEFAULT,
    UNAUTHENTICATED_META_BYTES_MAX,
    Authenticator,
    ConnectionGate,
    ConnectionLimits,
)
from kvfabric.dataplane.backend import GetGrant, PutSlot, SegmentBackend
from kvfabric.dataplane.frames import HEADER, OBJECT_BYTES_MAX, READS_MAX, Op, pack_header, unpack_header
from kvfabric.dataplane.scatter import ScatterDest, scatter_dests
from kvfabric.dataplane.staging import StagingFiles
from kvfabric.format.checksum import StreamingChecksum
from kvfabric.format.errors import BadRequest, Busy, Indeterminate, KvfError, Unauthorized, Unavailable
from kvfabric.proto.codec import FamilyDecoder, encode
from kvfabric.proto.common import ErrorReply, error_from_reply, error_reply_from
from kvfabric.proto.dataplane import (
    GetReply,
    GetRequest,
    LocalGrants,
    MapReply,
    MapRequest,
    ObjectResult,
    PutReply,
    PutRequest,
    ReadRef,
    StagedBytes,
    UnpinLocal,
    UnpinReply,
    dataplane_decoder,
)
from kvfabric.proto.directory import WriteTicket
from kvfabric.proto.segment import SSD_SLOT_BASE

__all__ = [
    "CONNECTIONS_MAX_DEFAULT",
    "Destination",
    "TcpDataClient",
    "TcpDataServer",
    "shutdown_fd",
    "tune_socket",
    "verified",
]

Destination = memoryview | bytearray | ScatterDest
"""Where one read's bytes go: a writable buffer of exactly its size, or a `ScatterDest`."""

# Receive + hash granularity: small enough that a piece is still in L2/L3 when hashed.
HASH_CHUNK_BYTES: Final = 1 << 20
# How often the watchdog checks deadlines: a connection outlives its deadline by at most this.
WATCHDOG_TICK_S: Final = 0.05
SOCKET_BUFFER_BYTES: Final = 4 << 20
IOV_MAX: Final = 512  # buffers per sendmsg call (Linux IOV_MAX is 1024)
# A view still filling (a disk read in flight) is sent in pieces of this size as they land.
STREAM_SEND_BYTES: Final = 256 << 10
_error_decoder: FamilyDecoder[ErrorReply] = FamilyDecoder(ErrorReply, "dataplane error")


class _Closed(Exception):
    """The peer closed the connection."""


class _PutRefused(Exception):
    """The backend refused a PUT before its payload was read."""

    def __init__(self, error: KvfError, payload_bytes: int) -> None:
        super().__init__(error.message)
        self.error = error
        self.payload_bytes = payload_bytes


def tune_socket(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got, size = 0, len(view)
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise _Closed
        got += n


def _recv_hashed(sock: socket.socket, view: memoryview) -> bytes:
    """`_recv_exact`, hashing each piece right after it lands (still in cache). Returns the digest."""
    digest = StreamingChecksum()
    got, size = 0, len(view)
    while got < size:
        n = sock.recv_into(view[got : got + HASH_CHUNK_BYTES])
        if n == 0:
            raise _Closed
        digest.update(view[got : got + n])
        got += n
    return digest.digest()


def _discard(sock: socket.socket, size: int) -> None:
    scratch = memoryview(bytearray(min(size, 1 << 20)))
    while size:
        n = sock.recv_into(scratch[: min(size, len(scratch))])
        if n == 0:
            raise _Closed
        size -= n


def _recv_bytes(sock: socket.socket, size: int) -> bytes:
    buf = bytearray(size)
    _recv_exact(sock, memoryview(buf))
    return bytes(buf)


def _send_all(sock: socket.socket, buffers: Sequence[bytes | memoryview]) -> None:
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


def _frame(op: Op, request_id: int, meta: msgspec.Struct, payload_count: int = 0) -> list[bytes]:
    body = encode(meta)
    return [pack_header(op, request_id, len(body), payload_count), body]


# ---- server ----------------------------------------------------------------------------------


class _Close(Exception):
    """Answer `error` to the request, then close the connection."""

    def __init__(self, error: KvfError, request_id: int) -> None:
        super().__init__(error.message)
        self.error = error
        self.request_id = request_id


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


class TcpDataServer:
    """Serves a `SegmentBackend` over TCP. `start()` binds and returns; `stop()` closes everything.

    Before authentication (`kvfabric.dataplane.admission`): with an `authenticate` function, a
    connection must present a valid credential in its first request within the auth deadline, or
    it is closed; unauthenticated connections are bounded apart from authenticated ones (a flood
    of them evicts its own oldest, never a token holder's); nothing the backend keeps is created
    before the credential is accepted. Without one (tests, benchmarks), every connection counts as
    authenticated from its accept. Deadlines are absolute (a watchdog thread shuts down a
    connection that overruns its current one), so a trickle of bytes cannot extend them.
    """

    def __init__(
        self,
        backend: SegmentBackend,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        connections_max: int | None = None,
        idle_timeout_s: float | None = None,
        tls: ssl.SSLContext | None = None,
        limits: ConnectionLimits | None = None,
        authenticate: Authenticator | None = None,
        count: Callable[[str], None] | None = None,
    ) -> None:
        self.backend = backend
        # A server-side TLS context: every connection is wrapped (handshake on its own thread)
        # and the address is advertised as tls://, which clients then must use.
        self.tls = tls
        limits = limits or ConnectionLimits()
        if connections_max is not None:
            limits = replace(limits, connections_max=connections_max)
        if idle_timeout_s is not None:
            limits = replace(limits, idle_timeout_ms=max(1, round(idle_timeout_s * 1000)))
        self.authenticate = authenticate
        self._count_fn = count  # the segment's event counter (names prefixed `dataplane_tcp_`)
        self.counters: dict[str, int] = {}
        self.gate = ConnectionGate(limits, on_event=self._count)
        self._listener = socket.create_server(
            (host, port), backlog=limits.connections_max + limits.unauthenticated_max
        )
        self.host, self.port = self._listener.getsockname()[:2]
        self._conns: dict[int, socket.socket] = {}
        self._fds: dict[int, int] = {}  # connection -> its socket's fd, until the socket closes
        self._deadlines: dict[int, tuple[float, str]] = {}  # connection -> (monotonic s, reason)
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        self.rejected_busy = 0
        self._staging: StagingFiles | None = None  # staged puts (made on first use)

    @property
    def limits(self) -> ConnectionLimits:
        return self.gate.limits

    @property
    def connections_max(self) -> int:
        return self.gate.limits.connections_max

    @property
    def idle_timeout_s(self) -> float:
        return self.gate.limits.idle_timeout_ms / 1000

    @property
    def address(self) -> str:
        return f"{'tls' if self.tls is not None else 'tcp'}://{self.host}:{self.port}"

    def _count(self, name: str) -> None:
        self.counters[name] = self.counters.get(name, 0) + 1
        if self._count_fn is not None:
            self._count_fn(f"dataplane_tcp_{name}")

    def start(self) -> None:
        for target, name in ((self._accept_loop, "kvf-tcp-accept"), (self._watchdog, "kvf-tcp-watchdog")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            for fd in self._fds.values():
                shutdown_fd(fd)
        for thread in self._threads:
            thread.join(timeout=5.0)

    # ---- deadlines -----------------------------------------------------------------------------

    def _deadline(self, conn: int, budget_ms: int, reason: str) -> None:
        """From now, `conn` has `budget_ms` to finish what it does (whatever bytes arrive)."""
        with self._lock:
            if conn in self._deadlines:
                self._deadlines[conn] = (time.monotonic() + budget_ms / 1000, reason)

    def _no_deadline(self, conn: int) -> None:
        """The backend works for `conn` (a confirm waits on the directory, bounded there)."""
        with self._lock:
            if conn in self._deadlines:
                self._deadlines[conn] = (math.inf, "")

    def _expire_locked(self, conn: int) -> None:
        fd = self._fds.get(conn)
        if fd is not None:
            shutdown_fd(fd)
        if conn in self._deadlines:
            self._deadlines[conn] = (math.inf, "")

    def _watchdog(self) -> None:
        """Shut down every connection past its deadline, every `WATCHDOG_TICK_S`."""
        while not self._stopping.wait(WATCHDOG_TICK_S):
            now = time.monotonic()
            with self._lock:
                expired = [(c, reason) for c, (at, reason) in self._deadlines.items() if at <= now]
                for conn, reason in expired:
                    self._count(f"closed_{reason}_total")
                    self._expire_locked(conn)

    # ---- connections ---------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                sock, peer = self._listener.accept()
            except OSError:
                return
            source = str(peer[0]) if isinstance(peer, tuple) else str(peer)
            refusal: KvfError | None = None
            limits = self.gate.limits
            with self._lock:
                conn = next(self._ids)
                for victim in self.gate.open(conn, source):
                    self._expire_locked(victim)  # the oldest unauthenticated ones make room
                budget_ms, reason = limits.auth_deadline_ms, "auth_deadline"
                if self.authenticate is None:  # no credentials in this deployment: admitted as is
                    refusal = self.gate.authenticate(conn)
                    budget_ms, reason = limits.idle_timeout_ms, "idle_timeout"
                if refusal is None:
                    self._conns[conn] = sock
                    self._fds[conn] = sock.fileno()
                    self._deadlines[conn] = (time.monotonic() + budget_ms / 1000, reason)
                else:
                    self.gate.close(conn)
                    self.rejected_busy += 1
            if refusal is not None:
                with contextlib.suppress(OSError):
                    _send_all(sock, _frame(Op.ERROR, 0, error_reply_from(refusal)))
                sock.close()
                continue
            tune_socket(sock)
            sock.settimeout(self.idle_timeout_s)  # a backstop: the watchdog enforces the deadlines
            thread = threading.Thread(
                target=self._serve, args=(conn, sock), name=f"kvf-tcp-{conn}", daemon=True
            )
            thread.start()
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)

    def _admit(self, conn: int, request_id: int, meta: object) -> None:
        """The first request of an unauthenticated connection: its credential, then the bounds."""
        assert self.authenticate is not None
        if not self.authenticate(meta):
            with self._lock:
                self._count("unauthorized_total")
            raise _Close(
                Unauthorized("a data connection must first present a valid read token or write ticket"),
                request_id,
            )
        with self._lock:
            refusal = self.gate.authenticate(conn)
            if isinstance(refusal, Busy):
                self.rejected_busy += 1
        if refusal is not None:
            raise _Close(refusal, request_id)

    def _serve(self, conn: int, sock: socket.socket) -> None:
        if self.tls is not None:
            try:
                sock = self.tls.wrap_socket(sock, server_side=True)  # owns the fd from here
            except (OSError, ssl.SSLError):
                with self._lock:
                    self._conns.pop(conn, None)
                    self._fds.pop(conn, None)
                    self._deadlines.pop(conn, None)
                    self.gate.close(conn)
                sock.close()
                return
            with self._lock:
                self._conns[conn] = sock
        limits = self.gate.limits
        authenticated = self.authenticate is None
        header_buf = memoryview(bytearray(HEADER.size))
        try:
            while True:
                if authenticated:
                    self._deadline(conn, limits.idle_timeout_ms, "idle_timeout")
                got = sock.recv_into(header_buf)  # the first bytes of the next request
                if got == 0:
                    raise _Closed
                if authenticated:
                    self._deadline(conn, limits.frame_timeout_ms, "frame_timeout")
                _recv_exact(sock, header_buf[got:])
                header = unpack_header(header_buf)
                if not authenticated and header.meta_bytes > UNAUTHENTICATED_META_BYTES_MAX:
                    raise _Close(
                        BadRequest(
                            f"a first request's meta may be at most {UNAUTHENTICATED_META_BYTES_MAX} bytes"
                        ),
                        header.request_id,
                    )
                meta = dataplane_decoder.decode(_recv_bytes(sock, header.meta_bytes))
                if not authenticated:
                    self._admit(conn, header.request_id, meta)
                    authenticated = True
                try:
                    self._dispatch(conn, sock, header.op, header.request_id, meta)
                except _PutRefused as refused:
                    # A size we cannot skip (too large, or negative: the stream is out of step).
                    if not 0 <= refused.payload_bytes <= OBJECT_BYTES_MAX:
                        _send_all(sock, _frame(Op.ERROR, header.request_id, error_reply_from(refused.error)))
                        return
                    self._deadline(conn, limits.transfer_ms(refused.payload_bytes), "transfer_timeout")
                    _discard(sock, refused.payload_bytes)
                    _send_all(sock, _frame(Op.ERROR, header.request_id, error_reply_from(refused.error)))
                except KvfError as err:
                    _send_all(sock, _frame(Op.ERROR, header.request_id, error_reply_from(err)))
        except (_Closed, OSError):
            return
        except _Close as close:
            with contextlib.suppress(OSError):
                _send_all(sock, _frame(Op.ERROR, close.request_id, error_reply_from(close.error)))
        except KvfError as err:  # malformed framing: answer once, then drop the connection
            with contextlib.suppress(OSError):
                _send_all(sock, _frame(Op.ERROR, 0, error_reply_from(err)))
        finally:
            self.backend.close_connection(conn)
            if self._staging is not None:
                self._staging.close(conn)
            with self._lock:
                self._conns.pop(conn, None)
                self._fds.pop(conn, None)
                self._deadlines.pop(conn, None)
                self.gate.close(conn)
            sock.close()

    def _staging_files(self) -> StagingFiles | None:
        """Staged puts come from staging files beside the arena (a backend that maps no arena
        takes none)."""
        if self._staging is None and hasattr(self.backend, "map_info"):
            self._staging = StagingFiles(os.path.dirname(self.backend.map_info().arena_path))
        return self._staging

    def _put_staged(self, conn: int, sock: socket.socket, request_id: int, meta: PutRequest) -> None:
        """A PUT whose bytes are in the writer's staging file (`kvfabric.dataplane.staging`): the
        same ticket check, slot and verification as a sent one (`finish_put` hashes the slot)."""
        files = self._staging_files()
        if files is None or meta.staged is None:
            raise BadRequest("this segment takes no staged puts", staging=True)
        put = self.backend.begin_put(meta.ticket, conn)
        put.trace_id = meta.trace_id
        put.save_writes = meta.save_writes
        put.receipt_wanted = meta.receipt
        try:
            put.checksum = files.read_into(conn, meta.staged, put.view)  # of the slot's bytes
        except BaseException:
            self.backend.abort_put(put, conn)
            raise
        self._no_deadline(conn)  # the confirm to the directory, as for a sent PUT
        slot, generation = self.backend.finish_put(put, conn)
        self._deadline(conn, self.gate.limits.frame_timeout_ms, "frame_timeout")
        reply = PutReply(
            slot=slot, slot_generation=generation, confirmed=not put.receipt, receipt=put.receipt
        )
        _send_all(sock, _frame(Op.REPLY, request_id, reply))

    def _dispatch(self, conn: int, sock: socket.socket, op: Op, request_id: int, meta: object) -> None:
        limits = self.gate.limits
        if op is Op.PUT and isinstance(meta, PutRequest) and meta.staged is not None:
            self._put_staged(conn, sock, request_id, meta)
        elif op is Op.PUT and isinstance(meta, PutRequest):
            try:
                put = self.backend.begin_put(meta.ticket, conn)
            except KvfError as err:
                raise _PutRefused(err, meta.ticket.size_bytes) from err
            put.trace_id = meta.trace_id
            put.save_writes = meta.save_writes
            put.receipt_wanted = meta.receipt
            self._deadline(conn, limits.transfer_ms(len(put.view)), "transfer_timeout")
            self._receive_put(conn, sock, put)
            self._no_deadline(conn)
            slot, generation = self.backend.finish_put(put, conn)
            self._deadline(conn, limits.frame_timeout_ms, "frame_timeout")
            put_reply = PutReply(
                slot=slot, slot_generation=generation, confirmed=not put.receipt, receipt=put.receipt
            )
            _send_all(sock, _frame(Op.REPLY, request_id, put_reply))
        elif op is Op.GET and isinstance(meta, GetRequest):
            if len(meta.reads) > READS_MAX:
                raise BadRequest(f"{len(meta.reads)} reads exceed {READS_MAX}")
            streamed = getattr(self.backend, "begin_get_streamed", None) if meta.verdicts_after else None
            grant = (streamed or self.backend.begin_get)(meta.reads, conn)
            try:
                results = [ObjectResult(s, c) for s, c in zip(grant.statuses, grant.checksums, strict=True)]
                views = [v for v in grant.views if v is not None]
                self._deadline(conn, limits.transfer_ms(sum(len(v) for v in views)), "transfer_timeout")
                if grant.filling is None or grant.verdicts is None:
                    _send_all(
                        sock, [*_frame(Op.REPLY, request_id, GetReply(results=results), len(views)), *views]
                    )
                else:  # views still filling: each piece sent as it lands, the verdicts after the bytes
                    reply = GetReply(results=results, verdicts_after=True)
                    self._send_streamed(
                        sock, request_id, grant, _frame(Op.REPLY, request_id, reply, len(views))
                    )
            finally:
                self.backend.end_get(grant, conn)
        elif op is Op.MAP and isinstance(meta, MapRequest):
            info = self.backend.map_info()
            if self._staging_files() is not None:
                info = msgspec.structs.replace(info, staged_puts=True)
            _send_all(sock, _frame(Op.REPLY, request_id, info))
        elif op is Op.PIN_LOCAL and isinstance(meta, GetRequest):
            if len(meta.reads) > READS_MAX:
                raise BadRequest(f"{len(meta.reads)} reads exceed {READS_MAX}")
            _send_all(sock, _frame(Op.REPLY, request_id, self.backend.pin_local(meta.reads, conn)))
        elif op is Op.UNPIN_LOCAL and isinstance(meta, UnpinLocal):
            released = self.backend.unpin_local(meta.grant_id, conn)
            _send_all(sock, _frame(Op.REPLY, request_id, UnpinReply(released=released)))
        else:
            raise BadRequest(f"op {op.name} does not take {type(meta).__name__}")

    @staticmethod
    def _send_streamed(sock: socket.socket, request_id: int, grant: GetGrant, head: list[bytes]) -> None:
        """A streamed GET's reply: `head` (the reply frame) with the first bytes, then what is in
        place of each filling view as it lands (at least `STREAM_SEND_BYTES` a time, or its end),
        and the verdicts frame with the last bytes: an object read whole by then goes in one send
        with both frames, as a read-then-send reply does."""
        assert grant.filling is not None and grant.verdicts is not None
        items = [(v, f) for v, f in zip(grant.views, grant.filling, strict=True) if v is not None]
        out: list[bytes | memoryview] = list(head)
        for n, (view, fill) in enumerate(items):
            sent = 0
            while True:
                ready = len(view) if fill is None else fill(min(sent + STREAM_SEND_BYTES, len(view)))
                out.append(view[sent:ready])
                sent = ready
                if sent >= len(view) and n == len(items) - 1:
                    break  # the last bytes go with the verdicts
                _send_all(sock, out)
                out = []
                if sent >= len(view):
                    break
        out += _frame(Op.REPLY, request_id, GetReply(results=grant.verdicts()))
        _send_all(sock, out)

    def _receive_put(self, conn: int, sock: socket.socket, put: PutSlot) -> None:
        try:
            put.checksum = _recv_hashed(sock, put.view)
        except BaseException:
            self.backend.abort_put(put, conn)  # nothing visible, the slot goes back
            raise


# ---- client ----------------------------------------------------------------------------------


class TcpDataClient:
    """One blocking connection to a segment's data port. One request at a time (a lock)."""

    def __init__(
        self, host: str, port: int, *, timeout_s: float = 30.0, tls: ssl.SSLContext | None = None
    ) -> None:
        self._sock = socket.create_connection((host, port), timeout=timeout_s)
        tune_socket(self._sock)
        if tls is not None:
            try:
                self._sock = tls.wrap_socket(self._sock, server_hostname=host)
            except BaseException:
                self._sock.close()
                raise
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._header = memoryview(bytearray(HEADER.size))
        self._unacked: int | None = None  # request id of a pipelined UNPIN_LOCAL not yet answered
        self._request_id = 0  # of the last `_call` (a GET's verdicts after its bytes carry it too)

    @classmethod
    def connect(
        cls, data_addr: str, *, timeout_s: float = 30.0, tls: ssl.SSLContext | None = None
    ) -> TcpDataClient:
        """Connect to the stream transport of a segment's data address: `tls://host:port` (then
        `tls`, a context that verifies the segment, is required) or `tcp://host:port`."""
        url = pick_stream(data_addr)
        if url.startswith("tls://") and tls is None:
            raise BadRequest("the segment serves TLS only: configure a data-plane CA", data_addr=data_addr)
        host, port = split_host_port(url)
        return cls(host, port, timeout_s=timeout_s, tls=tls if url.startswith("tls://") else None)

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> TcpDataClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _reply(self, request_id: int) -> tuple[object, int]:
        try:
            _recv_exact(self._sock, self._header)
        except _Closed:
            raise Unavailable("segment closed the data connection") from None
        header = unpack_header(self._header)
        body = _recv_bytes(self._sock, header.meta_bytes)
        if header.op is Op.ERROR:
            raise error_from_reply(_error_decoder.decode(body))
        if header.request_id != request_id:
            raise Indeterminate(f"reply for request {header.request_id}, expected {request_id}")
        return dataplane_decoder.decode(body), header.payload_count

    def _call(
        self, op: Op, meta: msgspec.Struct, payload: Sequence[bytes | memoryview] = ()
    ) -> tuple[object, int]:
        self._drain_unacked()
        request_id = self._request_id = next(self._ids)
        try:
            _send_all(self._sock, [*_frame(op, request_id, meta, len(payload)), *payload])
        except OSError as exc:
            # The segment may have refused and closed: its error frame can still be waiting.
            try:
                self._reply(request_id)
            except KvfError:
                raise
            except (OSError, _Closed):
                pass
            raise Indeterminate(f"data connection failed during {op.name}: {exc!r}") from exc
        try:
            return self._reply(request_id)
        except (OSError, _Closed) as exc:
            raise Indeterminate(f"data connection failed during {op.name}: {exc!r}") from exc

    def put(
        self,
        ticket: WriteTicket,
        data: bytes | bytearray | memoryview,
        *,
        trace_id: str = "",
        save_writes: int = 0,
        staged: StagedBytes | None = None,
        receipt: bool = False,
    ) -> PutReply:
        """Send one object's bytes under a signed ticket. On success the replica is confirmed, or
        with `receipt` (and a segment that signs them) the reply carries the segment's write
        receipt for put_commit (`PutReply.receipt`; `confirmed` False: it confirms later).
        `save_writes`: the writes of the same save to this segment and shard (`PutRequest`).
        `staged`: the bytes are in the writer's staging file, not sent (`data` is not read; only
        to a segment whose MapReply says `staged_puts`)."""
        view = memoryview(data).cast("B")
        if staged is None and len(view) != ticket.size_bytes:
            raise BadRequest(f"buffer is {len(view)} bytes, ticket says {ticket.size_bytes}")
        with self._lock:
            meta = PutRequest(
                ticket=ticket, trace_id=trace_id, save_writes=save_writes, staged=staged, receipt=receipt
            )
            reply, _ = self._call(Op.PUT, meta, [view] if staged is None else [])
        if not isinstance(reply, PutReply):
            raise Indeterminate(f"unexpected reply {type(reply).__name__} to PUT")
        return reply

    def put_many(
        self,
        writes: Sequence[tuple[WriteTicket, bytes | bytearray | memoryview, str, int]],
        *,
        receipt: bool = False,
        staged: Sequence[StagedBytes] | None = None,
    ) -> list[PutReply | KvfError]:
        """Several PUTs pipelined on this connection: every request is sent, then the replies are
        read in order (a segment serves a connection's requests one after another), so N writes
        wait one round trip, not N. Per write, its reply or the segment's refusal (one write
        refused never stops the others). Raises `Indeterminate` when the connection failed (the
        caller drops it; a write that landed unanswered is settled by its ticket's deadline).
        `writes`: (ticket, bytes, trace id, save_writes) each, as `put` takes them; `staged`:
        where each write's bytes are in the writer's staging file (then none is sent)."""
        views = [memoryview(data).cast("B") for _, data, _, _ in writes]
        if staged is not None and len(staged) != len(writes):
            raise BadRequest("one staged reference per write")
        for (ticket, *_), view in zip(writes, views, strict=True):
            if staged is None and len(view) != ticket.size_bytes:
                raise BadRequest(f"buffer is {len(view)} bytes, ticket says {ticket.size_bytes}")
        with self._lock:
            self._drain_unacked()
            sent: list[int] = []
            failed: OSError | None = None
            for n, ((ticket, _, trace_id, save_writes), view) in enumerate(zip(writes, views, strict=True)):
                request_id = self._request_id = next(self._ids)
                where = None if staged is None else staged[n]
                meta = PutRequest(
                    ticket=ticket, trace_id=trace_id, save_writes=save_writes, receipt=receipt, staged=where
                )
                try:
                    frame = _frame(Op.PUT, request_id, meta, 1 if where is None else 0)
                    _send_all(self._sock, [*frame, view] if where is None else frame)
                except OSError as exc:  # refused and closed? its answers may still be waiting
                    failed = exc
                    break
                sent.append(request_id)
            replies: list[PutReply | KvfError] = []
            try:
                for request_id in sent:
                    _recv_exact(self._sock, self._header)
                    header = unpack_header(self._header)
                    body = _recv_bytes(self._sock, header.meta_bytes)
                    if header.request_id != request_id:
                        raise Indeterminate(f"reply for request {header.request_id}, expected {request_id}")
                    if header.op is Op.ERROR:
                        replies.append(error_from_reply(_error_decoder.decode(body)))
                        continue
                    reply = dataplane_decoder.decode(body)
                    if not isinstance(reply, PutReply):
                        raise Indeterminate(f"unexpected reply {type(reply).__name__} to PUT")
                    replies.append(reply)
            except (OSError, _Closed) as exc:
                raise Indeterminate(f"data connection failed during pipelined PUTs: {exc!r}") from exc
            if failed is not None:
                raise Indeterminate(f"data connection failed during pipelined PUTs: {failed!r}") from failed
        return replies

    def get(self, reads: list[ReadRef], dests: Sequence[Destination]) -> list[ObjectResult]:
        """Read objects straight into `dests` (one writable buffer of exactly `size_bytes` per read).

        Only destinations whose result is `ok` are written; the caller must verify checksums
        (or use `get_hashed`/`get_verified`, which hash while receiving).
        """
        return self._get(reads, dests, None)

    def get_hashed(
        self, reads: list[ReadRef], dests: Sequence[Destination], *, streamed: bool = True
    ) -> list[tuple[ObjectResult, bytes]]:
        """`get`, each object hashed piece by piece as it lands (still in cache, no second pass):
        per read, its result and the checksum of the bytes now in its destination (b"" when the
        result is not `ok`). The caller compares it with the checksum it trusts.

        A destination may be a `ScatterDest` with a `WriteGate`: the payload is then written
        under the gate and `GateClosed` ends the call (and this connection's use) once its owner
        closed it. `streamed=False`: disk replicas are read whole before they are sent (no
        verdicts after the bytes; benchmarks compare the two)."""
        digests: list[bytes] = []
        results = self._get(reads, dests, digests, streamed)
        return list(zip(results, digests, strict=True))

    def get_verified(self, reads: list[ReadRef], dests: Sequence[Destination]) -> list[bool]:
        """Per read, True only when it was read and its bytes match the stored checksum. A False
        destination must not be used."""
        return verified(self.get_hashed(reads, dests))

    def _get(
        self,
        reads: list[ReadRef],
        dests: Sequence[Destination],
        digests: list[bytes] | None,
        streamed: bool = True,
    ) -> list[ObjectResult]:
        targets = scatter_dests(dests, [ref.size_bytes for ref in reads])
        # A disk replica may come as it is read, its verdict after its bytes (GetRequest).
        streamable = streamed and any(ref.slot >= SSD_SLOT_BASE for ref in reads)
        with self._lock:
            reply, payload_count = self._call(Op.GET, GetRequest(reads=reads, verdicts_after=streamable))
            if not isinstance(reply, GetReply) or len(reply.results) != len(reads):
                raise Indeterminate("malformed GET reply")
            ok = [t for r, t in zip(reply.results, targets, strict=True) if r.status == "ok"]
            if len(ok) != payload_count:
                raise Indeterminate("GET reply payload count does not match its results")
            try:
                for result, target in zip(reply.results, targets, strict=True):
                    if result.status != "ok":
                        if digests is not None:
                            digests.append(b"")
                        continue
                    digest = target.recv_from(self._sock, hashed=digests is not None)
                    if digests is not None:
                        digests.append(digest)
                if reply.verdicts_after:
                    final, _ = self._reply(self._request_id)
                    if not isinstance(final, GetReply) or len(final.results) != len(reads):
                        raise Indeterminate("malformed GET verdicts")
                    # A verdict after the bytes may only take an ok back, never give one: an
                    # object whose header said not ok sent no bytes, whatever the verdict says.
                    results = [
                        f if first.status == "ok" else first
                        for first, f in zip(reply.results, final.results, strict=True)
                    ]
                    if digests is not None:  # bytes whose verdict is not ok are nobody's
                        digests[:] = [
                            d if r.status == "ok" else b"" for r, d in zip(results, digests, strict=True)
                        ]
                    return results
            except (OSError, _Closed) as exc:
                raise Indeterminate(f"data connection failed during GET payload: {exc!r}") from exc
        return reply.results

    def map_info(self, *, reads: Sequence[ReadRef] = (), ticket: WriteTicket | None = None) -> MapReply:
        """The segment's arena and slot board. On a connection that has not made a request yet,
        a credential must come with it (`reads` with their tokens, or a write ticket for this
        segment): the segment hands its arena path only to token holders."""
        with self._lock:
            reply, _ = self._call(Op.MAP, MapRequest(reads=list(reads), ticket=ticket))
        if not isinstance(reply, MapReply):
            raise Indeterminate("malformed MAP reply")
        return reply

    def pin_local(self, reads: list[ReadRef]) -> LocalGrants:
        with self._lock:
            reply, _ = self._call(Op.PIN_LOCAL, GetRequest(reads=reads))
        if not isinstance(reply, LocalGrants):
            raise Indeterminate("malformed PIN_LOCAL reply")
        return reply

    def unpin_local(self, grant_id: int) -> int:
        with self._lock:
            reply, _ = self._call(Op.UNPIN_LOCAL, UnpinLocal(grant_id=grant_id))
        if not isinstance(reply, UnpinReply):
            raise Indeterminate("malformed UNPIN_LOCAL reply")
        return reply.released

    def unpin_local_nowait(self, grant_id: int) -> None:
        """Send UNPIN_LOCAL without waiting for its reply (one round trip less per local read).
        The segment drops the pins as soon as the frame arrives; the reply is read before the
        next request on this connection. An error reply there is not the next request's and is
        dropped (an unknown grant has nothing to release; a connection's pins also go when it
        closes)."""
        with self._lock:
            self._drain_unacked()
            request_id = next(self._ids)
            try:
                _send_all(self._sock, _frame(Op.UNPIN_LOCAL, request_id, UnpinLocal(grant_id=grant_id)))
            except OSError as exc:
                raise Indeterminate(f"data connection failed during UNPIN_LOCAL: {exc!r}") from exc
            self._unacked = request_id

    def _drain_unacked(self) -> None:
        """Read the reply of a pipelined UNPIN_LOCAL (caller holds the lock)."""
        request_id, self._unacked = self._unacked, None
        if request_id is None:
            return
        try:
            reply, _ = self._reply(request_id)
        except KvfError:
            return
        except (OSError, _Closed) as exc:
            raise Indeterminate(f"data connection failed reading an UNPIN_LOCAL reply: {exc!r}") from exc
        if not isinstance(reply, UnpinReply):
            raise Indeterminate("malformed UNPIN_LOCAL reply")


def verified(hashed: Sequence[tuple[ObjectResult, bytes]]) -> list[bool]:
    """Per read of a `get_hashed`: True when it was read and the bytes that landed match the
    segment's stored checksum."""
    return [r.status == "ok" and digest == r.checksum for r, digest in hashed]
