"""The segment shell: arena + slot table + data server, registered with the directory over NATS.

Lifecycle:
- start: pick an incarnation (microseconds since the epoch: grows across restarts), create the
  arena, start the TCP data server, register with the directory (failure domain, capacity, data
  address; asked again while no instance leads a shard yet, for at most `REGISTER_WAIT_S`), then
  heartbeat every `heartbeat_interval_ms` with the bytes in use.
- `free.<segment_id>` (NATS, from the directory): free the named (slot, generation) pairs; a slot
  under a transfer is freed when the transfer ends; an old generation is already freed.
- `drain.<segment_id>`: refuse new writes, keep serving reads; heartbeats say so.
- `report.<segment_id>`: a new leader of a directory shard asks what is stored (paged) to rebuild
  its index; its (shard, epoch) becomes the oldest this segment accepts for that shard: write
  tickets and frees of older epochs of the shard (a replaced leader's) are refused with
  `stale_generation`. Registration and heartbeats go to every instance leading a shard; confirms
  and corruption reports to the leader of the key's shard (`DirectoryRouter`).
- `copy.<segment_id>` (from repair, with a ticket from the directory's `replicate_begin`): write
  the ticket's object by reading it from another segment over TCP straight into the new slot; the
  ticket is checked like a PUT's, the bytes against its checksum, and the replica is confirmed to
  the directory like any write. At most `copies_max` at once (more: `Busy`), each within
  `copy_timeout_ms`; a failure leaves nothing stored and nothing held.
- scrub (background, `scrub_bytes_per_s`; 0: off): re-hash stored objects round-robin, a pass at
  most once per `scrub_pass_min_ms`; a mismatch frees the slot at once (no read of it succeeds
  from then on) and is reported to the directory (`replica_corrupt`), whatever it answers.
- verify: a slot a reader found corrupt, relayed by the directory, is re-hashed at once the same
  way (`kvfabric.segment_storage.suspects`: bounded queue, one at a time).
- If the directory answers a heartbeat with `not_found` / `stale_generation` (it declared this
  segment down), the segment stops with exit code 75 (EX_TEMPFAIL): it must restart empty under a
  new incarnation; it never serves bytes the directory has forgotten.
- disk tier (optional, `KVF_SEGMENT_SSD_PATH`/`_BYTES`: `kvfabric.segment_storage.ssd`): opened
  (or created) at start, before the arena is served; its recovered objects are listed by `report`
  after the arena's (their slot ids are `SSD_SLOT_BASE` and up) and read over GET. A disk read
  that finds an object corrupt frees it and reports it like the scrubber does. Free records whose
  write failed are tried again every `SSD_UNLINK_RETRY_S`.
- `demote.<segment_id>` (from the eviction policy): move named arena objects into the disk tier
  (`kvfabric.segment_storage.demoter`: a disk replica ticket, the copy, its confirm, then the
  arena replica dropped by the directory); a full disk stops demotion (`no_capacity`, logged
  `demotion_stopped`), the arena serves on.
- stop: stop the data server (connections closed, references released), unlink the arena, close
  the disk tier (its file stays: it is what the next start recovers).

Modules: this one holds the lifecycle and the directory's control requests (free, report, drain);
routing, registration and heartbeats are `shell_directory`, confirms `shell_confirms`, copies,
scrubbing and corruption reports `shell_repair` (mixins of `SegmentShell`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Final

import msgspec
from nats.aio.client import Client as NatsClient

from kvfabric.cluster.directory_router import DirectoryRouter
from kvfabric.core.segment_slots import HeldSlot, SlotTable
from kvfabric.dataplane.addresses import join
from kvfabric.dataplane.tcp import TcpDataServer
from kvfabric.dataplane.tls import client_context, server_context
from kvfabric.format.errors import BadRequest, StaleGeneration
from kvfabric.format.ids import ObjectKey
from kvfabric.proto import directory as m
from kvfabric.proto.segment import (
    REPORT_PAGE_MAX,
    SSD_SLOT_BASE,
    CopyRequest,
    DemoteRequest,
    DrainRequest,
    FreeSlotsReply,
    FreeSlotsRequest,
    HeldObject,
    ReportRequest,
    SegmentReport,
    SegmentState,
    VerifyRequest,
    segment_decoder,
)
from kvfabric.runtime.deadline import stop_tasks
from kvfabric.runtime.logs import get_logger
from kvfabric.runtime.service import ServiceRuntime
from kvfabric.segment_storage.arena import Arena, lock_segment_id, remove_stale_arenas, unlock_segment_id
from kvfabric.segment_storage.backend import ArenaBackend
from kvfabric.segment_storage.confirms import ConfirmBatcher
from kvfabric.segment_storage.demoter import Demoter
from kvfabric.segment_storage.disk_calls import DiskCalls
from kvfabric.segment_storage.disk_frees import DiskFrees
from kvfabric.segment_storage.scrubber import Scrubber
from kvfabric.segment_storage.settings import SegmentSettings
from kvfabric.segment_storage.shell_confirms import ShellConfirms
from kvfabric.segment_storage.shell_repair import CORRUPT_REPORTS_INFLIGHT_MAX, ShellRepair
from kvfabric.segment_storage.ssd import SsdIo, SsdTier
from kvfabric.segment_storage.suspects import SuspectChecker

if TYPE_CHECKING:
    from kvfabric.segment_storage.ucx_thread import UcxThread

__all__ = ["EXIT_REREGISTER", "SegmentShell", "new_incarnation"]

EXIT_REREGISTER: Final = 75
# At stop, how long the disk tier waits for demotion threads still writing before its files close
# (a write batch takes milliseconds to a few seconds; within the service's stop deadline).
DEMOTE_STOP_WAIT_S: Final = 5.0


def new_incarnation() -> int:
    return time.time_ns() // 1_000


class SegmentShell(ShellRepair, ShellConfirms):
    """One segment process: its arena, disk tier, data servers and background tasks, from start to
    stop; the directory's requests to it (frees, reports, drain) are answered here, the rest by
    its mixins."""

    def __init__(self, settings: SegmentSettings) -> None:
        self.settings = settings
        self.incarnation = new_incarnation()
        # Held until stop (or death): no second process of this id can remove our files below.
        self._id_lock_fd = lock_segment_id(settings.shm_dir, settings.segment_id)
        try:
            # Files of this segment's earlier incarnations that were killed hold tmpfs pages: gone.
            self.stale_files_removed = remove_stale_arenas(
                settings.shm_dir, settings.segment_id, self.incarnation
            )
            self.ssd: SsdTier | None = None
            self.ssd_io: SsdIo | None = None
            if settings.ssd_dir is not None:  # recovers what the file's index names (blocks: at start)
                self.ssd_io = SsdIo(
                    settings.ssd_io_threads, settings.ssd_io_queue_max, settings.ssd_io_chunk_bytes
                )
                try:
                    self.ssd = SsdTier(
                        settings.ssd_dir,
                        settings.segment_id,
                        settings.ssd_bytes,
                        settings.ssd_slots_max,
                        direct=settings.ssd_direct,
                        io=self.ssd_io,
                        read_bytes_max=settings.ssd_read_bytes_max,
                        verify_on_start=settings.ssd_verify_on_start,
                        stream_head_divisor=settings.ssd_stream_head_divisor,
                    )
                except BaseException:
                    self.ssd_io.close()
                    raise
            self.arena = Arena(settings.shm_dir, settings.segment_id, self.incarnation, settings.arena_bytes)
        except BaseException:
            if getattr(self, "ssd", None) is not None:
                self._close_ssd()
            unlock_segment_id(settings.shm_dir, settings.segment_id, self._id_lock_fd)
            raise
        self.slots = SlotTable(self.arena.size_bytes)  # (less than asked when it did not fit: arena.py)
        self.backend = ArenaBackend(
            self.arena,
            self.slots,
            segment_id=settings.segment_id,
            incarnation=self.incarnation,
            secret=settings.secret,
            confirm=self._confirm,
            confirm_later=self._confirm_later,
            read_tokens_required=settings.read_tokens_required,
            clock_skew_tolerance_ms=settings.clock_skew_tolerance_ms,
            ssd=self.ssd,
            report_corrupt=self._disk_read_corrupt,
            demote_yield_ms=settings.demote_yield_ms,
        )
        tls = bool(settings.tls_cert)
        # A connection presents a credential (read token, write ticket) before anything else.
        self.server = TcpDataServer(
            self.backend,
            settings.data_host,
            settings.data_port,
            tls=server_context(settings.tls_cert, settings.tls_key) if tls else None,
            limits=settings.connection_limits,
            authenticate=self.backend.admits,
            count=self.backend.count,
        )
        # Copies read other segments, which serve TLS when this one does (one cluster config).
        self.peer_tls = client_context(settings.tls_ca) if settings.tls_ca else None
        self.ucx: UcxThread | None = None
        self.data_addr = self.server.address
        self.router: DirectoryRouter | None = None
        self._beats = 0
        self.heartbeat_interval_ms = 1_000
        self._nc: NatsClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._runtime: ServiceRuntime | None = None  # set by `attach` (tests may start without)
        self._corrupt_reports = threading.BoundedSemaphore(CORRUPT_REPORTS_INFLIGHT_MAX)
        # Copies run on their own threads (never the default executor's, which frees use).
        self._copy_pool = concurrent.futures.ThreadPoolExecutor(
            settings.copies_max, thread_name_prefix="kvf-copy"
        )
        self._copy_lock = threading.Lock()
        self.copies_in_flight = 0
        self.disk_frees = DiskFrees(self.backend.free_slots, self.backend.count)
        self.scrubber = Scrubber(self.backend, pass_min_ms=settings.scrub_pass_min_ms)
        # Slots a reader found corrupt (relayed by the directory): re-hashed now, reported if so.
        # other threads that may write the disk tier (a free record's retry, a suspect's check)
        self.disk_calls = DiskCalls()
        self.suspects = SuspectChecker(
            self.backend, self.incarnation, self._report_corrupt, disk_calls=self.disk_calls
        )
        self.confirms = ConfirmBatcher(
            settings.segment_id,
            self.incarnation,
            lambda message, trace_id: self._directory("confirm", message, trace_id),
        )
        # Receipted writes' confirms: off the writes' path, gathered first (`_confirm_later`).
        self.confirms_later = ConfirmBatcher(
            settings.segment_id,
            self.incarnation,
            lambda message, trace_id: self._directory("confirm", message, trace_id),
        )
        self._later: list[tuple[m.WriteTicket, int, int, str]] = []  # receipted writes not yet on the loop
        self._later_lock = threading.Lock()
        self._later_woken = False  # a wake-up of the loop for `_later` is pending
        self._later_tasks: set[asyncio.Task[None]] = set()
        self._later_timer: asyncio.TimerHandle | None = None  # the gather's, while one runs
        self._later_stopped = False  # set at stop: receipted writes refused, nothing starts
        self.must_reregister = asyncio.Event()
        self._log = get_logger("kvfabric.segment_storage").bind(
            segment_id=settings.segment_id, incarnation=self.incarnation
        )
        self.demoter = Demoter(
            self.backend,
            segment_id=settings.segment_id,
            incarnation=self.incarnation,
            ask=self._directory,
            confirm=self._confirm_async,
            warn=self._log.warning,
            shard_of=lambda key: self.router.shard_of(key) if self.router is not None else 0,
            report_gone=self._disk_read_corrupt,
        )

    def attach(self, runtime: ServiceRuntime) -> None:
        self._runtime = runtime  # watches the background tasks (`start`)
        # Each decoded and checked by the runtime (`ServiceRuntime` typed endpoints).
        segment = self.settings.segment_id
        add, family = runtime.add_endpoint, segment_decoder
        add("free", self._on_free, request=FreeSlotsRequest, decoder=family, instance=segment)
        add("drain", self._on_drain, request=DrainRequest, decoder=family, instance=segment)
        add("report", self._on_report, request=ReportRequest, decoder=family, instance=segment)
        add("copy", self._on_copy, request=CopyRequest, decoder=family, instance=segment)
        add("verify", self.suspects.on_verify, request=VerifyRequest, decoder=family, instance=segment)
        add("demote", self.demoter.on_demote, request=DemoteRequest, decoder=family, instance=segment)

    async def start(self, nc: NatsClient) -> None:
        self._nc = nc
        self._loop = asyncio.get_running_loop()
        if self.settings.arena_prefault:  # before the first write could touch a page (arena.py)
            self.arena.start_prefault()
        self.server.start()
        addresses = [self.server.address]
        if self.settings.ucx and self.server.tls is not None:
            self._log.info("ucx_disabled", reason="data-plane TLS: UCX would bypass it")
        elif self.settings.ucx:
            try:
                from kvfabric.segment_storage.ucx_thread import UcxThread  # imports ucxx: optional

                self.ucx = UcxThread(
                    self.backend,
                    self.settings.data_host,  # where the TCP server listens, with its rules
                    self.settings.ucx_port,
                    limits=self.settings.connection_limits,
                    authenticate=self.backend.admits,
                    count=self.backend.count,
                )
                addresses.append(await asyncio.to_thread(self.ucx.start))
            except Exception as exc:  # UCX is an extra transport: serve TCP and shm without it
                self._log.warning("ucx_unavailable", error=repr(exc))
                self.ucx = None
        self.data_addr = join(*addresses)
        s = self.settings
        self.router = DirectoryRouter(nc)
        registration = m.RegisterSegment(
            segment_id=s.segment_id,
            incarnation=self.incarnation,
            capacity_bytes=self.arena.size_bytes,
            domain=m.FailureDomain(zone=s.zone, rack=s.rack, host=s.host),
            data_addr=self.data_addr,
            disk_objects=self._disk_objects(),  # recovered: the directory adopts them
        )
        replies = await self._register(registration)
        for reply in replies:
            if isinstance(reply, m.SegmentRegistered) and reply.heartbeat_interval_ms:
                self.heartbeat_interval_ms = reply.heartbeat_interval_ms
        self._tasks = [
            asyncio.create_task(self._heartbeats(), name="segment-heartbeats"),
            asyncio.create_task(self._expire_pins(), name="segment-pin-expiry"),
        ]
        if s.scrub_bytes_per_s > 0:
            self._tasks.append(asyncio.create_task(self._scrub(), name="segment-scrub"))
        if self.ssd is not None:
            self._tasks.append(asyncio.create_task(self._ssd_unlinks(), name="segment-ssd-unlinks"))
        if self._runtime is not None:
            # One that ends with an exception stops the segment (restarted by its supervisor):
            # a heartbeat loop that died on an unexpected error left a segment serving data
            # the directory had declared down, never re-registering (review, 2026-12-06).
            for task in self._tasks:
                self._runtime.watch(task, task.get_name())
        self._log.info(
            "segment_registered",
            data_addr=self.data_addr,
            arena=str(self.arena.path),
            arena_bytes=self.arena.size_bytes,
            shards_seen=len(self.backend.gate.fences),
        )

    async def stop(self) -> None:
        await stop_tasks(self._tasks, self._log)
        await self._stop_confirming_later()  # none may start or run once the arena closes below
        await self.suspects.stop()
        # A copy still running holds only its slot (aborted when its fetch fails) and views of
        # the arena (which stays mapped while any exists): nothing to wait for.
        self._copy_pool.shutdown(wait=False, cancel_futures=True)
        self.disk_frees.close()
        self.demoter.close()
        if self.ucx is not None:
            try:
                await asyncio.to_thread(self.ucx.stop)
            except Exception as exc:  # (a stop past its bound: it raised and skipped every step
                # below, the arena, disk tier and id lock left and exit 75 lost; review, stop 68)
                self._log.error("ucx_stop_failed", error=repr(exc))
        await asyncio.to_thread(self.server.stop)
        self.arena.close()
        # The disk tier after the data server (no read uses it any more) and after the demotion
        # threads: one may still write or sync it. One that outlasts the wait (a hung disk) keeps
        # the files open: the process's exit closes them, not a close under its feet.
        idle = await asyncio.to_thread(self.demoter.wait_idle, DEMOTE_STOP_WAIT_S)
        # (and after the disk frees: one handed off past its wait may still write its free record)
        idle = idle and await asyncio.to_thread(self.disk_frees.wait_idle, DEMOTE_STOP_WAIT_S)
        # (and after a free record's retry or a suspect's check still on its thread: cancelling
        # their task did not stop it; review, stop 65)
        idle = idle and await asyncio.to_thread(self.disk_calls.wait_idle, DEMOTE_STOP_WAIT_S)
        if self.ssd is not None and idle:
            await asyncio.to_thread(self._close_ssd)
        elif self.ssd is not None:
            self._log.warning(
                "ssd_left_open", reason="a demotion or a free still writes", waited_s=DEMOTE_STOP_WAIT_S
            )
        if self._id_lock_fd >= 0:  # the id is free for the next incarnation
            unlock_segment_id(self.settings.shm_dir, self.settings.segment_id, self._id_lock_fd)
            self._id_lock_fd = -1

    def _close_ssd(self) -> None:
        """Wait for the I/O threads, then close the file (it stays for the next start)."""
        if self.ssd_io is not None:
            self.ssd_io.close()
        if self.ssd is not None:
            self.ssd.close()

    # ---- the directory's requests: frees, reports, drain -----------------------------------------

    async def _on_free(self, message: FreeSlotsRequest, headers: Mapping[str, str]) -> msgspec.Struct:
        if message.incarnation != self.incarnation:
            raise StaleGeneration("segment_incarnation", message.incarnation, self.incarnation)
        self._admit(message.shard, message.epoch)  # a replaced leader's: fenced
        pairs = [(f.slot, f.slot_generation) for f in message.slots]
        on_disk = [p for p in pairs if p[0] >= SSD_SLOT_BASE] if self.ssd is not None else []
        arena = [p for p in pairs if p[0] < SSD_SLOT_BASE] if on_disk else pairs
        # The disk's on a thread of their own (`DiskFrees`): a hung disk held the default
        # executor's threads and the arena's frees queued behind it (review, 2026-12-06).
        done = await asyncio.to_thread(self.backend.free_slots, arena) if arena else []
        done += await self.disk_frees.free(on_disk)
        done_slots = set(done)  # once: a batch names up to 1,024 slots (`batch_frees`)
        freed = [
            m.FreedSlot(f.key, f.slot, f.slot_generation)
            for f in message.slots
            if (f.slot, f.slot_generation) in done_slots
        ]
        return FreeSlotsReply(incarnation=self.incarnation, freed=freed)

    async def _on_report(self, message: ReportRequest, headers: Mapping[str, str]) -> msgspec.Struct:
        self._admit(message.shard, message.epoch)  # a replaced leader's: fenced
        if not 0 < message.limit <= REPORT_PAGE_MAX:
            raise BadRequest(f"limit must be in 1..{REPORT_PAGE_MAX}")
        with self.backend.lock:
            held = self.slots.held(message.after_slot, message.limit + 1)
        if self.ssd is not None and len(held) <= message.limit:  # disk slots come after the arena's
            disk = await asyncio.to_thread(self.ssd.held, message.after_slot, message.limit + 1 - len(held))
            held += [HeldSlot(h.slot, h.generation, h.size, h.checksum, h.key) for h in disk]
        more = len(held) > message.limit
        held = held[: message.limit]
        return SegmentReport(
            incarnation=self.incarnation,
            capacity_bytes=self.arena.size_bytes,
            used_bytes=self.slots.used_bytes,
            draining=self.backend.draining,
            objects=[HeldObject(ObjectKey(h.key), h.slot, h.generation, h.size, h.checksum) for h in held],
            next_after_slot=held[-1].slot if more else -1,
        )

    async def _on_drain(self, message: DrainRequest, headers: Mapping[str, str]) -> msgspec.Struct:
        self.backend.draining = message.draining  # under the backend's lock (its gate)
        self._log.info("segment_drain_set", draining=message.draining)
        return SegmentState(
            incarnation=self.incarnation, draining=self.backend.draining, used_bytes=self.slots.used_bytes
        )
