"""The UCX transport's endpoint layer, shared by `ucx_server` and `ucx_client`: UCX settings and the
one import of ucxx, the per-loop worker progressed by its event loop (`Worker`), a connection's
endpoint and tag pair (`Link`), ucxx's handshake, frames; the design is in `kvfabric.dataplane.ucx`."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hashlib
import ipaddress
import logging
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import MutableMapping, Sequence
from typing import Any, Final

import msgspec

from kvfabric.dataplane.frames import (
    HEADER,
    META_BYTES_MAX,
    Op,
    pack_header,
)
from kvfabric.format.errors import (
    KvfError,
    Unavailable,
)
from kvfabric.format.invariant import InvariantViolation
from kvfabric.proto.codec import encode
from kvfabric.proto.common import error_reply_from

# one logger for the whole UCX transport, as before its split
_log = logging.getLogger("kvfabric.dataplane.ucx")

IO_TIMEOUT_S_DEFAULT: Final = 60.0
# How long to wait for UCX to finish cancelled transfers after aborting an endpoint (µs in practice).
SETTLE_S: Final = 5.0
FRAME_BYTES_MAX: Final = HEADER.size + META_BYTES_MAX
CONNECT_TIMEOUT_S_DEFAULT: Final = 5.0
# Longest a progress turn runs before the loop gets control back (a long transfer continues in the
# next turn), and how often an idle worker is progressed anyway (as ucxx's blocking mode does: UCX
# may have work that raised no event).
TURN_S: Final = 0.002
TICK_S: Final = 1.0
# The peer-info message of ucxx's connection handshake (its own tag, a checksum of it): ucxx
# asyncio endpoints (ucxx.create_endpoint / create_listener) interoperate with this transport.
PEER_INFO: Final = struct.Struct("QQ")

# Measured on loopback (2 cores), docs/ucx.md. Only TCP-transport knobs and the eager/rendezvous
# switch for transfers between hosts; everything else stays UCX's (or ucxx's) default.
_ENV_DEFAULTS: Final[dict[str, str]] = {
    "UCX_TCP_TX_SEG_SIZE": "1M",
    "UCX_TCP_RX_SEG_SIZE": "1M",
    "UCX_RNDV_THRESH": "inf",
}


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


def libucxx() -> Any:
    """ucxx's low-level bindings (worker, endpoint, listener, request)."""
    global _libucxx_module, _array_type
    if _libucxx_module is None:
        _ucxx()
        import ucxx._lib.libucxx as libucxx
        from ucxx._lib.arr import Array

        _array_type = Array
        _libucxx_module = libucxx
    return _libucxx_module


def ucx_array(buf: Any) -> Any:
    """ucxx's `Array` over `buf` (a buffer to post; after `libucxx()` imported it)."""
    return _array_type(buf)


def hash64bits(value: int) -> int:
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


def endpoint_hosts(ep: Any) -> tuple[str, str] | None:
    """(local address, peer address) of an accepted endpoint, or None when UCX cannot say. Does
    not progress UCX: callable from the listener callback."""
    global _ucp_ep_query
    try:
        if _ucp_ep_query is None:
            libucxx()
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


def host_addresses(host: str) -> frozenset[str] | None:
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


class Worker:
    """One UCX context and worker, progressed only by the event loop that created it.

    A turn (the worker's epoll fd became readable, a request was posted, or the 1 s tick) runs UCX
    progress until idle (at most `TURN_S`, then another turn is queued), resolves the future of
    every request that completed (its buffers stay referenced until then), and re-arms the worker
    so the next UCX event wakes the loop.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        u = libucxx()
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


_workers: dict[asyncio.AbstractEventLoop, Worker] = {}
_workers_lock = threading.Lock()


def worker_for_running_loop() -> Worker:
    """The running loop's worker (created on first use; workers of closed loops are dropped)."""
    loop = asyncio.get_running_loop()
    with _workers_lock:
        worker = _workers.get(loop)
        if worker is None:
            for closed in [lp for lp in _workers if lp.is_closed()]:
                del _workers[closed]
            worker = _workers[loop] = Worker(loop)
    return worker


def encode_frame(op: Op, request_id: int, meta: msgspec.Struct, payload_count: int = 0) -> bytes:
    body = encode(meta)
    return pack_header(op, request_id, len(body), payload_count) + body


def error_frame(request_id: int, err: KvfError) -> bytes:
    return encode_frame(Op.ERROR, request_id, error_reply_from(err))


class Truncated(Exception):
    """A message was larger than the buffer posted for it (UCX consumed and dropped it)."""


class LinkDown(Exception):
    """The endpoint failed, was closed by the peer, or a transfer timed out (endpoint aborted)."""


class LinkTimeout(LinkDown):
    """`LinkDown` because the transfers did not finish within their timeout (none failed)."""


def transfer_failure(failures: Sequence[BaseException]) -> Truncated | LinkDown | None:
    """What a request's failed transfers mean: None when none failed; `Truncated` when each was
    a receive larger than its buffer (the endpoint stays usable); `LinkDown` otherwise (the
    caller aborts the endpoint)."""
    if not failures:
        return None
    truncated = libucxx().UCXMessageTruncatedError
    if all(isinstance(e, truncated) for e in failures):
        return Truncated(str(failures[0]))
    return LinkDown(repr(next(e for e in failures if not isinstance(e, truncated))))


LinkOp = tuple[bool, Any]  # (is a send, buffer): a transfer to post on a link


class Link:
    """One UCX endpoint and its tag pair, with the rule that a buffer is released only after UCX is
    done with it."""

    def __init__(self, worker: Worker, ep: Any, send_tag: int, recv_tag: int) -> None:
        u = libucxx()
        self.worker = worker
        self.ep = ep
        self._send_tag = u.UCXXTag(send_tag)
        self._recv_tag = u.UCXXTag(recv_tag)
        self._mask = u.UCXXTagMaskFull
        self.aborted = False
        self.stuck = False  # UCX did not confirm cancelled transfers: never release their buffers

    @staticmethod
    def send(buf: Any) -> LinkOp:
        return (True, buf)

    @staticmethod
    def recv(buf: Any) -> LinkOp:
        return (False, buf)

    @property
    def alive(self) -> bool:
        return not self.aborted and bool(self.ep.alive)

    def abort(self) -> None:
        if not self.aborted:
            self.aborted = True
            close_endpoint(self.worker, self.ep)

    def _post(self, op: LinkOp) -> asyncio.Future[None]:
        is_send, buf = op
        array = _array_type(buf)
        if is_send:
            request = self.ep.tag_send(array, self._send_tag)
        else:
            request = self.ep.tag_recv(array, self._recv_tag, self._mask)
        return self.worker.post(request, array)

    async def complete(self, ops: Sequence[LinkOp], timeout_s: float | None) -> None:
        """Post the transfers (in order) and wait until all finish.

        Raises `Truncated` if one was truncated (all others succeeded), `LinkDown` on any other
        failure, `LinkTimeout` (a `LinkDown`) on a timeout. On timeout or cancellation the
        endpoint is aborted and the transfers are awaited (cancelled by UCX) before this returns
        or re-raises.
        """
        if self.aborted:
            raise LinkDown("endpoint aborted")
        if not ops:
            return
        futs: list[asyncio.Future[None]] = []
        try:
            for op in ops:
                futs.append(self._post(op))
        except Exception as exc:
            self.abort()
            await self._settle(futs)
            raise LinkDown(f"posting a transfer failed: {exc!r}") from exc
        pending: set[asyncio.Future[None]] = set()
        if not all(f.done() for f in futs):  # else all completed as posted: no turn of the loop
            try:
                _, pending = await asyncio.wait(futs, timeout=timeout_s, return_when=asyncio.FIRST_EXCEPTION)
            except asyncio.CancelledError:
                self.abort()
                await self._settle(futs)
                raise
        if pending:  # timed out, or one failed while others still run: the endpoint is done for
            # (before the abort: the transfers it cancels then fail too)
            timed_out = not any(f.done() and not f.cancelled() and f.exception() for f in futs)
            self.abort()
            await self._settle(futs)
            if timed_out:
                raise LinkTimeout(f"transfer did not finish within {timeout_s} s")
            failed = [f.exception() for f in futs if f.done() and f.exception()]
            raise LinkDown(repr(failed[0]) if failed else f"transfer did not finish within {timeout_s} s")
        failure = transfer_failure([e for e in (f.exception() for f in futs) if e is not None])
        if isinstance(failure, LinkDown):
            self.abort()
        if failure is not None:
            raise failure

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


def close_endpoint(worker: Worker, ep: Any) -> None:
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


async def handshake(worker: Worker, ep: Any, *, listener: bool, timeout_s: float) -> Link:
    """Agree the connection's tag pair, the way ucxx's asyncio API does (the listener sends its
    peer info first). Raises `LinkDown` (the endpoint aborted) on failure, `LinkTimeout` on a
    timeout."""
    own_tag = int.from_bytes(os.urandom(8), "little")
    mine = _array_type(PEER_INFO.pack(own_tag, hash64bits(own_tag)))
    theirs_buf = bytearray(PEER_INFO.size)
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
                raise LinkTimeout(f"no handshake within {timeout_s} s")
            futs[-1].result()
    except BaseException as exc:
        close_endpoint(worker, ep)
        if futs:
            with contextlib.suppress(BaseException):
                await asyncio.wait(futs, timeout=SETTLE_S)
            for fut in futs:
                if fut.done():
                    fut.exception()
        if isinstance(exc, (LinkDown, asyncio.CancelledError)) or not isinstance(exc, Exception):
            raise
        raise LinkDown(f"handshake failed: {exc!r}") from exc
    peer_tag, checksum = PEER_INFO.unpack(theirs_buf)
    if checksum != hash64bits(peer_tag):
        close_endpoint(worker, ep)
        raise LinkDown("handshake: peer info checksum does not match")
    return Link(worker, ep, send_tag=peer_tag, recv_tag=own_tag)
