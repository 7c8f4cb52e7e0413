"""The repair shell: directory state → `RepairCore` → segment-to-segment copies → core.

Every `scan_ms` the shell re-syncs the core with the directory (anti-entropy, no event to miss).
The directory is sharded: every request goes through a `DirectoryRouter` (created in `start`).
- `list_segments` of every shard, merged (`DirectoryRouter.segments`) → `segment_up` (failure
  domain, free = capacity − reserved summed over shards, draining) for each segment up,
  `segment_down` for one that is gone or restarted;
- `list_groups(below_target, with_objects)`, each shard's pages in turn → `object_known` for
  each member (object = its 96-byte key) with fewer live replicas than the target (replicas on
  draining segments do not count); objects tracked before and absent now reached their target
  or are gone → `object_removed`;
- while a segment drains: every replica on it whose object has its target elsewhere is dropped
  (`replica_corrupt` to the shard of its key, reason `drained`, never a last copy), so the
  segment ends up empty.
Every `tick_ms` the core's `Tick` (through its `CoreDriver`, `kvfabric.runtime.core_driver`, on
the wall clock) returns copies within the bandwidth budget and in-flight cap; each runs as a
task: `kvfabric.cluster.replicas.copy_replica` (the directory's ticket, then the
destination reads the bytes from the source over the data plane, verifies and confirms) →
`copy_ok` / `CopyFailed` (fed through the driver: it carries the time). No payload crosses NATS.
A copy the core dropped (no longer wanted, or timed out) comes back as a `CancelCopy`: its task
is cancelled, which aborts its ticket, so the destination's confirm, if still on its way, is
refused and the segment frees the bytes (it ran on and landed a replica past the target, kept
until eviction: review, 2026-12-06). A later copy of the same object waits until that task has
ended: the directory aborts a writer's tickets by key, and the abort of the old copy would
otherwise kill the new one's ticket (on another destination, or the same ticket again on the
same one: `replicate_begin` answers a retry with the ticket it issued).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Final

import msgspec
from nats.aio.client import Client as NatsClient

from kvfabric.cluster.directory_router import DirectoryRouter
from kvfabric.cluster.replicas import copy_replica
from kvfabric.core.repair import CancelCopy, DrainComplete, RepairCore, StartCopy
from kvfabric.core.repair_events import CopyFailed, RepairEvent, RepairOutput, Tick
from kvfabric.format.clock import monotonic_ms
from kvfabric.format.errors import Busy, ChecksumMismatch, KvfError, Unavailable
from kvfabric.format.ids import ObjectKey, domain_in_id, pack_group_id, pack_object_key
from kvfabric.proto import directory as m
from kvfabric.proto.repair import RepairStatus, RepairStatusRequest, repair_decoder
from kvfabric.runtime.core_driver import CoreDriver
from kvfabric.runtime.deadline import stop_tasks
from kvfabric.runtime.logs import get_logger
from kvfabric.runtime.service import ServiceRuntime
from kvfabric.runtime.ticker import every

__all__ = ["RepairShell", "key_of", "now_ms"]


def now_ms() -> int:
    """The repair core's time: monotonic. Its times (the bandwidth bucket, copy timeouts,
    backoffs) are never compared with another process's; on the wall clock an NTP step back of
    X held the core's time still for X (`CoreDriver` never goes back): no refill, no timeout,
    no retry, so repair stopped for X (review, 2026-12-06)."""
    return monotonic_ms()


LIST_PAGE: Final = 1000
SCAN_PAGES_MAX: Final = 10_000  # ≤ 10 M groups per scan (all shards): a bound, not a target
WRITER_ID: Final = "repair"
DRAINS_COMPLETE_KEPT: Final = 1_024  # segments whose drain completed, in `status` (latest last)


def key_of(summary: m.GroupSummary, member: m.Member) -> ObjectKey:
    """The object's 96-byte key: chunk group id (namespace, chunk index, chain hash) + member."""
    group_id = pack_group_id(summary.namespace, summary.chunk_index, summary.group)
    return pack_object_key(group_id, member.tp_rank, member.pp_stage, member.layer_group)


class RepairShell:
    _runtime: ServiceRuntime | None = None  # set by attach

    def __init__(
        self,
        core: RepairCore,
        *,
        replicas_target: int,
        scan_ms: int,
        tick_ms: int,
        request_timeout_s: float,
        copy_timeout_s: float,
    ) -> None:
        self.core = core
        # The core's time is this module's `now_ms` (monotonic), read through it (tests move it).
        self._driver: CoreDriver[RepairEvent, RepairOutput] = CoreDriver(
            core, self._perform, clock=lambda: now_ms()
        )
        self.replicas_target = replicas_target
        self.scan_ms = scan_ms
        self.tick_ms = tick_ms
        self.request_timeout_s = request_timeout_s
        self.copy_timeout_s = copy_timeout_s
        self._incarnations: dict[str, int] = {}
        self._tracked: set[bytes] = set()
        self._router: DirectoryRouter | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._copies: dict[int, asyncio.Task[None]] = {}  # copy id -> its task, until it ends
        self._of_key: dict[bytes, set[asyncio.Task[None]]] = {}  # object key -> its copies not ended
        self._log = get_logger("kvfabric.repair")
        self.scans = 0
        self.below_target = 0  # objects below target at the last scan
        self.bytes_copied = 0
        self.drains_complete: list[str] = []
        self.replicas_retired = 0  # replicas dropped from draining segments

    def attach(self, runtime: ServiceRuntime) -> None:
        runtime.add_endpoint("status", self._status, request=RepairStatusRequest, decoder=repair_decoder)
        self._runtime = runtime

    async def start(self, nc: NatsClient) -> None:
        self._router = DirectoryRouter(nc)
        self._tasks = [
            asyncio.create_task(every(self.scan_ms / 1000, self.scan, self._scan_failed), name="repair-scan")
        ]
        ticker = self._driver.start_ticker(Tick(), self.tick_ms)
        # A scan loop or ticker that dies of an exception (not a KvfError: a bug) stops the
        # service, which is restarted: they died silently, the service answering $SRV.PING
        # while it repaired nothing (review, 2026-12-05).
        if self._runtime is not None:
            self._runtime.watch(self._tasks[0], "repair_scan")
            self._runtime.watch(ticker, "repair_ticker")

    async def stop(self) -> None:
        await self._driver.stop()
        copies = list(self._copies.values())
        await stop_tasks([*self._tasks, *copies], self._log)

    # ---- scan --------------------------------------------------------------------------------

    def _scan_failed(self, exc: KvfError) -> None:
        self._log.info("scan_failed", code=exc.code)

    async def scan(self) -> None:
        """One anti-entropy pass (public for tests)."""
        segments = await self._dir().segments(self.request_timeout_s)
        seen = set()
        for seg in segments.segments:
            if not seg.up:
                continue
            seen.add(seg.segment_id)
            self._incarnations[seg.segment_id] = seg.incarnation
            self.core.segment_up(
                seg.segment_id,
                incarnation=seg.incarnation,
                zone=seg.domain.zone,
                rack=seg.domain.rack,
                host=seg.domain.host,
                free_bytes=max(0, seg.capacity_bytes - seg.reserved_bytes),
                draining=seg.draining,
            )
        for gone in set(self._incarnations) - seen:
            self.core.segment_down(gone)
            del self._incarnations[gone]
        draining = {s.segment_id for s in segments.segments if s.up and s.draining}
        below: set[bytes] = set()
        try:
            async for page in self._pages(
                m.ListGroups(limit=LIST_PAGE, below_target=True, with_objects=True)
            ):
                for summary in page.groups:
                    for obj in summary.objects:
                        # per segment: an arena and a disk replica on one segment count once
                        # (review, stop 65: counted twice, such an object was never repaired)
                        if len({r.segment_id for r in obj.replicas} - draining) >= self.replicas_target:
                            continue
                        key = key_of(summary, obj.member)
                        below.add(key)
                        self.core.object_known(
                            key,
                            size_bytes=obj.size_bytes,
                            replica_target=self.replicas_target,
                            segments=[r.segment_id for r in obj.replicas],
                            # held or not: a count of holds put a tenant's objects ahead of all
                            # others' (its leases and pins are its own to take; review, stop 70)
                            hot=int(bool(summary.leases or summary.pins)),
                            tenant=domain_in_id(summary.namespace),
                        )
        except BaseException:
            # A pass that failed part-way: what it told the core is tracked all the same, so a
            # later pass that no longer lists it removes it (it stayed in the core for good,
            # and a drain flag later recounted it from its stale view; review, stop 70).
            self._tracked |= below
            raise
        for done in self._tracked - below:
            self.core.object_removed(done)
        self.core.scan_complete()  # (a drain is reported complete only after this)
        self._tracked = below
        self.below_target = len(below)
        self.scans += 1
        if draining:
            await self._retire_drained(draining)

    async def _retire_drained(self, draining: set[str]) -> None:
        """Drop each replica on a draining segment whose object already has its target elsewhere
        (the directory frees the slot): once all are gone the segment holds nothing. Batched by
        (shard, segment incarnation), `REPLICA_BATCH_MAX` a request: one request a replica, one
        after another, held the next pass (and every segment failure it would notice) for
        minutes at a million replicas (review, stop 70)."""
        router = self._dir()
        batches: dict[tuple[int, str, int], list[m.CorruptItem]] = {}
        async for page in self._pages(m.ListGroups(limit=LIST_PAGE, with_objects=True)):
            for summary in page.groups:
                for obj in summary.objects:
                    healthy = len({r.segment_id for r in obj.replicas} - draining)  # (per segment)
                    for r in obj.replicas:
                        if r.segment_id in draining and healthy >= self.replicas_target:
                            key = key_of(summary, obj.member)
                            where = (router.shard_of(key), r.segment_id, r.incarnation)
                            item = m.CorruptItem(key=key, slot=r.slot, slot_generation=r.slot_generation)
                            batch = batches.setdefault(where, [])
                            batch.append(item)
                            if len(batch) == m.REPLICA_BATCH_MAX:
                                await self._retire(where, batches.pop(where))
        for where, batch in batches.items():
            await self._retire(where, batch)

    async def _retire(self, where: tuple[int, str, int], items: list[m.CorruptItem]) -> None:
        shard, segment_id, incarnation = where
        reply = await self._dir().ask(
            shard,
            "replica_corrupt_many",
            m.ReplicaCorruptMany(
                segment_id=segment_id, incarnation=incarnation, items=items, reason="drained"
            ),
            self.request_timeout_s,
        )
        # (one a read lease holds is refused: the next pass)
        if isinstance(reply, m.ReplicaCorruptManyReply):
            self.replicas_retired += sum(reply.dropped)

    async def _pages(self, query: m.ListGroups) -> AsyncIterator[m.GroupList]:
        """Every page of `query`, shard by shard (each shard pages on its own `after`); at most
        `SCAN_PAGES_MAX` pages over all shards. A failing shard raises (a partial listing would
        look like objects that reached their target)."""
        router = self._dir()
        pages = 0
        for shard in range(await router.known_shards()):
            last: m.GroupList | None = None
            async for page in router.shard_pages(
                shard, query, self.request_timeout_s, SCAN_PAGES_MAX - pages
            ):
                pages += 1
                last = page
                yield page
            # the page bound cut this shard (or left it no page): a partial listing, which
            # raises like a failing shard (it went on silently: a drain past 10 M groups never
            # completed, its later shards' objects looked gone; review, 2026-12-05)
            if pages >= SCAN_PAGES_MAX and (last is None or last.next_after):
                raise Unavailable(f"the listing is over its bound of {SCAN_PAGES_MAX} pages")

    # ---- copies ------------------------------------------------------------------------------

    async def _perform(self, effect: RepairOutput) -> None:
        """One effect of the core's `Tick`, in order."""
        if isinstance(effect, CancelCopy):
            cancelled = self._copies.get(effect.copy_id)
            if cancelled is not None and not cancelled.done():
                self._log.info("copy_cancelled", copy_id=effect.copy_id)
                cancelled.cancel()  # `copy_replica` aborts its ticket on the way out
        elif isinstance(effect, StartCopy):
            assert isinstance(effect.object_id, bytes)
            copy_id, key = effect.copy_id, effect.object_id
            of_key = self._of_key.setdefault(key, set())
            task = asyncio.create_task(self._copy(effect, frozenset(of_key)), name="repair-copy")
            self._copies[copy_id] = task
            of_key.add(task)
            task.add_done_callback(lambda done: self._copy_ended(copy_id, key, done))
        elif isinstance(effect, DrainComplete):
            # the latest `DRAINS_COMPLETE_KEPT`, each segment once (a drain flag that flapped
            # appended it again at every drain, for the service's life; review, stop 68)
            if effect.segment_id in self.drains_complete:
                self.drains_complete.remove(effect.segment_id)
            self.drains_complete.append(effect.segment_id)
            del self.drains_complete[:-DRAINS_COMPLETE_KEPT]
            self._log.info("drain_complete", segment_id=effect.segment_id)

    def _copy_ended(self, copy_id: int, key: bytes, task: asyncio.Task[None]) -> None:
        self._copies.pop(copy_id, None)
        of_key = self._of_key.get(key)
        if of_key is not None:
            of_key.discard(task)
            if not of_key:
                del self._of_key[key]

    async def _copy(self, start: StartCopy, after: frozenset[asyncio.Task[None]] = frozenset()) -> None:
        """Run one copy and report its result; `after`: the object's earlier copies not ended
        (cancelled by the core): this one begins once they have (their tickets aborted; module
        docstring)."""
        assert isinstance(start.object_id, bytes)
        source_failed = busy = False
        try:
            # The copy's own requests time out first (and abort); this only bounds the whole
            # (the wait for `after` included: within the core's timeout of the copy).
            ok = await asyncio.wait_for(self._copy_after(start, after), 2 * self.copy_timeout_s + 1)
        except (KvfError, TimeoutError) as exc:
            # The destination says which failures were its source's (a refused or expired read
            # token, an unreachable source: `source_addr`): the next copy reads another replica.
            # A checksum mismatch at the destination is the source's bytes (or the path from
            # it): read another replica next. The same source was picked every time, and a
            # drain whose other replica was good never ended (review, stop 70).
            source_failed = isinstance(exc, ChecksumMismatch) or (
                isinstance(exc, KvfError) and "source_addr" in exc.details
            )
            # no copy slot free at the destination: nothing was tried (a busy source is a
            # source failure: another replica, not the same one every second)
            busy = isinstance(exc, Busy) and not source_failed
            self._log.info(
                "copy_failed",
                copy_id=start.copy_id,
                error=getattr(exc, "code", "timeout"),
                source=start.source,
                source_failed=source_failed,
            )
            ok = False
        if ok:
            self.bytes_copied += start.size_bytes
            if not self.core.copy_ok(start.copy_id):
                # Confirmed before the core dropped it (or before its cancel got here): a replica
                # the directory took, maybe past the target (kept until eviction).
                self._log.info("copy_not_wanted_any_more", copy_id=start.copy_id)
        else:
            await self._driver.feed(CopyFailed(start.copy_id, source_failed=source_failed, busy=busy))

    async def _copy_after(self, start: StartCopy, after: frozenset[asyncio.Task[None]]) -> bool:
        if after:
            await asyncio.wait(after)
        return await self._copy_once(start)

    async def _copy_once(self, start: StartCopy) -> bool:
        assert isinstance(start.object_id, bytes)
        outcome = await copy_replica(
            self._dir(),
            key=ObjectKey(start.object_id),  # the core's object ids are object keys
            destination=start.destination,
            writer_id=WRITER_ID,
            request_id=f"copy-{start.copy_id}",
            timeout_s=self.copy_timeout_s,
            preferred_source=start.source,
        )
        if outcome == "not_found":
            self.core.object_removed(start.object_id)
        return outcome in ("copied", "already_there")

    def _dir(self) -> DirectoryRouter:
        if self._router is None:
            raise Unavailable("repair not started")
        return self._router

    # ---- status ------------------------------------------------------------------------------

    async def _status(self, message: RepairStatusRequest, headers: Mapping[str, str]) -> msgspec.Struct:
        return self.status()

    def status(self) -> RepairStatus:
        return RepairStatus(
            scans=self.scans,
            below_target=self.below_target,
            bytes_copied=self.bytes_copied,
            drains_complete=list(self.drains_complete),
            gauges={**self.core.gauges(), "replicas_retired": self.replicas_retired},
            counters=dict(self.core.counters),
        )
