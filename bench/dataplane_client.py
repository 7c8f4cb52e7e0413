"""The client side of the data-plane bench: one `ClientSide` per client process.

The bench process runs one (the 1-client figures); `worker_main` runs one in each of the 4 worker
processes (the 4-client figures: they prepare, meet at a barrier, then run at once). A `Spec`
names one measured run; `ClientSide.prepare` sets up buffers, connections, tickets and warm-up
outside the timed part, `ClientSide.measure` runs `spec.ops` operations back to back, timing each.

Kinds: `tcp_put`, `tcp_get`, `shm_get`, `ucx_put`, `ucx_get` (a get verifies the stored checksum
when `spec.verify`, and reads `spec.batch` objects per request), and the limits `raw_put` (send
+ 1-byte ack), `raw_get` (request + receive), `memcpy` (numpy copyto from a rotating 1 GiB
source), `hash_hot` (XXH3-128 over in-cache 1 MiB blocks: the checksum's own speed),
`redis_set`, `redis_get` (redis-py).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Final

import numpy as np

from bench.dataplane_server import RAW_HEADER, SEGMENT_ID, SegmentInfo
from kvfabric.dataplane.shm import ShmReader, verify
from kvfabric.dataplane.tcp import TcpDataClient, tune_socket
from kvfabric.format.checksum import checksum
from kvfabric.format.clock import now_ms
from kvfabric.format.ids import ObjectKey
from kvfabric.proto.dataplane import ObjectResult, ReadRef
from kvfabric.proto.directory import WriteTicket
from kvfabric.proto.tickets import sign_ticket

MEMCPY_SOURCE_BYTES: Final = 1 << 30
HASH_BLOCK_BYTES: Final = 1 << 20  # hash_hot: the block a fused copy+hash hashes from cache
WARMUP_OPS: Final = 2
TICKET_TTL_MS: Final = 3_600_000
IO_TIMEOUT_S: Final = 20.0


@dataclass(frozen=True)
class Targets:
    segment: SegmentInfo
    secret: bytes
    raw_port: int
    redis_port: int | None


@dataclass(frozen=True)
class Spec:
    kind: str
    size: int
    ops: int
    verify: bool = False
    batch: int = 1  # objects per get request
    # (incarnation, slot, generation, size, read token, token expiry)
    refs: tuple[tuple[int, int, int, int, bytes, int], ...] = ()
    keys: tuple[str, ...] = ()  # redis keys to rotate over
    first: int = 0  # where this client starts in the rotation
    warm_all: bool = False  # warm-up reads every ref once (shm: faults in the client's map)


@dataclass
class Outcome:
    lat_s: list[float] = field(default_factory=list)
    t0: float = 0.0
    t1: float = 0.0
    nbytes: int = 0
    verify_s: float = 0.0  # time spent in checksum verification, within lat_s
    stored: list[tuple[int, int]] = field(default_factory=list)  # (slot, generation) of every put
    error: str = ""


class ClientSide:
    """Connections and buffers of one client process, kept across runs (created on first use)."""

    def __init__(self, targets: Targets, index: int) -> None:
        self.targets = targets
        self.index = index
        self._tcp: TcpDataClient | None = None
        self._shm: ShmReader | None = None
        self._raw: socket.socket | None = None
        self._redis: Any = None
        self._ucx: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._shape = (0, 0)
        self._src = bytearray()
        self._dst = bytearray()
        self._dsts: list[memoryview] = []  # one view of _dst per object of a batch
        self._dst_array: np.ndarray[Any, np.dtype[np.uint8]] = np.zeros(0, np.uint8)  # over _dst
        self._src_checksum = b""
        self._memcpy_src: np.ndarray[Any, np.dtype[np.uint8]] | None = None
        self._tickets: Iterator[WriteTicket] = iter(())
        self._ticket_ids = 0
        self._warmed: set[int] = set()

    # ---- connections -------------------------------------------------------------------------

    @property
    def tcp(self) -> TcpDataClient:
        if self._tcp is None:
            seg = self.targets.segment
            self._tcp = TcpDataClient(seg.host, seg.tcp_port, timeout_s=IO_TIMEOUT_S)
        return self._tcp

    @property
    def shm(self) -> ShmReader:
        if self._shm is None:
            self._shm = ShmReader(self.tcp)
        return self._shm

    @property
    def raw(self) -> socket.socket:
        if self._raw is None:
            self._raw = socket.create_connection(("127.0.0.1", self.targets.raw_port), timeout=IO_TIMEOUT_S)
            tune_socket(self._raw)
        return self._raw

    @property
    def redis(self) -> Any:
        if self._redis is None:
            import redis

            if self.targets.redis_port is None:
                raise RuntimeError("no redis-server")
            self._redis = redis.Redis(host="127.0.0.1", port=self.targets.redis_port)
        return self._redis

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop

    def ucx(self) -> Any:
        if self._ucx is None:
            seg = self.targets.segment
            if seg.ucx_port is None:
                raise RuntimeError(f"ucx server did not start: {seg.ucx_error}")
            from kvfabric.dataplane.ucx import UcxClient

            client = UcxClient(seg.host, seg.ucx_port, io_timeout_s=IO_TIMEOUT_S)
            self.loop.run_until_complete(client.connect())
            self._ucx = client
        return self._ucx

    def close(self) -> None:
        if self._ucx is not None:
            self._ucx.close()
        if self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.run_until_complete(asyncio.sleep(0.05))  # let ucxx retire the endpoint
            self._loop.close()
        if self._shm is not None:
            self._shm.close()
        for closable in (self._tcp, self._raw, self._redis):
            if closable is not None:
                with contextlib.suppress(Exception):
                    closable.close()

    # ---- one run -----------------------------------------------------------------------------

    def _buffers(self, size: int, batch: int) -> None:
        if (size, batch) == self._shape:
            return
        self._shape = (0, 0)
        self._dsts, self._dst_array = [], np.zeros(0, np.uint8)  # drop the old buffers first
        self._src = self._dst = bytearray()
        self._src = bytearray(np.random.default_rng(1 + self.index).bytes(size))
        self._dst = bytearray(b"\x01") * (size * batch)  # written once: faulted in
        view = memoryview(self._dst)
        self._dsts = [view[i * size : (i + 1) * size] for i in range(batch)]
        self._dst_array = np.frombuffer(self._dst, dtype=np.uint8)
        self._src_checksum = checksum(self._src)
        self._shape = (size, batch)

    def _ticket(self) -> WriteTicket:
        self._ticket_ids += 1
        seg = self.targets.segment
        ticket_id = (self.index + 1) << 40 | self._ticket_ids
        return sign_ticket(
            WriteTicket(
                ticket_id=ticket_id,
                key=ObjectKey(ticket_id.to_bytes(8, "big") * 4),
                segment_id=SEGMENT_ID,
                incarnation=seg.incarnation,
                size_bytes=len(self._src),
                checksum=self._src_checksum,
                writer_id=f"bench-{self.index}",
                deadline_ms=now_ms() + TICKET_TTL_MS,
                epoch=1,
                data_addr=f"tcp://{seg.host}:{seg.tcp_port}",
            ),
            self.targets.secret,
        )

    def prepare(self, spec: Spec) -> Outcome:
        """Everything outside the timed part: buffers, connections, tickets, warm-up."""
        out = Outcome()
        try:
            self._buffers(spec.size, spec.batch)
            if spec.kind.endswith("_put"):
                self._tickets = iter([self._ticket() for _ in range(spec.ops + WARMUP_OPS)])
            if spec.kind == "memcpy" and self._memcpy_src is None:
                self._memcpy_src = np.full(MEMCPY_SOURCE_BYTES, 7, np.uint8)
            warm = WARMUP_OPS
            if spec.warm_all and hash(spec.refs) not in self._warmed:
                warm = -(-len(spec.refs) // spec.batch)
                self._warmed.add(hash(spec.refs))
            self._run(spec, warm, out)
        except Exception as exc:
            out.error = f"{type(exc).__name__}: {exc}"
        return out

    def measure(self, spec: Spec, out: Outcome) -> Outcome:
        if out.error:
            return out
        try:
            out.verify_s = 0.0
            out.lat_s, out.t0, out.t1 = self._run(spec, spec.ops, out)
            out.nbytes = spec.ops * spec.size * spec.batch
        except Exception as exc:
            out.error = f"{type(exc).__name__}: {exc}"
        return out

    def run(self, spec: Spec) -> Outcome:
        return self.measure(spec, self.prepare(spec))

    def _run(self, spec: Spec, n: int, out: Outcome) -> tuple[list[float], float, float]:
        """n operations back to back: (latency of each, start, end)."""
        if spec.kind.startswith("ucx_"):
            client = self.ucx()  # connects (runs the loop) before the run below does
            return self.loop.run_until_complete(self._ucx_run(client, spec, n, out))
        op = self._sync_op(spec, out)
        lat: list[float] = []
        perf = time.perf_counter
        t0 = perf()
        for i in range(n):
            s = perf()
            op(i)
            lat.append(perf() - s)
        return lat, t0, perf()

    def _reads(self, spec: Spec, i: int) -> list[ReadRef]:
        n, start = len(spec.refs), spec.first + i * spec.batch
        return [ReadRef(*spec.refs[(start + j) % n]) for j in range(spec.batch)]

    def _check(self, results: list[ObjectResult], out: Outcome, do_verify: bool) -> None:
        if do_verify:
            s = time.perf_counter()
            ok = verify(results, self._dsts)
            out.verify_s += time.perf_counter() - s
            if not all(ok):
                raise RuntimeError(f"checksum verification failed: {[r.status for r in results]}")
        elif any(r.status != "ok" for r in results):
            raise RuntimeError(f"read failed: {[r.status for r in results]}")

    def _sync_op(self, spec: Spec, out: Outcome) -> Callable[[int], None]:
        kind, size, src, dsts = spec.kind, spec.size, self._src, self._dsts
        if kind == "tcp_put":
            tcp, tickets, stored = self.tcp, self._tickets, out.stored

            def tcp_put(i: int) -> None:
                reply = tcp.put(next(tickets), src)
                stored.append((reply.slot, reply.slot_generation))

            return tcp_put
        if kind in ("tcp_get", "shm_get") and spec.verify:
            verifier = self.tcp if kind == "tcp_get" else self.shm

            def get_verified(i: int) -> None:  # hashes as the bytes land: no separate verify pass
                if not all(verifier.get_verified(self._reads(spec, i), dsts)):
                    raise RuntimeError("checksum verification failed")

            return get_verified
        if kind in ("tcp_get", "shm_get"):
            reader = self.tcp if kind == "tcp_get" else self.shm

            def get(i: int) -> None:
                self._check(reader.get(self._reads(spec, i), dsts), out, spec.verify)

            return get
        if kind == "raw_put":
            sock = self.raw
            ack = memoryview(bytearray(1))
            header = RAW_HEADER.pack(b"P", size)

            def raw_put(i: int) -> None:
                sock.sendall(header)
                sock.sendall(src)
                if sock.recv_into(ack) != 1:
                    raise RuntimeError("raw sink closed")

            return raw_put
        if kind == "raw_get":
            sock, view = self.raw, dsts[0]
            header = RAW_HEADER.pack(b"G", size)

            def raw_get(i: int) -> None:
                sock.sendall(header)
                got = 0
                while got < size:
                    n = sock.recv_into(view[got:])
                    if n == 0:
                        raise RuntimeError("raw sink closed")
                    got += n

            return raw_get
        if kind == "memcpy":
            source, dst_array = self._memcpy_src, self._dst_array
            assert source is not None
            per = MEMCPY_SOURCE_BYTES // size

            def memcpy(i: int) -> None:
                offset = ((spec.first + i) % per) * size
                np.copyto(dst_array, source[offset : offset + size])

            return memcpy
        if kind == "hash_hot":
            block = memoryview(src)[: min(size, HASH_BLOCK_BYTES)]
            blocks = max(1, size // len(block))

            def hash_hot(i: int) -> None:  # what verifying costs once the bytes are in cache
                for _ in range(blocks):
                    checksum(block)

            return hash_hot
        if kind == "redis_set":
            r, keys, value = self.redis, spec.keys, memoryview(src)

            def redis_set(i: int) -> None:
                r.set(keys[(spec.first + i) % len(keys)], value)

            return redis_set
        if kind == "redis_get":
            r, keys = self.redis, spec.keys

            def redis_get(i: int) -> None:
                value = r.get(keys[(spec.first + i) % len(keys)])
                if value is None or len(value) != size:
                    raise RuntimeError("redis GET missed")

            return redis_get
        raise ValueError(f"unknown kind {kind!r}")

    async def _ucx_run(
        self, client: Any, spec: Spec, n: int, out: Outcome
    ) -> tuple[list[float], float, float]:
        src, dsts, tickets = self._src, self._dsts, self._tickets
        put = spec.kind == "ucx_put"
        perf = time.perf_counter
        lat: list[float] = []
        t0 = perf()
        for i in range(n):
            s = perf()
            if put:
                reply = await client.put(next(tickets), src)
                out.stored.append((reply.slot, reply.slot_generation))
            else:
                self._check(await client.get(self._reads(spec, i), dsts), out, spec.verify)
            lat.append(perf() - s)
        return lat, t0, perf()


def worker_main(conn: Connection, barrier: Any, targets: Targets, index: int) -> None:
    """One of the 4 concurrent clients: prepare, meet the others at the barrier, run, report."""
    side = ClientSide(targets, index)
    try:
        while True:
            try:
                spec = conn.recv()
            except EOFError:
                break
            if spec is None:
                break
            out = side.prepare(spec)
            try:
                barrier.wait(timeout=120)
            except threading.BrokenBarrierError:
                out.error = out.error or "barrier broken (another client failed)"
            conn.send(side.measure(spec, out))
    finally:
        side.close()
