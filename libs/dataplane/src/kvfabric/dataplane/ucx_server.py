"""The UCX transport's server: `UcxServer` over a `SegmentBackend`, on the loop that started it;
the design and failure rules are in `kvfabric.dataplane.ucx`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Final

from kvfabric.dataplane.admission import (
    UNAUTHENTICATED_META_BYTES_MAX,
    Authenticator,
    ConnectionGate,
    ConnectionLimits,
    reads_credited,
)
from kvfabric.dataplane.backend import SegmentBackend, check_claimed, claim_of, new_connection_id
from kvfabric.dataplane.frames import (
    HEADER,
    OBJECT_BYTES_MAX,
    READS_MAX,
    Header,
    Op,
    unpack_header,
)
from kvfabric.dataplane.ucx_link import (
    CONNECT_TIMEOUT_S_DEFAULT,
    FRAME_BYTES_MAX,
    IO_TIMEOUT_S_DEFAULT,
    Link,
    LinkDown,
    LinkOp,
    LinkTimeout,
    Truncated,
    Worker,
    close_endpoint,
    encode_frame,
    endpoint_hosts,
    error_frame,
    handshake,
    host_addresses,
    libucxx,
    worker_for_running_loop,
)
from kvfabric.format.errors import (
    BadRequest,
    BatchTooLarge,
    Busy,
    KvfError,
    Unauthorized,
    Unavailable,
)
from kvfabric.proto.dataplane import (
    GetReply,
    GetRequest,
    ObjectResult,
    PutRequest,
    ReadRef,
    dataplane_decoder,
)

# one logger for the whole UCX transport, as before its split
_log = logging.getLogger("kvfabric.dataplane.ucx")

# Payload bytes one request may move (a PUT's object, the sum of a GET's objects): bounds what a
# connection holds in the arena (slot being written, transfer references) at any time.
INFLIGHT_BYTES_MAX_DEFAULT: Final = OBJECT_BYTES_MAX
# How long a refused connection (busy, stopping) may stay open for its peer to read the refusal.
REJECT_LINGER_S: Final = 1.0


@dataclass(eq=False)
class _Connection:
    conn: int
    link: Link
    task: asyncio.Task[Any] | None
    buf: mmap.mmap = field(default_factory=lambda: mmap.mmap(-1, FRAME_BYTES_MAX))


class UcxServer:
    """Serves a `SegmentBackend` over UCX. `await start()` listens; `await stop()` closes everything.

    ucxx 0.52 listens on every interface (its listener takes a port only), so the server checks
    where each connection arrived (`ucp_ep_query`): one addressed to anything but `host` (unless
    `host` is a wildcard) is closed before its handshake, as if the listener were bound to `host`
    like the TCP one. Then the TCP server's rules (`kvfabric.dataplane.admission`): with an
    `authenticate` function, the handshake and a first request carrying a valid credential must
    arrive within the auth deadline; unauthenticated connections are bounded apart (the oldest is
    closed to make room), authenticated ones in total and per peer address; an authenticated
    connection is closed the idle timeout after its last request with an accepted credential.
    Closures and refusals are counted under the TCP server's names. Runs on the loop that called
    `start()`.
    """

    def __init__(
        self,
        backend: SegmentBackend,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        connections_max: int | None = None,
        inflight_bytes_max: int = INFLIGHT_BYTES_MAX_DEFAULT,
        io_timeout_s: float = IO_TIMEOUT_S_DEFAULT,
        limits: ConnectionLimits | None = None,
        authenticate: Authenticator | None = None,
        count: Callable[[str], None] | None = None,
    ) -> None:
        self.backend = backend
        self.host = host
        self.port = port
        limits = limits or ConnectionLimits()
        if connections_max is not None:
            limits = replace(limits, connections_max=connections_max)
        self.authenticate = authenticate
        self._count_fn = count  # the segment's event counter (names prefixed `dataplane_ucx_`)
        self.counters: dict[str, int] = {}
        self.gate = ConnectionGate(limits, on_event=self._count)
        self.inflight_bytes_max = inflight_bytes_max
        self.io_timeout_s = io_timeout_s
        self.connect_timeout_s = CONNECT_TIMEOUT_S_DEFAULT  # the handshake of an accepted connection
        self._listener: Any = None
        self._worker: Worker | None = None
        self._bound: frozenset[str] | None = None  # the addresses `host` names; None: every one
        self._accepting: set[asyncio.Task[None]] = set()  # every connection's task, from accept on
        self._tasks: dict[int, asyncio.Task[Any]] = {}  # connection id -> its task, from accept on
        self._conns: dict[int, _Connection] = {}
        self._stopping = False
        self.rejected_busy = 0
        self.leaked_connections = 0

    @property
    def address(self) -> str:
        return f"ucx://{self.host}:{self.port}"

    @property
    def connections(self) -> int:
        return len(self._conns)

    @property
    def connections_max(self) -> int:
        return self.gate.limits.connections_max

    @connections_max.setter
    def connections_max(self, value: int) -> None:
        self.gate.limits = replace(self.gate.limits, connections_max=value)

    def _count(self, name: str) -> None:
        self.counters[name] = self.counters.get(name, 0) + 1
        if self._count_fn is not None:
            self._count_fn(f"dataplane_ucx_{name}")

    async def start(self) -> None:
        if self._listener is not None:
            return
        self._stopping = False
        self._bound = host_addresses(self.host)  # an address: no lookup (a name: one, at start)
        self._worker = worker = worker_for_running_loop()
        self._listener = libucxx().UCXListener.create(
            worker=worker.worker, port=self.port, cb_func=self._on_endpoint, cb_args=(), deliver_endpoint=True
        )
        self.port = int(self._listener.port)

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Stop listening, abort every connection, wait for their handlers to release everything."""
        self._stopping = True  # connections arriving from now on are refused
        listener, self._listener = self._listener, None
        del listener  # ucxx destroys the listener with its last reference: no new connections
        for c in list(self._conns.values()):
            c.link.abort()
        tasks = list(self._accepting)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=timeout_s)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=timeout_s)

    async def __aenter__(self) -> UcxServer:
        await self.start()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.stop()

    def _on_endpoint(self, ep: Any) -> None:
        """ucxx listener callback, called inside UCX progress (which must not be re-entered, e.g. by
        closing an endpoint): the connection gets its own task, nothing else happens here (reading
        the endpoint's addresses does not progress UCX)."""
        worker = self._worker
        if worker is None:
            return
        task = worker.loop.create_task(self._on_connect(worker, ep, endpoint_hosts(ep)))
        self._accepting.add(task)
        task.add_done_callback(self._accepting.discard)

    async def _on_connect(self, worker: Worker, ep: Any, hosts: tuple[str, str] | None) -> None:
        """One accepted endpoint, for the connection's lifetime."""
        if self._bound is not None and (hosts is None or hosts[0] not in self._bound):
            self._count("wrong_address_total")  # not addressed to `host`: as if nobody listened there
            close_endpoint(worker, ep)
            return
        source = hosts[1] if hosts is not None else ""
        limits = self.gate.limits
        loop = asyncio.get_running_loop()
        auth_deadline = loop.time() + limits.auth_deadline_ms / 1000
        conn = new_connection_id()
        for victim in self.gate.open(conn, source):  # the oldest unauthenticated ones make room
            task = self._tasks.get(victim)
            if task is not None:
                task.cancel()
        self._tasks[conn] = asyncio.current_task()  # type: ignore[assignment]
        refusal: KvfError | None = None
        if self.authenticate is None:  # no credentials in this deployment: admitted as is
            refusal = self.gate.authenticate(conn)
            if isinstance(refusal, Busy):
                self.rejected_busy += 1
        try:
            await self._connection(worker, ep, conn, auth_deadline, refusal)
        finally:
            self.gate.close(conn)
            self._tasks.pop(conn, None)

    async def _connection(
        self, worker: Worker, ep: Any, conn: int, auth_deadline: float, refusal: KvfError | None
    ) -> None:
        loop = asyncio.get_running_loop()
        handshake_s = self.connect_timeout_s
        if self.authenticate is not None:  # the handshake counts against the auth deadline
            handshake_s = min(handshake_s, max(0.0, auth_deadline - loop.time()))
        try:
            link = await handshake(worker, ep, listener=True, timeout_s=handshake_s)
        except LinkDown as exc:
            if isinstance(exc, LinkTimeout) and handshake_s < self.connect_timeout_s:
                self._count("closed_auth_deadline_total")  # (TCP: a TLS handshake past it)
            _log.info("ucx: connection handshake failed: %s", exc)
            return
        if self._stopping:
            refusal = Unavailable("data server is stopping")
        if refusal is not None:
            await self._reject(link, refusal)
            return
        c = _Connection(conn, link, asyncio.current_task())
        self._conns[c.conn] = c
        try:
            await self._serve(c, None if self.authenticate is None else auth_deadline)
        except (LinkDown, asyncio.CancelledError):
            pass
        except Exception:
            self._count("internal_errors_total")  # (TCP's name: a request no handler expects)
            _log.exception("ucx: connection %d failed", c.conn)
        finally:
            self._conns.pop(c.conn, None)
            link.abort()
            if link.stuck:
                self.leaked_connections += 1
                _log.error("ucx: connection %d: UCX may still use its buffers; its references leak", c.conn)
                self.backend.connection_leaked(c.conn)  # (no longer serving: demotion need not wait)
            else:
                self.backend.close_connection(c.conn)

    async def _reject(self, link: Link, err: KvfError) -> None:
        """Answer a connection we do not serve, then linger (bounded) until the peer hangs up, so
        the answer is not lost to an abort; whatever it sends meanwhile is dropped."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + REJECT_LINGER_S
        scratch = bytearray(1)
        with contextlib.suppress(LinkDown):
            await link.complete([link.send(error_frame(0, err))], REJECT_LINGER_S)
            while (left := deadline - loop.time()) > 0:
                with contextlib.suppress(Truncated):
                    await link.complete([link.recv(scratch)], left)
        link.abort()

    async def _serve(self, c: _Connection, auth_deadline: float | None) -> None:
        """Requests in order. `auth_deadline` (loop time): the connection is not authenticated
        yet and must be by then; until it is, anything but a valid first request closes it.
        Authenticated, it waits for a request at most the idle timeout from the end of the last
        one that presented a credential the backend accepted (`kvfabric.dataplane.admission`)."""
        frame = memoryview(c.buf)
        loop = asyncio.get_running_loop()
        idle_s = self.gate.limits.idle_timeout_ms / 1000
        renewed_at = loop.time()  # the end of the last request that renews the idle deadline
        try:
            while True:
                authenticated = auth_deadline is None
                if auth_deadline is not None:
                    wait_s = max(0.0, auth_deadline - loop.time())
                else:
                    wait_s = renewed_at + idle_s - loop.time()
                    if wait_s <= 0:  # (a message already there would be taken at once)
                        self._count("closed_idle_timeout_total")
                        return
                try:
                    await c.link.complete([c.link.recv(c.buf)], wait_s)
                except Truncated:
                    too_big = BadRequest(f"frame exceeds {FRAME_BYTES_MAX} bytes")
                    await self._send(c, error_frame(0, too_big))
                    if not authenticated:
                        return
                    continue
                except LinkTimeout:
                    self._count(
                        "closed_idle_timeout_total" if authenticated else "closed_auth_deadline_total"
                    )
                    raise
                try:
                    header = unpack_header(frame[: HEADER.size])
                except KvfError as err:  # not our framing: answer once, then drop the connection
                    await self._send(c, error_frame(0, err))
                    return
                try:
                    if not authenticated and header.meta_bytes > UNAUTHENTICATED_META_BYTES_MAX:
                        raise BadRequest(
                            f"a first request's meta may be at most {UNAUTHENTICATED_META_BYTES_MAX} bytes"
                        )
                    meta = dataplane_decoder.decode(frame[HEADER.size : HEADER.size + header.meta_bytes])
                except KvfError as err:
                    if not authenticated:
                        await self._send(c, error_frame(header.request_id, err))
                        return
                    await self._refuse(c, header, err)
                    continue
                if not authenticated:
                    refusal = self._admit(c.conn, meta)
                    if refusal is not None:
                        await self._send(c, error_frame(header.request_id, refusal))
                        return
                    auth_deadline = None
                    renewed_at = loop.time()  # (a credential accepted, whatever the answer)
                if await self._dispatch(c, header, meta) or self.authenticate is None:
                    renewed_at = loop.time()
        finally:
            frame.release()

    def _admit(self, conn: int, meta: object) -> KvfError | None:
        """The first request of an unauthenticated connection: its credential, then the bounds."""
        assert self.authenticate is not None
        if not self.authenticate(meta):
            self._count("unauthorized_total")
            return Unauthorized("a data connection must first present a valid read token or write ticket")
        refusal = self.gate.authenticate(conn)
        if isinstance(refusal, Busy):
            self.rejected_busy += 1
        return refusal

    async def _send(self, c: _Connection, frame: bytes) -> None:
        """A reply or error frame alone (TCP sends those under the frame timeout)."""
        await self._complete(c, [c.link.send(frame)], self.io_timeout_s, "frame_timeout")

    async def _complete(self, c: _Connection, ops: list[LinkOp], timeout_s: float, reason: str) -> None:
        """`Link.complete`, a timeout counted `closed_<reason>_total` (the TCP server's names)."""
        try:
            await c.link.complete(ops, timeout_s)
        except LinkTimeout:
            self._count(f"closed_{reason}_total")
            raise

    async def _refuse(self, c: _Connection, header: Header, err: KvfError) -> None:
        """Consume the payload messages the request declared, then answer `err`: all of them
        within one `io_timeout_s` (each had its own: a peer declaring 4,096 and sending one a
        minute held its connection for days past the idle timeout; review, 2026-12-06)."""
        if header.payload_count:
            scratch = bytearray(1)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.io_timeout_s
            for _ in range(header.payload_count):
                with contextlib.suppress(Truncated):
                    left = max(0.001, deadline - loop.time())
                    await self._complete(c, [c.link.recv(scratch)], left, "transfer_timeout")
        await self._send(c, error_frame(header.request_id, err))

    async def _dispatch(self, c: _Connection, header: Header, meta: object) -> bool:
        """Serve one request; whether it renews the idle deadline: it presented a credential the
        backend accepted (a ticket `begin_put` took, a read past its token check)."""
        if header.op is Op.PUT and isinstance(meta, PutRequest):
            return await self._put(c, header, meta)
        if header.op is Op.GET and isinstance(meta, GetRequest):
            return await self._get(c, header, meta.reads)
        what = f"op {header.op.name} with {type(meta).__name__}"
        await self._refuse(c, header, BadRequest(f"{what} is not served over UCX"))
        return False

    async def _put(self, c: _Connection, header: Header, meta: PutRequest) -> bool:
        ticket = meta.ticket
        if header.payload_count != 1:
            await self._refuse(c, header, BadRequest("a PUT carries exactly one payload message"))
            return False
        try:
            check_claimed(meta, staged=False)
        except KvfError as err:
            await self._refuse(c, header, err)
            return False
        if ticket.size_bytes > self.inflight_bytes_max:
            await self._refuse(
                c,
                header,
                BatchTooLarge(
                    f"object of {ticket.size_bytes} bytes exceeds the {self.inflight_bytes_max}-byte "
                    "per-connection limit",
                    size_bytes=ticket.size_bytes,
                    limit=self.inflight_bytes_max,
                ),
            )
            return False
        try:
            put = self.backend.begin_put(ticket, c.conn, claim_of(meta))
        except KvfError as err:
            await self._refuse(c, header, err)
            return False
        put.take_meta(meta)  # (a receipted save failed over UCX when it took only the checksum)
        try:
            await self._complete(c, [c.link.recv(put.view)], self.io_timeout_s, "transfer_timeout")
        except Truncated:
            self.backend.abort_put(put, c.conn)
            too_big = BadRequest("PUT payload is larger than the ticket's size_bytes")
            await self._send(c, error_frame(header.request_id, too_big))
            return True  # (its ticket was taken)
        except BaseException:
            if not c.link.stuck:
                self.backend.abort_put(put, c.conn)  # nothing visible; the slot goes back
            raise
        try:
            slot, generation = self.backend.finish_put(put, c.conn)
        except KvfError as err:
            await self._send(c, error_frame(header.request_id, err))
            return True
        reply = put.reply(slot, generation)
        await self._send(c, encode_frame(Op.REPLY, header.request_id, reply))
        return True

    async def _get(self, c: _Connection, header: Header, reads: list[ReadRef]) -> bool:
        if header.payload_count:
            await self._refuse(c, header, BadRequest("a GET request carries no payload"))
            return False
        if len(reads) > READS_MAX:
            await self._refuse(c, header, BatchTooLarge(f"{len(reads)} reads exceed {READS_MAX}"))
            return False
        total = sum(max(ref.size_bytes, 0) for ref in reads)
        if total > self.inflight_bytes_max:
            await self._refuse(
                c,
                header,
                BatchTooLarge(
                    f"GET of {total} bytes exceeds the {self.inflight_bytes_max}-byte per-connection limit",
                    size_bytes=total,
                    limit=self.inflight_bytes_max,
                ),
            )
            return False
        try:
            grant = self.backend.begin_get(reads, c.conn)
        except KvfError as err:
            await self._send(c, error_frame(header.request_id, err))
            return False
        try:
            results = [ObjectResult(s, cs) for s, cs in zip(grant.statuses, grant.checksums, strict=True)]
            views = [v for v in grant.views if v is not None]
            reply = encode_frame(Op.REPLY, header.request_id, GetReply(results=results), len(views))
            link = c.link
            sends = [link.send(reply), *(link.send(v) for v in views)]
            await self._complete(c, sends, self.io_timeout_s, "transfer_timeout")
        finally:
            if not c.link.stuck:
                self.backend.end_get(grant, c.conn)
        return reads_credited(grant.statuses)
