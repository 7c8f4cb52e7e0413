"""Blocking object transfers for the client, run on its worker threads.

`SegmentPool` holds, per segment data address, at most `connections_per_segment_max` connections
in use or idle (a TCP data connection, plus a shared-memory reader when the segment's arena file
is on this host): a transfer that finds them all busy waits for one (up to the timeout) instead of
opening more, so a client never costs a segment more than that many connections and threads
(segments refuse connections past `connections_max`, shared by every client). A connection that
failed is closed, never reused. Every call is bounded by the
connection's timeout, so a dead segment costs at most one timeout per attempt.

Per-attempt budget: a replica read that is not the last one to try gets part of what is left of
its load's deadline, and is cut when that runs out (`kvfabric.client.attempts`).

Ownership: `fetch` writes straight into the engine's buffers it is given (a `ScatterDest`), each
block under the buffers' `WriteGate`: once their owner closes the gate it stops writing
("cancelled") and drops the connection, which is then out of step. Bytes that land are reported
"ok" only after their checksum matched. `store` reads the caller's buffer until it returns.

Why one module of ~600 lines: `SegmentPool`'s reads and writes share its connections, their
semaphores and idle lists under one lock; split apart, each half would reach into the other's state.
"""

from __future__ import annotations

import contextlib
import math
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Final

import msgspec

from kvfabric.client.attempts import (
    ATTEMPT_MIN_S_DEFAULT,
    ATTEMPT_SHARE_DEFAULT,
    AttemptWatchdog,
    attempt_budget_s,
)
from kvfabric.client.save_memory import SaveMemoryRegistry
from kvfabric.dataplane.scatter import GateClosed, ScatterDest
from kvfabric.dataplane.shm import ShmReader
from kvfabric.dataplane.staging import MEMFD_PATH, StagingFile
from kvfabric.dataplane.tcp import TcpDataClient
from kvfabric.format.errors import KvfError
from kvfabric.format.invariant import unreachable
from kvfabric.proto.dataplane import ObjectResult, PutReply, ReadRef, StagedBytes
from kvfabric.proto.directory import ObjectLocation, Replica, WriteReceipt, WriteTicket
from kvfabric.proto.segment import tier_of_slot

__all__ = ["AttemptWatchdog", "SegmentPool", "attempt_budget_s", "read_ref"]


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
CONNECT_MIN_S: Final = 0.001  # a connect inside an attempt's budget gets at least this long
# Staged puts (co-located writes through a staging file, `SegmentPool.store`): a connection's
# staging file holds at least this much (remade larger for a larger object), and objects above
# the cap are sent instead. A file per pooled connection: at most connections_per_segment_max
# of them per co-located segment (8 × 64 MiB of /dev/shm at most, 8 × 4 MiB for objects up to
# 4 MiB), each gone with its connection.
STAGING_FILE_BYTES_MIN: Final = 4 << 20
STAGED_PUT_BYTES_MAX: Final = 64 << 20
# A segment that refused a kind of staged put is asked again after this (or once it restarts).
REFUSAL_RETRY_S: Final = 600.0


class StagingRefusals:
    """The segments (data addresses) that refused one kind of staged put, each remembered for its
    incarnation and for `REFUSAL_RETRY_S`: a segment restarted (upgraded, or moved into this
    pid namespace) is tried again, and so is any after that long (a refusal may be ours and
    pass: a staging file we could not make while /dev/shm was full). A try that is refused
    again costs one write sent at once (never a lost chunk). A write whose ticket names an older
    incarnation (one placed before the restart) asks nothing and forgets nothing. Shared by the
    pool's transfer threads (a lock: an expired entry is dropped only if it is still the one
    looked at)."""

    def __init__(self) -> None:
        self._until: dict[str, tuple[int, float]] = {}  # data address -> (incarnation, monotonic s)
        self._lock = threading.Lock()

    def add(self, data_addr: str, incarnation: int, now_s: float) -> None:
        with self._lock:
            self._until[data_addr] = (incarnation, now_s + REFUSAL_RETRY_S)

    def refuses(self, data_addr: str, incarnation: int, now_s: float) -> bool:
        with self._lock:
            entry = self._until.get(data_addr)
            if entry is None:
                return False
            if incarnation < entry[0]:
                return False  # a ticket of an older incarnation: the newer one's refusal stays
            if incarnation > entry[0] or now_s >= entry[1]:
                del self._until[data_addr]
                return False
            return True

    def addresses(self) -> set[str]:
        """The data addresses remembered now (tests)."""
        with self._lock:
            return set(self._until)


@dataclass(slots=True)
class _Connection:
    tcp: TcpDataClient
    shm: ShmReader | None
    staging: StagingFile | None = None  # this connection's staged puts (co-located writes)

    def close(self) -> None:
        if self.staging is not None:
            with contextlib.suppress(BufferError, OSError):
                self.staging.close()
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
        attempt_share: float = ATTEMPT_SHARE_DEFAULT,
        attempt_min_s: float = ATTEMPT_MIN_S_DEFAULT,
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
        self.attempt_share = attempt_share  # see `attempt_budget_s`
        self.attempt_min_s = attempt_min_s
        self.watchdog = AttemptWatchdog()
        # Called (from a transfer thread) with each replica whose bytes failed their checksum:
        # the client reports it (`replica_suspect`) so the segment re-verifies and drops it.
        self.on_corrupt: Callable[[ObjectLocation, Replica], None] = lambda location, replica: None
        self._idle: dict[tuple[str, bool], list[_Connection]] = {}
        self._in_use: dict[str, threading.BoundedSemaphore] = {}  # per data address
        self._swept_s = 0.0
        self._lock = threading.Lock()
        self._closed = False
        self._staging_refused = StagingRefusals()  # segments that cannot read our staging files
        self._memfd_refused = StagingRefusals()  # ... nor our memfds (they read files beside the arena)
        self._refusal_clock: Callable[[], float] = time.monotonic  # their time (tests move it)
        self.staged_puts = 0  # writes that went through a staging file (tests, benchmarks)
        # The engine's save memory (`kvfabric.client.save_memory`): writes from it are staged by
        # reference, not copied, to a segment that maps memfds.
        self.save_memory = SaveMemoryRegistry()
        self.save_memory_puts = 0  # writes staged by reference to save memory (tests, benchmarks)
        self.local_reads_now = 0  # objects read by `fetch_local_now` (tests, benchmarks)
        self.idle_dropped = 0  # idle connections found closed by their segment (tests)

    def close(self) -> None:
        self.watchdog.close()
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()
        self.save_memory.close()

    def _shm_ok(self, segment_id: str) -> bool:
        return self.use_shm and (not self.local_segments or segment_id in self.local_segments)

    def sweep(self) -> None:
        """`_sweep`, from the client's timer too (`AsyncKvClient`): run only when a connection
        was asked for, a dead incarnation's map stayed while no transfer came (a lone segment
        restarting: nothing to look up or save until it is back), and its pages kept the new
        incarnation's arena from fitting the tmpfs (review, stop 68)."""
        self._sweep()

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
        cut_at_s: float | None = None,
    ) -> Iterator[_Connection]:
        """A pooled connection to `data_addr`. `reads` / `ticket`: this transfer's credential, which
        a new connection presents with its first request (the segment maps its arena only for
        token holders). `cut_at_s` (monotonic): this attempt's budget ends then: waiting for a
        connection and connecting stop there, and the watchdog cuts the request at that time
        (`TimeoutError`; the connection is closed, never pooled)."""
        self._sweep()
        with self._lock:
            slots = self._in_use.get(data_addr)
            if slots is None:
                slots = self._in_use[data_addr] = threading.BoundedSemaphore(self.connections_per_segment_max)
        wait_s = self.timeout_s
        if cut_at_s is not None:
            wait_s = min(wait_s, max(0.0, cut_at_s - time.monotonic()))
        if not slots.acquire(timeout=wait_s):
            raise TimeoutError(
                f"all {self.connections_per_segment_max} connections to {data_addr} stayed busy"
            )
        try:
            with self._checked_out(data_addr, shm_ok, reads, ticket, cut_at_s) as conn:
                yield conn
        finally:
            slots.release()

    @contextlib.contextmanager
    def _checked_out(
        self,
        data_addr: str,
        shm_ok: bool,
        reads: Sequence[ReadRef],
        ticket: WriteTicket | None,
        cut_at_s: float | None = None,
    ) -> Iterator[_Connection]:
        conn = self._idle_alive(data_addr, shm_ok)
        armed = None
        if conn is None:
            connect_s = self.timeout_s
            if cut_at_s is not None:
                connect_s = min(connect_s, max(CONNECT_MIN_S, cut_at_s - time.monotonic()))
            tcp = TcpDataClient.connect(data_addr, timeout_s=connect_s, tls=self.tls)
            if connect_s != self.timeout_s:  # the attempt's budget bounded the connect only
                tcp._sock.settimeout(self.timeout_s)
            # Armed before the MAP request, which is part of the attempt too (a frozen segment
            # that still accepts connections held every load there for the socket's timeout).
            if cut_at_s is not None:
                armed = self.watchdog.arm(tcp._sock, cut_at_s)
            shm = None
            if shm_ok:
                try:
                    shm = ShmReader(tcp, use_board=self.lockfree_local_reads, reads=reads, ticket=ticket)
                except (OSError, ValueError):  # (`ArenaNotHere` among them)
                    shm = None  # answered, but not co-located (or no arena file): TCP only
                except KvfError as exc:
                    # The MAP request itself failed: refused (busy, unauthorized: the segment
                    # closed the connection) or unanswered (its answer may still come: out of
                    # step). The attempt fails with that cause; it went on over this connection,
                    # a refusal reported `unavailable`, a PUT sent on a closed socket (review,
                    # stop 68).
                    cut = armed is not None and self.watchdog.disarm(armed)
                    tcp.close()
                    if cut:
                        raise TimeoutError(f"replica read from {data_addr} past its attempt budget") from exc
                    raise
            conn = _Connection(tcp, shm)
        elif cut_at_s is not None:
            armed = self.watchdog.arm(conn.tcp._sock, cut_at_s)
        try:
            yield conn
        except BaseException as exc:
            cut = armed is not None and self.watchdog.disarm(armed)
            conn.close()
            if cut and not isinstance(exc, GateClosed):
                raise TimeoutError(f"replica read from {data_addr} past its attempt budget") from exc
            raise
        if armed is not None and self.watchdog.disarm(armed):
            conn.close()  # cut right after it answered: its socket is shut down
            return
        with self._lock:
            pool = self._idle.setdefault((data_addr, shm_ok), [])
            if self._closed or len(pool) >= self.connections_per_segment_max:
                conn.close()
            else:
                pool.append(conn)

    def _idle_alive(self, data_addr: str, shm_ok: bool) -> _Connection | None:
        """An idle pooled connection to `data_addr` the segment has not closed, if any; those it
        closed (its idle timeout, a restart at the same address) are closed and dropped."""
        while True:
            with self._lock:
                conns = self._idle.get((data_addr, shm_ok))
                conn = conns.pop() if conns else None
            if conn is None or not conn.tcp.peer_closed():
                return conn
            conn.close()
            with self._lock:
                self.idle_dropped += 1

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

    def _cut_at_s(self, deadline_s: float, last: bool) -> float | None:
        """When this attempt's budget ends (monotonic), or None without a deadline. The last
        attempt's ends at the deadline: a sync load (`load_now`, on the engine's thread) has no
        gate that closes then, so an unarmed last try against a segment that trickles bytes held
        the engine's thread far past `load_timeout_ms` (review, 2026-12-05)."""
        if deadline_s == math.inf:
            return None
        now = time.monotonic()
        remaining_s = max(0.0, deadline_s - now)
        budget_s = attempt_budget_s(remaining_s, last, self.attempt_share, self.attempt_min_s)
        return now + min(budget_s, remaining_s)

    def fetch(
        self, location: ObjectLocation, dest: ScatterDest, attempts_max: int, deadline_s: float = math.inf
    ) -> str:
        """Read one object into `dest` from its first reachable replica and verify its
        checksum against the directory's. Tries at most `attempts_max` replicas; each but the
        last within its share of what is left until `deadline_s` (monotonic; see the module)."""
        cause = "not_found"
        tries = location.replicas[:attempts_max]
        for attempt, replica in enumerate(tries):
            if dest.gate is not None and not dest.gate.is_open:
                return "cancelled"  # the load ended: no connection, no request for nobody
            if time.monotonic() >= deadline_s:
                return "timeout"  # no other replica is tried past the load's deadline
            if attempt:
                self.on_retry()
            ref = read_ref(replica, location.size_bytes)
            cut_at_s = self._cut_at_s(deadline_s, attempt == len(tries) - 1)
            try:
                shm_ok = self._shm_ok(replica.segment_id)
                with self._connection(replica.data_addr, shm_ok, reads=[ref], cut_at_s=cut_at_s) as conn:
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
        self,
        locations: list[ObjectLocation],
        dests: list[ScatterDest],
        attempts_max: int,
        deadline_s: float = math.inf,
    ) -> list[str]:
        """`fetch` for objects whose first replicas share one segment: one request for all (one
        PIN_LOCAL/UNPIN_LOCAL pair over shared memory, or one GET over TCP), each verified; an
        object that fails there is retried alone on its next replicas. Returns a cause each.
        `deadline_s`: the loads' deadline (monotonic); the first request gets its share of it
        when an object has another replica to try. An object of the batch without one ends with
        the cut (`timeout`): its results are reported with the batch's, so reading it again until
        the deadline would hold back those of the objects read from their other replicas."""
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
            last = attempts_max < 2 or all(len(locations[i].replicas) < 2 for i in live)
            cut_at_s = self._cut_at_s(deadline_s, last)
            try:
                with self._connection(
                    addr, self._shm_ok(first.segment_id), reads=refs[:1], cut_at_s=cut_at_s
                ) as conn:
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
                retry = self.fetch(rest, dests[i], attempts_max - 1, deadline_s)
                causes[i] = retry if retry == OK else causes[i]
        return causes

    def fetch_local_now(self, locations: list[ObjectLocation], dests: list[ScatterDest]) -> list[str] | None:
        """`fetch_many` for objects whose first replicas share one co-located segment, done now on
        the calling thread (the client's loop) when it needs no I/O: an idle pooled connection to
        that segment maps its arena and its slot board covers every first replica (DRAM slots of
        the mapped incarnation), and a connection slot is free. Then each object is copied from
        the arena into its `dest` and hashed as it lands (no round trip, no thread hop) and a cause
        is returned per object, "ok" only when its bytes matched the directory's checksum (and the
        segment's). None when it would need I/O (a connect, a pin, a wait for a connection) or any
        object did not read ok: the caller then runs `fetch_many` on a worker thread as before
        (which reads again, tries the next replicas and reports corrupt ones)."""
        firsts = [loc.replicas[0] if loc.replicas else None for loc in locations]
        if not locations or any(r is None for r in firsts):
            return None
        addr = firsts[0].data_addr  # type: ignore[union-attr]  # none is None (checked)
        if any(r.data_addr != addr or tier_of_slot(r.slot) != "dram" for r in firsts if r is not None):
            return None
        with self._lock:
            slots = self._in_use.get(addr)
            conns = self._idle.get((addr, True))
            conn = conns.pop() if conns else None
        if conn is None:
            return None
        refs = [
            read_ref(r, loc.size_bytes) for r, loc in zip(firsts, locations, strict=True) if r is not None
        ]
        shm = conn.shm
        board = shm.board if shm is not None else None
        usable = (
            shm is not None
            and board is not None
            and all(board.covers(ref) for ref in refs)
            and slots is not None
            and slots.acquire(blocking=False)
        )
        if not usable:
            self._put_back(addr, conn)
            return None
        assert shm is not None and slots is not None
        try:
            hashed = shm.get_hashed(refs, dests)
        except GateClosed:
            slots.release()
            self._put_back(addr, conn)
            return ["cancelled"] * len(locations)
        except (OSError, KvfError, ValueError):  # e.g. the arena was removed: the slow path decides
            slots.release()
            conn.close()
            return None
        slots.release()
        self._put_back(addr, conn)
        for loc, (result, digest) in zip(locations, hashed, strict=True):
            if result.status != OK or (
                self.verify and (result.checksum != loc.checksum or digest != loc.checksum)
            ):
                return None  # never "ok" for bytes that did not verify: the worker's way decides
        with self._lock:  # transfer threads and the loop's thread count here at once
            self.local_reads_now += len(locations)
        return [OK] * len(locations)

    def _put_back(self, data_addr: str, conn: _Connection) -> None:
        """An idle connection of the shared-memory pool of `data_addr` back into it (closed when
        the pool is full or closed)."""
        with self._lock:
            pool: list[_Connection] | None = self._idle.setdefault((data_addr, True), [])
            assert pool is not None
            if self._closed or len(pool) >= self.connections_per_segment_max:
                pool = None
            else:
                pool.append(conn)
        if pool is None:
            conn.close()

    def store(self, ticket: WriteTicket, data: memoryview, trace_id: str = "", save_writes: int = 0) -> str:
        """Write one replica under its ticket (`write`, confirmed by the segment before it answers).
        Returns "ok" or a cause."""
        return self.write(ticket, data, trace_id, save_writes)[0]

    def write(
        self,
        ticket: WriteTicket,
        data: memoryview,
        trace_id: str = "",
        save_writes: int = 0,
        *,
        receipt: bool = False,
        cut_at_s: float | None = None,
    ) -> tuple[str, WriteReceipt | None]:
        """Write one replica under its ticket, by `cut_at_s` (monotonic; the save's write phase
        deadline: past it the write is cut, `timeout`). Returns ("ok" or a cause, the segment's write receipt
        or None): with `receipt`, a segment that signs receipts answers once the bytes are stored
        and verified, and confirms in the background (the caller's put_commit carries the
        receipt); else "ok" means confirmed. Writes share
        the segment's connections with loads: measured, capping them at half (so loads always
        find one while the directory confirms slowly) split a save of 8 objects into two waves of
        segment confirms, 15.0 vs 9.0 ms p50 for 8 × 4 KiB (bench.client_floor, 2026-12-01).

        To a co-located segment that takes staged puts (its MapReply), the bytes go through the
        connection's staging file (`kvfabric.dataplane.staging`: one copy here, one into the slot
        there, no socket): a sealed memfd first, a file beside the arena once the segment refused
        a memfd (`_refused_staging`). A segment that refuses the file (it cannot open it: another
        user, another host's /dev/shm) gets the bytes sent, now and until it restarts or
        `REFUSAL_RETRY_S` have passed (`StagingRefusals`)."""
        try:
            # The pool loads use too (one idle pool per segment): a PUT only needs its TCP half.
            shm_ok = self._shm_ok(ticket.segment_id)
            with self._connection(ticket.data_addr, shm_ok, ticket=ticket, cut_at_s=cut_at_s) as conn:
                staged = self._stage(conn, ticket, data)
                reply = None
                if staged is not None:
                    try:
                        reply = conn.tcp.put(
                            ticket,
                            data,
                            trace_id=trace_id,
                            save_writes=save_writes,
                            staged=staged,
                            receipt=receipt,
                        )
                        self._staged_landed(conn, [staged])
                    except KvfError as exc:
                        if not exc.details.get("staging"):
                            raise
                        self._refused_staging(ticket, staged)
                if reply is None:
                    reply = conn.tcp.put(
                        ticket, data, trace_id=trace_id, save_writes=save_writes, receipt=receipt
                    )
        except KvfError as exc:
            return exc.code, None
        except TimeoutError:  # cut at `cut_at_s`, or no connection free in time
            return "timeout", None
        except OSError:
            return "segment_unreachable", None
        if reply.receipt:
            return OK, _receipt(ticket, reply)
        return (OK if reply.confirmed else "unconfirmed"), None

    def write_many(
        self,
        writes: Sequence[tuple[WriteTicket, memoryview, str, int]],
        *,
        receipt: bool = False,
        cut_at_s: float | None = None,
    ) -> list[tuple[str, WriteReceipt | None]]:
        """`write` of several replicas to one segment (one data address), pipelined on one pooled
        connection (`TcpDataClient.put_many`): one thread and one round trip for all of them, not
        one each. To a co-located segment that takes staged puts the objects go through the
        connection's staging file, each at its own offset (`_stage_many`); a staging refusal
        sends those bytes, as `write` does. `writes`: (ticket, bytes, trace id, save_writes)
        each, as `write` takes them. Per write, as `write` returns; a connection that failed
        fails the writes it had not answered (those answered stand as answered)."""
        if not writes:
            return []
        first = writes[0][0]
        # Per write, its reply (None: unanswered when the connection failed, if it did: those
        # fail with it; the answered ones stand as answered)
        replies: list[PutReply | KvfError | None] = [None] * len(writes)
        failed: tuple[str, None] = ("indeterminate", None)
        try:
            shm_ok = self._shm_ok(first.segment_id)
            with self._connection(first.data_addr, shm_ok, ticket=first, cut_at_s=cut_at_s) as conn:
                self._put_many(conn, writes, receipt, replies)
        except KvfError as exc:
            failed = (exc.code, None)
        except TimeoutError:
            failed = ("timeout", None)
        except OSError:
            failed = ("segment_unreachable", None)
        outcomes: list[tuple[str, WriteReceipt | None]] = []
        for (ticket, *_), reply in zip(writes, replies, strict=True):
            if reply is None:
                outcomes.append(failed)
            elif isinstance(reply, KvfError):
                outcomes.append((reply.code, None))
            elif reply.receipt:
                outcomes.append((OK, _receipt(ticket, reply)))
            else:
                outcomes.append((OK if reply.confirmed else "unconfirmed", None))
        return outcomes

    def _put_many(
        self,
        conn: _Connection,
        writes: Sequence[tuple[WriteTicket, memoryview, str, int]],
        receipt: bool,
        replies: list[PutReply | KvfError | None],
    ) -> None:
        """`put_many` on `conn` into `replies` (one per write, in order), staged when
        `_stage_many` can; the writes a segment refused to stage (`staging` detail) are sent
        again, and so is everything to that segment for a while (`StagingRefusals`). A connection
        that fails raises (the caller drops it), the replies read before it kept, the others
        None (`put_many_partial`): a resend that failed threw away the first pass's writes that
        had landed (review, stop 71)."""
        staged = self._stage_many(conn, writes)
        got, failure = conn.tcp.put_many_partial(writes, receipt=receipt, staged=staged)
        replies[: len(got)] = got
        refused: list[int] = []
        if staged is not None:
            self._staged_landed(
                conn, [s for s, r in zip(staged, got, strict=False) if isinstance(r, PutReply)]
            )
            refused = [i for i, r in enumerate(got) if isinstance(r, KvfError) and r.details.get("staging")]
            if refused:
                self._refused_staging(writes[0][0], staged[refused[0]])
                for i in refused:  # not stored: sent again below, or failed with the connection
                    replies[i] = None
        if failure is not None:
            raise failure
        if refused:
            again, failure = conn.tcp.put_many_partial([writes[i] for i in refused], receipt=receipt)
            for i, reply in zip(refused, again, strict=False):
                replies[i] = reply
            if failure is not None:
                raise failure

    def _staged_landed(self, conn: _Connection, landed: Sequence[StagedBytes]) -> None:
        """Count staged writes the segment took, those by reference to save memory apart; the
        connection's file beside the arena loses its name (the segment holds it open now)."""
        own = conn.staging.path if conn.staging is not None else None
        with self._lock:  # several transfer threads land writes at once (`+=` is not atomic)
            self.staged_puts += len(landed)
            self.save_memory_puts += sum(1 for s in landed if s.path != own)
        if landed and conn.staging is not None:
            conn.staging.unlink()

    def _refused_staging(self, ticket: WriteTicket, refused: StagedBytes) -> None:
        """The segment of `ticket` refused a staged write: a memfd (the connection's, or save
        memory: it cannot open our `/proc` links, another pid namespace or user, or it is older
        than memfds) makes its writes go through a file beside the arena from now on; a refused
        file beside the arena, sent (`StagingRefusals`: until that segment restarts, or for
        `REFUSAL_RETRY_S`)."""
        kind = self._memfd_refused if MEMFD_PATH.match(refused.path) else self._staging_refused
        kind.add(ticket.data_addr, ticket.incarnation, self._refusal_clock())

    def _staging_file(
        self, conn: _Connection, arena_dir: str, ticket: WriteTicket, size: int
    ) -> StagingFile | None:
        """`conn`'s staging file, made (or remade larger, or of the other kind) to hold `size`
        bytes; None when it cannot be made (`ticket`'s segment is then remembered as refusing
        staged puts, as if it had: its writes are sent)."""
        data_addr, incarnation, now = ticket.data_addr, ticket.incarnation, self._refusal_clock()
        memfd = not self._memfd_refused.refuses(data_addr, incarnation, now)
        if conn.staging is None or conn.staging.data_bytes < size or conn.staging.memfd != memfd:
            if conn.staging is not None:
                conn.staging.close()
                conn.staging = None
            try:
                conn.staging = StagingFile(arena_dir, max(size, STAGING_FILE_BYTES_MIN), memfd=memfd)
            except (KvfError, OSError):  # none made: as if the segment had refused that kind
                (self._memfd_refused if memfd else self._staging_refused).add(data_addr, incarnation, now)
                return None
        return conn.staging

    def _stage_many(
        self, conn: _Connection, writes: Sequence[tuple[WriteTicket, memoryview, str, int]]
    ) -> list[StagedBytes] | None:
        """Every write's bytes staged: by reference where they lie in save memory (and the segment
        maps memfds), the others copied into `conn`'s staging file one after another (the file
        made, or remade larger, on demand); or None when they are all sent instead (not
        co-located, a segment without staged puts or that refused them, copies over
        `STAGED_PUT_BYTES_MAX`)."""
        shm = conn.shm
        first = writes[0][0]
        now = self._refusal_clock()
        if (
            shm is None
            or not shm.staged_puts
            or any(t.incarnation != shm.incarnation for t, *_ in writes)
            or self._staging_refused.refuses(first.data_addr, first.incarnation, now)
        ):
            return None
        by_reference = not self._memfd_refused.refuses(first.data_addr, first.incarnation, now)
        refs = [self.save_memory.staged(data) if by_reference else None for _, data, _, _ in writes]
        copied = [len(data) for (_, data, _, _), ref in zip(writes, refs, strict=True) if ref is None]
        staging = None
        if copied:
            if max(copied) > STAGED_PUT_BYTES_MAX or sum(copied) > STAGED_PUT_BYTES_MAX:
                return None
            staging = self._staging_file(conn, shm.arena_dir, first, sum(copied))
            if staging is None:
                return None
        staged = []
        at = 0
        for (_, data, _, _), ref in zip(writes, refs, strict=True):
            if ref is not None:
                staged.append(ref)
            else:
                if staging is None:
                    unreachable("a copied write without a staging file")
                staged.append(staging.stage(data, at))
                at += len(data)
        return staged

    def _stage(self, conn: _Connection, ticket: WriteTicket, data: memoryview) -> StagedBytes | None:
        """`data` staged (as `_stage_many` does for one write), or None when it is sent."""
        staged = self._stage_many(conn, [(ticket, data, "", 0)])
        return staged[0] if staged is not None else None


def _receipt(ticket: WriteTicket, reply: PutReply) -> WriteReceipt:
    """The write receipt a segment's reply carries, for the writer's put_commit (with the checksum
    the segment stored when the ticket named none: the directory takes the object's from it)."""
    return WriteReceipt(ticket.ticket_id, reply.slot, reply.slot_generation, reply.receipt, reply.checksum)
