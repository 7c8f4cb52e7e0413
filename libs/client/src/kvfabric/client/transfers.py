"""Blocking object transfers for the client, run on its worker threads.

`SegmentPool` holds, per segment data address, at most `connections_per_segment_max` connections
in use or idle (a TCP data connection, plus a shared-memory reader when the segment's arena file
is on this host): a transfer that finds them all busy waits for one (up to the timeout) instead of
opening more, so a client never costs a segment more than that many connections and threads
(segments refuse connections past `connections_max`, shared by every client). A connection that
failed is closed, never reused. Every call is bounded by the
connection's timeout, so a dead segment costs at most one timeout per attempt.

Ownership: `fetch` writes straight into the engine's buffers it is given (a `ScatterDest`), each
block under the buffers' `WriteGate`: once their owner closes the gate it stops writing
("cancelled") and drops the connection, which is then out of step. Bytes that land are reported
"ok" only after their checksum matched. `store` reads the caller's buffer until it returns.
"""

from __future__ import annotations

import contextlib
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Final

import msgspec

from kvfabric.dataplane.scatter import GateClosed, ScatterDest
from kvfabric.dataplane.shm import ShmReader
from kvfabric.dataplane.tcp import TcpDataClient
from kvfabric.format.errors import KvfError
from kvfabric.proto.dataplane import ObjectResult, ReadRef
from kvfabric.proto.directory import ObjectLocation, Replica, WriteTicket
from kvfabric.proto.segment import tier_of_slot

__all__ = ["SegmentPool", "read_ref"]


def read_ref(replica: Replica, size_bytes: int) -> ReadRef:
    """The data-plane reference to read `replica`, with the directory's read token for it."""
    return ReadRef(
        replica.incarnation,
        replica.slot,
        replica.slot_generation,
        size_bytes,
        replica.read_token,
        replica.read_expires_ms,
    )


OK: Final = "ok"
SWEEP_INTERVAL_S: Final = 1.0  # idle connections to removed arenas are closed this often


@dataclass(slots=True)
class _Connection:
    tcp: TcpDataClient
    shm: ShmReader | None

    def close(self) -> None:
        if self.shm is not None:
            with contextlib.suppress(BufferError, ValueError):
                self.shm.close()
        self.tcp.close()


class SegmentPool:
    """Data connections to segments, shared by the client's worker threads."""

    def __init__(
        self,
        *,
        connections_per_segment_max: int,
        timeout_s: float,
        use_shm: bool,
        lockfree_local_reads: bool = True,
        verify: bool = True,
        local_segments: frozenset[str] = frozenset(),
        on_retry: Callable[[], None] = lambda: None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.connections_per_segment_max = connections_per_segment_max
        self.tls = tls  # verifies segments that serve tls:// (data-plane TLS)
        self.verify = verify  # False only under the chaos test switch
        self.timeout_s = timeout_s
        self.use_shm = use_shm
        self.lockfree_local_reads = lockfree_local_reads  # slot board (else pin each local read)
        # Segments on this host (empty: any segment whose arena can be mapped counts as local).
        self.local_segments = local_segments
        self.on_retry = on_retry  # called once per read retried on another replica (metrics)
        # Called (from a transfer thread) with each replica whose bytes failed their checksum:
        # the client reports it (`replica_suspect`) so the segment re-verifies and drops it.
        self.on_corrupt: Callable[[ObjectLocation, Replica], None] = lambda location, replica: None
        self._idle: dict[tuple[str, bool], list[_Connection]] = {}
        self._in_use: dict[str, threading.BoundedSemaphore] = {}  # per data address
        self._swept_s = 0.0
        self._lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()

    def _shm_ok(self, segment_id: str) -> bool:
        return self.use_shm and (not self.local_segments or segment_id in self.local_segments)

    def _sweep(self) -> None:
        """Close idle connections whose segment arena is gone (at most once a second): their
        maps would otherwise keep a dead incarnation's tmpfs pages alive while nobody reads
        that address again (a restarted segment may listen elsewhere)."""
        now = time.monotonic()
        with self._lock:
            if now - self._swept_s < SWEEP_INTERVAL_S:
                return
            self._swept_s = now
            dead = [c for conns in self._idle.values() for c in conns if c.shm is not None and c.shm.gone()]
            dead_ids = {id(c) for c in dead}
            for conns in self._idle.values():
                conns[:] = [c for c in conns if id(c) not in dead_ids]
        for conn in dead:
            conn.close()

    @contextlib.contextmanager
    def _connection(
        self,
        data_addr: str,
        shm_ok: bool = False,
        *,
        reads: Sequence[ReadRef] = (),
        ticket: WriteTicket | None = None,
    ) -> Iterator[_Connection]:
        """A pooled connection to `data_addr`. `reads` / `ticket`: this transfer's credential, which
        a new connection presents with its first request (the segment maps its arena only for
        token holders)."""
        self._sweep()
        with self._lock:
            slots = self._in_use.get(data_addr)
            if slots is None:
                slots = self._in_use[data_addr] = threading.BoundedSemaphore(self.connections_per_segment_max)
        if not slots.acquire(timeout=self.timeout_s):
            raise TimeoutError(
                f"all {self.connections_per_segment_max} connections to {data_addr} stayed busy"
            )
        try:
            with self._checked_out(data_addr, shm_ok, reads, ticket) as conn:
                yield conn
        finally:
            slots.release()

    @contextlib.contextmanager
    def _checked_out(
        self, data_addr: str, shm_ok: bool, reads: Sequence[ReadRef], ticket: WriteTicket | None
    ) -> Iterator[_Connection]:
        with self._lock:
            conns = self._idle.get((data_addr, shm_ok))
            conn = conns.pop() if conns else None
        if conn is None:
            tcp = TcpDataClient.connect(data_addr, timeout_s=self.timeout_s, tls=self.tls)
            shm = None
            if shm_ok:
                try:
                    shm = ShmReader(tcp, use_board=self.lockfree_local_reads, reads=reads, ticket=ticket)
                except (KvfError, OSError, ValueError):
                    shm = None  # not co-located (or no arena file): TCP only
            conn = _Connection(tcp, shm)
        try:
            yield conn
        except BaseException:
            conn.close()
            raise
        with self._lock:
            pool = self._idle.setdefault((data_addr, shm_ok), [])
            if self._closed or len(pool) >= self.connections_per_segment_max:
                conn.close()
            else:
                pool.append(conn)

    def prefer_local(self, location: ObjectLocation) -> ObjectLocation:
        """The same location with replicas on this host's segments first (stable otherwise)."""
        if not self.local_segments or len(location.replicas) < 2:
            return location
        ordered = sorted(location.replicas, key=lambda r: r.segment_id not in self.local_segments)
        return msgspec.structs.replace(location, replicas=ordered)

    def _read(
        self, conn: _Connection, refs: list[ReadRef], views: list[ScatterDest]
    ) -> list[tuple[ObjectResult, bytes]]:
        """One request on `conn`: over shared memory when it maps the replicas' incarnation and
        they are in its arena, else TCP (a disk replica is read from disk by the segment: GET).
        Verifying, each object is hashed as it lands (no second pass over it)."""
        local = (
            conn.shm is not None
            and {r.incarnation for r in refs} == {conn.shm.incarnation}
            and all(tier_of_slot(r.slot) == "dram" for r in refs)
        )
        reader: ShmReader | TcpDataClient = conn.shm if local and conn.shm is not None else conn.tcp
        if self.verify:
            return reader.get_hashed(refs, views)
        return [(result, b"") for result in reader.get(refs, views)]

    def fetch(self, location: ObjectLocation, dest: ScatterDest, attempts_max: int) -> str:
        """Read one object into `dest` from its first reachable replica and verify its
        checksum against the directory's. Tries at most `attempts_max` replicas."""
        cause = "not_found"
        for attempt, replica in enumerate(location.replicas[:attempts_max]):
            if dest.gate is not None and not dest.gate.is_open:
                return "cancelled"  # the load ended: no connection, no request for nobody
            if attempt:
                self.on_retry()
            ref = read_ref(replica, location.size_bytes)
            try:
                shm_ok = self._shm_ok(replica.segment_id)
                with self._connection(replica.data_addr, shm_ok, reads=[ref]) as conn:
                    ((result, digest),) = self._read(conn, [ref], [dest])
            except GateClosed:
                return "cancelled"  # the engine took its buffers back: nothing more to try
            except (ConnectionError, TimeoutError) as exc:
                cause = "timeout" if isinstance(exc, TimeoutError) else "segment_unreachable"
                continue
            except OSError:
                cause = "segment_unreachable"
                continue
            except KvfError as exc:
                cause = "segment_unreachable" if exc.retryable else "transport_error"
                continue
            if result.status != OK:
                cause = result.status if result.status in ("stale_generation", "not_found") else "not_found"
                continue
            # Verify against the directory's checksum (what the writer declared), not only the
            # segment's: a segment that lost or mixed up bytes cannot vouch for them.
            if self.verify and (result.checksum != location.checksum or digest != location.checksum):
                cause = "checksum"
                self.on_corrupt(location, replica)
                continue
            return OK
        return cause

    def fetch_many(
        self, locations: list[ObjectLocation], dests: list[ScatterDest], attempts_max: int
    ) -> list[str]:
        """`fetch` for objects whose first replicas share one segment: one request for all (one
        PIN_LOCAL/UNPIN_LOCAL pair over shared memory, or one GET over TCP), each verified; an
        object that fails there is retried alone on its next replicas. Returns a cause each."""
        if not locations:
            return []
        firsts = [loc.replicas[0] if loc.replicas else None for loc in locations]
        causes = ["not_found"] * len(locations)
        live = [i for i, r in enumerate(firsts) if r is not None]
        if live:
            first = firsts[live[0]]
            assert first is not None
            addr = first.data_addr
            refs = [read_ref(r, locations[i].size_bytes) for i in live if (r := firsts[i]) is not None]
            views = [dests[i] for i in live]
            try:
                with self._connection(addr, self._shm_ok(first.segment_id), reads=refs[:1]) as conn:
                    hashed = self._read(conn, refs, views)
                for i, (result, digest) in zip(live, hashed, strict=True):
                    loc = locations[i]
                    if result.status != OK:
                        causes[i] = result.status if result.status == "stale_generation" else "not_found"
                    elif self.verify and (result.checksum != loc.checksum or digest != loc.checksum):
                        causes[i] = "checksum"
                        self.on_corrupt(loc, firsts[i])  # type: ignore[arg-type]  # live: not None
                    else:
                        causes[i] = OK
            except GateClosed:
                return ["cancelled"] * len(locations)
            except TimeoutError:
                causes = ["timeout"] * len(locations)
            except (OSError, KvfError):
                causes = ["segment_unreachable"] * len(locations)
        for i, loc in enumerate(locations):  # the next replicas, one object at a time
            if causes[i] != OK and attempts_max > 1 and len(loc.replicas) > 1:
                rest = msgspec.structs.replace(loc, replicas=loc.replicas[1:])
                self.on_retry()
                retry = self.fetch(rest, dests[i], attempts_max - 1)
                causes[i] = retry if retry == OK else causes[i]
        return causes

    def store(self, ticket: WriteTicket, data: memoryview, trace_id: str = "", save_writes: int = 0) -> str:
        """Write one replica under its ticket. Returns "ok" (confirmed) or a cause. Writes share
        the segment's connections with loads: measured, capping them at half (so loads always
        find one while the directory confirms slowly) split a save of 8 objects into two waves of
        segment confirms, 15.0 vs 9.0 ms p50 for 8 × 4 KiB (bench.client_floor, 2026-12-01)."""
        try:
            # The pool loads use too (one idle pool per segment): a PUT only needs its TCP half.
            shm_ok = self._shm_ok(ticket.segment_id)
            with self._connection(ticket.data_addr, shm_ok, ticket=ticket) as conn:
                reply = conn.tcp.put(ticket, data, trace_id=trace_id, save_writes=save_writes)
        except KvfError as exc:
            return exc.code
        except OSError:
            return "segment_unreachable"
        return OK if reply.confirmed else "unconfirmed"
