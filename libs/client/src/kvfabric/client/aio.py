"""The asyncio client: lookup (folded hit + read lease), verified loads, two-phase saves.

Rules every method keeps (issue 5, docs/design.md 3):
- **Failures never raise into the engine.** A miss, timeout, partial load, checksum mismatch,
  stale generation, dead segment or unreachable directory shortens the hit or the load to the
  last verified chunk and is counted by cause (`metrics.fallbacks`). Only caller bugs (bad token
  ids, wrongly sized buffers) raise.
- **Ownership.** Transports write straight into the engine's buffers, block by block under the
  load's `WriteGate` (`kvfabric.dataplane.scatter`), which `load` closes before it returns:
  then no transfer writes into them any more, whatever thread it runs on. A chunk is reported
  loaded only once the hash of what landed matched the directory's checksum.
- **Coalescing.** Concurrent loads of one object share one transfer (`LoadTable`): it writes
  into the buffers of the load that started it; a joiner copies from there on the loop thread
  (the `LoadTable` fence: `may_write` -> copy -> `delivered`), only while those are still lent.
- **Bounded.** Transfers and their bytes are bounded by the table (Busy -> shorter load); worker
  threads by `transfers_max`; save bytes and queued saves by `save_inflight_bytes_max` and
  `saves_queued_max` (over -> the save is dropped and counted, never queued without bound).
- **Leases** are released by `release`, and expire at the directory if the client dies.

The parts: shared state and directory access `aio_base`, lookups and lease give-backs `aio_lookups`,
loads `aio_loads`, saves `aio_saves`; this module assembles `AsyncKvClient` (with its lifecycle)
and keeps the public names.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final

from nats.aio.client import Client as NatsClient

from kvfabric.client.aio_base import Destination, EngineSpec, Source, directory_cause
from kvfabric.client.aio_loads import (
    FETCH_BATCH_BYTES_TARGET,
    FETCH_BATCH_OBJECTS_MAX,
    LOCAL_INLINE_BYTES_MAX,
    LoadMixin,
)
from kvfabric.client.aio_lookups import RELEASE_GATHER_LEASES_MAX, RELEASE_GATHER_MS, LookupMixin
from kvfabric.client.aio_saves import (
    SAVE_BUSY_ATTEMPTS_MAX,
    SAVE_DIRECTORY_CALLS_MAX,
    SAVE_PHASES,
    SAVE_WRITE_STREAM_BYTES_TARGET,
    SaveMixin,
    aborts_bound_s,
)
from kvfabric.client.connect import open_nats
from kvfabric.client.metrics import ClientMetrics
from kvfabric.client.save_memory import SaveMemory
from kvfabric.client.save_rate import SaveRate
from kvfabric.client.settings import ClientSettings
from kvfabric.client.suspects import REPORT_TIMEOUT_S, SuspectReporter
from kvfabric.client.threads import thread_placement
from kvfabric.client.transfers import SegmentPool
from kvfabric.core.client_loads import LoadTable, TransferId
from kvfabric.core.directory.keys import check_group_members
from kvfabric.dataplane.scatter import ScatterDest
from kvfabric.dataplane.tls import client_context
from kvfabric.proto import directory as m

__all__ = [
    "FETCH_BATCH_BYTES_TARGET",
    "FETCH_BATCH_OBJECTS_MAX",
    "LOCAL_INLINE_BYTES_MAX",
    "POOL_SWEEP_S",
    "RELEASE_GATHER_LEASES_MAX",
    "RELEASE_GATHER_MS",
    "SAVE_BUSY_ATTEMPTS_MAX",
    "SAVE_DIRECTORY_CALLS_MAX",
    "SAVE_WRITE_STREAM_BYTES_TARGET",
    "AsyncKvClient",
    "Destination",
    "EngineSpec",
    "Source",
    "directory_cause",
]


log = logging.getLogger("kvfabric.client")

# How often idle connections to removed arenas are let go without a transfer asking
# (`AsyncKvClient._sweep_pool`).
POOL_SWEEP_S: Final = 5.0


class AsyncKvClient(LookupMixin, LoadMixin, SaveMixin):
    """One engine's client. Create, `await start()`, use, `await close()`; one event loop."""

    def __init__(
        self, settings: ClientSettings, spec: EngineSpec, *, metrics: ClientMetrics | None = None
    ) -> None:
        self.settings = settings
        self.spec = spec
        self.metrics = metrics or ClientMetrics()
        self.nc: NatsClient | None = None
        self.table = LoadTable(
            transfers_max=settings.transfers_max, inflight_bytes_max=settings.load_inflight_bytes_max
        )
        self.pool = SegmentPool(
            connections_per_segment_max=settings.connections_per_segment_max,
            timeout_s=settings.load_timeout_ms / 1000,
            use_shm=settings.use_shm,
            lockfree_local_reads=settings.local_reads_lockfree,
            verify=not settings.unsafe_skip_verification_for_tests,
            local_segments=frozenset(s for s in settings.local_segments.split(",") if s),
            on_retry=self.metrics.replica_retries.inc,
            tls=client_context(settings.data_tls_ca) if settings.data_tls_ca else None,
            attempt_share=settings.replica_attempt_share_pct / 100,
            attempt_min_s=settings.replica_attempt_min_ms / 1000,
        )
        self._executor = ThreadPoolExecutor(  # thread_cpus decided here, in the creating thread
            settings.transfers_max,
            thread_name_prefix="kvf-transfer",
            initializer=thread_placement(settings.thread_cpus, background=False),
        )
        self._save_executor = ThreadPoolExecutor(
            max(1, settings.transfers_max // 2),
            thread_name_prefix="kvf-save",
            initializer=thread_placement(settings.thread_cpus, background=True),
        )
        self._waiters = {}
        self._targets = {}  # StartTransfer .. ReleaseStaging
        self._locations: dict[Any, m.ObjectLocation] = {}  # object id -> where (for StartTransfer)
        self._load_seq = itertools.count(1)
        self._generations = itertools.count(1)
        self._leases: dict[tuple[int, int], int] = {}  # (shard, lease id) -> expires_ms (directory clock)
        self._leases_pruned_s = time.monotonic()
        self.router = None  # the shard map; epochs per shard (fencing)
        # directory instances without `lookup_many` / `lease_release_many` (older): shard by shard
        self._lookup_many_refused: set[str] = set()
        self._save_bytes = 0
        self._saves_running = 0
        # the engine's save rate: saves past it keep their leading chunks (`SaveMixin.save`)
        self._save_clock = time.monotonic
        self._save_rate = SaveRate(
            settings.save_bytes_per_s_max, settings.save_burst_bytes, self._save_clock()
        )
        self._save_rate_lock = threading.Lock()
        # Writes this client runs at once per segment: what a segment may gather for one confirm.
        self._writes_at_once = min(max(1, settings.transfers_max // 2), settings.connections_per_segment_max)
        # The save-path directory requests, shared by the saves in flight (`SharedCalls`).
        holder = settings.holder_id
        self._begins = self._save_calls(
            "put_begin",
            lambda rid, specs: m.PutBegin(
                writer_id=holder, request_id=rid, objects=specs, write_ttl_ms=settings.write_ttl_ms
            ),
            # a put_begin's reply holds a ticket per replica: batches whose reply always fits NATS's
            # max_payload (the directory refuses a larger one with batch_too_large, placing nothing)
            m.PUT_BEGIN_BATCH_OBJECTS_FIT,
        )
        self._commits = self._save_calls(
            "put_commit",
            lambda rid, items: m.PutCommit(
                writer_id=holder,
                request_id=rid,
                keys=[key for key, _ in items],
                receipts=[r for _, receipts in items for r in receipts],
            ),
            # keys with their receipts (up to replicas_max each): the request stays far below
            # NATS's max_payload and the receipts below PUT_BATCH_OBJECTS_MAX
            m.PUT_BEGIN_BATCH_OBJECTS_FIT,
        )
        self._aborts = self._save_calls(
            "put_abort",
            lambda rid, keys: m.PutAbort(writer_id=holder, request_id=rid, keys=keys),
            m.PUT_BATCH_OBJECTS_MAX,
        )
        self._tasks: set[asyncio.Task[Any]] = set()  # running saves
        self._no_saves = asyncio.Event()  # set while `_tasks` is empty (`close` waits on it)
        self._no_saves.set()
        self._lookups: set[asyncio.Task[object]] = set()  # lookups in flight
        self._abandoned: set[asyncio.Task[Any]] = set()  # aborts of cancelled (or cut) saves
        self._writing: set[asyncio.Future[Any]] = set()  # save write threads running (`_write_all`)
        self._saves_cut = False  # `close` stopped waiting for running saves (`SaveMixin`)
        self._directory_shut = False  # `close` is past its wait for aborts: no save request goes
        self._capacity = asyncio.Event()  # set whenever a transfer ends (ReleaseStaging: room again)
        # not dispatched yet: (transfer, where, the starter's buffers, the starter's deadline ms)
        self._starting: list[tuple[TransferId, m.ObjectLocation, ScatterDest, int]] = []
        self._closed = False
        self.serves_metrics = False  # this client started `metrics.serve`: `close` stops it
        self.suspects: SuspectReporter | None = None  # reports of corrupt replicas (after start)
        # `release_soon`: leases gathered for the next give-back (still in `_leases`), its timer,
        # and the give-backs in flight (`close` waits for them)
        self._gathered: list[tuple[int, int]] = []
        self._gathered_trace = ""  # the trace id the gathered give-back is sent with
        self._gather_timer: asyncio.TimerHandle | None = None
        self._giving_back: set[asyncio.Task[None]] = set()
        self._sweep_timer: asyncio.TimerHandle | None = None  # `_sweep_pool`'s, from `start` to `close`

    # ---- lifecycle -------------------------------------------------------------------------

    def save_memory(self, nbytes: int) -> SaveMemory:
        """`nbytes` of memory (`SaveMemory.view`, writable) for the engine to gather KV into
        before it saves it: a co-located segment reads an object saved from it straight out of
        it (no copy into a staging file here; `kvfabric.client.save_memory`); anywhere else it
        is saved as any memory is. The engine owns it (`close`), at most `SAVE_MEMORY_MAX` open;
        `bad_request` past either bound or for a size outside 1..1 GiB."""
        return self.pool.save_memory.allocate(nbytes)

    async def start(self) -> None:
        """Connect to NATS and check access, within `connect_timeout_ms` (`kvfabric.client.connect`):
        `BadRequest` for a setting the client cannot use, `Unauthorized` when NATS refuses it,
        `Unavailable` when no server listens, `Indeterminate` when none answers in time."""
        # A layout whose groups the directory refuses: every lookup and save would be `bad_request`.
        layout = self.spec.layout
        check_group_members(layout.tp_size, layout.pp_size, layout.layer_group_count)
        if self.settings.metrics_port >= 0:
            # Before NATS: a port in use failed the start after connecting, and the connection
            # stayed open, reconnecting for the client's life while it was disabled (review,
            # stop 68). `metrics.serve` raises OSError: `start_error` makes it config_error.
            self.metrics.serve(self.settings.metrics_port, self.settings.metrics_host)
            self.serves_metrics = True  # stopped by `close`
        self.nc, self.router = await open_nats(self.settings)
        self.suspects = SuspectReporter(
            asyncio.get_running_loop(), lambda: self.router, self.metrics.corrupt_reports
        )
        self.pool.on_corrupt = self.suspects.seen  # a bad replica is reported, never dropped here
        self._sweep_timer = asyncio.get_running_loop().call_later(POOL_SWEEP_S, self._sweep_pool)

    def _sweep_pool(self) -> None:
        """Every `POOL_SWEEP_S` until `close`: idle connections to removed arenas let go
        (`SegmentPool.sweep`), on a transfer thread: closing one unmaps what it read of a dead
        arena, ~20 ms a GiB, never on the loop (review of the fix)."""
        self._sweep_timer = None
        if self._closed:
            return
        with contextlib.suppress(RuntimeError):  # (its executor shut down: closing)
            self._executor.submit(self.pool.sweep)
        self._sweep_timer = asyncio.get_running_loop().call_later(POOL_SWEEP_S, self._sweep_pool)

    async def _saves_ended(self, timeout_s: float) -> None:
        """Until no save runs (`_tasks` empty), at most `timeout_s`: the saves, not their tasks
        (an async caller's save runs in the caller's own task, which goes on after it)."""
        if self._tasks:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._no_saves.wait(), timeout_s)

    async def _aborts_ended(self, timeout_s: float) -> int:
        """Until the saves `close` gave up on have ended (`_tasks`: cut, each ends soon, its begin
        and writes answered `closed` and its commit aborted instead, once a write of it still
        running returns), no save write thread runs (`_writing`, a cancelled save's too) and no
        commit or abort runs (`_abandoned`, those held while this waits included): at most
        `timeout_s` for all of it; how many commits and aborts still run then. Only `_abandoned`
        was waited for (review of the close fix, 2026-12-07): a commit sent before the cut went
        on under the drain (it reached the directory after `close` returned), and the abort of a
        cut save whose writes ended after the wait was answered `closed`, unsent."""
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout_s
        while (left := until - loop.time()) > 0:
            saves = asyncio.ensure_future(self._no_saves.wait()) if self._tasks else None
            running = {*self._writing, *self._abandoned, *((saves,) if saves is not None else ())}
            if not running:
                break
            try:
                await asyncio.wait(running, timeout=left)
            finally:
                if saves is not None:
                    saves.cancel()
        return len(self._abandoned)

    async def close(self) -> None:
        """Let lookups in flight end, release every lease still held, wait for running saves
        (their queued writes ended `closed` past `save_timeout_ms`, each save waited for up to
        its phases' deadlines, `SAVE_PHASES` × `save_timeout_ms`), then cut those still running
        and wait for them, the save write threads and the aborts of cancelled (or cut) saves
        (`ABORT_PHASES` × `save_timeout_ms` and a grace: `aborts_bound_s`; those aborts still
        running then are counted, `close_aborts_unfinished`), close connections. Each
        wait bounded. No save starts once it began (`closed`); a save still running when it was
        cut performs no begin, write or commit any more, only aborts (its chunks fail `closed`),
        and no save-path directory request goes once it is past that wait (an abort answered
        `closed` so is counted too)."""
        if self._closed:
            return
        self._closed = True
        if self._sweep_timer is not None:
            self._sweep_timer.cancel()
            self._sweep_timer = None
        if self._gather_timer is not None:
            self._gather_timer.cancel()
            self._gather_timer = None
        try:
            if self._lookups:  # each bounded by its timeout; one ending now gives its leases back
                await asyncio.wait(list(self._lookups), timeout=self.settings.lookup_timeout_ms / 1000)
            gathered, self._gathered = self._gathered, []
            await self._release_leases(gathered, self._gathered_trace)  # with their hit's trace id
            await self._release_leases(list(self._leases))  # every other one held
            if self._giving_back:  # gathered give-backs already sent: wait for their answers
                await asyncio.wait(list(self._giving_back), timeout=self.settings.lookup_timeout_ms / 1000)
            await self._saves_ended(self.settings.save_timeout_ms / 1000)
            if self._tasks:
                # A save has `SAVE_PHASES` phases of `save_timeout_ms` each. One still running ends
                # before NATS drains (review, stop 65: it was left running, its commit or abort
                # failing on the drained connection, its placements reserved until the write
                # TTL): its queued writes end `closed` at once, and it is waited for until its
                # phases' deadlines have passed. The wait was one more `save_timeout_ms`: a save
                # whose begin was answered as the first wait ended still had its write phase
                # (writes running are not cancelled) and its commit, up to 2 × `save_timeout_ms`,
                # and NATS drained under its commit (2026-12-07). Never cancelled here: an async
                # caller's save runs in the caller's own task.
                self._save_executor.shutdown(wait=False, cancel_futures=True)
                await self._saves_ended((SAVE_PHASES - 1) * self.settings.save_timeout_ms / 1000)
            # A save still running has overrun its deadlines (a write past its cut, a stalled
            # loop): it went on after `close` returned, committing on the drained connection.
            # From here it performs no begin, write or commit (answered `closed`), only aborts of
            # what was placed for it, held in `_abandoned`.
            self._saves_cut = True
            if self._tasks:
                log.warning(
                    "kvfabric: %d saves still running at close past their phases' deadlines: "
                    "no begin, write or commit of theirs goes any more (their chunks fail closed)",
                    len(self._tasks),
                )
            # Then, before anything is shut, the saves just cut (ending soon, or once a write of
            # theirs returns: their aborts go then), the save write threads, and every commit and
            # abort in flight: a cancelled save's end within `ABORT_PHASES` × `save_timeout_ms`
            # of its cancel, and the grace of a shared request (`aborts_bound_s`). Close waited
            # one `save_timeout_ms`, for those held when it began only, then drained NATS under a
            # cancelled save's abort of what its late begin answer placed (sent a
            # `save_timeout_ms` after the cancel, its own deadline one more): those placements
            # were held at the directory until the TTL. And it waited for the write threads only
            # after the drain: a cut save's abort, sent once its writes returned, was answered
            # `closed` unsent (review of the close fix, 2026-12-07).
            unfinished = await self._aborts_ended(aborts_bound_s(self.settings.save_timeout_ms))
            self._directory_shut = True  # nothing more is sent (an abort then counted): NATS drains
            if unfinished or self._tasks or self._writing:
                self.metrics.close_aborts_unfinished.inc(unfinished)
                log.warning(
                    "kvfabric: %d aborts of cancelled saves unanswered at close, %d saves and %d "
                    "save writes still running (an abort of theirs is not sent now, counted): "
                    "what they end stays reserved at the directory until its write TTL",
                    unfinished,
                    len(self._tasks),
                    len(self._writing),
                )
            if self.suspects is not None:
                await self.suspects.close(REPORT_TIMEOUT_S)
            if self.nc is not None:
                with contextlib.suppress(Exception):
                    await self.nc.drain()
            # Waited for off the loop (review, 2026-12-05): a transfer still running may take its
            # whole timeout, and the loop must stay free to take its answer and serve other tasks.
            await asyncio.to_thread(self._executor.shutdown, wait=True, cancel_futures=True)
            await asyncio.to_thread(self._save_executor.shutdown, wait=True, cancel_futures=True)
        finally:
            # A close cancelled past its bound (`KvClient.close`) still lets go of the threads,
            # connections and save memory (review, 2026-12-06: they leaked, and a second close
            # returned at once). Without waiting: a running transfer ends by its own deadline.
            # And no save still running (or cancelled by `KvClient.close`'s settling) writes
            # after it: no begin, write, commit or directory request of theirs goes.
            self._saves_cut = True
            self._directory_shut = True
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._save_executor.shutdown(wait=False, cancel_futures=True)
            self.pool.close()
            if self.serves_metrics:
                self.metrics.stop()
