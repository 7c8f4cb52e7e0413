"""The UCX transport's clients: `UcxClient` (asyncio, progressed by its loop) and `UcxSyncClient`
(blocking, progressed by its caller's thread); the design is in `kvfabric.dataplane.ucx`."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import mmap
import os
import select
import threading
import time
from collections.abc import Sequence
from typing import Any, Generic, Self, TypeVar

import msgspec

from kvfabric.dataplane.backend import put_claim  # a checksum-less ticket travels sealed, with its claim
from kvfabric.dataplane.frames import (
    HEADER,
    Op,
    unpack_header,
)
from kvfabric.dataplane.ucx_link import (
    CONNECT_TIMEOUT_S_DEFAULT,
    FRAME_BYTES_MAX,
    IO_TIMEOUT_S_DEFAULT,
    PEER_INFO,
    SETTLE_S,
    TICK_S,
    Link,
    LinkDown,
    LinkOp,
    Truncated,
    encode_frame,
    handshake,
    hash64bits,
    libucxx,
    transfer_failure,
    ucx_array,
    worker_for_running_loop,
)
from kvfabric.format.errors import (
    BadRequest,
    Indeterminate,
    KvfError,
    Unavailable,
)
from kvfabric.proto.codec import FamilyDecoder
from kvfabric.proto.common import ErrorReply, error_from_reply
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

# one logger for the whole UCX transport, as before its split
_log = logging.getLogger("kvfabric.dataplane.ucx")

_LockT = TypeVar("_LockT", asyncio.Lock, threading.Lock)

_error_decoder: FamilyDecoder[ErrorReply] = FamilyDecoder(ErrorReply, "dataplane error")


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


def _put_reply(reply: object) -> PutReply:
    if not isinstance(reply, PutReply):
        raise Indeterminate(f"unexpected reply {type(reply).__name__} to PUT")
    return reply


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


class _UcxClientBase(Generic[_LockT]):
    """What both UCX clients hold alike: the segment's address, the timeouts, the request ids,
    the reply buffer and a lock (an asyncio one for `UcxClient`, a thread's for `UcxSyncClient`)."""

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
        self._lock: _LockT = self._new_lock()
        self._ids = itertools.count(1)
        self._buf = mmap.mmap(-1, FRAME_BYTES_MAX)
        self._closed = False

    def _new_lock(self) -> _LockT:
        raise NotImplementedError

    @classmethod
    def from_address(cls, address: str, **kwargs: Any) -> Self:
        """`ucx://host:port`."""
        if not address.startswith("ucx://"):
            raise BadRequest(f"not a ucx data address: {address!r}")
        host, _, port = address.removeprefix("ucx://").rpartition(":")
        return cls(host, int(port), **kwargs)

    @property
    def address(self) -> str:
        return f"ucx://{self.host}:{self.port}"

    def _drop(self) -> None:
        raise NotImplementedError

    def _frame(self, op: Op, meta: msgspec.Struct, payload_count: int) -> tuple[int, bytes]:
        """A request's id and frame (`BadRequest` when the frame is over `FRAME_BYTES_MAX`)."""
        request_id = next(self._ids)
        frame = encode_frame(op, request_id, meta, payload_count)
        if len(frame) > FRAME_BYTES_MAX:
            raise BadRequest(f"request frame of {len(frame)} bytes exceeds {FRAME_BYTES_MAX}")
        return request_id, frame

    def _lost(self, op: Op, exc: Truncated | LinkDown) -> Indeterminate:
        """A request's transfers failed: the connection is dropped, and the request may or may
        not have landed."""
        self._drop()
        if isinstance(exc, Truncated):  # only a receive truncates: the reply
            return Indeterminate(f"reply frame exceeds {FRAME_BYTES_MAX} bytes")
        return Indeterminate(f"ucx connection failed during {op.name}: {exc}")

    def _payload_views(
        self, reply: object, reads: list[ReadRef], views: list[memoryview], payload_count: int
    ) -> list[memoryview]:
        """`_ok_views`; a malformed GET reply drops the connection and raises its error."""
        try:
            return _ok_views(reply, reads, views, payload_count)
        except _BadReply as bad:
            self._drop()
            raise bad.err from None

    def _payload_lost(self, exc: Truncated | LinkDown) -> Indeterminate:
        """A GET's payload transfers failed: the connection is dropped."""
        self._drop()
        return Indeterminate(f"ucx connection failed during GET payload: {exc}")

    def _reply(self, request_id: int) -> tuple[object, int]:
        """The reply in the buffer and its payload count; a bad reply raises its error (and drops
        the connection where it leaves it out of step)."""
        try:
            return _decode_reply(self._buf, request_id)
        except _BadReply as bad:
            if bad.drop:
                self._drop()
            raise bad.err from None


class UcxClient(_UcxClientBase[asyncio.Lock]):
    """One UCX connection to a segment's data port; one request at a time (an asyncio lock).

    Connects on first use (or `await connect()`); after a transport failure the next call
    reconnects. Errors: the segment's typed `KvfError`; `Unavailable` when it cannot be reached;
    `Indeterminate` when the connection failed mid-request (a PUT may or may not have landed).
    Cancelling a call aborts the connection (UCX stops writing the caller's buffers first).
    """

    _link: Link | None = None

    def _new_lock(self) -> asyncio.Lock:
        return asyncio.Lock()

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

    async def _ensure(self) -> Link:
        if self._closed:
            raise Unavailable("ucx client is closed")
        link = self._link
        if link is not None:
            if link.alive and link.worker.loop is asyncio.get_running_loop():
                return link
            self._drop()  # closed by the segment, failed, or connected on another (finished) loop
        worker = worker_for_running_loop()
        try:
            ep = libucxx().UCXEndpoint.create(worker.worker, self.host, self.port, True)
            self._link = await handshake(worker, ep, listener=False, timeout_s=self.connect_timeout_s)
        except (LinkDown, libucxx().UCXError, OSError) as exc:
            raise Unavailable(f"cannot connect to {self.address}: {exc}", address=self.address) from exc
        return self._link

    async def _call(
        self, op: Op, meta: msgspec.Struct, payload: Sequence[memoryview] = ()
    ) -> tuple[object, int, Link]:
        """Send the request (and its payload) with the reply's receive posted alongside."""
        link = await self._ensure()
        request_id, frame = self._frame(op, meta, len(payload))
        transfers = [link.send(frame), *(link.send(p) for p in payload), link.recv(self._buf)]
        try:
            await link.complete(transfers, self.io_timeout_s)
        except (Truncated, LinkDown) as exc:
            raise self._lost(op, exc) from exc
        reply, payload_count = self._reply(request_id)
        return reply, payload_count, link

    async def put(
        self,
        ticket: WriteTicket,
        data: Any,
        *,
        receipt: bool = False,
        trace_id: str = "",
        save_writes: int = 0,
    ) -> PutReply:
        """Send one object's bytes (any C-contiguous buffer) under a signed ticket; with
        `receipt`, answered with a write receipt once stored and verified (the caller's
        put_commit carries it). A checksum-less ticket goes sealed with the writer's claim of
        the bytes' checksum (`put_claim`, as over TCP: the segment refused it without one, after
        the payload; review, stop 70); `trace_id` and `save_writes` as `TcpDataClient.put`."""
        view = _put_view(ticket, data)
        as_sent, claimed, proof = put_claim(ticket, view, None)
        async with self._lock:
            request = PutRequest(
                ticket=as_sent,
                receipt=receipt,
                trace_id=trace_id,
                save_writes=save_writes,
                checksum=claimed,
                claim_proof=proof,
            )
            reply, _, _ = await self._call(Op.PUT, request, [view])
        return _put_reply(reply)

    async def get(self, reads: list[ReadRef], dests: Sequence[Any]) -> list[ObjectResult]:
        """Read objects straight into `dests` (one writable buffer of at least `size_bytes` per
        read; the first `size_bytes` are written). Only `ok` results are written; the caller
        verifies checksums."""
        views = _get_views(reads, dests)
        async with self._lock:
            reply, payload_count, link = await self._call(Op.GET, GetRequest(reads=reads))
            ok = self._payload_views(reply, reads, views, payload_count)
            if ok:
                try:
                    await link.complete([link.recv(v) for v in ok], self.io_timeout_s)
                except (LinkDown, Truncated) as exc:
                    raise self._payload_lost(exc) from exc
        assert isinstance(reply, GetReply)
        return reply.results


# ---- blocking client -----------------------------------------------------------------------------


class _SyncLink:
    """One endpoint on a worker that the calling thread progresses itself (epoll when idle)."""

    def __init__(self, host: str, port: int, connect_timeout_s: float) -> None:
        u = libucxx()
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
        u = libucxx()
        own_tag = int.from_bytes(os.urandom(8), "little")
        theirs_buf = bytearray(PEER_INFO.size)
        theirs = ucx_array(theirs_buf)
        mine = ucx_array(PEER_INFO.pack(own_tag, hash64bits(own_tag)))
        deadline = time.monotonic() + timeout_s
        try:
            self._wait([(self.ep.stream_recv(theirs), theirs)], deadline)  # the listener sends first
            self._wait([(self.ep.stream_send(mine), mine)], deadline)
        except Truncated as exc:  # what a refused or reset connection looks like here
            raise LinkDown(f"handshake failed: {exc}") from exc
        peer_tag, checksum = PEER_INFO.unpack(theirs_buf)
        if checksum != hash64bits(peer_tag):
            raise LinkDown("handshake: peer info checksum does not match")
        return u.UCXXTag(peer_tag), u.UCXXTag(own_tag)

    def complete(self, ops: Sequence[LinkOp], timeout_s: float) -> None:
        """Post the transfers (in order) and progress until all finish; `Truncated` /
        `LinkDown` as `Link.complete` (on failure or timeout the endpoint is aborted first)."""
        if self.aborted:
            raise LinkDown("endpoint aborted")
        posted: list[tuple[Any, Any]] = []
        try:
            for is_send, buf in ops:
                array = ucx_array(buf)
                if is_send:
                    posted.append((self.ep.tag_send(array, self._send_tag), array))
                else:
                    posted.append((self.ep.tag_recv(array, self._recv_tag, self._mask), array))
        except Exception as exc:
            self._abort_and_settle(posted)
            raise LinkDown(f"posting a transfer failed: {exc!r}") from exc
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
                    raise LinkDown("transfer did not finish in time")
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
        failure = transfer_failure(failures)
        if isinstance(failure, LinkDown):
            self.abort()
        if failure is not None:
            raise failure

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


class UcxSyncClient(_UcxClientBase[threading.Lock]):
    """A blocking UCX client (the API of `TcpDataClient`: `put`, `get`, `close`), for callers on
    threads. It owns a UCX context and worker that the calling thread progresses during a call and
    sleeps on (epoll) when UCX has nothing to do: no event loop, no threads, no hand-off between
    threads. One request at a time (a lock); open several clients for parallelism.

    Connects on first use; after a transport failure the next call reconnects. Errors as
    `UcxClient`: the segment's typed `KvfError`, `Unavailable`, `Indeterminate`.
    """

    _link: _SyncLink | None = None

    def _new_lock(self) -> threading.Lock:
        return threading.Lock()

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
        except (LinkDown, libucxx().UCXError, OSError) as exc:
            raise Unavailable(f"cannot connect to {self.address}: {exc}", address=self.address) from exc
        return self._link

    def _call(self, op: Op, meta: msgspec.Struct, payload: Sequence[memoryview] = ()) -> tuple[object, int]:
        link = self._ensure()
        request_id, frame = self._frame(op, meta, len(payload))
        try:
            link.complete(
                [(True, frame), *((True, p) for p in payload), (False, self._buf)], self.io_timeout_s
            )
        except (Truncated, LinkDown) as exc:
            raise self._lost(op, exc) from exc
        return self._reply(request_id)

    def put(self, ticket: WriteTicket, data: Any) -> PutReply:
        """Send one object's bytes (any C-contiguous buffer) under a signed ticket (a
        checksum-less one with the writer's claim, as `UcxClient.put`)."""
        view = _put_view(ticket, data)
        as_sent, claimed, proof = put_claim(ticket, view, None)
        with self._lock:
            request = PutRequest(ticket=as_sent, checksum=claimed, claim_proof=proof)
            reply, _ = self._call(Op.PUT, request, [view])
        return _put_reply(reply)

    def get(self, reads: list[ReadRef], dests: Sequence[Any]) -> list[ObjectResult]:
        """Read objects straight into `dests` (as `UcxClient.get`); the caller verifies checksums."""
        views = _get_views(reads, dests)
        with self._lock:
            reply, payload_count = self._call(Op.GET, GetRequest(reads=reads))
            ok = self._payload_views(reply, reads, views, payload_count)
            if ok:
                link = self._link
                assert link is not None
                try:
                    link.complete([(False, v) for v in ok], self.io_timeout_s)
                except (LinkDown, Truncated) as exc:
                    raise self._payload_lost(exc) from exc
        assert isinstance(reply, GetReply)
        return reply.results
