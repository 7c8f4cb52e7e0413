"""The segment shell's repair: copies in from another segment (`copy.<segment_id>`), the scrubber's
paced passes, disk reads found corrupt, retried free records of the disk tier, and the corruption
reports to the directory.

`ShellRepair` is a mixin of `SegmentShell` (`kvfabric.segment_storage.shell`), over
`ShellDirectory` (it reports to the directory): it reads the shell's backend, settings, scrubber,
disk tier and copy pool and writes only `copies_in_flight`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ssl
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Final

import msgspec

from kvfabric.format.errors import Busy, KvfError, Unavailable
from kvfabric.format.ids import ObjectKey
from kvfabric.proto import directory as m
from kvfabric.proto.common import TRACE_ID_HEADER
from kvfabric.proto.dataplane import ReadRef
from kvfabric.proto.segment import SSD_SLOT_BASE, CopyReply, CopyRequest, tier_of_slot
from kvfabric.runtime.ticker import every
from kvfabric.segment_storage.copier import fetch_replica
from kvfabric.segment_storage.disk_calls import DiskCalls
from kvfabric.segment_storage.scrubber import CorruptObject, ScrubPacer
from kvfabric.segment_storage.shell_directory import ShellDirectory

if TYPE_CHECKING:
    from kvfabric.segment_storage.scrubber import Scrubber

__all__ = [
    "CORRUPT_REPORTS_INFLIGHT_MAX",
    "CORRUPT_REPORT_ATTEMPTS",
    "CORRUPT_REPORT_BACKOFF_S",
    "SCRUB_TICK_S",
    "SSD_UNLINK_RETRY_S",
    "ShellRepair",
]

SCRUB_TICK_S: Final = 0.1
CORRUPT_REPORT_ATTEMPTS: Final = 3  # a report the directory could not take is retried, then dropped
CORRUPT_REPORT_BACKOFF_S: Final = 1.0
SSD_UNLINK_RETRY_S: Final = 1.0
PIN_EXPIRY_CHECK_S: Final = 1.0  # how often lapsed local pins are released
# Reports of disk reads found corrupt or unreadable, in flight at once; past it one is counted
# `replica_corrupt_unreported` (the slot is freed here already: the directory learns it at its
# next read or rebuild). A failing device started one report task per object read, each with
# its retries, unbounded (review, 2026-12-06).
CORRUPT_REPORTS_INFLIGHT_MAX: Final = 64


class ShellRepair(ShellDirectory):
    """Copies in, scrubbing and corruption reports."""

    scrubber: Scrubber
    peer_tls: ssl.SSLContext | None
    copies_in_flight: int
    _copy_pool: concurrent.futures.ThreadPoolExecutor
    _copy_lock: threading.Lock
    _loop: asyncio.AbstractEventLoop | None
    _corrupt_reports: threading.BoundedSemaphore  # CORRUPT_REPORTS_INFLIGHT_MAX slots
    disk_calls: DiskCalls  # threads that may write the disk tier (the stop waits for them)

    async def _on_copy(self, message: CopyRequest, headers: Mapping[str, str]) -> msgspec.Struct:
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

        async def tick() -> None:
            budget = pacer.available(time.monotonic())
            if budget <= 0:
                return
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

        await every(SCRUB_TICK_S, tick, delay_first=True)

    def _disk_read_corrupt(self, key: bytes, slot: int, generation: int, size: int) -> None:
        """From any thread: a disk read found this replica corrupt (or unreadable) and the tier
        freed it, a demotion's re-hash found its arena copy corrupt (freed), or a demotion found
        a disk replica the directory lists gone; report it like the scrubber does."""
        self._log.warning(
            "corrupt_replica_freed", slot=slot, slot_generation=generation, tier=tier_of_slot(slot)
        )
        if self._loop is None:
            return
        if not self._corrupt_reports.acquire(blocking=False):
            self.backend.count("replica_corrupt_unreported_total")
            return
        found = CorruptObject(key, slot, generation, size)
        try:
            asyncio.run_coroutine_threadsafe(self._report_corrupt_then_release(found), self._loop)
        except RuntimeError:  # the loop closed: the segment is stopping
            self._corrupt_reports.release()

    async def _report_corrupt_then_release(self, found: CorruptObject) -> None:
        try:
            await self._report_corrupt(found)
        finally:
            self._corrupt_reports.release()

    async def _expire_pins(self) -> None:
        """Local pins past their read tokens' expiry are released (`BackendReads.expire_pins`)."""

        async def expire() -> None:
            self.backend.expire_pins()

        await every(PIN_EXPIRY_CHECK_S, expire, delay_first=True)

    async def _ssd_unlinks(self) -> None:
        """Free records whose write failed (an I/O error): their extents stay held until a retry
        gets them durable."""
        ssd = self.ssd
        assert ssd is not None

        async def retry() -> None:
            if ssd.unlinks_pending:
                retried = await self.disk_calls.run(ssd.retry_unlinks)  # (the stop waits for it)
                if retried:
                    self._log.info("ssd_unlinks_retried", slots=retried)

        await every(SSD_UNLINK_RETRY_S, retry, delay_first=True)

    async def _report_corrupt(self, found: CorruptObject) -> None:
        """Tell the directory (bounded retries); the slot is already freed here whatever it says."""
        message = m.ReplicaCorrupt(
            segment_id=self.settings.segment_id,
            incarnation=self.incarnation,
            key=ObjectKey(found.key),
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
