"""`demote.<segment_id>`: move arena objects into this segment's own disk tier (issue 23).

The eviction policy picks the victims and asks; the segment runs the protocol for each object,
each step an existing mechanism, up to `DEMOTE_CONCURRENCY_MAX` objects of a request at once:

1. `replicate_begin(key, this segment, tier="ssd")` at the key's shard leader: a ticket for a
   disk replica (reserves no arena bytes). `already_there`: an earlier demotion copied it (its
   arena replica was kept): go to 4. The arena replica named must be one of the directory's
   live sources (this incarnation, that slot and generation), else `not_found`.
2. `ArenaBackend.demote`: under a read reference on the arena slot, re-hash its bytes (a
   mismatch frees it like the scrubber), then the disk tier's write protocol (data, sync, commit
   record, sync). A full tier is `no_capacity`: nothing is written, the ticket is aborted
   (`put_abort`), the rest of the request is not tried, and the shell logs `demotion_stopped`
   and counts `demote_no_capacity`; the arena keeps serving as before.
3. Confirm the disk replica like any write (the confirm batcher); a refusal or no verdict frees
   the disk slot (the directory never published it).
4. `replica_corrupt(reason="demoted")` for the arena replica: the directory drops it and frees it
   (`free.<segment_id>`), unless a lease or pin holds the group (`copied`: both replicas stay,
   a later demotion drops it) or it is the last replica.

One request at a time (another is `busy`). Within it, up to `DEMOTE_CONCURRENCY_MAX` objects run
the four steps at once, each in its own order, so their directory round trips overlap (the
confirm batcher sends concurrent confirms in one request) and their disk writes share syncs
(`GroupSync`: a sync that starts after a write covers every write finished by then — a batch of
writes costs a few syncs, not two each; the write protocol of each object is unchanged: its data
is durable before its commit record is written). Sequentially each object paid two syncs and three
round trips, and demotion moved 0.04-0.34 of the raw disk's write rate (docs/ssd-tier.md). The
disk writes run on threads of their own (the I/O engine splits each into pieces on its threads),
never on the default executor that frees use. A full tier (`no_capacity`) stops the objects not
yet started; those in flight finish. An unexpected error in one object lets the others finish
(none is left half-done: a disk slot written but neither confirmed nor freed), then is raised. A
failure at any step leaves the object readable where it was: the arena replica goes only once the
disk replica is in the directory's record.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import os
import threading
from collections.abc import Awaitable, Callable, Mapping
from typing import Final

import msgspec

from kvfabric.format.errors import BadRequest, Busy, Conflict, KvfError, NoCapacity, NotFound, StaleGeneration
from kvfabric.proto import directory as m
from kvfabric.proto.segment import (
    DEMOTE_BATCH_MAX,
    DemoteObject,
    DemoteReply,
    DemoteRequest,
    DemoteResult,
    segment_decoder,
)
from kvfabric.segment_storage.backend import ArenaBackend

__all__ = ["DEMOTE_CONCURRENCY_MAX", "DEMOTE_THREAD_NICE", "DEMOTE_TTL_MS", "Demoter"]

DEMOTE_TTL_MS: Final = 30_000  # the disk replica's ticket: one object's write, well within it
# Objects of one demote request in flight at once (their disk writes and round trips overlap);
# with 4 MiB objects: 32 pieces of the I/O engine's queue (KVF_SEGMENT_SSD_IO_QUEUE_MAX, 256).
DEMOTE_CONCURRENCY_MAX: Final = 8
# The demotion threads' nice value (Linux: per thread): with both cores busy, the transports'
# threads (nice 0) run first; demotion is background work (docs/ssd-tier.md).
DEMOTE_THREAD_NICE: Final = 10

# (verb, message) -> the directory's reply, from the leader of the message key's shard
AskFn = Callable[[str, msgspec.Struct], Awaitable[msgspec.Struct]]
# (ticket, disk slot, generation) -> the directory's confirm verdict ("ok", ...)
ConfirmAsyncFn = Callable[[m.WriteTicket, int, int], Awaitable[str]]
# (event, fields) -> a log line
LogFn = Callable[..., None]


class Demoter:
    def __init__(
        self,
        backend: ArenaBackend,
        *,
        segment_id: str,
        incarnation: int,
        ask: AskFn,
        confirm: ConfirmAsyncFn,
        warn: LogFn,
    ) -> None:
        self.backend = backend
        self.segment_id = segment_id
        self.incarnation = incarnation
        self.writer_id = f"demote:{segment_id}"  # no "/": not a tenant's scoped writer
        self._ask = ask
        self._confirm = confirm
        self._warn = warn
        self._busy = False
        self._requests = itertools.count(1)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            DEMOTE_CONCURRENCY_MAX, thread_name_prefix="kvf-demote", initializer=_lower_priority
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def on_demote(self, data: bytes, headers: Mapping[str, str]) -> msgspec.Struct:
        message = segment_decoder.decode(data)
        if not isinstance(message, DemoteRequest):
            raise BadRequest(f"expected DemoteRequest, got {type(message).__name__}")
        if not 0 < len(message.objects) <= DEMOTE_BATCH_MAX:
            raise BadRequest(f"objects must be 1..{DEMOTE_BATCH_MAX}")
        ssd = self.backend.ssd
        if ssd is None:
            raise Conflict("this segment has no disk tier")
        if self._busy:
            self.backend.count("demote_busy_total")
            raise Busy("a demotion is running on this segment")
        self._busy = True
        results: list[DemoteResult] = [DemoteResult("no_capacity")] * len(message.objects)
        gate = asyncio.Semaphore(DEMOTE_CONCURRENCY_MAX)
        full = False

        async def demote(i: int, obj: DemoteObject) -> None:
            nonlocal full
            async with gate:
                if full:  # the tier is full: the rest would not fit either, not tried
                    return
                results[i] = await self._one(obj)
                if results[i].status == "no_capacity":
                    full = True

        try:
            # Every object runs to its end (none cancelled half-way by another's error).
            outcomes = await asyncio.gather(
                *(demote(i, obj) for i, obj in enumerate(message.objects)), return_exceptions=True
            )
        finally:
            self._busy = False
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        stats = ssd.stats()
        return DemoteReply(
            results=results, ssd_capacity_bytes=stats["capacity_bytes"], ssd_used_bytes=stats["used_bytes"]
        )

    async def _one(self, obj: DemoteObject) -> DemoteResult:
        try:
            begun = await self._ask(
                "replicate_begin",
                m.ReplicateBegin(
                    writer_id=self.writer_id,
                    request_id=f"demote-{self.incarnation}-{next(self._requests)}",
                    key=obj.key,
                    segment_id=self.segment_id,
                    write_ttl_ms=DEMOTE_TTL_MS,
                    tier="ssd",
                ),
            )
        except KvfError as err:
            return self._failed(obj, "replicate_begin", err)
        if not isinstance(begun, m.ReplicateBeginReply) or begun.status in ("segment_down", "no_capacity"):
            self.backend.count("demote_failed_total")
            return DemoteResult("failed")
        if begun.status == "not_found":
            self.backend.count("demote_not_found_total")
            return DemoteResult("not_found")
        disk = (-1, -1)
        if begun.status == "placed":
            ticket = begun.ticket
            if ticket is None or not any(
                (s.segment_id, s.incarnation, s.slot, s.slot_generation)
                == (self.segment_id, self.incarnation, obj.slot, obj.slot_generation)
                for s in begun.sources
            ):
                await self._abort(obj.key)
                self.backend.count("demote_not_found_total")
                return DemoteResult("not_found")
            loop = asyncio.get_running_loop()
            try:
                disk = await loop.run_in_executor(
                    self._pool, self.backend.demote, obj.slot, obj.slot_generation, ticket.size_bytes
                )
            except NoCapacity as err:
                await self._abort(obj.key)
                self.backend.count("demote_no_capacity_total")
                self._warn("demotion_stopped", reason="disk tier full", error=err.message)
                return DemoteResult("no_capacity")
            except (NotFound, StaleGeneration):  # freed or rewritten since the policy looked
                await self._abort(obj.key)
                self.backend.count("demote_not_found_total")
                return DemoteResult("not_found")
            except KvfError as err:
                await self._abort(obj.key)
                return self._failed(obj, "write", err)
            try:
                verdict = await self._confirm(ticket, *disk)
            except KvfError as err:
                verdict = err.code
            if verdict != "ok":  # never published: nobody reads it, it goes now
                await loop.run_in_executor(self._pool, self.backend.free_slots, [disk])
                self.backend.count("demote_failed_total")
                self._warn("demotion_failed", step="confirm", verdict=verdict, key=obj.key.hex())
                return DemoteResult("failed")
        try:
            dropped = await self._ask(
                "replica_corrupt",
                m.ReplicaCorrupt(
                    segment_id=self.segment_id,
                    incarnation=self.incarnation,
                    key=obj.key,
                    slot=obj.slot,
                    slot_generation=obj.slot_generation,
                    reason="demoted",
                ),
            )
        except KvfError as err:  # both replicas stay: a later demotion drops the arena one
            self._warn("demotion_drop_failed", code=err.code, key=obj.key.hex())
            dropped = None
        if isinstance(dropped, m.ReplicaCorruptReply) and dropped.dropped:
            self.backend.count("demote_dropped_total")
            return DemoteResult("demoted", *disk)
        self.backend.count("demote_kept_total")
        return DemoteResult("copied", *disk)

    async def _abort(self, key: bytes) -> None:
        """The disk replica's ticket goes now (its tenant bytes), not at its deadline."""
        request_id = f"demote-abort-{next(self._requests)}"
        with contextlib.suppress(KvfError):  # else it expires at its deadline
            abort = m.PutAbort(writer_id=self.writer_id, request_id=request_id, keys=[key])
            await self._ask("put_abort", abort)

    def _failed(self, obj: DemoteObject, step: str, err: KvfError) -> DemoteResult:
        self.backend.count("demote_failed_total")
        self._warn("demotion_failed", step=step, code=err.code, error=err.message, key=obj.key.hex())
        return DemoteResult("failed")


def _lower_priority() -> None:
    """A demotion thread's initializer: nice `DEMOTE_THREAD_NICE` for this thread alone."""
    with contextlib.suppress(OSError):  # lowering one's own priority is always allowed; be safe
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), DEMOTE_THREAD_NICE)
