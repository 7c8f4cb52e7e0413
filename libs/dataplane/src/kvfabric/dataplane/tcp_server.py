"""The TCP data plane's server: a thread per connection over a `SegmentBackend`, with admission,
absolute deadlines (a watchdog thread) and streamed GETs; the rules are in `kvfabric.dataplane.tcp`."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Final

import msgspec

from kvfabric.dataplane.admission import (
    UNAUTHENTICATED_META_BYTES_MAX,
    Authenticator,
    ConnectionGate,
    ConnectionLimits,
    reads_credited,
)
from kvfabric.dataplane.backend import (
    GetGrant,
    PutSlot,
    SegmentBackend,
    check_claimed,
    claim_of,
    new_connection_id,
)
from kvfabric.dataplane.frames import GET_BYTES_MAX, HEADER, OBJECT_BYTES_MAX, READS_MAX, Op, unpack_header
from kvfabric.dataplane.staging import StagingFiles
from kvfabric.dataplane.tcp_wire import (
    PeerClosed,
    encode_frame,
    recv_bytes,
    recv_discard,
    recv_exact,
    recv_hashed,
    send_all,
    shutdown_fd,
    tune_socket,
)
from kvfabric.format.errors import BadRequest, BatchTooLarge, Busy, KvfError, Unauthorized
from kvfabric.proto.common import error_reply_from
from kvfabric.proto.dataplane import (
    GetReply,
    GetRequest,
    MapRequest,
    ObjectResult,
    PutRequest,
    UnpinLocal,
    UnpinReply,
    dataplane_decoder,
)

_log = logging.getLogger("kvfabric.dataplane.tcp")
ACCEPT_RETRY_S: Final = 0.05  # after a failed accept (out of fds, say): then the next

# How often the watchdog checks deadlines: a connection outlives its deadline by at most this.
WATCHDOG_TICK_S: Final = 0.05
# A view still filling (a disk read in flight) is sent as its pieces land, at least this many
# bytes a time (or its end): the smallest piece a segment cuts a streamed disk read into
# (`kvfabric.segment_storage.ssd_io.STREAM_PIECE_MIN_BYTES`), so each piece goes as it lands.
STREAM_SEND_BYTES: Final = 64 << 10


class _PutRefused(Exception):
    """The backend refused a PUT before its payload was read."""

    def __init__(self, error: KvfError, payload_bytes: int) -> None:
        super().__init__(error.message)
        self.error = error
        self.payload_bytes = payload_bytes


class _Close(Exception):
    """Answer `error` to the request, then close the connection."""

    def __init__(self, error: KvfError, request_id: int) -> None:
        super().__init__(error.message)
        self.error = error
        self.request_id = request_id


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
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        self.rejected_busy = 0
        self._staging: StagingFiles | None = None  # staged puts (made on first use)
        self._internal_logged_at = -math.inf  # `_log_internal`

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

    def _log_internal(self, exc: Exception) -> None:
        """A request that raised what no handler expects: its traceback, at most once a minute
        (a peer able to trigger it must not flood the log)."""
        now = time.monotonic()
        if now - self._internal_logged_at >= 60.0:
            self._internal_logged_at = now
            _log.error("dataplane_internal_error", exc_info=exc)

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

    def _idle_deadline(self, conn: int, at: float) -> bool:
        """`conn` waits for its next request until `at` (monotonic s): False, and the connection
        shut down (counted), when that is past already (the watchdog would not see it when the
        next request's bytes are already queued: its frame deadline replaced this one at once)."""
        with self._lock:
            if conn not in self._deadlines:
                return True
            if at <= time.monotonic():
                self._count("closed_idle_timeout_total")
                self._expire_locked(conn)
                return False
            self._deadlines[conn] = (at, "idle_timeout")
            return True

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
            except OSError as exc:
                if self._stopping.is_set():
                    return
                # Out of fds (EMFILE), buffers, or a network error on a pending connection: one
                # returned here and stopped the data plane for good while the segment went on
                # heartbeating (review, stop 68). Counted, logged at most once a minute, retried.
                with self._lock:
                    self._count("accept_errors_total")
                self._log_internal(exc)
                self._stopping.wait(ACCEPT_RETRY_S)
                continue
            source = str(peer[0]) if isinstance(peer, tuple) else str(peer)
            refusal: KvfError | None = None
            limits = self.gate.limits
            with self._lock:
                if self._stopping.is_set():  # accepted as `stop` began: it shut the others already
                    sock.close()
                    return
                conn = new_connection_id()
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
                    send_all(sock, encode_frame(Op.ERROR, 0, error_reply_from(refusal)))
                sock.close()
                continue
            try:
                tune_socket(sock)
                sock.settimeout(self.idle_timeout_s)  # a backstop: the watchdog enforces deadlines
                thread = threading.Thread(
                    target=self._serve, args=(conn, sock), name=f"kvf-tcp-{conn}", daemon=True
                )
                thread.start()
            except (OSError, RuntimeError) as exc:  # (no thread to be had): its place given back
                self._forget(conn)
                sock.close()
                with self._lock:
                    self._count("accept_errors_total")
                self._log_internal(exc)
                continue
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

    def _forget(self, conn: int) -> None:
        """A connection's entries dropped (its socket, fd, deadline, and its place at the gate)."""
        with self._lock:
            self._conns.pop(conn, None)
            self._fds.pop(conn, None)
            self._deadlines.pop(conn, None)
            self.gate.close(conn)

    def _serve(self, conn: int, sock: socket.socket) -> None:
        if self.tls is not None:
            try:
                # The handshake after the wrap: a failed handshake inside `wrap_socket` closed
                # the fd while it was still listed here, and a connection accepted meanwhile
                # under the same fd number could be shut down in its place (review, 2026-12-06).
                sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                sock.do_handshake()  # owns the fd from the wrap
            except (OSError, ssl.SSLError):
                self._forget(conn)
                sock.close()
                return
            with self._lock:
                self._conns[conn] = sock
        limits = self.gate.limits
        authenticated = self.authenticate is None
        header_buf = memoryview(bytearray(HEADER.size))
        request_id = 0
        renewed_at = time.monotonic()  # the end of the last request that renews the idle deadline
        try:
            while True:
                if authenticated and not self._idle_deadline(
                    conn, renewed_at + limits.idle_timeout_ms / 1000
                ):
                    return
                got = sock.recv_into(header_buf)  # the first bytes of the next request
                if got == 0:
                    raise PeerClosed
                if authenticated:
                    self._deadline(conn, limits.frame_timeout_ms, "frame_timeout")
                recv_exact(sock, header_buf[got:])
                header = unpack_header(header_buf)
                request_id = header.request_id  # (the request an unexpected failure answers)
                if not authenticated and header.meta_bytes > UNAUTHENTICATED_META_BYTES_MAX:
                    raise _Close(
                        BadRequest(
                            f"a first request's meta may be at most {UNAUTHENTICATED_META_BYTES_MAX} bytes"
                        ),
                        header.request_id,
                    )
                meta = dataplane_decoder.decode(recv_bytes(sock, header.meta_bytes))
                admitted = not authenticated
                if admitted:
                    self._admit(conn, header.request_id, meta)
                    authenticated = True
                    renewed_at = time.monotonic()  # (a credential accepted, whatever the answer)
                    # The rest of this request runs as any later one's does (the frame timeout),
                    # not within what is left of the auth deadline: a first GET's disk read or a
                    # staged PUT's file read was cut off at 1 s from the accept.
                    self._deadline(conn, limits.frame_timeout_ms, "frame_timeout")
                try:
                    if self._dispatch(conn, sock, header.op, header.request_id, meta, admitted):
                        renewed_at = time.monotonic()
                except _PutRefused as refused:
                    # A size we cannot skip (too large, or negative: the stream is out of step).
                    if not 0 <= refused.payload_bytes <= OBJECT_BYTES_MAX:
                        send_all(
                            sock, encode_frame(Op.ERROR, header.request_id, error_reply_from(refused.error))
                        )
                        return
                    self._deadline(conn, limits.transfer_ms(refused.payload_bytes), "transfer_timeout")
                    recv_discard(sock, refused.payload_bytes)
                    send_all(sock, encode_frame(Op.ERROR, header.request_id, error_reply_from(refused.error)))
                except KvfError as err:
                    send_all(sock, encode_frame(Op.ERROR, header.request_id, error_reply_from(err)))
        except (PeerClosed, OSError):
            return
        except _Close as close:
            with contextlib.suppress(OSError):
                send_all(sock, encode_frame(Op.ERROR, close.request_id, error_reply_from(close.error)))
        except KvfError as err:  # malformed framing: answer once, then drop the connection
            with contextlib.suppress(OSError):
                send_all(sock, encode_frame(Op.ERROR, 0, error_reply_from(err)))
        except Exception as exc:
            # A defect: answered `internal` (typed) for the request that raised it, counted,
            # logged at most once a minute; the connection closed.
            with self._lock:
                self._count("internal_errors_total")
            self._log_internal(exc)
            with contextlib.suppress(OSError):
                reply = error_reply_from(KvfError(f"internal error: {type(exc).__name__}"))
                send_all(sock, encode_frame(Op.ERROR, request_id, reply))
        finally:
            self.backend.close_connection(conn)
            if self._staging is not None:
                self._staging.close(conn)
            self._forget(conn)
            sock.close()

    def _staging_files(self) -> StagingFiles | None:
        """Staged puts come from staging files beside the arena (a backend that maps no arena
        takes none)."""
        if self._staging is None and hasattr(self.backend, "map_info"):
            with self._lock:  # two first staged puts at once: one set of files (review, 2026-12-05)
                if self._staging is None:
                    self._staging = StagingFiles(os.path.dirname(self.backend.map_info().arena_path))
        return self._staging

    def _put_staged(self, conn: int, sock: socket.socket, request_id: int, meta: PutRequest) -> None:
        """A PUT whose bytes are in the writer's staging file (`kvfabric.dataplane.staging`): the
        same ticket check, slot and verification as a sent one (`finish_put` hashes the slot)."""
        files = self._staging_files()
        if files is None or meta.staged is None:
            raise BadRequest("this segment takes no staged puts", staging=True)
        check_claimed(meta, staged=True)
        put = self.backend.begin_put(meta.ticket, conn, claim_of(meta))
        put.take_meta(meta)
        try:
            put.checksum = files.read_into(conn, meta.staged, put.view)  # of the slot's bytes
        except OSError as exc:  # (mmap, pread of the writer's file): a refusal it can act on
            self.backend.abort_put(put, conn)
            raise BadRequest(f"the staged bytes could not be read: {exc}", staging=True) from exc
        except BaseException:
            self.backend.abort_put(put, conn)
            raise
        self._no_deadline(conn)  # the confirm to the directory, as for a sent PUT
        self._finish_put(conn, sock, request_id, put)

    def _finish_put(self, conn: int, sock: socket.socket, request_id: int, put: PutSlot) -> None:
        """A PUT whose ticket `begin_put` took, its bytes in the slot: stored and answered, or its
        failure (a checksum mismatch, the directory's refusal) answered here: the ticket was
        accepted all the same (the request renews the idle deadline)."""
        try:
            slot, generation = self.backend.finish_put(put, conn)
        except KvfError as err:
            self._deadline(conn, self.gate.limits.frame_timeout_ms, "frame_timeout")
            send_all(sock, encode_frame(Op.ERROR, request_id, error_reply_from(err)))
            return
        self._deadline(conn, self.gate.limits.frame_timeout_ms, "frame_timeout")
        send_all(sock, encode_frame(Op.REPLY, request_id, put.reply(slot, generation)))

    def _dispatch(
        self, conn: int, sock: socket.socket, op: Op, request_id: int, meta: object, admitted: bool
    ) -> bool:
        """Serve one request; whether it renews the connection's idle deadline (it presented a
        credential the backend accepted, `kvfabric.dataplane.admission`). `admitted`: it is the
        connection's first, its credential checked already."""
        limits = self.gate.limits
        if self.authenticate is None:  # no credentials in this deployment: every request renews
            admitted = True
        if op is Op.PUT and isinstance(meta, PutRequest) and meta.staged is not None:
            self._put_staged(conn, sock, request_id, meta)
            return True  # (`begin_put` took its ticket, or it raised)
        if op is Op.PUT and isinstance(meta, PutRequest):
            try:
                check_claimed(meta, staged=False)
                put = self.backend.begin_put(meta.ticket, conn, claim_of(meta))
            except KvfError as err:
                raise _PutRefused(err, meta.ticket.size_bytes) from err
            put.take_meta(meta)
            self._deadline(conn, limits.transfer_ms(len(put.view)), "transfer_timeout")
            self._receive_put(conn, sock, put)
            self._no_deadline(conn)
            self._finish_put(conn, sock, request_id, put)
            return True
        if op is Op.GET and isinstance(meta, GetRequest):
            if len(meta.reads) > READS_MAX:
                raise BadRequest(f"{len(meta.reads)} reads exceed {READS_MAX}")
            streamed = getattr(self.backend, "begin_get_streamed", None) if meta.verdicts_after else None
            grant = (streamed or self.backend.begin_get)(meta.reads, conn)
            credited = admitted or reads_credited(grant.statuses)
            try:
                readable = [
                    (r.slot, r.slot_generation)
                    for r, s in zip(meta.reads, grant.statuses, strict=True)
                    if s == "ok"
                ]
                if len(set(readable)) != len(readable):
                    # Each would be sent again: one token, 4,096 times, made one small request
                    # send 4,096 x the object, its deadline as long, the slot pinned all along (a
                    # free answered done while the arena kept it; review, stop 68). No client
                    # asks for one object twice (refused refs of it may repeat: they send nothing).
                    raise BadRequest("a GET names an object twice")
                results = [ObjectResult(s, c) for s, c in zip(grant.statuses, grant.checksums, strict=True)]
                views = [v for v in grant.views if v is not None]
                total = sum(len(v) for v in views)
                if total > GET_BYTES_MAX:
                    # Its references pin the slots until the reply is sent, frees deferred: 4 GiB
                    # at the 1 MiB/s floor held them ~68 min after the directory freed them (a
                    # tenant's save, GET, evict: the arena filled; review, stop 70). UCX's bound.
                    raise BatchTooLarge(
                        f"GET of {total} bytes exceeds {GET_BYTES_MAX}", size_bytes=total, limit=GET_BYTES_MAX
                    )
                self._deadline(conn, limits.transfer_ms(total), "transfer_timeout")
                if grant.filling is None or grant.verdicts is None:
                    send_all(
                        sock,
                        [*encode_frame(Op.REPLY, request_id, GetReply(results=results), len(views)), *views],
                    )
                else:  # views still filling: each piece sent as it lands, the verdicts after the bytes
                    reply = GetReply(results=results, verdicts_after=True)
                    self._send_streamed(
                        sock, request_id, grant, encode_frame(Op.REPLY, request_id, reply, len(views))
                    )
            finally:
                self.backend.end_get(grant, conn)
            return credited
        if op is Op.MAP and isinstance(meta, MapRequest):
            info = self.backend.map_info()
            if self._staging_files() is not None:
                info = msgspec.structs.replace(info, staged_puts=True)
            send_all(sock, encode_frame(Op.REPLY, request_id, info))
            # A MAP is rare (one a pooled connection): its credential is checked again here.
            return admitted or (self.authenticate is not None and self.authenticate(meta))
        if op is Op.PIN_LOCAL and isinstance(meta, GetRequest):
            if len(meta.reads) > READS_MAX:
                raise BadRequest(f"{len(meta.reads)} reads exceed {READS_MAX}")
            grants = self.backend.pin_local(meta.reads, conn)
            send_all(sock, encode_frame(Op.REPLY, request_id, grants))
            return admitted or reads_credited(g.status for g in grants.grants)
        if op is Op.UNPIN_LOCAL and isinstance(meta, UnpinLocal):
            # Served whoever asks (a give-back is never refused), but it carries no credential.
            released = self.backend.unpin_local(meta.grant_id, conn)
            send_all(sock, encode_frame(Op.REPLY, request_id, UnpinReply(released=released)))
            return admitted
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
                send_all(sock, out)
                out = []
                if sent >= len(view):
                    break
        out += encode_frame(Op.REPLY, request_id, GetReply(results=grant.verdicts()))
        send_all(sock, out)

    def _receive_put(self, conn: int, sock: socket.socket, put: PutSlot) -> None:
        try:
            put.checksum = recv_hashed(sock, put.view)
        except BaseException:
            self.backend.abort_put(put, conn)  # nothing visible, the slot goes back
            raise
