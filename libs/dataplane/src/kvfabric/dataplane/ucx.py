"""The data-plane protocol over UCX (ucxx, asyncio): `UcxServer` over a `SegmentBackend`, `UcxClient`.

Same frames as TCP (`kvfabric.dataplane.frames`), carried as UCX tag messages on the connection's
own tag pair (agreed at connect time, as ucxx's own asyncio API does; messages on one tag are
matched in order):

| message | bytes | received into |
|---|---|---|
| request / reply | 24-byte header + msgpack meta | a per-connection `FRAME_BYTES_MAX` buffer |
| PUT payload | exactly `ticket.size_bytes` | the arena view from `backend.begin_put` |
| GET payload | one message per `ok` object, `size_bytes` each | the caller's destination buffer |

Progress engine: ucxx's low-level worker (`ucxx._lib.libucxx`), one UCX context and worker per
event loop, progressed by that loop and nothing else (`_Worker`): the worker's epoll fd is a
reader of the loop; each turn progresses UCX until idle, resolves the futures of the requests that
completed, and re-arms the worker. No ucxx threads, no thread hop per message. ucxx's asyncio
layer (`ucxx.create_endpoint`: a progress thread, delayed submission, a notifier thread setting
asyncio futures: a thread hand-off per submission and per completion) cost ~0.7-1.2 ms per
request on 2 shared cores (docs/ucx.md, `bench/ucx_options.py`). A client sends its request and
posts the reply's receive together (pre-posted), so the reply lands without UCX's
unexpected-message queue. `UcxSyncClient` is the blocking variant: its caller's thread progresses
its own worker.

Why header + meta is one message: a UCX tag receive may be larger than the message (it may not be
smaller: the message is then consumed and the receive fails "truncated"), and the header says how
many meta bytes are valid. One message halves the small-request round trip against two (header,
then meta). Truncation keeps the stream in step: an oversize message is consumed, answered with
`bad_request`, and the connection stays usable.

Payload messages are posted straight on their final buffers (arena view, caller's buffer): no copy
in Python. Inside UCX, an eager message (below `UCX_RNDV_THRESH`) that arrives before its receive is
posted is buffered and copied once; a rendezvous message waits at the sender until matched.

Before authentication (as the TCP transport, `kvfabric.dataplane.admission`): a connection
addressed to anything but the server's `host` is closed at once (ucxx's listener binds every
interface); with an `authenticate` function, the handshake and a first request that carries a
valid credential must arrive within the auth deadline, or the connection is closed; until then
nothing reaches the backend. Unauthenticated connections are bounded apart (the oldest is closed
to make room); authenticated ones in total and per peer address; an authenticated connection
silent for the idle timeout is closed (a UCX message arrives whole: no trickle reaches us).

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

Threading: a server or client belongs to the event loop it started (connected) on, whose worker
carries its transfers; the backend is called synchronously on that loop's thread and must not
block on it. Several loops (threads) may each run servers and clients: each has its own worker.

UCX settings: `ucx_env_defaults()` (measured, docs/ucx.md) are applied with
`os.environ.setdefault` just before ucxx is first imported, so anything set in the environment
wins. Import ucxx only through this module (ucxx sets `UCX_RNDV_THRESH=8192` at import when unset).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hashlib
import ipaddress
import itertools
import logging
import math
import mmap
import os
import select
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final

import msgspec

from kvfabric.dataplane.admission import (
    CONNECTIONS_MAX_DEFAULT,
    UNAUTHENTICATED_META_BYTES_MAX,
    Authenticator,
    ConnectionGate,
    ConnectionLimits,
)
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
from kvfabric.format.errors import (
    BadRequest,
    BatchTooLarge,
    Busy,
    Indeterminate,
    KvfError,
    Unauthorized,
    Unavailable,
)
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
    "UcxSyncClient",
    "apply_ucx_env_defaults",
    "ucx_env_defaults",
]

_log = logging.getLogger(__name__)

# Payload bytes one request may move (a PUT's object, the sum of a GET's objects): bounds what a
# connection holds in the arena (slot being written, transfer references) at any time.
INFLIGHT_BYTES_MAX_DEFAULT: Final = OBJECT_BYTES_MAX
IO_TIMEOUT_S_DEFAULT: Final = 60.0
# How long to wait for UCX to finish cancelled transfers after aborting an endpoint (µs in practice).
SETTLE_S: Final = 5.0
# How long a refused connection (busy, stopping) may stay open for its peer to read the refusal.
REJECT_LINGER_S: Final = 1.0
FRAME_BYTES_MAX: Final = HEADER.size + META_BYTES_MAX
CONNECT_TIMEOUT_S_DEFAULT: Final = 5.0
# Longest a progress turn runs before the loop gets control back (a long transfer continues in the
# next turn), and how often an idle worker is progressed anyway (as ucxx's blocking mode does: UCX
# may have work that raised no event).
TURN_S: Final = 0.002
TICK_S: Final = 1.0
# The peer-info message of ucxx's connection handshake (its own tag, a checksum of it): ucxx
# asyncio endpoints (ucxx.create_endpoint / create_listener) interoperate with this transport.
_PEER_INFO: Final = struct.Struct("QQ")

# Measured on loopback (2 cores), docs/ucx.md. Only TCP-transport knobs and the eager/rendezvous
# switch for transfers between hosts; everything else stays UCX's (or ucxx's) default.
_ENV_DEFAULTS: Final[dict[str, str]] = {
    "UCX_TCP_TX_SEG_SIZE": "1M",
    "UCX_TCP_RX_SEG_SIZE": "1M",
    "UCX_RNDV_THRESH": "inf",
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
_libucxx_module: Any = None
_array_type: Any = None


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


def _libucxx() -> Any:
    """ucxx's low-level bindings (worker, endpoint, listener, request)."""
    global _libucxx_module, _array_type
    if _libucxx_module is None:
        _ucxx()
        import ucxx._lib.libucxx as libucxx
        from ucxx._lib.arr import Array

        _array_type = Array
        _libucxx_module = libucxx
    return _libucxx_module


def _hash64bits(value: int) -> int:
    """ucxx's `hash64bits(value)` (the peer-info checksum of its handshake)."""
    return int(hashlib.sha1(repr((value,)).encode()).hexdigest()[:16], 16)


# ucp_ep_query (UCX >= 1.14): ucxx exposes no endpoint addresses, so they are read from UCP
# itself (already loaded by ucxx). ucp_ep_attr_t: field_mask (u64), name[UCP_ENTITY_NAME_MAX = 32],
# local_sockaddr, remote_sockaddr (struct sockaddr_storage, 128 bytes each), then more fields.
_EP_ATTR_LOCAL_SOCKADDR: Final = 1 << 1
_EP_ATTR_REMOTE_SOCKADDR: Final = 1 << 2
_EP_ATTR_LOCAL_OFFSET: Final = 8 + 32
_EP_ATTR_REMOTE_OFFSET: Final = 8 + 32 + 128
_EP_ATTR_BYTES: Final = 1024  # the struct is ~450 bytes: room to spare
_ucp_ep_query: Any = None


def _sockaddr_host(raw: bytes, offset: int) -> str | None:
    family = struct.unpack_from("=H", raw, offset)[0]
    if family == socket.AF_INET:
        return socket.inet_ntop(socket.AF_INET, raw[offset + 4 : offset + 8])
    if family == socket.AF_INET6:
        return socket.inet_ntop(socket.AF_INET6, raw[offset + 8 : offset + 24])
    return None


def _endpoint_hosts(ep: Any) -> tuple[str, str] | None:
    """(local address, peer address) of an accepted endpoint, or None when UCX cannot say. Does
    not progress UCX: callable from the listener callback."""
    global _ucp_ep_query
    try:
        if _ucp_ep_query is None:
            _libucxx()
            _ucp_ep_query = ctypes.CDLL("libucp.so.0", mode=os.RTLD_NOLOAD).ucp_ep_query
        attr = ctypes.create_string_buffer(_EP_ATTR_BYTES)
        struct.pack_into("=Q", attr, 0, _EP_ATTR_LOCAL_SOCKADDR | _EP_ATTR_REMOTE_SOCKADDR)
        if _ucp_ep_query(ctypes.c_void_p(int(ep.handle)), attr) != 0:  # UCS_OK
            return None
        raw = attr.raw
    except (OSError, AttributeError, ValueError, TypeError):
        return None
    local, remote = _sockaddr_host(raw, _EP_ATTR_LOCAL_OFFSET), _sockaddr_host(raw, _EP_ATTR_REMOTE_OFFSET)
    return (local, remote) if local is not None and remote is not None else None


_WILDCARD_HOSTS: Final = frozenset({"", "0.0.0.0", "::"})


def _host_addresses(host: str) -> frozenset[str] | None:
    """The addresses `host` names (None: a wildcard, every address is ours)."""
    if host in _WILDCARD_HOSTS:
        return None
    with contextlib.suppress(ValueError):
        return frozenset({str(ipaddress.ip_address(host))})
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return frozenset({host})
    return frozenset(str(info[4][0]) for info in infos)


class _Worker:
    """One UCX context and worker, progressed only by the event loop that created it.

    A turn (the worker's epoll fd became readable, a request was posted, or the 1 s tick) runs UCX
    progress until idle (at most `TURN_S`, then another turn is queued), resolves the future of
    every request that completed (its buffers stay referenced until then), and re-arms the worker
    so the next UCX event wakes the loop.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        u = _libucxx()
        self.loop = loop
        self.context = u.UCXContext({})
        self.worker = u.UCXWorker(self.context, enable_delayed_submission=False, enable_python_future=False)
        self.worker.init_blocking_progress_mode()
        self._pending: list[tuple[Any, asyncio.Future[None], Any]] = []
        self._scheduled = False
        loop.add_reader(self.worker.epoll_file_descriptor, self._turn)
        self._tick_handle = loop.call_later(TICK_S, self._tick)

    def post(self, request: Any, buffer: Any) -> asyncio.Future[None]:
        """A future resolved (or failed with the UCX error) once `request` completed. `buffer` is
        kept referenced until then, whatever happens to the future."""
        fut: asyncio.Future[None] = self.loop.create_future()
        if request.completed:  # e.g. an eager send (up to the TCP segment size) or an arrived message
            _resolve(request, fut)
        else:
            self._pending.append((request, fut, buffer))
        self.kick()  # UCX may still have bytes to push out or events to progress
        return fut

    def kick(self) -> None:
        """Queue a turn (call on the loop's thread)."""
        if not self._scheduled and not self.loop.is_closed():
            self._scheduled = True
            self.loop.call_soon(self._turn)

    def _tick(self) -> None:
        self._turn()
        if not self.loop.is_closed():
            self._tick_handle = self.loop.call_later(TICK_S, self._tick)

    def _turn(self) -> None:
        self._scheduled = False
        worker = self.worker
        deadline = time.monotonic() + TURN_S
        busy = False
        while worker.progress_once():
            if time.monotonic() > deadline:
                busy = True
                break
        if not busy:
            worker.progress()  # also cancels the requests of endpoints that failed meanwhile
        if self._pending:
            self._complete()
        if busy or not worker.arm():  # not armed: UCX has events to progress now
            self.kick()

    def _complete(self) -> None:
        keep = []
        for entry in self._pending:
            request, fut, _ = entry
            if not request.completed:
                keep.append(entry)
                continue
            if not fut.done():
                _resolve(request, fut)
        self._pending = keep


def _resolve(request: Any, fut: asyncio.Future[None]) -> None:
    """The outcome of a completed UCX request, into its future."""
    try:
        request.check_error()
    except Exception as exc:
        fut.set_exception(exc)
    else:
        fut.set_result(None)


_workers: dict[asyncio.AbstractEventLoop, _Worker] = {}
_workers_lock = threading.Lock()


def _worker_for_running_loop() -> _Worker:
    """The running loop's worker (created on first use; workers of closed loops are dropped)."""
    loop = asyncio.get_running_loop()
    with _workers_lock:
        worker = _workers.get(loop)
        if worker is None:
            for closed in [lp for lp in _workers if lp.is_closed()]:
                del _workers[closed]
            worker = _workers[loop] = _Worker(loop)
    return worker


def _frame(op: Op, request_id: int, meta: msgspec.Struct, payload_count: int = 0) -> bytes:
    body = encode(meta)
    return pack_header(op, request_id, len(body), payload_count) + body


def _error_frame(request_id: int, err: KvfError) -> bytes:
    return _frame(Op.ERROR, request_id, error_reply_from(err))


class _Truncated(Exception):
    """A message was larger than the buffer posted for it (UCX consumed and dropped it)."""


class _LinkDown(Exception):
    """The endpoint failed, was closed by the peer, or a transfer timed out (endpoint aborted)."""


_Op = tuple[bool, Any]  # (is a send, buffer): a transfer to post on a link


class _Link:
    """One UCX endpoint and its tag pair, with the rule that a buffer is released only after UCX is
    done with it."""

    def __init__(self, worker: _Worker, ep: Any, send_tag: int, recv_tag: int) -> None:
        u = _libucxx()
        self.worker = worker
        self.ep = ep
        self._send_tag = u.UCXXTag(send_tag)
        self._recv_tag = u.UCXXTag(recv_tag)
        self._mask = u.UCXXTagMaskFull
        self.aborted = False
        self.stuck = False  # UCX did not confirm cancelled transfers: never release their buffers

    @staticmethod
    def send(buf: Any) -> _Op:
        return (True, buf)

    @staticmethod
    def recv(buf: Any) -> _Op:
        return (False, buf)

    @property
    def alive(self) -> bool:
        return not self.aborted and bool(self.ep.alive)

    def abort(self) -> None:
        if not self.aborted:
            self.aborted = True
            _close_endpoint(self.worker, self.ep)

    def _post(self, op: _Op) -> asyncio.Future[None]:
        is_send, buf = op
        array = _array_type(buf)
        if is_send:
            request = self.ep.tag_send(array, self._send_tag)
        else:
            request = self.ep.tag_recv(array, self._recv_tag, self._mask)
        return self.worker.post(request, array)

    async def complete(self, ops: Sequence[_Op], timeout_s: float | None) -> None:
        """Post the transfers (in order) and wait until all finish.

        Raises `_Truncated` if one was truncated (all others succeeded), `_LinkDown` on any other
        failure or timeout. On timeout or cancellation the endpoint is aborted and the transfers
        are awaited (cancelled by UCX) before this returns or re-raises.
        """
        if self.aborted:
            raise _LinkDown("endpoint aborted")
        if not ops:
            return
        futs: list[asyncio.Future[None]] = []
        try:
            for op in ops:
                futs.append(self._post(op))
        except Exception as exc:
            self.abort()
            await self._settle(futs)
            raise _LinkDown(f"posting a transfer failed: {exc!r}") from exc
        pending: set[asyncio.Future[None]] = set()
        if not all(f.done() for f in futs):  # else all completed as posted: no turn of the loop
            try:
                _, pending = await asyncio.wait(futs, timeout=timeout_s, return_when=asyncio.FIRST_EXCEPTION)
            except asyncio.CancelledError:
                self.abort()
                await self._settle(futs)
                raise
        if pending:  # timed out, or one failed while others still run: the endpoint is done for
            self.abort()
            await self._settle(futs)
            failed = [f.exception() for f in futs if f.done() and f.exception()]
            raise _LinkDown(repr(failed[0]) if failed else f"transfer did not finish within {timeout_s} s")
        failures = [e for e in (f.exception() for f in futs) if e is not None]
        if not failures:
            return
        truncated = _libucxx().UCXMessageTruncatedError
        if all(isinstance(e, truncated) for e in failures):
            raise _Truncated(str(failures[0]))
        self.abort()
        raise _LinkDown(repr(next(e for e in failures if not isinstance(e, truncated))))

    async def _settle(self, futs: Sequence[asyncio.Future[None]]) -> None:
        if not futs:
            return
        try:
            _, pending = await asyncio.wait(futs, timeout=SETTLE_S)
        except asyncio.CancelledError:  # cancelled again while settling: assume the worst
            self.stuck = not all(f.done() for f in futs)
            raise
        for fut in futs:
            if fut.done():
                fut.exception()  # retrieved: no "exception never retrieved" noise
        if pending:
            self.stuck = True
            _log.error("ucx: %d transfer(s) not finished %s s after endpoint abort", len(pending), SETTLE_S)


def _close_endpoint(worker: _Worker, ep: Any) -> None:
    """Close `ep` at once (its in-flight requests are cancelled; they complete in the next turn)."""
    if worker.loop.is_running() and not _on_loop_thread(worker.loop):
        raise InvariantViolation("a UCX endpoint may only be closed from its event loop's thread")
    with contextlib.suppress(Exception):
        ep.close_blocking(period=10**9, max_attempts=1)  # no progress thread: progresses inline
    with contextlib.suppress(Exception):
        ep.remove_close_callback()
    worker.kick()


def _on_loop_thread(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


async def _handshake(worker: _Worker, ep: Any, *, listener: bool, timeout_s: float) -> _Link:
    """Agree the connection's tag pair, the way ucxx's asyncio API does (the listener sends its
    peer info first). Raises `_LinkDown` (the endpoint aborted) on failure or timeout."""
    own_tag = int.from_bytes(os.urandom(8), "little")
    mine = _array_type(_PEER_INFO.pack(own_tag, _hash64bits(own_tag)))
    theirs_buf = bytearray(_PEER_INFO.size)
    theirs = _array_type(theirs_buf)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    futs: list[asyncio.Future[None]] = []
    try:
        for is_send in (True, False) if listener else (False, True):
            request = ep.stream_send(mine) if is_send else ep.stream_recv(theirs)
            futs.append(worker.post(request, mine if is_send else theirs))
            done, _ = await asyncio.wait([futs[-1]], timeout=max(0.0, deadline - loop.time()))
            if not done:
                raise _LinkDown(f"no handshake within {timeout_s} s")
            futs[-1].result()
    except BaseException as exc:
        _close_endpoint(worker, ep)
        if futs:
            with contextlib.suppress(BaseException):
                await asyncio.wait(futs, timeout=SETTLE_S)
            for fut in futs:
                if fut.done():
                    fut.exception()
        if isinstance(exc, (_LinkDown, asyncio.CancelledError)) or not isinstance(exc, Exception):
            raise
        raise _LinkDown(f"handshake failed: {exc!r}") from exc
    peer_tag, checksum = _PEER_INFO.unpack(theirs_buf)
    if checksum != _hash64bits(peer_tag):
        _close_endpoint(worker, ep)
        raise _LinkDown("handshake: peer info checksum does not match")
    return _Link(worker, ep, send_tag=peer_tag, recv_tag=own_tag)


# ---- server ----------------------------------------------------------------------------------


@dataclass(eq=False)
class _Connection:
    conn: int
    link: _Link
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
    connection silent for the idle timeout is closed. Runs on the loop that called `start()`.
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
        self._worker: _Worker | None = None
        self._bound: frozenset[str] | None = None  # the addresses `host` names; None: every one
        self._accepting: set[asyncio.Task[None]] = set()  # every connection's task, from accept on
        self._tasks: dict[int, asyncio.Task[Any]] = {}  # connection id -> its task, from accept on
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
        self._bound = _host_addresses(self.host)  # an address: no lookup (a name: one, at start)
        self._worker = worker = _worker_for_running_loop()
        self._listener = _libucxx().UCXListener.create(
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
        task = worker.loop.create_task(self._on_connect(worker, ep, _endpoint_hosts(ep)))
        self._accepting.add(task)
        task.add_done_callback(self._accepting.discard)

    async def _on_connect(self, worker: _Worker, ep: Any, hosts: tuple[str, str] | None) -> None:
        """One accepted endpoint, for the connection's lifetime."""
        if self._bound is not None and (hosts is None or hosts[0] not in self._bound):
            self._count("wrong_address_total")  # not addressed to `host`: as if nobody listened there
            _close_endpoint(worker, ep)
            return
        source = hosts[1] if hosts is not None else ""
        limits = self.gate.limits
        loop = asyncio.get_running_loop()
        auth_deadline = loop.time() + limits.auth_deadline_ms / 1000
        conn = next(self._ids)
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
        self, worker: _Worker, ep: Any, conn: int, auth_deadline: float, refusal: KvfError | None
    ) -> None:
        loop = asyncio.get_running_loop()
        handshake_s = self.connect_timeout_s
        if self.authenticate is not None:  # the handshake counts against the auth deadline
            handshake_s = min(handshake_s, max(0.0, auth_deadline - loop.time()))
        try:
            link = await _handshake(worker, ep, listener=True, timeout_s=handshake_s)
        except _LinkDown as exc:
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
            await link.complete([link.send(_error_frame(0, err))], REJECT_LINGER_S)
            while (left := deadline - loop.time()) > 0:
                with contextlib.suppress(_Truncated):
                    await link.complete([link.recv(scratch)], left)
        link.abort()

    async def _serve(self, c: _Connection, auth_deadline: float | None) -> None:
        """Requests in order. `auth_deadline` (loop time): the connection is not authenticated
        yet and must be by then; until it is, anything but a valid first request closes it."""
        frame = memoryview(c.buf)
        loop = asyncio.get_running_loop()
        idle_s = self.gate.limits.idle_timeout_ms / 1000
        try:
            while True:
                authenticated = auth_deadline is None
                wait_s = idle_s if auth_deadline is None else max(0.0, auth_deadline - loop.time())
                try:
                    await c.link.complete([c.link.recv(c.buf)], wait_s)
                except _Truncated:
                    too_big = BadRequest(f"frame exceeds {FRAME_BYTES_MAX} bytes")
                    await self._send(c, _error_frame(0, too_big))
                    if not authenticated:
                        return
                    continue
                except _LinkDown:
                    if loop.time() >= (auth_deadline if auth_deadline is not None else math.inf):
                        self._count("closed_auth_deadline_total")
                    raise
                try:
                    header = unpack_header(frame[: HEADER.size])
                except KvfError as err:  # not our framing: answer once, then drop the connection
                    await self._send(c, _error_frame(0, err))
                    return
                try:
                    if not authenticated and header.meta_bytes > UNAUTHENTICATED_META_BYTES_MAX:
                        raise BadRequest(
                            f"a first request's meta may be at most {UNAUTHENTICATED_META_BYTES_MAX} bytes"
                        )
                    meta = dataplane_decoder.decode(frame[HEADER.size : HEADER.size + header.meta_bytes])
                except KvfError as err:
                    if not authenticated:
                        await self._send(c, _error_frame(header.request_id, err))
                        return
                    await self._refuse(c, header, err)
                    continue
                if not authenticated:
                    refusal = self._admit(c.conn, meta)
                    if refusal is not None:
                        await self._send(c, _error_frame(header.request_id, refusal))
                        return
                    auth_deadline = None
                await self._dispatch(c, header, meta)
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
        await c.link.complete([c.link.send(frame)], self.io_timeout_s)

    async def _refuse(self, c: _Connection, header: Header, err: KvfError) -> None:
        """Consume the payload messages the request declared, then answer `err`."""
        if header.payload_count:
            scratch = bytearray(1)
            for _ in range(header.payload_count):
                with contextlib.suppress(_Truncated):
                    await c.link.complete([c.link.recv(scratch)], self.io_timeout_s)
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
            await c.link.complete([c.link.recv(put.view)], self.io_timeout_s)
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
            link = c.link
            await link.complete([link.send(reply), *(link.send(v) for v in views)], self.io_timeout_s)
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


class _BadReply(Exception):
    """A reply to raise as `err`; `drop`: the connection is out of step (close it first)."""

    def __init__(self, err: KvfError, drop: bool) -> None:
        super().__init__(err.message)
        self.err = err
        self.drop = drop


def _decode_reply(buf: mmap.mmap, request_id: int) -> tuple[object, int]:
    """The reply frame in `buf` (meta, payload count); `_BadReply` for an ERROR frame or a frame
    that is not the reply to `request_id`."""
    frame = memoryview(buf)
    try:
        try:
            header = unpack_header(frame[: HEADER.size])
        except KvfError as exc:
            raise _BadReply(Indeterminate(f"malformed reply frame: {exc.message}"), drop=True) from None
        body = frame[HEADER.size : HEADER.size + header.meta_bytes]
        if header.op is Op.ERROR:
            # request id 0: connection-level (busy, bad framing): the segment closes it
            raise _BadReply(
                error_from_reply(_error_decoder.decode(body)), drop=header.request_id != request_id
            )
        if header.op is not Op.REPLY or header.request_id != request_id:
            what = f"reply {header.op.name} #{header.request_id} to request #{request_id}"
            raise _BadReply(Indeterminate(what), drop=True)
        return dataplane_decoder.decode(body), header.payload_count
    finally:
        frame.release()


def _get_views(reads: list[ReadRef], dests: Sequence[Any]) -> list[memoryview]:
    """The first `size_bytes` of each destination (checked: one per read, writable, large enough)."""
    if len(dests) != len(reads):
        raise BadRequest("one destination buffer per read")
    views: list[memoryview] = []
    for ref, dest in zip(reads, dests, strict=True):
        view = _byte_view(dest, writable=True)
        if view.nbytes < ref.size_bytes:
            raise BadRequest(f"destination is {view.nbytes} bytes, object is {ref.size_bytes}")
        views.append(view[: ref.size_bytes])
    return views


def _put_view(ticket: WriteTicket, data: Any) -> memoryview:
    view = _byte_view(data, writable=False)
    if view.nbytes != ticket.size_bytes:
        raise BadRequest(f"buffer is {view.nbytes} bytes, ticket says {ticket.size_bytes}")
    return view


def _ok_views(
    reply: object, reads: list[ReadRef], views: list[memoryview], payload_count: int
) -> list[memoryview]:
    """The destinations the GET reply's payload messages go to; `_BadReply` when it is malformed."""
    if not isinstance(reply, GetReply) or len(reply.results) != len(reads):
        raise _BadReply(Indeterminate("malformed GET reply"), drop=True)
    ok = [v for r, v in zip(reply.results, views, strict=True) if r.status == "ok"]
    if len(ok) != payload_count:
        raise _BadReply(Indeterminate("GET reply payload count does not match its results"), drop=True)
    return ok


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
        connect_timeout_s: float = CONNECT_TIMEOUT_S_DEFAULT,
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
        link = self._link
        if link is not None:
            if link.alive and link.worker.loop is asyncio.get_running_loop():
                return link
            self._drop()  # closed by the segment, failed, or connected on another (finished) loop
        worker = _worker_for_running_loop()
        try:
            ep = _libucxx().UCXEndpoint.create(worker.worker, self.host, self.port, True)
            self._link = await _handshake(worker, ep, listener=False, timeout_s=self.connect_timeout_s)
        except (_LinkDown, _libucxx().UCXError, OSError) as exc:
            raise Unavailable(f"cannot connect to {self.address}: {exc}", address=self.address) from exc
        return self._link

    async def _call(
        self, op: Op, meta: msgspec.Struct, payload: Sequence[memoryview] = ()
    ) -> tuple[object, int, _Link]:
        """Send the request (and its payload) with the reply's receive posted alongside."""
        link = await self._ensure()
        request_id = next(self._ids)
        frame = _frame(op, request_id, meta, len(payload))
        if len(frame) > FRAME_BYTES_MAX:
            raise BadRequest(f"request frame of {len(frame)} bytes exceeds {FRAME_BYTES_MAX}")
        transfers = [link.send(frame), *(link.send(p) for p in payload), link.recv(self._buf)]
        try:
            await link.complete(transfers, self.io_timeout_s)
        except _Truncated as exc:  # only a receive truncates: the reply
            self._drop()
            raise Indeterminate(f"reply frame exceeds {FRAME_BYTES_MAX} bytes") from exc
        except _LinkDown as exc:
            self._drop()
            raise Indeterminate(f"ucx connection failed during {op.name}: {exc}") from exc
        try:
            reply, payload_count = _decode_reply(self._buf, request_id)
        except _BadReply as bad:
            if bad.drop:
                self._drop()
            raise bad.err from None
        return reply, payload_count, link

    async def put(self, ticket: WriteTicket, data: Any) -> PutReply:
        """Send one object's bytes (any C-contiguous buffer) under a signed ticket."""
        view = _put_view(ticket, data)
        async with self._lock:
            reply, _, _ = await self._call(Op.PUT, PutRequest(ticket=ticket), [view])
        if not isinstance(reply, PutReply):
            raise Indeterminate(f"unexpected reply {type(reply).__name__} to PUT")
        return reply

    async def get(self, reads: list[ReadRef], dests: Sequence[Any]) -> list[ObjectResult]:
        """Read objects straight into `dests` (one writable buffer of at least `size_bytes` per
        read; the first `size_bytes` are written). Only `ok` results are written; the caller
        verifies checksums."""
        views = _get_views(reads, dests)
        async with self._lock:
            reply, payload_count, link = await self._call(Op.GET, GetRequest(reads=reads))
            try:
                ok = _ok_views(reply, reads, views, payload_count)
            except _BadReply as bad:
                self._drop()
                raise bad.err from None
            if ok:
                try:
                    await link.complete([link.recv(v) for v in ok], self.io_timeout_s)
                except (_LinkDown, _Truncated) as exc:
                    self._drop()
                    raise Indeterminate(f"ucx connection failed during GET payload: {exc}") from exc
        assert isinstance(reply, GetReply)
        return reply.results


# ---- blocking client -----------------------------------------------------------------------------


class _SyncLink:
    """One endpoint on a worker that the calling thread progresses itself (epoll when idle)."""

    def __init__(self, host: str, port: int, connect_timeout_s: float) -> None:
        u = _libucxx()
        self.context = u.UCXContext({})
        self.worker = u.UCXWorker(self.context, enable_delayed_submission=False, enable_python_future=False)
        self.worker.init_blocking_progress_mode()
        self._epoll = select.epoll()
        self._epoll.register(self.worker.epoll_file_descriptor, select.EPOLLIN)
        self._mask = u.UCXXTagMaskFull
        self.aborted = False
        self.stuck = False  # UCX did not confirm cancelled transfers: their buffers stay referenced
        self._leaked: list[Any] = []
        try:
            self.ep = u.UCXEndpoint.create(self.worker, host, port, True)
            self._send_tag, self._recv_tag = self._handshake(connect_timeout_s)
        except BaseException:
            self.close()
            raise

    def _handshake(self, timeout_s: float) -> tuple[Any, Any]:
        u = _libucxx()
        own_tag = int.from_bytes(os.urandom(8), "little")
        theirs_buf = bytearray(_PEER_INFO.size)
        theirs = _array_type(theirs_buf)
        mine = _array_type(_PEER_INFO.pack(own_tag, _hash64bits(own_tag)))
        deadline = time.monotonic() + timeout_s
        try:
            self._wait([(self.ep.stream_recv(theirs), theirs)], deadline)  # the listener sends first
            self._wait([(self.ep.stream_send(mine), mine)], deadline)
        except _Truncated as exc:  # what a refused or reset connection looks like here
            raise _LinkDown(f"handshake failed: {exc}") from exc
        peer_tag, checksum = _PEER_INFO.unpack(theirs_buf)
        if checksum != _hash64bits(peer_tag):
            raise _LinkDown("handshake: peer info checksum does not match")
        return u.UCXXTag(peer_tag), u.UCXXTag(own_tag)

    def complete(self, ops: Sequence[_Op], timeout_s: float) -> None:
        """Post the transfers (in order) and progress until all finish; `_Truncated` /
        `_LinkDown` as `_Link.complete` (on failure or timeout the endpoint is aborted first)."""
        if self.aborted:
            raise _LinkDown("endpoint aborted")
        posted: list[tuple[Any, Any]] = []
        try:
            for is_send, buf in ops:
                array = _array_type(buf)
                if is_send:
                    posted.append((self.ep.tag_send(array, self._send_tag), array))
                else:
                    posted.append((self.ep.tag_recv(array, self._recv_tag, self._mask), array))
        except Exception as exc:
            self._abort_and_settle(posted)
            raise _LinkDown(f"posting a transfer failed: {exc!r}") from exc
        self._wait(posted, time.monotonic() + timeout_s)

    def _wait(self, posted: list[tuple[Any, Any]], deadline: float) -> None:
        worker = self.worker
        try:
            while not all(request.completed for request, _ in posted):
                if worker.progress_once():
                    continue
                worker.progress()  # idle: also cancels requests of a failed endpoint
                if all(request.completed for request, _ in posted):
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise _LinkDown("transfer did not finish in time")
                if worker.arm():  # nothing to progress: sleep until UCX has an event
                    self._epoll.poll(min(left, TICK_S))
        except BaseException:  # timeout, KeyboardInterrupt: UCX must let go of the buffers first
            self._abort_and_settle(posted)
            raise
        failures = []
        for request, _ in posted:
            try:
                request.check_error()
            except Exception as exc:
                failures.append(exc)
        if not failures:
            return
        truncated = _libucxx().UCXMessageTruncatedError
        if all(isinstance(e, truncated) for e in failures):
            raise _Truncated(str(failures[0]))
        self.abort()
        raise _LinkDown(repr(next(e for e in failures if not isinstance(e, truncated))))

    def _abort_and_settle(self, posted: list[tuple[Any, Any]]) -> None:
        self.abort()
        deadline = time.monotonic() + SETTLE_S
        while not all(request.completed for request, _ in posted) and time.monotonic() < deadline:
            self.worker.progress()
            time.sleep(0.001)
        if not all(request.completed for request, _ in posted):
            self.stuck = True
            self._leaked.extend(posted)  # never released while UCX might still use them
            _log.error("ucx: transfers not finished %s s after endpoint abort", SETTLE_S)

    def abort(self) -> None:
        if not self.aborted:
            self.aborted = True
            ep = getattr(self, "ep", None)
            if ep is not None:
                with contextlib.suppress(Exception):
                    ep.close_blocking(period=10**9, max_attempts=1)
                with contextlib.suppress(Exception):
                    ep.remove_close_callback()

    @property
    def alive(self) -> bool:
        return not self.aborted and bool(self.ep.alive)

    def close(self) -> None:
        self.abort()
        with contextlib.suppress(Exception):
            self.worker.progress()
        if not self.stuck:
            self._epoll.close()


_stuck_sync_links: list[_SyncLink] = []  # links whose transfers UCX never confirmed (not observed)


class UcxSyncClient:
    """A blocking UCX client (the API of `TcpDataClient`: `put`, `get`, `close`), for callers on
    threads. It owns a UCX context and worker that the calling thread progresses during a call and
    sleeps on (epoll) when UCX has nothing to do: no event loop, no threads, no hand-off between
    threads. One request at a time (a lock); open several clients for parallelism.

    Connects on first use; after a transport failure the next call reconnects. Errors as
    `UcxClient`: the segment's typed `KvfError`, `Unavailable`, `Indeterminate`.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        io_timeout_s: float = IO_TIMEOUT_S_DEFAULT,
        connect_timeout_s: float = CONNECT_TIMEOUT_S_DEFAULT,
    ) -> None:
        self.host = host
        self.port = port
        self.io_timeout_s = io_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._link: _SyncLink | None = None
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._buf = mmap.mmap(-1, FRAME_BYTES_MAX)
        self._closed = False

    @classmethod
    def from_address(cls, address: str, **kwargs: Any) -> UcxSyncClient:
        """`ucx://host:port`."""
        if not address.startswith("ucx://"):
            raise BadRequest(f"not a ucx data address: {address!r}")
        host, _, port = address.removeprefix("ucx://").rpartition(":")
        return cls(host, int(port), **kwargs)

    @property
    def address(self) -> str:
        return f"ucx://{self.host}:{self.port}"

    def connect(self) -> None:
        with self._lock:
            self._ensure()

    def close(self) -> None:
        """Abort the connection (the segment releases what it held for it). Idempotent. Waits for
        a call in progress on another thread (at most its `io_timeout_s`): only the thread holding
        the client may progress its worker."""
        with self._lock:
            self._closed = True
            self._drop()

    def __enter__(self) -> UcxSyncClient:
        self.connect()
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _drop(self) -> None:
        if self._link is not None:
            self._link.close()
            if self._link.stuck:  # UCX never let go of its buffers: keep it all, never reuse
                _stuck_sync_links.append(self._link)
            self._link = None

    def _ensure(self) -> _SyncLink:
        if self._closed:
            raise Unavailable("ucx client is closed")
        if self._link is not None:
            if self._link.alive:
                return self._link
            self._drop()  # closed by the segment or failed: reconnect
        try:
            self._link = _SyncLink(self.host, self.port, self.connect_timeout_s)
        except (_LinkDown, _libucxx().UCXError, OSError) as exc:
            raise Unavailable(f"cannot connect to {self.address}: {exc}", address=self.address) from exc
        return self._link

    def _call(self, op: Op, meta: msgspec.Struct, payload: Sequence[memoryview] = ()) -> tuple[object, int]:
        link = self._ensure()
        request_id = next(self._ids)
        frame = _frame(op, request_id, meta, len(payload))
        if len(frame) > FRAME_BYTES_MAX:
            raise BadRequest(f"request frame of {len(frame)} bytes exceeds {FRAME_BYTES_MAX}")
        try:
            link.complete(
                [(True, frame), *((True, p) for p in payload), (False, self._buf)], self.io_timeout_s
            )
        except _Truncated as exc:
            self._drop()
            raise Indeterminate(f"reply frame exceeds {FRAME_BYTES_MAX} bytes") from exc
        except _LinkDown as exc:
            self._drop()
            raise Indeterminate(f"ucx connection failed during {op.name}: {exc}") from exc
        try:
            return _decode_reply(self._buf, request_id)
        except _BadReply as bad:
            if bad.drop:
                self._drop()
            raise bad.err from None

    def put(self, ticket: WriteTicket, data: Any) -> PutReply:
        """Send one object's bytes (any C-contiguous buffer) under a signed ticket."""
        view = _put_view(ticket, data)
        with self._lock:
            reply, _ = self._call(Op.PUT, PutRequest(ticket=ticket), [view])
        if not isinstance(reply, PutReply):
            raise Indeterminate(f"unexpected reply {type(reply).__name__} to PUT")
        return reply

    def get(self, reads: list[ReadRef], dests: Sequence[Any]) -> list[ObjectResult]:
        """Read objects straight into `dests` (as `UcxClient.get`); the caller verifies checksums."""
        views = _get_views(reads, dests)
        with self._lock:
            reply, payload_count = self._call(Op.GET, GetRequest(reads=reads))
            try:
                ok = _ok_views(reply, reads, views, payload_count)
            except _BadReply as bad:
                self._drop()
                raise bad.err from None
            if ok:
                link = self._link
                assert link is not None
                try:
                    link.complete([(False, v) for v in ok], self.io_timeout_s)
                except (_LinkDown, _Truncated) as exc:
                    self._drop()
                    raise Indeterminate(f"ucx connection failed during GET payload: {exc}") from exc
        assert isinstance(reply, GetReply)
        return reply.results
