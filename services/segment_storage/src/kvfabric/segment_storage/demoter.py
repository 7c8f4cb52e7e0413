"""`demote.<segment_id>`: move arena objects into this segment's own disk tier (issue 23).

The eviction policy picks the victims and asks; the segment runs the protocol for a request's
objects, each step an existing mechanism, the directory's steps batched per shard:

1. One `replicate_begin_many` (`ReplicateBeginMany`, tier "ssd") per shard of the request's
   keys, at that shard's leader: a ticket per object for a disk replica (reserves no arena
   bytes). `already_there`: an earlier demotion copied it (its arena replica was kept): go to 4,
   once the disk replica the reply lists for this segment is checked to be held here (one that
   is not is reported gone, and the arena replica stays) and, unless `keep_arena`, its bytes are
   read back and verified (a corrupt one is freed and reported, the arena replica stays:
   nothing else reads or scrubs such a copy; review, 2026-12-06).
   The arena replica named must be one of the directory's live sources (this incarnation, that
   slot and generation), else `not_found`.
2. `ArenaBackend.demote_many`, the objects split into up to `DEMOTE_CONCURRENCY_MAX` write
   batches at once: under a read reference on each arena slot, re-hash its bytes (a mismatch
   frees it like the scrubber), then the disk tier's write protocol for the batch
   (`SsdTier.write_many`: every object's data, one sync, their commit records in one write,
   one sync). An object whose ticket a newer leader of its shard has fenced by the step that
   makes it readable is not stored (checked in that step under the backend's lock, which the
   fence rises under, as a PUT is: its slot freed, its ticket aborted, `failed`), so its slot is
   in that leader's report or never stored (review, 2026-12-06). A full tier is `no_capacity`:
   nothing is written for that object (the batch's later objects are still tried: a smaller one
   may fit a hole), and the shell logs `demotion_stopped` once a batch and counts
   `demote_no_capacity`; the arena keeps serving as before.
3. Once every object is written, their confirms at once, like any write's (the confirm batcher:
   concurrent confirms share a request, up to its batch bound: one for a request's objects per
   shard); a final refusal (`unknown_ticket`, `mismatch`, `not_found`) frees the disk slot (the
   directory never published it). No verdict (a timeout, the directory unreachable or busy) is
   asked again every `CONFIRM_LATER_RETRY_S` until one comes or the ticket is long settled
   (`CONFIRM_LATER_GIVE_UP_MS` past its deadline: then freed), as a receipted write's background
   confirm is: the directory may have applied a confirm whose verdict was lost, and freeing that
   slot left it listing a disk replica that was gone (review, 2026-12-05). A newer leader
   (`stale_generation`) adopted the slot from this segment's report (stored before its fence
   rose: step 2): it publishes or frees it; the arena replica stays either way.
4. One `replica_corrupt_many` (reason "demoted") per shard for the arena replicas of the objects
   now on disk: the directory drops and frees each (`free.<segment_id>`), unless a lease or pin
   holds its group (`copied`: both replicas stay, a later demotion drops it) or it is the last
   replica. An object asked with `keep_arena` skips this step: it is `copied` once confirmed
   (or at once when a disk replica is there already) — the policy copies a demoted tail's
   DRAM-only ancestors that way, so the disk holds whole prefixes (docs/ssd-tier.md). Its
   ticket says `keep_source`, so its confirm has the directory publish the group again with its
   disk bytes (no drop follows to do it: a policy that replays the event stream knows the copy). Tickets
   of objects not written (full tier, a failed write, a wrong source) go in one
   `put_abort` per shard, not at their deadline.

One request at a time (another is `busy`). Per object two directory requests of its own
(`replicate_begin`, `replica_corrupt`) and a confirm as its write ended cost about as much
directory time as a raw 1 MiB write (docs/ssd-tier.md): batched, a request of 64 objects costs
one of each per shard (its confirms one more). A write batch shares its syncs and writes its
commit records together (adjacent slot ids: one write), and concurrent batches share syncs
(`GroupSync`: a sync that starts after a write covers every write finished by then); each
object's write protocol is unchanged: its data is durable before its commit record is written.
Before (one object a thread, 8 at once) the waits for syncs and the one-sector record writes
took most of a demotion's write time (py-spy: docs/ssd-tier.md). The disk writes run on
threads of their own at nice `DEMOTE_THREAD_NICE` (the I/O engine splits each into pieces on
its threads), never on the default executor that frees use.
An unexpected error in one write batch, one confirm or a batched request lets the others finish
(none is left half-done: a disk slot written but neither confirmed nor freed), then is raised.
A failure at any step leaves the object readable where it was: the arena replica goes only once
the disk replica is in the directory's record.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import os
import threading
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final

import msgspec

from kvfabric.format.errors import (
    BadRequest,
    Busy,
    Conflict,
    KvfError,
    NoCapacity,
    NotFound,
    StaleGeneration,
    Unavailable,
)
from kvfabric.proto import directory as m
from kvfabric.proto.segment import (
    DEMOTE_BATCH_MAX,
    SSD_SLOT_BASE,
    DemoteObject,
    DemoteReply,
    DemoteRequest,
    DemoteResult,
)
from kvfabric.segment_storage.backend import ArenaBackend
from kvfabric.segment_storage.shell_confirms import CONFIRM_LATER_GIVE_UP_MS, CONFIRM_LATER_RETRY_S

__all__ = ["DEMOTE_CONCURRENCY_MAX", "DEMOTE_THREAD_NICE", "DEMOTE_TTL_MS", "Demoter"]

DEMOTE_TTL_MS: Final = 30_000  # the disk replica's ticket: one object's write, well within it
# Write batches of one demote request in flight at once (a request's objects split among them):
# a batch writes its objects one after another, then one sync, one commit-record write, one sync
# (docs/ssd-tier.md: per-object syncs and records waited out most of a demotion's writes); with
# 4 MiB objects: 16 pieces of the I/O engine's queue (KVF_SEGMENT_SSD_IO_QUEUE_MAX, 256).
DEMOTE_CONCURRENCY_MAX: Final = 4
# The demotion threads' nice value (Linux: per thread): with both cores busy, the transports'
# threads (nice 0) run first; demotion is background work (docs/ssd-tier.md).
DEMOTE_THREAD_NICE: Final = 10

# (verb, message) -> the directory's reply, from the leader of the message key's shard
AskFn = Callable[[str, msgspec.Struct], Awaitable[msgspec.Struct]]
# (ticket, disk slot, generation) -> the directory's confirm verdict ("ok", ...)
ConfirmAsyncFn = Callable[[m.WriteTicket, int, int], Awaitable[str]]
# (event, fields) -> a log line
LogFn = Callable[..., None]
# (key, slot, generation, size): a replica of this segment found gone or corrupt, to report
ReportFn = Callable[[bytes, int, int, int], None]


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
        shard_of: Callable[[bytes], int] | None = None,
        report_gone: ReportFn | None = None,
    ) -> None:
        """`shard_of`: a key's directory shard (the segment's router); None: one shard.
        `report_gone`: a disk replica the directory lists but this segment does not hold, to
        report (`replica_corrupt`: the directory drops it)."""
        self.backend = backend
        self.segment_id = segment_id
        self.incarnation = incarnation
        self.writer_id = f"demote:{segment_id}"  # no "/": not a tenant's scoped writer
        self._ask = ask
        self._confirm = confirm
        self._warn = warn
        self._shard_of: Callable[[bytes], int] = shard_of or (lambda key: 0)
        self._report_gone: ReportFn = report_gone or (lambda key, slot, generation, size: None)
        self._busy = False
        self._requests = itertools.count(1)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            DEMOTE_CONCURRENCY_MAX, thread_name_prefix="kvf-demote", initializer=_lower_priority
        )
        self._running: set[concurrent.futures.Future[object]] = set()  # disk work on the pool now

    def close(self) -> None:
        """No new disk work; what runs goes on (`wait_idle` waits for it)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def wait_idle(self, timeout_s: float) -> bool:
        """Blocks until no disk work of a demotion runs (at most `timeout_s`): the disk tier's
        files must stay open while a demotion thread may still write or sync them (closed under
        it, a reused descriptor number could take its writes). Whether it is idle."""
        _, running = concurrent.futures.wait(list(self._running), timeout_s)
        return not running

    async def _on_pool(self, fn: Callable[..., Any], *args: object) -> Any:
        """`fn(*args)` on a demotion thread, tracked until it ends (`wait_idle`)."""
        future: concurrent.futures.Future[object] = self._pool.submit(fn, *args)
        self._running.add(future)
        future.add_done_callback(self._running.discard)
        return await asyncio.wrap_future(future)

    async def on_demote(self, message: DemoteRequest, headers: Mapping[str, str]) -> msgspec.Struct:
        if not 0 < len(message.objects) <= DEMOTE_BATCH_MAX:
            raise BadRequest(f"objects must be 1..{DEMOTE_BATCH_MAX}")
        ssd = self.backend.ssd
        if ssd is None:
            raise Conflict("this segment has no disk tier")
        if ssd.stats()["failed"]:
            # A sync failed: the tier refuses every write until a restart. Answered per object
            # `failed` (transient), the policy asked again every few seconds, each time taking
            # and aborting a directory ticket per object (review, 2026-12-06); `Conflict` is
            # "no disk tier" to it until this incarnation goes.
            self.backend.count("demote_tier_failed_total")
            raise Conflict("this segment's disk tier failed (ssd_failed): restart the segment")
        if self._busy:
            self.backend.count("demote_busy_total")
            raise Busy("a demotion is running on this segment")
        self._busy = True
        try:
            results = await self._demote_all(message.objects)
        finally:
            self._busy = False
        stats = ssd.stats()
        return DemoteReply(
            results=results, ssd_capacity_bytes=stats["capacity_bytes"], ssd_used_bytes=stats["used_bytes"]
        )

    def _by_shard(self, indexes: list[int], objects: list[DemoteObject]) -> list[list[int]]:
        """`indexes` grouped by their key's shard, in request order, at most REPLICA_BATCH_MAX a group."""
        shards: dict[int, list[int]] = {}
        for i in indexes:
            shards.setdefault(self._shard_of(objects[i].key), []).append(i)
        return [
            group[at : at + m.REPLICA_BATCH_MAX]
            for group in shards.values()
            for at in range(0, len(group), m.REPLICA_BATCH_MAX)
        ]

    async def _demote_all(self, objects: list[DemoteObject]) -> list[DemoteResult]:
        n = len(objects)
        results: list[DemoteResult] = [DemoteResult("no_capacity")] * n
        disks: list[tuple[int, int]] = [(-1, -1)] * n
        begun: list[m.ReplicateBeginReply | KvfError] = [Unavailable("not asked")] * n
        await asyncio.gather(
            *(self._begin(group, objects, begun) for group in self._by_shard(list(range(n)), objects))
        )
        to_drop: list[int] = []  # on disk and in the directory's record: their arena replicas go
        to_abort: list[int] = []  # a ticket placed, nothing confirmed: it goes now
        written: list[int] = []  # on disk, to confirm
        to_write: list[tuple[int, int]] = []  # (index, size) of the objects to write
        there: list[int] = []  # already_there: on disk already (an earlier demotion copied it)
        for i in range(n):
            checked, abort = self._check(objects[i], begun[i])
            if abort:
                to_abort.append(i)
            if isinstance(checked, DemoteResult):
                results[i] = checked
            elif checked is None:
                there.append(i)
            else:
                to_write.append((i, checked))
        # Their disk replicas checked first (held here; verified, unless the arena replica stays).
        found = await asyncio.gather(
            *(self._already_there(objects[i], begun[i]) for i in there), return_exceptions=True
        )
        errors: list[BaseException] = []
        for i, one in zip(there, found, strict=True):
            if isinstance(one, BaseException):  # its arena replica stays
                errors.append(one)
                results[i] = DemoteResult("failed")
            elif one is not None:
                results[i] = one
            elif objects[i].keep_arena:
                results[i] = DemoteResult("copied")  # on disk already, and its arena replica stays
            else:
                to_drop.append(i)
        # Step 2 in write batches, up to DEMOTE_CONCURRENCY_MAX at once: each batch's objects are
        # written one after another, then share one sync, one commit-record write and one sync.
        per_batch = -(-len(to_write) // DEMOTE_CONCURRENCY_MAX) if to_write else 1
        batches = [to_write[at : at + per_batch] for at in range(0, len(to_write), per_batch)]
        # Every batch runs to its end (none cancelled half-way by another's error).
        outcomes = await asyncio.gather(
            *(self._write(batch, objects, begun, results, disks, written, to_abort) for batch in batches),
            return_exceptions=True,
        )
        # Step 3 for every object written, at once: the confirm batcher sends them in shared requests.
        confirmed = await asyncio.gather(
            *(self._confirm_one(objects[i], begun[i], disks[i]) for i in written), return_exceptions=True
        )
        errors += [o for o in outcomes if isinstance(o, BaseException)]
        for i, ok in zip(written, confirmed, strict=True):
            if isinstance(ok, BaseException):  # its arena replica stays (both replicas, as `copied`)
                errors.append(ok)
            elif ok and objects[i].keep_arena:  # a copy asked for: both replicas stay
                self.backend.count("demote_kept_total")
                results[i] = DemoteResult("copied", *disks[i])
            elif ok:
                to_drop.append(i)
            else:
                results[i] = DemoteResult("failed")
        ended = await asyncio.gather(
            *(self._abort(group, objects) for group in self._by_shard(sorted(to_abort), objects)),
            *(
                self._drop(group, objects, disks, results)
                for group in self._by_shard(sorted(to_drop), objects)
            ),
            return_exceptions=True,
        )
        errors += [e for e in ended if isinstance(e, BaseException)]
        if errors:  # after every other object ran to its end
            raise errors[0]
        return results

    async def _begin(
        self, group: list[int], objects: list[DemoteObject], begun: list[m.ReplicateBeginReply | KvfError]
    ) -> None:
        """One shard's tickets, one request: each object's reply (or the request's error) in `begun`."""
        request = m.ReplicateBeginMany(
            writer_id=self.writer_id,
            segment_id=self.segment_id,
            items=[
                m.ReplicateItem(
                    key=objects[i].key,
                    request_id=f"demote-{self.incarnation}-{next(self._requests)}",
                    keep_source=objects[i].keep_arena,  # its confirm then publishes the group again
                )
                for i in group
            ],
            write_ttl_ms=DEMOTE_TTL_MS,
            tier="ssd",
        )
        try:
            reply = await self._ask("replicate_begin_many", request)
            if not isinstance(reply, m.ReplicateBeginManyReply) or len(reply.replies) != len(group):
                raise Unavailable(f"unexpected replicate_begin_many reply {type(reply).__name__}")
        except KvfError as err:
            for i in group:
                begun[i] = err
            return
        for i, one in zip(group, reply.replies, strict=True):
            begun[i] = one

    def _check(
        self, obj: DemoteObject, begun: m.ReplicateBeginReply | KvfError
    ) -> tuple[DemoteResult | int | None, bool]:
        """Before step 2, one object: its final result, or its size to write (a placed ticket
        naming this segment's arena replica), or None when an earlier demotion copied it
        (`already_there`: its disk replica to check, `_already_there`). And whether its ticket is
        to be aborted."""
        if isinstance(begun, KvfError):
            return self._failed(obj, "replicate_begin", begun), False
        if begun.status in ("segment_down", "no_capacity"):
            self.backend.count("demote_failed_total")
            return DemoteResult("failed"), False
        if begun.status == "not_found":
            self.backend.count("demote_not_found_total")
            return DemoteResult("not_found"), False
        if begun.status != "placed":  # already_there: on disk already (`_already_there` next)
            return None, False
        ticket = begun.ticket
        if ticket is None or not any(
            (s.segment_id, s.incarnation, s.slot, s.slot_generation)
            == (self.segment_id, self.incarnation, obj.slot, obj.slot_generation)
            for s in begun.sources
        ):
            self.backend.count("demote_not_found_total")
            return DemoteResult("not_found"), True
        return ticket.size_bytes, False

    async def _already_there(
        self, obj: DemoteObject, begun: m.ReplicateBeginReply | KvfError
    ) -> DemoteResult | None:
        """`already_there`: None (the arena replica to drop, or with `keep_arena` to keep)
        unless the disk replica the directory lists for this segment is not held here (freed
        since, say): then it is reported gone and the object's arena replica stays (`failed`).
        Before its arena replica is dropped, the disk replica's bytes are read back and verified
        on a demotion thread: a copy made with `keep_arena` (a head's) is read by no one while
        its arena replica is listed first, and no scrub pass reads the disk tier, so it could rot
        unseen, and dropping the arena replica left only the rotted copy: the object lost
        (review, 2026-12-06). A corrupt one is freed by the tier and reported like a disk read's
        find, and the arena replica stays (`failed`; so does one the disk tier is too busy to
        read now). A reply without sources (an older directory, or none live) is taken at its
        word, as before."""
        assert isinstance(begun, m.ReplicateBeginReply)
        here = (self.segment_id, self.incarnation)
        mine = [s for s in begun.sources if (s.segment_id, s.incarnation) == here and s.slot >= SSD_SLOT_BASE]
        ssd = self.backend.ssd
        assert ssd is not None  # `on_demote` refuses a segment without a disk tier
        for s in mine:
            held = self.backend.held_one(s.slot, s.slot_generation)
            if held is None:
                self.backend.count("demote_disk_replica_gone_total")
                self._warn("demotion_failed", step="already_there", key=obj.key.hex(), slot=s.slot)
                self._report_gone(obj.key, s.slot, s.slot_generation, 0)
                return DemoteResult("failed")
            if obj.keep_arena:  # both replicas stay: nothing is lost if the disk one is bad
                continue
            try:
                status = await self._on_pool(ssd.verify, s.slot, s.slot_generation, held.size)
            except KvfError as err:  # busy: the arena replica stays, a later demotion drops it
                return self._failed(obj, "already_there", err)
            if status == "ok":
                continue
            corrupt = status == "corrupt"  # else freed since it was listed: gone
            self.backend.count(f"demote_disk_replica_{'corrupt' if corrupt else 'gone'}_total")
            self._warn(
                "demotion_failed", step="already_there", key=obj.key.hex(), slot=s.slot, verdict=status
            )
            # freed by the tier when corrupt (its read did it), reported as a GET's disk read does
            self._report_gone(obj.key, s.slot, s.slot_generation, held.size if corrupt else 0)
            return DemoteResult("failed")
        return None

    async def _write(
        self,
        batch: list[tuple[int, int]],
        objects: list[DemoteObject],
        begun: list[m.ReplicateBeginReply | KvfError],
        results: list[DemoteResult],
        disks: list[tuple[int, int]],
        written: list[int],
        to_abort: list[int],
    ) -> None:
        """Step 2 for one write batch (index, size): `ArenaBackend.demote_many` on a demotion
        thread, with the objects' tickets (one a newer leader of its shard fenced is not stored);
        each object's disk replica into `disks` and `written`, or its result (and its ticket to
        abort). An unexpected error leaves nothing half-made and is raised."""
        refs = [(objects[i].slot, objects[i].slot_generation, size) for i, size in batch]
        tickets: list[m.WriteTicket] = []
        for i, _ in batch:
            one_begun = begun[i]  # a placed ticket (`_check`)
            assert isinstance(one_begun, m.ReplicateBeginReply) and one_begun.ticket is not None
            tickets.append(one_begun.ticket)
        try:
            done: list[tuple[int, int] | KvfError] = await self._on_pool(
                self.backend.demote_many, refs, tickets
            )
        except KvfError as err:  # the whole batch (no disk tier, a failed sync)
            done = [err] * len(batch)
        stopped = False
        for (i, _), one in zip(batch, done, strict=True):
            if not isinstance(one, KvfError):
                disks[i] = one
                written.append(i)
                continue
            to_abort.append(i)
            if isinstance(one, NoCapacity):
                self.backend.count("demote_no_capacity_total")
                if not stopped:  # once a batch (its later objects were still tried)
                    self._warn("demotion_stopped", reason="disk tier full", error=one.message)
                    stopped = True
                results[i] = DemoteResult("no_capacity")
            elif isinstance(one, StaleGeneration) and one.details.get("kind") == "directory_epoch":
                # A newer leader of its shard fenced the ticket before the slot was stored: not
                # stored, its slot freed (`ArenaBackend.demote_many`), its ticket aborted.
                self.backend.count("demote_fenced_total")
                results[i] = self._failed(objects[i], "write", one)
            elif isinstance(one, (NotFound, StaleGeneration)):  # freed or rewritten since the policy looked
                self.backend.count("demote_not_found_total")
                results[i] = DemoteResult("not_found")
            else:
                results[i] = self._failed(objects[i], "write", one)

    async def _confirm_one(
        self, obj: DemoteObject, begun: m.ReplicateBeginReply | KvfError, disk: tuple[int, int]
    ) -> bool:
        """Step 3 for one written object: whether the directory took its disk replica. A final
        refusal frees the disk slot (never published: nobody reads it; its ticket is gone); no
        verdict is asked again until one comes or the ticket is long settled; a newer leader
        owns the slot's fate (module docstring, step 3)."""
        assert isinstance(begun, m.ReplicateBeginReply) and begun.ticket is not None
        ticket = begun.ticket
        settled_ms = self.backend.ticket_deadline_ms(ticket) + CONFIRM_LATER_GIVE_UP_MS
        while True:
            try:
                verdict = await self._confirm(ticket, *disk)
            except StaleGeneration as err:
                if err.details.get("kind") != "directory_epoch":  # a newer incarnation of ours:
                    verdict = err.code  # no report adopts the slot: freed below (review, stop 67)
                    break
                self.backend.count("demote_confirm_superseded_total")
                self._warn("demotion_failed", step="confirm", verdict="stale_generation", key=obj.key.hex())
                # Stored before the successor's fence rose (a slot fenced first is not stored:
                # `ArenaBackend.demote_many`), so its report, taken after, lists it: it adopts it.
                return False
            except NotFound as err:
                verdict = err.code
            except KvfError as err:  # no verdict
                if self.backend.clock_ms() < settled_ms:
                    self.backend.count("demote_confirm_retries_total")
                    await asyncio.sleep(CONFIRM_LATER_RETRY_S)
                    continue
                verdict = f"no_verdict ({err.code})"
            break
        if verdict == "ok":
            return True
        await self._on_pool(self.backend.free_slots, [disk])
        self.backend.count("demote_failed_total")
        self._warn("demotion_failed", step="confirm", verdict=verdict, key=obj.key.hex())
        return False

    async def _drop(
        self,
        group: list[int],
        objects: list[DemoteObject],
        disks: list[tuple[int, int]],
        results: list[DemoteResult],
    ) -> None:
        """Step 4 for one shard's objects, one request."""
        request = m.ReplicaCorruptMany(
            segment_id=self.segment_id,
            incarnation=self.incarnation,
            items=[
                m.CorruptItem(
                    key=objects[i].key, slot=objects[i].slot, slot_generation=objects[i].slot_generation
                )
                for i in group
            ],
            reason="demoted",
        )
        dropped = [False] * len(group)
        try:
            reply = await self._ask("replica_corrupt_many", request)
            if isinstance(reply, m.ReplicaCorruptManyReply) and len(reply.dropped) == len(group):
                dropped = list(reply.dropped)
            else:
                self._warn("demotion_drop_failed", code="unexpected_reply", keys=len(group))
        except KvfError as err:  # both replicas stay: a later demotion drops the arena one
            self._warn("demotion_drop_failed", code=err.code, keys=len(group))
        for i, ok in zip(group, dropped, strict=True):
            if ok:
                self.backend.count("demote_dropped_total")
                results[i] = DemoteResult("demoted", *disks[i])
            else:
                self.backend.count("demote_kept_total")
                results[i] = DemoteResult("copied", *disks[i])

    async def _abort(self, group: list[int], objects: list[DemoteObject]) -> None:
        """Tickets of one shard that wrote nothing go now (their tenant bytes), not at their deadline."""
        request_id = f"demote-abort-{next(self._requests)}"
        with contextlib.suppress(KvfError):  # else they expire at their deadline
            keys = [objects[i].key for i in group]
            await self._ask(
                "put_abort", m.PutAbort(writer_id=self.writer_id, request_id=request_id, keys=keys)
            )

    def _failed(self, obj: DemoteObject, step: str, err: KvfError) -> DemoteResult:
        self.backend.count("demote_failed_total")
        self._warn("demotion_failed", step=step, code=err.code, error=err.message, key=obj.key.hex())
        return DemoteResult("failed")


def _lower_priority() -> None:
    """A demotion thread's initializer: nice `DEMOTE_THREAD_NICE` for this thread alone."""
    with contextlib.suppress(OSError):  # lowering one's own priority is always allowed; be safe
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), DEMOTE_THREAD_NICE)
