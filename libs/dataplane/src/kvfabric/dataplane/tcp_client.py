"""The TCP data plane's blocking client: one connection, one request at a time; the rules are in
`kvfabric.dataplane.tcp`."""

from __future__ import annotations

import itertools
import select
import socket
import ssl
import threading
from collections.abc import Sequence

import msgspec

from kvfabric.dataplane.addresses import pick_stream, split_host_port
from kvfabric.dataplane.backend import put_claim
from kvfabric.dataplane.frames import HEADER, Op, unpack_header
from kvfabric.dataplane.scatter import scatter_dests
from kvfabric.dataplane.tcp_wire import (
    Destination,
    PeerClosed,
    encode_frame,
    recv_bytes,
    recv_exact,
    send_all,
    tune_socket,
)
from kvfabric.format.errors import BadRequest, Indeterminate, KvfError, Unavailable
from kvfabric.proto.codec import FamilyDecoder
from kvfabric.proto.common import ErrorReply, error_from_reply
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
from kvfabric.proto.tickets import sealed_ticket

_error_decoder: FamilyDecoder[ErrorReply] = FamilyDecoder(ErrorReply, "dataplane error")


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

    def peer_closed(self) -> bool:
        """Whether this idle connection is dead: the segment closed it (its idle timeout, a
        restart at the same address) or sent something nobody asked for. Never blocks. Checked
        before a pooled connection is reused: without it the first transfer after a segment
        restart, or after `KVF_SEGMENT_IDLE_TIMEOUT_MS` of quiet, failed (a load's replica lost, a
        save's chunk failed) on a socket the kernel already knew was closed (review, 2026-12-06).
        With a pipelined UNPIN_LOCAL unanswered (every local read through pins ends so), its
        reply is what is waiting: it is read, then the connection looked at again (peeking
        saw the reply's first byte, not the EOF behind it: review of the day)."""
        if not self._readable():
            return False
        if self._unacked is not None:
            try:
                with self._lock:
                    self._drain_unacked()
            except (KvfError, OSError):
                return True
            if not self._readable():
                return False
        return True  # nothing is owed to us: EOF, a reset or bytes out of step

    def _readable(self) -> bool:
        """Whether the socket has something to read (or an error) now; never blocks."""
        if isinstance(self._sock, ssl.SSLSocket) and self._sock.pending():
            return True
        poller = select.poll()
        poller.register(self._sock, select.POLLIN)
        try:
            return bool(poller.poll(0))
        except OSError:
            return True

    def __enter__(self) -> TcpDataClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _reply(self, request_id: int) -> tuple[object, int]:
        try:
            recv_exact(self._sock, self._header)
        except PeerClosed:
            raise Unavailable("segment closed the data connection") from None
        header = unpack_header(self._header)
        body = recv_bytes(self._sock, header.meta_bytes)
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
            send_all(self._sock, [*encode_frame(op, request_id, meta, len(payload)), *payload])
        except OSError as exc:
            # The segment may have refused and closed: its error frame can still be waiting.
            try:
                self._reply(request_id)
            except KvfError:
                raise
            except (OSError, PeerClosed):
                pass
            raise Indeterminate(f"data connection failed during {op.name}: {exc!r}") from exc
        try:
            return self._reply(request_id)
        except (OSError, PeerClosed) as exc:
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
        as_sent, claimed, proof = put_claim(ticket, view, staged)
        with self._lock:
            meta = PutRequest(
                ticket=as_sent,
                trace_id=trace_id,
                save_writes=save_writes,
                staged=staged,
                receipt=receipt,
                checksum=claimed,
                claim_proof=proof,
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
        replies, failure = self.put_many_partial(writes, receipt=receipt, staged=staged)
        if failure is not None:
            raise failure
        return replies

    def put_many_partial(
        self,
        writes: Sequence[tuple[WriteTicket, bytes | bytearray | memoryview, str, int]],
        *,
        receipt: bool = False,
        staged: Sequence[StagedBytes] | None = None,
    ) -> tuple[list[PutReply | KvfError], Indeterminate | None]:
        """`put_many`, whose connection failure comes with the replies read before it: those of
        the first writes, in order (each landed, or was refused, as it says), and the failure
        (`Indeterminate`: the caller drops the connection) for the rest. `put_many` raising
        threw away writes that had landed and been answered, receipts included: the save then
        wrote them again or went without (stop 69's list)."""
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
                as_sent, claimed, proof = put_claim(ticket, view, where)  # hashed while the last lands
                meta = PutRequest(
                    ticket=as_sent,
                    trace_id=trace_id,
                    save_writes=save_writes,
                    receipt=receipt,
                    staged=where,
                    checksum=claimed,
                    claim_proof=proof,
                )
                try:
                    frame = encode_frame(Op.PUT, request_id, meta, 1 if where is None else 0)
                    send_all(self._sock, [*frame, view] if where is None else frame)
                except OSError as exc:  # refused and closed? its answers may still be waiting
                    failed = exc
                    break
                sent.append(request_id)
            replies: list[PutReply | KvfError] = []
            try:
                for request_id in sent:
                    recv_exact(self._sock, self._header)
                    header = unpack_header(self._header)
                    body = recv_bytes(self._sock, header.meta_bytes)
                    if header.request_id != request_id:
                        raise Indeterminate(f"reply for request {header.request_id}, expected {request_id}")
                    if header.op is Op.ERROR:
                        replies.append(error_from_reply(_error_decoder.decode(body)))
                        continue
                    reply = dataplane_decoder.decode(body)
                    if not isinstance(reply, PutReply):
                        raise Indeterminate(f"unexpected reply {type(reply).__name__} to PUT")
                    replies.append(reply)
            except (OSError, PeerClosed) as exc:
                return replies, _pipeline_failure(exc)
            except Indeterminate as exc:  # out of step: nothing after it can be matched
                return replies, exc
            if failed is not None:
                return replies, _pipeline_failure(failed)
        return replies, None

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
            except (OSError, PeerClosed) as exc:
                raise Indeterminate(f"data connection failed during GET payload: {exc!r}") from exc
        return reply.results

    def map_info(self, *, reads: Sequence[ReadRef] = (), ticket: WriteTicket | None = None) -> MapReply:
        """The segment's arena and slot board. On a connection that has not made a request yet,
        a credential must come with it (`reads` with their tokens, or a write ticket for this
        segment): the segment hands its arena path only to token holders."""
        with self._lock:
            credential = None if ticket is None else sealed_ticket(ticket)  # as a PUT sends it
            reply, _ = self._call(Op.MAP, MapRequest(reads=list(reads), ticket=credential))
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
                send_all(self._sock, encode_frame(Op.UNPIN_LOCAL, request_id, UnpinLocal(grant_id=grant_id)))
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
        except (OSError, PeerClosed) as exc:
            raise Indeterminate(f"data connection failed reading an UNPIN_LOCAL reply: {exc!r}") from exc
        if not isinstance(reply, UnpinReply):
            raise Indeterminate("malformed UNPIN_LOCAL reply")


def verified(hashed: Sequence[tuple[ObjectResult, bytes]]) -> list[bool]:
    """Per read of a `get_hashed`: True when it was read and the bytes that landed match the
    segment's stored checksum."""
    return [r.status == "ok" and digest == r.checksum for r, digest in hashed]


def _pipeline_failure(exc: BaseException) -> Indeterminate:
    failure = Indeterminate(f"data connection failed during pipelined PUTs: {exc!r}")
    failure.__cause__ = exc
    return failure
