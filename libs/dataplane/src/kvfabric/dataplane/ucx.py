"""The data-plane protocol over UCX (ucxx, asyncio): `UcxServer` over a `SegmentBackend`, `UcxClient`.

Same frames as TCP (`kvfabric.dataplane.frames`), carried as UCX tag messages on the connection's
own tag (ucxx gives every endpoint a private tag pair; messages on one tag are matched in order):

| message | bytes | received into |
|---|---|---|
| request / reply | 24-byte header + msgpack meta | a per-connection `FRAME_BYTES_MAX` buffer |
| PUT payload | exactly `ticket.size_bytes` | the arena view from `backend.begin_put` |
| GET payload | one message per `ok` object, `size_bytes` each | the caller's destination buffer |

Why header + meta is one message: a UCX tag receive may be larger than the message (it may not be
smaller: the message is then consumed and the receive fails "truncated"), and the header says how
many meta bytes are valid. One message halves the small-request round trip against two (header,
then meta): 145 µs vs 283 µs here (docs/ucx.md). Truncation keeps the stream in step: an
oversize message is consumed, answered with `bad_request`, and the connection stays usable.

Payload messages are posted straight on their final buffers (arena view, caller's buffer): no copy
in Python. Inside UCX, an eager message (below `UCX_RNDV_THRESH`) that arrives before its receive is
posted is buffered and copied once; a rendezvous message waits at the sender until matched.

Failure rules (as the TCP transport):
- A refused PUT (`begin_put` raised, too large, malformed) is answered with an ERROR frame after its
  payload message has been consumed (received into a 1-byte buffer: UCX drops the rest), so the
  connection stays usable. Any refused request consumes the `payload_count` messages it declared.
- A connection that drops mid-PUT aborts the slot; any drop releases everything the connection held
  (`backend.close_connection`).
- A payload transfer that does not finish within `io_timeout_s` aborts the connection.
- An arena view is released (`finish_put`/`abort_put`/`end_get`/`close_connection`) only after UCX
  has finished with it (completed or cancelled). If UCX never confirms (not observed), the
  connection's references are leaked on purpose (`UcxServer.leaked_connections`), never reused
  while UCX may still write or read them.

Threading: the server runs on the asyncio loop that called `start()` and calls the backend
synchronously on that loop's thread; a backend must not block on that same loop. ucxx has one
context per process and (python-future mode, our default) delivers completions to one event loop:
use one running loop per process; a later loop takes the notifier over (~1 s) once the earlier one
is no longer running.

UCX settings: `ucx_env_defaults()` (measured, docs/ucx.md) are applied with
`os.environ.setdefault` just before ucxx is first imported, so anything set in the environment
wins. Import ucxx only through this module (ucxx sets `UCX_RNDV_THRESH=8192` at import when unset).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import mmap
import os
import sys
import threading
from collections.abc import Awaitable, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec

from kvfabric.dataplane.backend import SegmentBackend
from kvfabric.dataplane.frames import (
    HEADER,
    META_BYTES_MAX,
    OBJECT_BYTES_MAX,
    READS_MAX,
    Header,
    Op,
    pack_header,
    unpack_header,
)
from kvfabric.format.errors import BadRequest, BatchTooLarge, Busy, Indeterminate, KvfError, Unavailable
from kvfabric.format.invariant import InvariantViolation
from kvfabric.proto.codec import FamilyDecoder, encode
from kvfabric.proto.common import ErrorReply, error_from_reply, error_reply_from
from kvfabric.proto.dataplane import (
    GetReply,
    GetRequest,
    ObjectResult,
    PutReply,
    PutRequest,
    ReadRef,
    dataplane_decoder,
)
from kvfabric.proto.directory import WriteTicket

__all__ = [
    "CONNECTIONS_MAX_DEFAULT",
    "INFLIGHT_BYTES_MAX_DEFAULT",
    "IO_TIMEOUT_S_DEFAULT",
    "UcxClient",
    "UcxServer",
    "apply_ucx_env_defaults",
    "ucx_env_defaults",
]

_log = logging.getLogger(__name__)

CONNECTIONS_MAX_DEFAULT: Final = 64
# Payload bytes one request may move (a PUT's object, the sum of a GET's objects): bounds what a
# connection holds in the arena (slot being written, transfer references) at any time.
INFLIGHT_BYTES_MAX_DEFAULT: Final = OBJECT_BYTES_MAX
IO_TIMEOUT_S_DEFAULT: Final = 60.0
# How long to wait for UCX to finish cancelled transfers after aborting an endpoint (µs in practice).
SETTLE_S: Final = 5.0
# How long a refused connection (busy, stopping) may stay open for its peer to read the refusal.
REJECT_LINGER_S: Final = 1.0
FRAME_BYTES_MAX: Final = HEADER.size + META_BYTES_MAX

# Measured on loopback (2 cores), docs/ucx.md. Only TCP-transport knobs and the eager/rendezvous
# switch for transfers between hosts; everything else stays UCX's (or ucxx's) default.
_ENV_DEFAULTS: Final[dict[str, str]] = {
    "UCX_TCP_TX_SEG_SIZE": "1M",
    "UCX_TCP_RX_SEG_SIZE": "1M",
    "UCX_RNDV_THRESH": "inf",
    # Completions through asyncio futures set by ucxx's notifier thread. Without it every awaited
    # transfer polls the event loop: a server with one idle connection burns a whole core.
    "UCXPY_ENABLE_PYTHON_FUTURE": "1",
}

_error_decoder: FamilyDecoder[ErrorReply] = FamilyDecoder(ErrorReply, "dataplane error")


def ucx_env_defaults() -> dict[str, str]:
    """The UCX environment this transport is tuned for (a fresh copy)."""
    return dict(_ENV_DEFAULTS)


def apply_ucx_env_defaults(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """`setdefault` each of `ucx_env_defaults()` into `environ` (default `os.environ`).

    Returns what was set (variables already present are left alone). Effective only before the
    UCX context is created, i.e. before the first listener/endpoint of the process.
    """
    env = os.environ if environ is None else environ
    applied: dict[str, str] = {}
    for key, value in ucx_env_defaults().items():
        if key not in env:
            env[key] = value
            applied[key] = value
    return applied


_ucxx_module: Any = None


def _ucxx() -> Any:
    """Import ucxx once, after applying the env defaults."""
    global _ucxx_module
    if _ucxx_module is None:
        preloaded = "ucxx" in sys.modules
        apply_ucx_env_defaults()
        try:
            import ucxx
        except ImportError as exc:  # the optional `ucx` extra is not installed
            raise Unavailable(f"ucxx is not importable: {exc}") from exc
        if preloaded and os.environ.get("UCX_RNDV_THRESH") == "8192" != _ENV_DEFAULTS["UCX_RNDV_THRESH"]:
            _log.warning(
                "UCX_RNDV_THRESH=8192: ucxx was imported before kvfabric.dataplane.ucx applied its "
                "defaults (or it was set so); large transfers use rendezvous"
            )
        _ucxx_module = ucxx
    return _ucxx_module


_notifier_loop: asyncio.AbstractEventLoop | None = None
_exit_hook_registered = False


def _ucxx_on_running_loop() -> Any:
    """ucxx, with its context created and its completion notifier bound to the running loop.

    ucxx's notifier thread (python-future mode) delivers completions to the one loop it was
    started for. A later loop (a second `asyncio.run`, a test's own loop) gets the notifier
    restarted for it, provided the previous loop is not running (one running loop per process).
    The notifier is a non-daemon thread: it is stopped at interpreter exit before threads are
    joined, or the process would never exit.
    """
    global _notifier_loop, _exit_hook_registered
    ucxx = _ucxx()
    loop = asyncio.get_running_loop()
    fresh = ucxx.core._ctx is None  # ucxx 0.52: the process-wide ApplicationContext
    ctx = ucxx.core._get_ctx()  # created here if needed: its notifier binds to this loop
    if not _exit_hook_registered:
        register = getattr(threading, "_register_atexit", None)  # runs before threads are joined
        if register is not None:
            register(ucxx.stop_notifier_thread)
        _exit_hook_registered = True
    if not ctx.enable_python_future or _notifier_loop is loop:
        return ucxx
    if not fresh:
        if _notifier_loop is not None and _notifier_loop.is_running():
            raise InvariantViolation("ucxx already serves an event loop running in another thread")
        ctx.stop_notifier_thread()  # up to ~1 s: the notifier wakes once a second
        ctx.start_notifier_thread()  # for the running loop
    _notifier_loop = loop
    return ucxx


def _frame(op: Op, request_id: int, meta: msgspec.Struct, payload_count: int = 0) -> bytes:
    body = encode(meta)
    return pack_header(op, request_id, len(body), payload_count) + body


def _error_frame(request_id: int, err: KvfError) -> bytes:
    return _frame(Op.ERROR, request_id, error_reply_from(err))


class _Truncated(Exception):
    """A message was larger than the buffer posted for it (UCX consumed and dropped it)."""


class _LinkDown(Exception):
    """The endpoint failed, was closed by the peer, or a transfer timed out (endpoint aborted)."""


class _Link:
    """One ucxx endpoint, with the rule that a buffer is released only after UCX is done with it."""

    def __init__(self, ep: Any) -> None:
        self.ep = ep
        self.aborted = False
        self.stuck = False  # UCX did not confirm cancelled transfers: never release their buffers

    def abort(self) -> None:
        if not self.aborted:
            self.aborted = True
            with contextlib.suppress(Exception):
                self.ep.abort()  # cancels the endpoint's in-flight requests

    async def complete(self, transfers: Sequence[Awaitable[Any]], timeout_s: float | None) -> None:
        """Run the transfers (posted in order) until all finish.

        Raises `_Truncated` if one was truncated (all others succeeded), `_LinkDown` on any other
        failure or timeout. On timeout or cancellation the endpoint is aborted and the transfers
        are awaited (cancelled by UCX) before this returns or re-raises.
        """
        if self.aborted:
            for aw in transfers:  # never started: close the coroutines
                if asyncio.iscoroutine(aw):
                    aw.close()
            raise _LinkDown("endpoint aborted")
        tasks = [asyncio.ensure_future(aw) for aw in transfers]
        try:
            _, pending = await asyncio.wait(tasks, timeout=timeout_s, return_when=asyncio.FIRST_EXCEPTION)
        except asyncio.CancelledError:
            self.abort()
            await self._settle(tasks)
            raise
        if pending:  # timed out, or one failed while others still run: the endpoint is done for
            self.abort()
            await self._settle(tasks)
            failed = [t.exception() for t in tasks if t.done() and not t.cancelled() and t.exception()]
            raise _LinkDown(repr(failed[0]) if failed else f"transfer did not finish within {timeout_s} s")
        failures = [e for e in (t.exception() for t in tasks) if e is not None]
        if not failures:
            return
        truncated = _ucxx().exceptions.UCXMessageTruncatedError
        if all(isinstance(e, truncated) for e in failures):
            raise _Truncated(str(failures[0]))
        self.abort()
        raise _LinkDown(repr(next(e for e in failures if not isinstance(e, truncated))))

    async def _settle(self, tasks: Sequence[asyncio.Future[Any]]) -> None:
        try:
            _, pending = await asyncio.wait(tasks, timeout=SETTLE_S)
        except asyncio.CancelledError:  # cancelled again while settling: assume the worst
            self.stuck = not all(t.done() for t in tasks)
            raise
        for task in tasks:
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: no "exception never retrieved" noise
        if pending:
            self.stuck = True
            _log.error("ucx: %d transfer(s) not finished %s s after endpoint abort", len(pending), SETTLE_S)


# ---- server ----------------------------------------------------------------------------------


@dataclass(eq=False)
class _Connection:
    conn: int
    link: _Link
    task: asyncio.Task[Any] | None
    buf: mmap.mmap = field(default_factory=lambda: mmap.mmap(-1, FRAME_BYTES_MAX))


class UcxServer:
    """Serves a `SegmentBackend` over UCX. `await start()` listens; `await stop()` closes everything.

    ucxx 0.52 listens on every interface (`create_listener` takes a port only): `host` is the
    address advertised in `address`, not a bind address.
    """

    def __init__(
        self,
        backend: SegmentBackend,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        connections_max: int = CONNECTIONS_MAX_DEFAULT,
        inflight_bytes_max: int = INFLIGHT_BYTES_MAX_DEFAULT,
        io_timeout_s: float = IO_TIMEOUT_S_DEFAULT,
    ) -> None:
        self.backend = backend
        self.host = host
        self.port = port
        self.connections_max = connections_max
        self.inflight_bytes_max = inflight_bytes_max
        self.io_timeout_s = io_timeout_s
        self._listener: Any = None
        self._conns: dict[int, _Connection] = {}
        self._ids = itertools.count(1)
        self._stopping = False
        self.rejected_busy = 0
        self.leaked_connections = 0

    @property
    def address(self) -> str:
        return f"ucx://{self.host}:{self.port}"

    @property
    def connections(self) -> int:
        return len(self._conns)

    async def start(self) -> None:
        if self._listener is not None:
            return
        self._stopping = False
        self._listener = _ucxx_on_running_loop().create_listener(self._on_connect, self.port)
        self.port = int(self._listener.port)

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Stop listening, abort every connection, wait for their handlers to release everything."""
        self._stopping = True  # connections arriving from now on are refused
        conns = list(self._conns.values())
        for c in conns:
            c.link.abort()
        tasks = [c.task for c in conns if c.task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=timeout_s)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=timeout_s)
        listener, self._listener = self._listener, None
        if listener is not None:
            for _ in range(int(timeout_s / 0.005)):  # ucxx retires its handler records a turn late
                if not listener.active_clients:
                    break
                await asyncio.sleep(0.005)
            listener.close()

    async def __aenter__(self) -> UcxServer:
        await self.start()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.stop()

    async def _on_connect(self, ep: Any) -> None:
        """ucxx listener callback: one task per connection, for the connection's lifetime."""
        link = _Link(ep)
        if self._stopping or len(self._conns) >= self.connections_max:
            err: KvfError
            if self._stopping:
                err = Unavailable("data server is stopping")
            else:
                self.rejected_busy += 1
                err = Busy("too many data connections", limit=self.connections_max)
            await self._reject(link, err)
            return
        c = _Connection(next(self._ids), link, asyncio.current_task())
        self._conns[c.conn] = c
        try:
            await self._serve(c)
        except (_LinkDown, asyncio.CancelledError):
            pass
        except Exception:
            _log.exception("ucx: connection %d failed", c.conn)
        finally:
            self._conns.pop(c.conn, None)
            link.abort()
            if link.stuck:
                self.leaked_connections += 1
                _log.error("ucx: connection %d: UCX may still use its buffers; its references leak", c.conn)
            else:
                self.backend.close_connection(c.conn)

    async def _reject(self, link: _Link, err: KvfError) -> None:
        """Answer a connection we do not serve, then linger (bounded) until the peer hangs up, so
        the answer is not lost to an abort; whatever it sends meanwhile is dropped."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + REJECT_LINGER_S
        scratch = bytearray(1)
        with contextlib.suppress(_LinkDown):
            await link.complete([link.ep.send(_error_frame(0, err))], REJECT_LINGER_S)
            while (left := deadline - loop.time()) > 0:
                with contextlib.suppress(_Truncated):
                    await link.complete([link.ep.recv(scratch)], left)
        link.abort()

    async def _serve(self, c: _Connection) -> None:
        frame = memoryview(c.buf)
        try:
            while True:
                try:
                    await c.link.complete([c.link.ep.recv(c.buf)], None)  # idle: no timeout
                except _Truncated:
                    await self._send(c, _error_frame(0, BadRequest(f"frame exceeds {FRAME_BYTES_MAX} bytes")))
                    continue
                try:
                    header = unpack_header(frame[: HEADER.size])
                except KvfError as err:  # not our framing: answer once, then drop the connection
                    await self._send(c, _error_frame(0, err))
                    return
                try:
                    meta = dataplane_decoder.decode(frame[HEADER.size : HEADER.size + header.meta_bytes])
                except KvfError as err:
                    await self._refuse(c, header, err)
                    continue
                await self._dispatch(c, header, meta)
        finally:
            frame.release()

    async def _send(self, c: _Connection, frame: bytes) -> None:
        await c.link.complete([c.link.ep.send(frame)], self.io_timeout_s)

    async def _refuse(self, c: _Connection, header: Header, err: KvfError) -> None:
        """Consume the payload messages the request declared, then answer `err`."""
        if header.payload_count:
            scratch = bytearray(1)
            for _ in range(header.payload_count):
                with contextlib.suppress(_Truncated):
                    await c.link.complete([c.link.ep.recv(scratch)], self.io_timeout_s)
        await self._send(c, _error_frame(header.request_id, err))

    async def _dispatch(self, c: _Connection, header: Header, meta: object) -> None:
        if header.op is Op.PUT and isinstance(meta, PutRequest):
            await self._put(c, header, meta.ticket)
        elif header.op is Op.GET and isinstance(meta, GetRequest):
            await self._get(c, header, meta.reads)
        else:
            what = f"op {header.op.name} with {type(meta).__name__}"
            await self._refuse(c, header, BadRequest(f"{what} is not served over UCX"))

    async def _put(self, c: _Connection, header: Header, ticket: WriteTicket) -> None:
        if header.payload_count != 1:
            await self._refuse(c, header, BadRequest("a PUT carries exactly one payload message"))
            return
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
            return
        try:
            put = self.backend.begin_put(ticket, c.conn)
        except KvfError as err:
            await self._refuse(c, header, err)
            return
        try:
            await c.link.complete([c.link.ep.recv(put.view)], self.io_timeout_s)
        except _Truncated:
            self.backend.abort_put(put, c.conn)
            too_big = BadRequest("PUT payload is larger than the ticket's size_bytes")
            await self._send(c, _error_frame(header.request_id, too_big))
            return
        except BaseException:
            if not c.link.stuck:
                self.backend.abort_put(put, c.conn)  # nothing visible; the slot goes back
            raise
        try:
            slot, generation = self.backend.finish_put(put, c.conn)
        except KvfError as err:
            await self._send(c, _error_frame(header.request_id, err))
            return
        reply = PutReply(slot=slot, slot_generation=generation, confirmed=True)
        await self._send(c, _frame(Op.REPLY, header.request_id, reply))

    async def _get(self, c: _Connection, header: Header, reads: list[ReadRef]) -> None:
        if header.payload_count:
            await self._refuse(c, header, BadRequest("a GET request carries no payload"))
            return
        if len(reads) > READS_MAX:
            await self._refuse(c, header, BatchTooLarge(f"{len(reads)} reads exceed {READS_MAX}"))
            return
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
            return
        try:
            grant = self.backend.begin_get(reads, c.conn)
        except KvfError as err:
            await self._send(c, _error_frame(header.request_id, err))
            return
        try:
            results = [ObjectResult(s, cs) for s, cs in zip(grant.statuses, grant.checksums, strict=True)]
            views = [v for v in grant.views if v is not None]
            reply = _frame(Op.REPLY, header.request_id, GetReply(results=results), len(views))
            ep = c.link.ep
            await c.link.complete([ep.send(reply), *(ep.send(v) for v in views)], self.io_timeout_s)
        finally:
            if not c.link.stuck:
                self.backend.end_get(grant, c.conn)


# ---- client ----------------------------------------------------------------------------------


def _byte_view(buf: Any, *, writable: bool) -> memoryview:
    view = memoryview(buf)
    if not view.c_contiguous:
        raise BadRequest("buffer must be C-contiguous")
    if writable and view.readonly:
        raise BadRequest("destination buffer is read-only")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class UcxClient:
    """One UCX connection to a segment's data port; one request at a time (an asyncio lock).

    Connects on first use (or `await connect()`); after a transport failure the next call
    reconnects. Errors: the segment's typed `KvfError`; `Unavailable` when it cannot be reached;
    `Indeterminate` when the connection failed mid-request (a PUT may or may not have landed).
    Cancelling a call aborts the connection (UCX stops writing the caller's buffers first).
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        io_timeout_s: float = IO_TIMEOUT_S_DEFAULT,
        connect_timeout_s: float = 5.0,
    ) -> None:
        self.host = host
        self.port = port
        self.io_timeout_s = io_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._link: _Link | None = None
        self._lock = asyncio.Lock()
        self._ids = itertools.count(1)
        self._buf = mmap.mmap(-1, FRAME_BYTES_MAX)
        self._closed = False

    @classmethod
    def from_address(cls, address: str, **kwargs: Any) -> UcxClient:
        """`ucx://host:port`."""
        if not address.startswith("ucx://"):
            raise BadRequest(f"not a ucx data address: {address!r}")
        host, _, port = address.removeprefix("ucx://").rpartition(":")
        return cls(host, int(port), **kwargs)

    @property
    def address(self) -> str:
        return f"ucx://{self.host}:{self.port}"

    async def connect(self) -> None:
        async with self._lock:
            await self._ensure()

    def close(self) -> None:
        """Abort the connection (the segment releases what it held for it). Idempotent."""
        self._closed = True
        self._drop()

    async def __aenter__(self) -> UcxClient:
        await self.connect()
        return self

    async def __aexit__(self, *_: object) -> None:
        self.close()

    def _drop(self) -> None:
        if self._link is not None:
            self._link.abort()
            self._link = None

    async def _ensure(self) -> _Link:
        if self._closed:
            raise Unavailable("ucx client is closed")
        if self._link is not None and not self._link.aborted and not self._link.ep.closed:
            return self._link
        self._drop()  # an idle connection the segment closed: reconnect
        ucxx = _ucxx_on_running_loop()
        try:
            ep = await asyncio.wait_for(
                ucxx.create_endpoint(self.host, self.port, connect_timeout=self.connect_timeout_s),
                self.connect_timeout_s + 1.0,
            )
        except (ucxx.exceptions.UCXError, OSError, TimeoutError) as exc:
            raise Unavailable(f"cannot connect to {self.address}: {exc!r}", address=self.address) from exc
        self._link = _Link(ep)
        return self._link

    async def _reply(self, link: _Link, request_id: int) -> tuple[object, int]:
        """Receive one reply frame; raise the segment's error if it is an ERROR frame."""
        try:
            await link.complete([link.ep.recv(self._buf)], self.io_timeout_s)
        except _Truncated as exc:
            self._drop()
            raise Indeterminate(f"reply frame exceeds {FRAME_BYTES_MAX} bytes") from exc
        frame = memoryview(self._buf)
        try:
            try:
                header = unpack_header(frame[: HEADER.size])
            except KvfError as exc:
                self._drop()
                raise Indeterminate(f"malformed reply frame: {exc.message}") from exc
            body = frame[HEADER.size : HEADER.size + header.meta_bytes]
            if header.op is Op.ERROR:
                err = error_from_reply(_error_decoder.decode(body))
                if header.request_id != request_id:  # connection-level (busy, bad framing): closed
                    self._drop()
                raise err
            if header.op is not Op.REPLY or header.request_id != request_id:
                self._drop()
                raise Indeterminate(f"reply {header.op.name} #{header.request_id} to request #{request_id}")
            return dataplane_decoder.decode(body), header.payload_count
        finally:
            frame.release()

    async def _call(
        self, op: Op, meta: msgspec.Struct, payload: Sequence[memoryview] = ()
    ) -> tuple[object, int, _Link]:
        link = await self._ensure()
        request_id = next(self._ids)
        frame = _frame(op, request_id, meta, len(payload))
        if len(frame) > FRAME_BYTES_MAX:
            raise BadRequest(f"request frame of {len(frame)} bytes exceeds {FRAME_BYTES_MAX}")
        try:
            await link.complete([link.ep.send(frame), *(link.ep.send(p) for p in payload)], self.io_timeout_s)
        except (_LinkDown, _Truncated) as exc:
            self._drop()
            raise Indeterminate(f"ucx connection failed during {op.name}: {exc}") from exc
        try:
            reply, payload_count = await self._reply(link, request_id)
        except _LinkDown as exc:
            self._drop()
            raise Indeterminate(f"ucx connection failed during {op.name}: {exc}") from exc
        return reply, payload_count, link

    async def put(self, ticket: WriteTicket, data: Any) -> PutReply:
        """Send one object's bytes (any C-contiguous buffer) under a signed ticket."""
        view = _byte_view(data, writable=False)
        if view.nbytes != ticket.size_bytes:
            raise BadRequest(f"buffer is {view.nbytes} bytes, ticket says {ticket.size_bytes}")
        async with self._lock:
            reply, _, _ = await self._call(Op.PUT, PutRequest(ticket=ticket), [view])
        if not isinstance(reply, PutReply):
            raise Indeterminate(f"unexpected reply {type(reply).__name__} to PUT")
        return reply

    async def get(self, reads: list[ReadRef], dests: Sequence[Any]) -> list[ObjectResult]:
        """Read objects straight into `dests` (one writable buffer of at least `size_bytes` per
        read; the first `size_bytes` are written). Only `ok` results are written; the caller
        verifies checksums."""
        if len(dests) != len(reads):
            raise BadRequest("one destination buffer per read")
        views: list[memoryview] = []
        for ref, dest in zip(reads, dests, strict=True):
            view = _byte_view(dest, writable=True)
            if view.nbytes < ref.size_bytes:
                raise BadRequest(f"destination is {view.nbytes} bytes, object is {ref.size_bytes}")
            views.append(view[: ref.size_bytes])
        async with self._lock:
            reply, payload_count, link = await self._call(Op.GET, GetRequest(reads=reads))
            if not isinstance(reply, GetReply) or len(reply.results) != len(reads):
                self._drop()
                raise Indeterminate("malformed GET reply")
            ok = [v for r, v in zip(reply.results, views, strict=True) if r.status == "ok"]
            if len(ok) != payload_count:
                self._drop()
                raise Indeterminate("GET reply payload count does not match its results")
            if ok:
                try:
                    await link.complete([link.ep.recv(v) for v in ok], self.io_timeout_s)
                except (_LinkDown, _Truncated) as exc:
                    self._drop()
                    raise Indeterminate(f"ucx connection failed during GET payload: {exc}") from exc
        return reply.results
