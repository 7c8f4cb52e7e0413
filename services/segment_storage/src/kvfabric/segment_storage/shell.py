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

from kvfabric.core.segment_slots import HeldSlot, SlotTable
from kvfabric.dataplane.addresses import join
from kvfabric.dataplane.tcp import TcpDataServer
from kvfabric.dataplane.tls import client_context, server_context
from kvfabric.format.errors import (
    BadRequest,
    Busy,
    Indeterminate,
    KvfError,
    NotFound,
    StaleGeneration,
    Unavailable,
)
from kvfabric.proto import directory as m
from kvfabric.proto.common import TRACE_ID_HEADER
from kvfabric.proto.dataplane import ReadRef
from kvfabric.proto.segment import (
    REPORT_PAGE_MAX,
    SSD_SLOT_BASE,
    CopyReply,
    CopyRequest,
    DrainRequest,
    FreeSlotsReply,
    FreeSlotsRequest,
    HeldObject,
    ReportRequest,
    SegmentReport,
    SegmentState,
    segment_decoder,
)
from kvfabric.runtime.directory_router import DirectoryRouter
from kvfabric.runtime.logs import get_logger
from kvfabric.runtime.service import ServiceRuntime
from kvfabric.segment_storage.arena import Arena, lock_segment_id, remove_stale_arenas, unlock_segment_id
from kvfabric.segment_storage.backend import ArenaBackend
from kvfabric.segment_storage.confirms import CONFIRM_LATER_LINGER_S, ConfirmBatcher
from kvfabric.segment_storage.copier import fetch_replica
from kvfabric.segment_storage.demoter import Demoter
from kvfabric.segment_storage.scrubber import CorruptObject, Scrubber, ScrubPacer
from kvfabric.segment_storage.settings import SegmentSettings
from kvfabric.segment_storage.ssd import SsdIo, SsdTier
from kvfabric.segment_storage.suspects import SuspectChecker

if TYPE_CHECKING:
    from kvfabric.segment_storage.ucx_thread import UcxThread

__all__ = ["EXIT_REREGISTER", "SegmentShell", "new_incarnation"]

EXIT_REREGISTER: Final = 75
REQUEST_TIMEOUT_S: Final = 5.0
HEARTBEAT_TIMEOUT_MIN_S: Final = 0.2  # a heartbeat request waits one interval, at least this
HEARTBEATS_FAILED_WARN: Final = 2  # failed rounds in a row logged as a warning
MAP_REFRESH_BEATS: Final = 10  # the shard map is asked again at least every this many heartbeats
SCRUB_TICK_S: Final = 0.1
CORRUPT_REPORT_ATTEMPTS: Final = 3  # a report the directory could not take is retried, then dropped
CORRUPT_REPORT_BACKOFF_S: Final = 1.0
SSD_UNLINK_RETRY_S: Final = 1.0
# A receipted write's background confirm that got no verdict (directory unreachable, busy) is
# asked again every this long until one comes; past the ticket's deadline (plus the clock skew
# tolerance) the directory has committed or dropped the write, so any verdict is final then,
# and a confirm still without one after CONFIRM_LATER_GIVE_UP_MS more frees the slot.
CONFIRM_LATER_RETRY_S: Final = 0.5
CONFIRM_LATER_GIVE_UP_MS: Final = 30_000
# Refusals that are final: the slot is freed at once (the others are asked again).
_CONFIRM_FINAL_ERRORS: Final = (NotFound, StaleGeneration)
# A segment that starts before any directory instance leads a shard (a cluster coming up, a busy
# directory answering the shard map late) asks again, waiting this long doubling to the max,
# for at most REGISTER_WAIT_S in all; then its start fails (the supervisor restarts it).
REGISTER_RETRY_S_MIN: Final = 0.1
REGISTER_RETRY_S_MAX: Final = 2.0
REGISTER_WAIT_S: Final = 30.0


def new_incarnation() -> int:
    return time.time_ns() // 1_000


class SegmentShell:
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
        self.slots = SlotTable(settings.arena_bytes)
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
        # Copies run on their own threads (never the default executor's, which frees use).
        self._copy_pool = concurrent.futures.ThreadPoolExecutor(
            settings.copies_max, thread_name_prefix="kvf-copy"
        )
        self._copy_lock = threading.Lock()
        self.copies_in_flight = 0
        self.scrubber = Scrubber(self.backend, pass_min_ms=settings.scrub_pass_min_ms)
        # Slots a reader found corrupt (relayed by the directory): re-hashed now, reported if so.
        self.suspects = SuspectChecker(self.backend, self.incarnation, self._report_corrupt)
        self.confirms = ConfirmBatcher(
            settings.segment_id,
            self.incarnation,
            lambda message, trace_id: self._directory("confirm", message, trace_id),
        )
        # Receipted writes' confirms: off the writes' path, so they wait a little to share requests.
        self.confirms_later = ConfirmBatcher(
            settings.segment_id,
            self.incarnation,
            lambda message, trace_id: self._directory("confirm", message, trace_id),
            linger_s=CONFIRM_LATER_LINGER_S,
        )
        self._later: list[tuple[m.WriteTicket, int, int, str]] = []  # receipted writes not yet on the loop
        self._later_lock = threading.Lock()
        self._later_woken = False  # a wake-up of the loop for `_later` is pending
        self._later_tasks: set[asyncio.Task[None]] = set()
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
        )

    def attach(self, runtime: ServiceRuntime) -> None:
        runtime.add_endpoint("free", self._on_free, instance=self.settings.segment_id)
        runtime.add_endpoint("drain", self._on_drain, instance=self.settings.segment_id)
        runtime.add_endpoint("report", self._on_report, instance=self.settings.segment_id)
        runtime.add_endpoint("copy", self._on_copy, instance=self.settings.segment_id)
        runtime.add_endpoint("verify", self.suspects.on_verify, instance=self.settings.segment_id)
        runtime.add_endpoint("demote", self.demoter.on_demote, instance=self.settings.segment_id)

    async def _directory(self, verb: str, message: msgspec.Struct, trace_id: str = "") -> msgspec.Struct:
        """A keyed request (confirm, replica_corrupt, replicate_begin, put_abort) to the leader of
        its key's shard."""
        assert self.router is not None
        if isinstance(message, m.ConfirmReplicas):
            shard = self.router.shard_of(message.confirms[0].key)
        elif isinstance(message, m.PutAbort):
            shard = self.router.shard_of(message.keys[0])
        elif isinstance(message, m.ReplicateBeginMany | m.ReplicaCorruptMany):  # one shard's keys
            shard = self.router.shard_of(message.items[0].key)
        else:
            shard = self.router.shard_of(getattr(message, "key", b""))
        reply = await self.router.ask(
            shard,
            verb,
            message,
            REQUEST_TIMEOUT_S,
            headers={TRACE_ID_HEADER: trace_id} if trace_id else None,
        )
        self._saw_epoch(shard, getattr(reply, "epoch", 0))
        return reply

    async def _every_leader(
        self, verb: str, message: msgspec.Struct, timeout_s: float = REQUEST_TIMEOUT_S
    ) -> list[msgspec.Struct]:
        """Registration and heartbeats: every instance that leads a shard keeps segments. Raises
        the first error when no instance took it (or `NotFound`/`StaleGeneration` from any: a
        leader declared this incarnation down)."""
        assert self.router is not None
        answers = await self.router.ask_all(verb, message, timeout_s)
        replies: list[msgspec.Struct] = [a for a in answers if not isinstance(a, KvfError)]
        errors = [a for a in answers if isinstance(a, KvfError)]
        for err in errors:
            if isinstance(err, NotFound | StaleGeneration):
                raise err
        covered = {e.shard for r in replies for e in getattr(r, "shard_epochs", [])}
        self._beats += 1
        if errors or len(covered) < self.router.shards or self._beats % MAP_REFRESH_BEATS == 0:
            # A gone or deposed instance, a shard nobody here answered for (it moved: a handover
            # or a failover), or just time: ask the map again before the next heartbeat, so
            # every shard's leader hears from this segment before it would declare it down.
            self.router.forget_all()
        if not replies:
            raise errors[0] if errors else Unavailable("no directory instance leads a shard yet")
        for reply in replies:
            for shard_epoch in getattr(reply, "shard_epochs", []):
                self._saw_epoch(shard_epoch.shard, shard_epoch.epoch)
        return replies

    def _saw_epoch(self, shard: int, epoch: int) -> None:
        """A leader of `shard` with `epoch` exists: tickets and frees of older epochs are fenced."""
        # The backend fences tickets with it (`min_epochs`: the one record of epochs seen).
        if epoch > self.backend.min_epochs.get(shard, 0):
            self.backend.min_epochs[shard] = epoch
            self._log.info("directory_epoch_seen", shard=shard, epoch=epoch)

    async def start(self, nc: NatsClient) -> None:
        self._nc = nc
        self._loop = asyncio.get_running_loop()
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
            capacity_bytes=s.arena_bytes,
            domain=m.FailureDomain(zone=s.zone, rack=s.rack, host=s.host),
            data_addr=self.data_addr,
            disk_objects=self._disk_objects(),  # recovered: the directory adopts them
        )
        replies = await self._register(registration)
        for reply in replies:
            if isinstance(reply, m.SegmentRegistered) and reply.heartbeat_interval_ms:
                self.heartbeat_interval_ms = reply.heartbeat_interval_ms
        self._tasks = [asyncio.create_task(self._heartbeats())]
        if s.scrub_bytes_per_s > 0:
            self._tasks.append(asyncio.create_task(self._scrub()))
        if self.ssd is not None:
            self._tasks.append(asyncio.create_task(self._ssd_unlinks()))
        self._log.info(
            "segment_registered",
            data_addr=self.data_addr,
            arena=str(self.arena.path),
            arena_bytes=s.arena_bytes,
            shards_seen=len(self.backend.min_epochs),
        )

    async def _register(
        self,
        registration: m.RegisterSegment,
        *,
        wait_s: float = REGISTER_WAIT_S,
        retry_s: float = REGISTER_RETRY_S_MIN,
    ) -> list[msgspec.Struct]:
        """`register` with every shard leader; while none answers (`Unavailable`: no leader yet,
        or a shard map answered too late), asked again with a doubling wait for at most `wait_s`.
        `NotFound`/`StaleGeneration` (this incarnation declared down) and, once the wait is spent,
        the last error are raised."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return await self._every_leader("register", registration)
            except (NotFound, StaleGeneration):
                raise
            except (Unavailable, Indeterminate) as err:  # a register is idempotent per incarnation
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                self._log.info("register_retry", error=repr(err), wait_s=round(min(retry_s, left), 3))
                await asyncio.sleep(min(retry_s, left))
                retry_s = min(retry_s * 2, REGISTER_RETRY_S_MAX)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.suspects.stop()
        # A copy still running holds only its slot (aborted when its fetch fails) and views of
        # the arena (which stays mapped while any exists): nothing to wait for.
        self._copy_pool.shutdown(wait=False, cancel_futures=True)
        self.demoter.close()
        if self.ucx is not None:
            await asyncio.to_thread(self.ucx.stop)
        await asyncio.to_thread(self.server.stop)
        self.arena.close()
        if self.ssd is not None:  # after the data server: no read is using it any more
            await asyncio.to_thread(self._close_ssd)
        if self._id_lock_fd >= 0:  # the id is free for the next incarnation
            unlock_segment_id(self.settings.shm_dir, self.settings.segment_id, self._id_lock_fd)
            self._id_lock_fd = -1

    def _disk_objects(self) -> int:
        return self.ssd.table.objects if self.ssd is not None else 0

    def _close_ssd(self) -> None:
        """Wait for the I/O threads, then close the file (it stays for the next start)."""
        if self.ssd_io is not None:
            self.ssd_io.close()
        if self.ssd is not None:
            self.ssd.close()

    # ---- directory traffic ---------------------------------------------------------------------

    def _confirm(
        self, ticket: m.WriteTicket, slot: int, generation: int, trace_id: str = "", save_writes: int = 0
    ) -> str:
        """Called from a transport thread: confirm on the event loop (batched with the other
        replicas of the same save, `ConfirmBatcher`), wait for the verdict."""
        if self._loop is None or self.router is None:
            raise Unavailable("the segment is not connected to the directory")
        confirm = m.ReplicaConfirm(
            ticket_id=ticket.ticket_id,
            key=ticket.key,
            slot=slot,
            slot_generation=generation,
            size_bytes=ticket.size_bytes,
            checksum=ticket.checksum,
        )
        shard = self.router.shard_of(ticket.key)
        future = asyncio.run_coroutine_threadsafe(
            self.confirms.confirm(shard, ticket.epoch, confirm, trace_id, expected=save_writes), self._loop
        )
        try:
            return future.result(timeout=self.settings.confirm_timeout_ms / 1000)
        except TimeoutError:  # the caller frees the slot: a late "ok" names a replica that is gone
            future.cancel()
            raise Indeterminate(
                "no confirm verdict in time", timeout_ms=self.settings.confirm_timeout_ms
            ) from None
        except (concurrent.futures.CancelledError, RuntimeError):  # stopping: the slot is freed
            raise Unavailable("the segment stopped confirming") from None

    def _confirm_later(self, ticket: m.WriteTicket, slot: int, generation: int, trace_id: str = "") -> None:
        """Called from a transport thread for a write answered with a receipt: its confirm goes
        in the background (`_confirm_in_background`); never blocks. The writes that arrive before
        the loop runs share one wake-up and one task (not one each)."""
        loop = self._loop
        if loop is None or self.router is None:
            raise Unavailable("the segment is not connected to the directory")
        with self._later_lock:
            self._later.append((ticket, slot, generation, trace_id))
            if self._later_woken:
                return
            self._later_woken = True
        try:
            loop.call_soon_threadsafe(self._start_later)
        except RuntimeError:  # the loop is closing
            raise Unavailable("the segment stopped confirming") from None

    def _start_later(self) -> None:
        """On the loop: the receipted writes queued since the last wake-up, confirmed together."""
        with self._later_lock:
            items, self._later = self._later, []
            self._later_woken = False
        task = asyncio.ensure_future(self._confirm_in_background(items))
        self._later_tasks.add(task)
        task.add_done_callback(self._later_tasks.discard)

    async def _confirm_in_background(self, items: list[tuple[m.WriteTicket, int, int, str]]) -> None:
        """Confirm receipted writes until the directory gives each a verdict: `ok` keeps the slot
        (the writer's commit named it, or will), a refusal frees it (the write expired or was
        aborted uncommitted, or the ticket already names another slot). Those without a verdict
        are asked again (`CONFIRM_LATER_RETRY_S`): freeing a slot the writer's receipt may have
        published would lose a replica. After a ticket's deadline every verdict is final; a
        directory silent for `CONFIRM_LATER_GIVE_UP_MS` past it gets the slot freed (as a
        synchronous confirm without a verdict does)."""
        assert self.router is not None
        waiting = items
        while waiting:
            asked = [
                (
                    (ticket, slot, generation, trace_id),
                    self.confirms_later.submit(
                        self.router.shard_of(ticket.key),
                        ticket.epoch,
                        m.ReplicaConfirm(
                            ticket_id=ticket.ticket_id,
                            key=ticket.key,
                            slot=slot,
                            slot_generation=generation,
                            size_bytes=ticket.size_bytes,
                            checksum=ticket.checksum,
                        ),
                        trace_id,
                        shared=True,
                    ),
                )
                for ticket, slot, generation, trace_id in waiting
            ]
            await asyncio.wait([f for _, f in asked], timeout=self.settings.confirm_timeout_ms / 1000)
            waiting = []
            for (ticket, slot, generation, trace_id), verdict in asked:
                if not verdict.done():
                    verdict.cancel()  # its batch skips it (or drops its late verdict)
                    err: BaseException | None = TimeoutError()
                else:
                    err = verdict.exception()
                if err is None:
                    if verdict.result() != "ok":
                        self.backend.unconfirmed(slot, generation, verdict.result())
                elif isinstance(err, _CONFIRM_FINAL_ERRORS):
                    self.backend.unconfirmed(slot, generation, err.code)
                elif (
                    self.backend.clock_ms()
                    >= self.backend.ticket_deadline_ms(ticket) + CONFIRM_LATER_GIVE_UP_MS
                ):
                    self.backend.unconfirmed(slot, generation, "no_verdict")
                else:
                    waiting.append((ticket, slot, generation, trace_id))
            if waiting:
                self.backend.count("confirm_later_retries_total", len(waiting))
                await asyncio.sleep(CONFIRM_LATER_RETRY_S)

    async def _confirm_async(self, ticket: m.WriteTicket, slot: int, generation: int) -> str:
        """A demotion's disk replica, confirmed on the loop like a transport's write."""
        assert self.router is not None
        confirm = m.ReplicaConfirm(
            ticket_id=ticket.ticket_id,
            key=ticket.key,
            slot=slot,
            slot_generation=generation,
            size_bytes=ticket.size_bytes,
            checksum=ticket.checksum,
        )
        try:
            return await asyncio.wait_for(
                self.confirms.confirm(self.router.shard_of(ticket.key), ticket.epoch, confirm, ""),
                self.settings.confirm_timeout_ms / 1000,
            )
        except TimeoutError:
            raise Indeterminate(
                "no confirm verdict in time", timeout_ms=self.settings.confirm_timeout_ms
            ) from None

    async def _heartbeats(self) -> None:
        """One heartbeat round per interval, on a fixed cadence. A round waits at most one
        interval for its slowest instance: an instance that died with a heartbeat in flight
        (no reply, no `no responders`) must not hold back the next round to the others, or they
        declare this segment down (heartbeat timeout) and it restarts empty."""
        loop = asyncio.get_running_loop()
        due = loop.time()
        failed_in_a_row = 0
        while True:
            interval_s = self.heartbeat_interval_ms / 1000
            due = max(due + interval_s, loop.time())
            await asyncio.sleep(due - loop.time())
            try:
                await self._every_leader(
                    "heartbeat",
                    m.Heartbeat(
                        segment_id=self.settings.segment_id,
                        incarnation=self.incarnation,
                        used_bytes=self.slots.used_bytes,
                        draining=self.backend.draining,
                        disk_objects=self._disk_objects(),
                    ),
                    timeout_s=min(REQUEST_TIMEOUT_S, max(HEARTBEAT_TIMEOUT_MIN_S, interval_s)),
                )
            except (NotFound, StaleGeneration) as err:
                self._log.warning("segment_declared_down", code=err.code)
                self.must_reregister.set()
                return
            except KvfError as err:  # directory unreachable: keep trying, keep serving reads
                failed_in_a_row += 1  # one is routine (a failover); a run of them nears the timeout
                log = self._log.warning if failed_in_a_row >= HEARTBEATS_FAILED_WARN else self._log.info
                log("heartbeat_failed", code=err.code, failed_in_a_row=failed_in_a_row)
            else:
                failed_in_a_row = 0

    async def _on_free(self, data: bytes, headers: Mapping[str, str]) -> msgspec.Struct:
        message = segment_decoder.decode(data)
        if not isinstance(message, FreeSlotsRequest):
            raise BadRequest(f"expected FreeSlotsRequest, got {type(message).__name__}")
        if message.incarnation != self.incarnation:
            raise StaleGeneration("segment_incarnation", message.incarnation, self.incarnation)
        fence = self.backend.min_epochs.get(message.shard, 0)
        if message.epoch < fence:  # from a leader of the shard that has been replaced: fenced
            raise StaleGeneration("directory_epoch", message.epoch, fence)
        self._saw_epoch(message.shard, message.epoch)
        done = await asyncio.to_thread(
            self.backend.free_slots, [(f.slot, f.slot_generation) for f in message.slots]
        )
        done_slots = set(done)  # once: a batch names up to 1,024 slots (`batch_frees`)
        freed = [
            m.FreedSlot(f.key, f.slot, f.slot_generation)
            for f in message.slots
            if (f.slot, f.slot_generation) in done_slots
        ]
        return FreeSlotsReply(incarnation=self.incarnation, freed=freed)

    async def _on_report(self, data: bytes, headers: Mapping[str, str]) -> msgspec.Struct:
        message = segment_decoder.decode(data)
        if not isinstance(message, ReportRequest):
            raise BadRequest(f"expected ReportRequest, got {type(message).__name__}")
        fence = self.backend.min_epochs.get(message.shard, 0)
        if message.epoch < fence:
            raise StaleGeneration("directory_epoch", message.epoch, fence)
        if not 0 < message.limit <= REPORT_PAGE_MAX:
            raise BadRequest(f"limit must be in 1..{REPORT_PAGE_MAX}")
        self._saw_epoch(message.shard, message.epoch)
        with self.backend.lock:
            held = self.slots.held(message.after_slot, message.limit + 1)
        if self.ssd is not None and len(held) <= message.limit:  # disk slots come after the arena's
            disk = await asyncio.to_thread(self.ssd.held, message.after_slot, message.limit + 1 - len(held))
            held += [HeldSlot(h.slot, h.generation, h.size, h.checksum, h.key) for h in disk]
        more = len(held) > message.limit
        held = held[: message.limit]
        return SegmentReport(
            incarnation=self.incarnation,
            capacity_bytes=self.settings.arena_bytes,
            used_bytes=self.slots.used_bytes,
            draining=self.backend.draining,
            objects=[HeldObject(h.key, h.slot, h.generation, h.size, h.checksum) for h in held],
            next_after_slot=held[-1].slot if more else -1,
        )

    async def _on_drain(self, data: bytes, headers: Mapping[str, str]) -> msgspec.Struct:
        message = segment_decoder.decode(data)
        if not isinstance(message, DrainRequest):
            raise BadRequest(f"expected DrainRequest, got {type(message).__name__}")
        self.backend.draining = message.draining
        self._log.info("segment_drain_set", draining=message.draining)
        return SegmentState(
            incarnation=self.incarnation, draining=self.backend.draining, used_bytes=self.slots.used_bytes
        )

    # ---- repair: copies in, scrub ----------------------------------------------------------------

    async def _on_copy(self, data: bytes, headers: Mapping[str, str]) -> msgspec.Struct:
        message = segment_decoder.decode(data)
        if not isinstance(message, CopyRequest):
            raise BadRequest(f"expected CopyRequest, got {type(message).__name__}")
        with self._copy_lock:
            busy = self.copies_in_flight >= self.settings.copies_max
            if not busy:
                self.copies_in_flight += 1
        if busy:
            self.backend.count("copies_busy_total")
            raise Busy("copies in flight at the limit", copies_max=self.settings.copies_max)
        try:
            future = self._copy_pool.submit(self._copy, message, headers.get(TRACE_ID_HEADER, ""))
        except RuntimeError:  # the pool is shut down: stopping
            self._copy_finished(None)
            raise Unavailable("segment is stopping") from None
        # The in-flight count drops when the copy thread is done (or the copy never started),
        # not when this handler returns or is cancelled.
        future.add_done_callback(self._copy_finished)
        try:
            slot, generation = await asyncio.wrap_future(future)
        except KvfError as err:
            self._log.warning(
                "copy_failed",
                code=err.code,
                error=err.message,
                source_addr=message.source_addr,
                ticket_id=message.ticket.ticket_id,
            )
            raise
        if message.source_incarnation == self.incarnation and message.source_slot >= SSD_SLOT_BASE:
            self.backend.count("promotions_total")  # from its own disk into its arena
        return CopyReply(slot=slot, slot_generation=generation)

    def _copy_finished(self, _: object) -> None:
        with self._copy_lock:
            self.copies_in_flight -= 1

    def _copy(self, message: CopyRequest, trace_id: str) -> tuple[int, int]:
        """On a copy thread: the ticket's put, filled from the source replica, within the timeout."""
        ticket = message.ticket
        source = ReadRef(
            message.source_incarnation,
            message.source_slot,
            message.source_slot_generation,
            ticket.size_bytes,
            message.source_read_token,
            message.source_read_expires_ms,
        )
        # No point reading past the ticket's deadline: the directory no longer takes the replica.
        # (An expired ticket is refused by `begin_put` before anything is read.)
        # The deadline as this segment honours it (plus the clock skew tolerance).
        ticket_left_ms = self.backend.ticket_deadline_ms(ticket) - self.backend.clock_ms()
        timeout_ms = min(self.settings.copy_timeout_ms, ticket_left_ms)
        timeout_s = max(timeout_ms, 1) / 1000
        return self.backend.copy_in(
            ticket,
            lambda view: fetch_replica(message.source_addr, source, view, timeout_s, self.peer_tls),
            trace_id,
        )

    async def _scrub(self) -> None:
        """Scrub at `scrub_bytes_per_s`, one bounded step per tick; report what is corrupt."""
        pacer = ScrubPacer(self.settings.scrub_bytes_per_s, time.monotonic())
        while True:
            await asyncio.sleep(SCRUB_TICK_S)
            budget = pacer.available(time.monotonic())
            if budget <= 0:
                continue
            spent, corrupt = await asyncio.to_thread(self.scrubber.step, budget, self.backend.clock_ms())
            pacer.spend(spent)
            for found in corrupt:
                self._log.warning(
                    "corrupt_replica_freed",
                    slot=found.slot,
                    slot_generation=found.generation,
                    size_bytes=found.size,
                    key=found.key.hex(),
                )
                await self._report_corrupt(found)

    def _disk_read_corrupt(self, key: bytes, slot: int, generation: int, size: int) -> None:
        """From a transport thread: a disk read found this replica corrupt (or unreadable) and the
        tier freed it; report it like the scrubber does."""
        self._log.warning("corrupt_replica_freed", slot=slot, slot_generation=generation, tier="ssd")
        if self._loop is not None:
            found = CorruptObject(key, slot, generation, size)
            asyncio.run_coroutine_threadsafe(self._report_corrupt(found), self._loop)

    async def _ssd_unlinks(self) -> None:
        """Free records whose write failed (an I/O error): their extents stay held until a retry
        gets them durable."""
        assert self.ssd is not None
        while True:
            await asyncio.sleep(SSD_UNLINK_RETRY_S)
            if self.ssd.unlinks_pending:
                retried = await asyncio.to_thread(self.ssd.retry_unlinks)
                if retried:
                    self._log.info("ssd_unlinks_retried", slots=retried)

    async def _report_corrupt(self, found: CorruptObject) -> None:
        """Tell the directory (bounded retries); the slot is already freed here whatever it says."""
        message = m.ReplicaCorrupt(
            segment_id=self.settings.segment_id,
            incarnation=self.incarnation,
            key=found.key,
            slot=found.slot,
            slot_generation=found.generation,
        )
        for attempt in range(1, CORRUPT_REPORT_ATTEMPTS + 1):
            try:
                reply = await self._directory("replica_corrupt", message)
            except KvfError as err:
                self._log.info("replica_corrupt_report_failed", code=err.code, attempt=attempt)
                if not err.retryable or attempt == CORRUPT_REPORT_ATTEMPTS:
                    self.backend.count("replica_corrupt_unreported_total")
                    return
                await asyncio.sleep(CORRUPT_REPORT_BACKOFF_S * attempt)
                continue
            dropped = isinstance(reply, m.ReplicaCorruptReply) and reply.dropped
            self.backend.count("replica_corrupt_reported_total")
            self._log.info("replica_corrupt_reported", slot=found.slot, dropped=dropped)
            return
