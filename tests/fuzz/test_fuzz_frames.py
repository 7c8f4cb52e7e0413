"""Fuzz: the data-plane framing, in process and through a real `TcpDataServer`.

In process: `unpack_header` takes any bytes (a `Header` or `BadRequest`).

Over loopback: one segment (`ArenaBackend` over a small arena and a real `SlotTable`, tickets
signed with a test secret, a fixed clock) serves `TcpDataServer` for the whole module. Each input
is a client byte stream (frames built field by field with lies in any field, corpus streams,
mutations, raw bytes). The client sends it, half-closes and reads to EOF. Then:
- everything the server sent is well-formed reply/error frames (errors are typed), and no read
  returned an object (nothing is stored);
- no server thread died of an exception;
- nothing is stored or held: the slot table is empty (`used_bytes == 0`), no confirm was sent;
- the server still serves a well-formed client.
Signed tickets name a checksum (`BAD_CHECKSUM`) that no payload has: a PUT may get as far as
receiving its bytes, never further.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfabric.core.segment_slots import SlotTable
from kvfabric.dataplane.frames import (
    HEADER,
    MAGIC,
    META_BYTES_MAX,
    OBJECT_BYTES_MAX,
    READS_MAX,
    Op,
    unpack_header,
)
from kvfabric.dataplane.tcp import TcpDataClient, TcpDataServer
from kvfabric.format.checksum import checksum
from kvfabric.format.errors import BadRequest, KvfError, error_class_for_code
from kvfabric.proto import dataplane as dp
from kvfabric.proto.codec import FamilyDecoder, encode
from kvfabric.proto.common import ErrorReply
from kvfabric.proto.directory import WriteTicket
from kvfabric.segment_storage.arena import Arena
from kvfabric.segment_storage.backend import ArenaBackend

from .fuzzkit import corpus, corpus_params, fuzz_settings, mutated, saving_crash, wide_ints
from .seeds import INCARNATION, NOW_MS, SECRET, SEGMENT_ID, frame, ticket

ARENA_BYTES: Final = 4 << 20
READ_TIMEOUT_S: Final = 10.0
FRAME_SEEDS: Final = [p.read_bytes() for p in corpus("frames")]
META_SEEDS: Final = [p.read_bytes() for p in corpus("decoders") if p.name.startswith("golden-dp.")] + [
    encode(dp.MapRequest()),
    encode(dp.UnpinLocal(grant_id=1)),
    encode(dp.GetRequest(reads=[dp.ReadRef(INCARNATION, 0, 1, 64)])),
    encode(dp.PutRequest(ticket=ticket(64))),
]
DP_TAGS: Final = [
    "dp.put.v1", "dp.get.v1", "dp.map.v1", "dp.unpin_local.v1", "dp.put_reply.v1", "dp.local_grants.v1",
]  # fmt: skip
_error_decoder: Final = FamilyDecoder[ErrorReply](ErrorReply, "error frame")


# ---- in process: the header parser ---------------------------------------------------------


def check_header(data: bytes) -> None:
    try:
        header = unpack_header(data)
    except BadRequest:
        return
    assert len(data) == HEADER.size and data[:4] == MAGIC
    assert 0 <= header.meta_bytes <= META_BYTES_MAX
    assert 0 <= header.payload_count <= READS_MAX


@fuzz_settings(500)
@given(
    st.binary(min_size=HEADER.size, max_size=HEADER.size)
    | st.binary(max_size=40)
    | mutated([s[: HEADER.size] for s in FRAME_SEEDS if len(s) >= HEADER.size], rounds_max=2)
)
def test_header_parser_takes_any_bytes(data: bytes) -> None:
    with saving_crash("frames", data):
        check_header(data)


# ---- over loopback: the TCP server ------------------------------------------------------------


@dataclass
class Segment:
    server: TcpDataServer
    backend: ArenaBackend
    slots: SlotTable
    confirms: list[WriteTicket] = field(default_factory=list)
    thread_errors: list[BaseException] = field(default_factory=list)


@pytest.fixture(scope="module")
def segment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Segment]:
    arena = Arena(tmp_path_factory.mktemp("arena"), SEGMENT_ID, INCARNATION, ARENA_BYTES)
    slots = SlotTable(ARENA_BYTES)
    confirms: list[WriteTicket] = []

    def confirm(t: WriteTicket, slot: int, generation: int, trace_id: str = "", writes: int = 0) -> str:
        confirms.append(t)
        return "ok"

    backend = ArenaBackend(
        arena,
        slots,
        segment_id=SEGMENT_ID,
        incarnation=INCARNATION,
        secret=SECRET,
        confirm=confirm,
        clock_ms=lambda: NOW_MS,
    )
    server = TcpDataServer(backend, idle_timeout_s=READ_TIMEOUT_S)
    seg = Segment(server, backend, slots, confirms)
    saved_hook = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_value is not None:
            seg.thread_errors.append(args.exc_value)
        saved_hook(args)

    threading.excepthook = hook
    server.start()
    try:
        yield seg
    finally:
        threading.excepthook = saved_hook
        server.stop()
        arena.close()


def _exchange(seg: Segment, stream: bytes) -> bytes:
    """Send `stream`, half-close, read until the server closes. Returns what it sent."""
    sock = socket.create_connection((seg.server.host, seg.server.port), timeout=READ_TIMEOUT_S)
    received = bytearray()
    try:
        # EPIPE, ECONNRESET, ENOTCONN: the server answered early and closed; what it sent is
        # still readable.
        with contextlib.suppress(OSError):
            sock.sendall(stream)
            sock.shutdown(socket.SHUT_WR)
        while True:
            try:
                chunk = sock.recv(1 << 16)
            except ConnectionResetError:
                break
            if not chunk:
                break
            received += chunk
    except TimeoutError:
        pytest.fail(f"the server neither answered nor closed within {READ_TIMEOUT_S} s")
    finally:
        sock.close()
    return bytes(received)


def _check_replies(received: bytes) -> None:
    """Every byte the server sent is a reply or a typed error frame; no read found an object."""
    view, offset = memoryview(received), 0
    while offset < len(received):
        assert len(received) - offset >= HEADER.size, "the server sent a partial frame header"
        header = unpack_header(view[offset : offset + HEADER.size])
        offset += HEADER.size
        assert offset + header.meta_bytes <= len(received), "the server sent a partial meta"
        body = bytes(view[offset : offset + header.meta_bytes])
        offset += header.meta_bytes
        assert header.payload_count == 0, "the server sent object bytes: something was stored"
        if header.op is Op.ERROR:
            reply = _error_decoder.decode(body)
            assert error_class_for_code(reply.code) is not KvfError, f"untyped error {reply.code!r}"
            continue
        assert header.op is Op.REPLY, f"the server sent a {header.op.name} frame"
        meta: Any = dp.dataplane_decoder.decode(body)
        if isinstance(meta, dp.GetReply):
            assert all(r.status != "ok" for r in meta.results)
        elif isinstance(meta, dp.LocalGrants):
            assert all(g.status != "ok" for g in meta.grants)
        elif isinstance(meta, dp.UnpinReply):
            assert meta.released == 0
        else:
            assert isinstance(meta, dp.MapReply), f"unexpected reply {type(meta).__name__}"


def _join_new_connection_threads(before: set[threading.Thread]) -> None:
    """Wait for the server threads of connections opened since `before` (their clients closed)."""
    for thread in threading.enumerate():
        if thread not in before and thread.name.startswith("kvf-tcp-"):
            thread.join(timeout=READ_TIMEOUT_S)
            assert not thread.is_alive(), f"{thread.name} still serves a closed connection"


def check_server(seg: Segment, stream: bytes) -> None:
    before = set(threading.enumerate())
    seg.thread_errors.clear()
    received = _exchange(seg, stream)
    _join_new_connection_threads(before)  # an exception that ended one has reached the hook now
    _check_replies(received)
    assert not seg.thread_errors, f"a server thread died: {seg.thread_errors!r}"
    assert seg.confirms == [], "a replica was confirmed"
    assert (seg.slots.used_bytes, seg.slots.slots_in_use, seg.slots.writing) == (0, 0, 0)
    before = set(threading.enumerate())
    with TcpDataClient(seg.server.host, seg.server.port, timeout_s=READ_TIMEOUT_S) as client:
        assert client.map_info().incarnation == INCARNATION
    _join_new_connection_threads(before)


def _ticket_meta(t: WriteTicket) -> bytes:
    return encode(dp.PutRequest(ticket=t))


@st.composite
def tickets(draw: st.DrawFn) -> WriteTicket:
    size = draw(
        st.sampled_from([0, 1, 64, -1, ARENA_BYTES + 1, OBJECT_BYTES_MAX, OBJECT_BYTES_MAX + 1]) | wide_ints()
    )
    fields: dict[str, Any] = {}
    if draw(st.booleans()):
        fields["segment_id"] = draw(st.sampled_from(["s2", ""]))
    if draw(st.booleans()):
        fields["incarnation"] = draw(wide_ints())
    if draw(st.booleans()):
        fields["deadline_ms"] = draw(st.sampled_from([0, NOW_MS, NOW_MS + 1]) | wide_ints())
    if draw(st.booleans()):
        fields["epoch"] = draw(wide_ints())
    return ticket(size, signed=draw(st.booleans()), **fields)


read_refs = st.builds(dp.ReadRef, wide_ints(), wide_ints(), wide_ints(), wide_ints()) | st.builds(
    dp.ReadRef, st.just(INCARNATION), st.integers(-1, 3), st.integers(0, 3), st.sampled_from([0, 1, 64])
)
get_metas = st.lists(read_refs, max_size=5).map(lambda reads: encode(dp.GetRequest(reads=reads)))
# A request as a client would send it: the op and the meta agree.
requests = st.one_of(
    st.tuples(st.just(Op.PUT), tickets().map(_ticket_meta)),
    st.tuples(st.sampled_from([Op.GET, Op.PIN_LOCAL]), get_metas),
    st.tuples(st.just(Op.UNPIN_LOCAL), wide_ints().map(lambda grant: encode(dp.UnpinLocal(grant_id=grant)))),
    st.tuples(st.just(Op.MAP), st.just(encode(dp.MapRequest()))),
)
HEADER_LIES: Final = ("op", "magic", "flags", "reserved", "meta_short", "meta_long", "meta_over_max", "count")


@st.composite
def frames(draw: st.DrawFn) -> bytes:
    """Mostly an honest header; sometimes one field lies; the meta is typed, mutated or noise."""
    request_op, meta = draw(requests)
    op: int = request_op
    meta_kind = draw(st.sampled_from(["typed", "typed", "mutated", "noise"]))
    if meta_kind == "mutated":
        meta = draw(mutated([meta, *META_SEEDS], DP_TAGS))
    elif meta_kind == "noise":
        meta = draw(st.binary(max_size=64))
    fields: dict[str, Any] = {"request_id": draw(st.integers(0, 2**64 - 1))}
    lie = draw(st.none() | st.sampled_from(HEADER_LIES))
    if lie == "op":
        op = draw(st.sampled_from(list(Op)) | st.integers(0, 255))
    elif lie == "magic":
        fields["magic"] = draw(st.binary(min_size=4, max_size=4))
    elif lie in ("flags", "reserved"):
        fields[lie] = draw(st.integers(1, 255))
    elif lie == "meta_short":
        fields["meta_bytes"] = max(0, len(meta) - draw(st.integers(1, 8)))
    elif lie == "meta_long":
        fields["meta_bytes"] = len(meta) + draw(st.integers(1, 8))
    elif lie == "meta_over_max":
        fields["meta_bytes"] = draw(st.integers(META_BYTES_MAX + 1, 2**32 - 1))
    elif lie == "count":
        fields["payload_count"] = draw(st.integers(0, 2**32 - 1))
    payload = draw(st.sampled_from([b"", bytes(64)]) | st.binary(max_size=128))
    return frame(op, meta, payload, **fields)


streams = st.one_of(
    st.lists(frames(), min_size=1, max_size=4).map(b"".join),
    mutated(FRAME_SEEDS, rounds_max=2),
    st.binary(max_size=128),
)


@pytest.mark.parametrize("path", corpus_params("frames"))
def test_server_corpus(segment: Segment, path: Path) -> None:
    check_server(segment, path.read_bytes())


@fuzz_settings(500)
@given(streams)
def test_server_takes_any_stream(segment: Segment, stream: bytes) -> None:
    with saving_crash("frames", stream):
        check_server(segment, stream)


def test_server_still_stores_a_good_put_after_the_fuzzing(segment: Segment) -> None:
    """The checks above could not fail if nothing could ever be stored: a correct PUT is."""
    payload = b"kv" * 32
    with TcpDataClient(segment.server.host, segment.server.port, timeout_s=READ_TIMEOUT_S) as client:
        reply = client.put(ticket(len(payload), checksum=checksum(payload)), payload)
        dest = bytearray(len(payload))
        read = dp.ReadRef(INCARNATION, reply.slot, reply.slot_generation, len(payload))
        assert client.get([read], [dest])[0].status == "ok" and bytes(dest) == payload
    assert segment.slots.used_bytes > 0 and len(segment.confirms) == 1
    # Leave the segment empty again (the free is deferred until the GET's reference is dropped).
    segment.backend.free_slots([(reply.slot, reply.slot_generation)])
    segment.confirms.clear()
    deadline = time.monotonic() + READ_TIMEOUT_S
    while segment.slots.used_bytes and time.monotonic() < deadline:
        time.sleep(0.01)
    assert segment.slots.used_bytes == 0
