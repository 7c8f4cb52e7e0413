"""The directory shell of one shard: `DirectoryCore.handle(request, now_ms)` → perform effects → reply.

An instance runs one shell per shard it leads; `kvfabric.directory.shard_host` decodes requests and
routes them here by shard. The core is synchronous, so each call is atomic on the event loop;
effects are performed after it returns:

- `EmitEvent` → a bounded outbox drained by one publisher task into the JetStream stream
  `KVF_DIRECTORY_EVENTS` (subjects `kvf.v1.events.directory.<kind>`), in order; JetStream gives
  each event a sequence number so consumers detect gaps and replay. When the outbox is full the
  handler waits (backpressure) rather than dropping an event. Each event is retried until
  JetStream takes it; a stream stuck on a store write error (a disk that was full) is recreated
  with its sequences continued (`kvfabric.directory.events`).
- A shell's first event is `ShardStarted(shard, epoch)` (`start`): the core it replaces (an
  earlier leader's, or the same epoch's before a rebuild) may have stopped with events queued
  and not published, which `stop` drops (a handover drains them for at most `HANDOVER_DRAIN_MS`,
  1 s; a stopping instance not at all). They never got a stream sequence, so no follower could
  see a gap; the marker is that gap: the router's index and the eviction policy list the
  directory again on it. Dropped events are counted (`events_dropped`: queued, in flight, or
  never queued by a request that ended waiting for room) and logged `events_dropped`.
- Every event it publishes (the marker too) carries the NATS header `Kvf-Shard-Epoch:
  <shard>.<epoch>` of its core (`kvfabric.proto.directory.shard_epoch_header`): the core's
  epoch when the step that emitted the event ran, kept with it in the outbox (it may be raised
  between steps, `kvfabric.core.directory.base`: an event emitted before is published under the
  epoch it was emitted under, one after under the new one). An old core's late events (its
  handover drain runs while its lease is released; nats-py may flush a cancelled publish on
  reconnect) can land after the new core's marker, and the followers drop those naming an epoch
  below one they saw for the shard (`kvfabric.core.shard_fence`).
- `FreeSlots` → a request to `kvf.v1.segment.free.<segment_id>`; the segment's reply is fed back
  to the core as `SlotsFreed`. A lost or failed free is retried by the core's `tick`.
A tick task calls `core.tick(now_ms)` every `tick_ms` and performs its effects the same way.
Every core call is timed (`kvfabric.directory.stalls`: how long it held the event loop).
`stop` cancels the publisher, the ticker and the frees and waits for them within a deadline,
cancelling again a task that swallowed its cancellation; it returns what still runs.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from typing import Any, Final

import msgspec
from nats.aio.client import Client as NatsClient
from nats.js.api import DiscardPolicy, StreamConfig

from kvfabric.cluster.requests import request
from kvfabric.core import authz
from kvfabric.core.directory import DirectoryCore, Effect, EmitEvent, FreeSlots, Outcome
from kvfabric.directory.events import EVENTS_STREAM, EventPublisher, EventsStream
from kvfabric.directory.stalls import CORE_CALLS
from kvfabric.format.clock import now_ms
from kvfabric.format.errors import KvfError, NotFound, WrongShard
from kvfabric.proto import directory as m
from kvfabric.proto.segment import FreeSlotsReply, FreeSlotsRequest, segment_decoder
from kvfabric.proto.subjects import Service, event_subject, events_wildcard, segment_subject
from kvfabric.runtime.deadline import cancel_and_wait
from kvfabric.runtime.logs import get_logger
from kvfabric.runtime.ticker import every

__all__ = [
    "EVENTS_STREAM",
    "LOOKUP_SLICE_GROUPS",
    "LOOKUP_SLICE_YIELDS",
    "VERBS",
    "WRITE_SLICE_IDS",
    "WRITE_WHOLE_IDS_MAX",
    "DirectoryShell",
    "now_ms",
    "slice_ids",
]

FREES_INFLIGHT_MAX: Final = 256
STOP_TIMEOUT_S: Final = 2.0  # the shell's tasks end within this once cancelled
# A tick that runs this much later than due follows a stalled event loop (a long call, a GC
# pass, a stopped process): segments' silence over the stall is excused as while deaf. On a
# NATS cluster a leader acts for 12.5 s, past the 5 s heartbeat timeout, and a 5-12.5 s stall
# declared every segment down; each then restarted empty (review, 2026-12-06; test:
# test_directory_liveness.py). A stall this short cannot make a 5 s silence of a live segment.
LOOP_STALL_EXCUSED_S: Final = 1.0
# A longer lookup is folded this many groups a core call, the event loop yielded between
# (`_lookup_in_slices`): ~3-6 ms a slice on a busy 2-core machine, instead of ~100 ms for 4,096.
LOOKUP_SLICE_GROUPS: Final = 128
# Event-loop iterations yielded between two slices. A request passes ~5 iterations in this
# process before its reply is on the wire (the socket's read callback, nats-py's read loop, the
# subscription's task, the handler's task, nats-py's flusher), and a slice that yields once runs
# again in every one of them: a request arriving during a long lookup waited one slice per
# stage, ~5 slices (issue 21 row 2, docs/security.md). Yielding this many, it waits for one.
LOOKUP_SLICE_YIELDS: Final = 8
# A put_begin, put_commit, put_abort or evict naming more ids than this runs as the core's steps
# of this many (`_in_steps`; `KVF_DIRECTORY_WRITE_SLICE_IDS`, 0 = whole): one 4,096-id request
# held the loop 180-250 ms in one call (bench/results/directory_big_requests.md), ~3-5 ms a step.
WRITE_SLICE_IDS: Final = 64
# ...but one of at most this many ids runs whole: the client's own batches (its put_begin and
# put_commit carry up to 256 keys: `PUT_BEGIN_BATCH_OBJECTS_FIT` in kvfabric.client) keep one
# `GroupsPublished` event per commit (issue 20) and one core call (~3-14 ms); only the larger
# requests a hostile or odd writer sends (up to 4,096 ids) are cut (review of 71ae4e6).
WRITE_WHOLE_IDS_MAX: Final = 256

# verb -> the request type it accepts
VERBS: Final[dict[str, type[msgspec.Struct]]] = {
    "register": m.RegisterSegment,
    "heartbeat": m.Heartbeat,
    "put_begin": m.PutBegin,
    "confirm": m.ConfirmReplicas,
    "put_commit": m.PutCommit,
    "put_abort": m.PutAbort,
    "lookup": m.Lookup,
    "lease_release": m.LeaseRelease,
    "lease_renew": m.LeaseRenew,
    "pin": m.Pin,
    "unpin": m.Unpin,
    "evict": m.Evict,
    "freed": m.SlotsFreed,
    "replicate_begin": m.ReplicateBegin,
    "replica_corrupt": m.ReplicaCorrupt,
    "replicate_begin_many": m.ReplicateBeginMany,  # a segment's demotion batch (issue 23)
    "replica_corrupt_many": m.ReplicaCorruptMany,
    "list_segments": m.ListSegments,
    "list_groups": m.ListGroups,
    "show_group": m.ShowGroup,
    "list_leases": m.ListLeases,
    "list_tenants": m.ListTenants,
}


_ENCODER: Final = msgspec.msgpack.Encoder()


def slice_ids(message: msgspec.Struct, replicas_max: int) -> int:
    """The ids a request the shell may run in steps names (0: not such a request); a commit's
    receipts count per replica (the client's commit of 256 keys at 2 replicas carries 512: it is
    still one client batch, run whole)."""
    if isinstance(message, m.PutBegin):
        return len(message.objects)
    if isinstance(message, m.PutCommit):
        return max(len(message.keys), -(-len(message.receipts) // max(1, replicas_max)))
    if isinstance(message, m.PutAbort):
        return len(message.keys)
    if isinstance(message, m.Evict):
        return len(message.groups)
    return 0


def _encoded(objects: list[m.ObjectLocation]) -> list[msgspec.Raw]:
    """`objects` each encoded (what `encode` of the reply writes for it: `msgspec.Raw`)."""
    encode = _ENCODER.encode
    return [msgspec.Raw(encode(o)) for o in objects]


class DirectoryShell:
    """Owns the core, the events outbox and the background tasks of one directory instance."""

    def __init__(
        self,
        core: DirectoryCore,
        *,
        tick_ms: int,
        events_outbox_max: int,
        events_max_age_s: int,
        free_timeout_s: float,
        events_replicas: int = 1,
        events_stream: EventsStream | None = None,
        write_slice_ids: int = WRITE_SLICE_IDS,
        events_max_bytes: int = 0,
    ) -> None:
        self.core = core
        # A put_begin, put_commit, put_abort or evict of more ids runs in steps of this many (0: whole).
        self.write_slice_ids = write_slice_ids
        # The instance's events stream (shared by its shells: one repair at a time); a shell
        # started without one makes its own.
        self.events_stream = events_stream
        self.publisher: EventPublisher | None = None
        self.events_replicas = events_replicas  # of the events stream (3 on a NATS cluster)
        self.tick_ms = tick_ms
        self.events_max_age_s = events_max_age_s
        self.events_max_bytes = events_max_bytes  # 0: no size bound
        self.free_timeout_s = free_timeout_s
        # (subject, payload, the core's epoch as it was emitted: its header's, module docstring)
        self._outbox: asyncio.Queue[tuple[str, bytes, int]] = asyncio.Queue(maxsize=events_outbox_max)
        self._outbox_turn = asyncio.Lock()  # held by the event waiting for room (`_queue_event`)
        self._outbox_waiting = 0  # events in `_queue_event`'s slow path
        self._stopped = asyncio.Event()  # `stop` began: nothing reads the outbox any more
        self._frees: set[asyncio.Task[None]] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._nc: NatsClient | None = None
        self._log = get_logger("kvfabric.directory")
        self._publishing = False  # an event taken from the outbox is not in JetStream yet
        self._events_not_queued = 0  # events that never entered the outbox (`_queue_event`)
        self._dropped_logged = False
        self.frees_skipped_busy = 0
        # Whether this instance may act as the leader right now (its lease has not lapsed):
        # checked before every request and every tick, so a fenced leader stops at once.
        self.may_act: Callable[[], bool] = lambda: True
        self._last_tick_done_s: float | None = None  # monotonic: a late tick is a stalled loop

    def _core_handle(self, message: msgspec.Struct, reply_bytes_max: int | None) -> Outcome:
        """The core's answer, timed (`kvfabric.directory.stalls`: it holds the event loop)."""
        return CORE_CALLS.timed(
            type(message).__name__,
            lambda: self.core.handle(message, now_ms(), reply_bytes_max=reply_bytes_max),
        )

    async def _answer(self, message: msgspec.Struct, reply_bytes_max: int | None) -> msgspec.Struct:
        """The core's reply to `message` once its effects are performed; a long lookup in slices."""
        if isinstance(message, m.Lookup) and len(message.groups) > LOOKUP_SLICE_GROUPS:
            return await self._lookup_in_slices(message, reply_bytes_max)
        if self.write_slice_ids > 0 and slice_ids(message, self.core.config.replicas_max) > max(
            self.write_slice_ids, WRITE_WHOLE_IDS_MAX
        ):
            return await self._in_steps(message)
        outcome = self._core_handle(message, reply_bytes_max)
        await self.perform(outcome.effects)
        return outcome.reply

    async def _in_steps(self, message: msgspec.Struct) -> msgspec.Struct:
        """A put_begin, put_commit, put_abort or evict of more than `write_slice_ids` ids (and more
        than `WRITE_WHOLE_IDS_MAX`), run as the core's
        steps of that many (`DirectoryCore.steps`: every whole-request check in the first, so a
        refusal still applies nothing), each one core call whose effects are performed before
        the loop is yielded (`LOOKUP_SLICE_YIELDS`) to whatever else is in progress. One such
        request of 4,096 ids held the loop for 180-250 ms (issue 21 item 2: every other
        tenant's lookup waited behind it); a step is ~3-5 ms (docs/security.md). A shard lost
        between two steps ends the request (`wrong_shard`) with the earlier steps applied and
        their effects performed, as a request cut by a failover."""
        what = type(message).__name__
        steps = self.core.steps(message, now_ms(), self.write_slice_ids)
        try:
            while True:
                try:
                    effects = CORE_CALLS.timed(what, functools.partial(next, steps))
                except StopIteration as done:
                    reply: msgspec.Struct = done.value
                    return reply
                await self.perform(effects)
                for _ in range(LOOKUP_SLICE_YIELDS):  # every other request in progress goes on
                    await asyncio.sleep(0)
                if not self.may_act():
                    raise WrongShard(
                        "this directory instance no longer leads the shard", shard=self.core.shard
                    )
        finally:
            steps.close()

    async def _lookup_in_slices(self, lookup: m.Lookup, reply_bytes_max: int | None) -> m.LookupReply:
        """A lookup of more than `LOOKUP_SLICE_GROUPS` groups, folded one slice per core call
        with the event loop yielded between (a 4,096-group hit is ~100 ms of one call on this
        machine: every other tenant waited behind it, issue 21 row 2). The first slice is the
        lookup (checked, charged for all its groups, leased); each next one extends the lease
        (`DirectoryCore.lookup_more`) while every group so far hit and the reply has room. What
        ran meanwhile can only end the fold earlier (a shorter hit is always correct); the
        groups already in the reply stay leased. Each slice's objects are encoded at once and
        kept as `msgspec.Raw` (the reply's bytes are the same): held as Structs until the reply
        went out, a 4,096-group hit's ~12,000 GC-tracked objects were walked by every young
        collection meanwhile and promoted into full ones (docs/security.md)."""
        room = self.core.config.reply_bytes_max
        if reply_bytes_max is not None:
            room = min(room, reply_bytes_max)
        outcome = CORE_CALLS.timed(
            "Lookup",
            lambda: self.core.handle(lookup, now_ms(), reply_bytes_max=room, groups_max=LOOKUP_SLICE_GROUPS),
        )
        await self.perform(outcome.effects)
        reply = outcome.reply
        assert isinstance(reply, m.LookupReply)
        objects = _encoded(reply.objects)
        # its size as sent (the objects' array header may grow by up to 4 bytes: counted now)
        used = len(msgspec.msgpack.encode(msgspec.structs.replace(reply, objects=objects))) + 4
        asked = min(LOOKUP_SLICE_GROUPS, len(lookup.groups))
        folded = reply.hit_chunks
        while folded == asked < len(lookup.groups):  # every group so far hit: the next slice
            for _ in range(LOOKUP_SLICE_YIELDS):  # every other request in progress goes on, whole
                await asyncio.sleep(0)
            if not self.may_act():
                raise WrongShard("this directory instance no longer leads the shard", shard=self.core.shard)
            more = CORE_CALLS.timed(
                "Lookup",
                functools.partial(
                    self.core.lookup_more,
                    lookup,
                    reply.lease_id,
                    asked,
                    now_ms(),
                    reply_bytes_max=room - used,
                    groups_max=LOOKUP_SLICE_GROUPS,
                ),
            )
            await self.perform(more.effects)
            part = more.reply
            assert isinstance(part, m.LookupReply)
            asked = min(asked + LOOKUP_SLICE_GROUPS, len(lookup.groups))
            folded += part.hit_chunks
            encoded = _encoded(part.objects)
            objects.extend(encoded)
            used += sum(len(o) for o in encoded)
        return msgspec.structs.replace(reply, hit_chunks=folded, objects=objects)

    async def handle(self, message: msgspec.Struct, *, reply_bytes_max: int | None = None) -> msgspec.Struct:
        """A service-plane request for this shard: core, effects, reply. `reply_bytes_max`
        lowers a lookup's reply bound (a `lookup_many` part: `DirectoryCore.handle`)."""
        if not self.may_act():
            raise WrongShard("this directory instance no longer leads the shard", shard=self.core.shard)
        return await self._answer(message, reply_bytes_max)

    async def handle_tenant(
        self,
        message: msgspec.Struct,
        verb: str,
        grant: authz.TenantGrant,
        *,
        reply_bytes_max: int | None = None,
    ) -> msgspec.Struct:
        """A tenant's request for this shard, authorized for its grant (`kvfabric.core.authz`)
        before the core sees it: whatever depends on an object of another tenant's (a group to
        show) is refused here, with a missing object's answer, before any work on it."""
        if not self.may_act():
            raise WrongShard("this directory instance no longer leads the shard", shard=self.core.shard)
        authorized = authz.authorize(message, verb, grant)  # refusals counted by code (runtime)
        if grant.home and authz.charge_home(verb, authorized):
            home = [grant.home]
            CORE_CALLS.timed("charge", lambda: self.core.charge_domains(home, now_ms()))
        if isinstance(authorized, m.ListGroups) and not authz.listing_allowed(authorized, grant):
            return m.GroupList(epoch=self.core.epoch, groups=[])  # a domain not granted: nothing there
        if isinstance(authorized, m.ShowGroup):
            return self._show_granted(authorized, grant)
        reply = await self._answer(authorized, reply_bytes_max)
        if isinstance(message, m.Evict) and isinstance(reply, m.EvictReply):
            return authz.merge_evict_results(message.groups, reply, grant)
        return reply

    def _show_granted(self, message: m.ShowGroup, grant: authz.TenantGrant) -> m.GroupList:
        """A tenant's `show_group`: the core is asked only for keys in the grant (`show_keys`);
        a group of another tenant's gets a missing group's `NotFound` before any work on it,
        whether or not it exists (issue 21 row 9)."""
        found: list[m.GroupSummary] = []
        for key in authz.show_keys(message, grant):
            try:
                reply = self._core_handle(msgspec.structs.replace(message, group=key), None).reply
            except NotFound:
                continue
            assert isinstance(reply, m.GroupList)
            found += reply.groups
        if not found:
            raise authz.not_found_error(message.group)
        return authz.check_visible(m.GroupList(epoch=self.core.epoch, groups=found), grant, message.group)

    # ---- lifecycle ---------------------------------------------------------------------------

    async def start(self, nc: NatsClient) -> None:
        self._nc = nc
        if self.events_stream is None:
            self.events_stream = EventsStream(nc, self.events_config())
        await self.events_stream.ensure()
        shard = self.core.shard
        # First in the outbox, before any event of this core: whatever the core before it left
        # unpublished is gone with no gap in the sequences, so this one tells the followers
        # (module docstring; they resync on it).
        started = m.ShardStarted(shard=shard, epoch=self.core.epoch)
        await self._queue_event(
            (
                event_subject(Service.DIRECTORY, "shard_started"),
                msgspec.msgpack.encode(started),
                started.epoch,
            )
        )
        self.publisher = EventPublisher(self.events_stream, name=f"shard-{shard}")
        self._tasks = [
            asyncio.create_task(self._publisher(), name=f"directory-publisher-{shard}"),
            asyncio.create_task(self._ticker(), name=f"directory-ticker-{shard}"),
        ]

    def events_config(self) -> StreamConfig:
        """The events stream's configuration (every instance adds or updates it the same)."""
        return StreamConfig(
            name=EVENTS_STREAM,
            subjects=[events_wildcard(Service.DIRECTORY)],
            max_age=float(self.events_max_age_s),
            max_bytes=self.events_max_bytes or -1,
            discard=DiscardPolicy.OLD,
            num_replicas=self.events_replicas,
        )

    @property
    def tasks(self) -> list[asyncio.Task[None]]:
        """The shell's own tasks (publisher, ticker), for the host to watch."""
        return list(self._tasks)

    @property
    def events_published(self) -> int:
        """Events JetStream acknowledged from this shell."""
        return self.publisher.published if self.publisher is not None else 0

    @property
    def events_dropped(self) -> int:
        """Events of this shell's core never known to reach JetStream: those that never entered
        the outbox (refused `wrong_shard`, or cancelled, while waiting for room) and, once `stop`
        began, those still queued and the one being published (JetStream may have taken it; its
        acknowledgement never came). The next core's `ShardStarted` tells the followers (module
        docstring)."""
        if not self._stopped.is_set():
            return self._events_not_queued
        return self._events_not_queued + self._outbox.qsize() + int(self._publishing)

    async def drain_events(self, timeout_s: float) -> None:
        """Wait (at most `timeout_s`) until the events outbox is empty (a handover: no request
        reaches this shard any more, so nothing new is queued)."""
        deadline = time.monotonic() + timeout_s
        while (not self._outbox.empty() or self._publishing) and time.monotonic() < deadline:  # noqa: ASYNC110 (bounded poll)
            await asyncio.sleep(0.01)

    async def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> set[asyncio.Task[Any]]:
        """Cancel the shell's tasks and wait at most `timeout_s`; returns those still running.
        A request waiting for room in the events outbox ends `wrong_shard` (`_queue_event`).
        Events still queued are dropped: counted (`events_dropped`) and logged; the shard's
        next core tells the followers (`ShardStarted`, module docstring)."""
        self._stopped.set()
        still = await cancel_and_wait([*self._tasks, *self._frees], timeout_s)
        dropped = self.events_dropped
        if dropped and not self._dropped_logged:
            self._dropped_logged = True
            self._log.warning("events_dropped", shard=self.core.shard, epoch=self.core.epoch, events=dropped)
        return still

    async def _queue_event(self, item: tuple[str, bytes, int]) -> None:
        """Into the outbox, waiting for room while its publisher runs (`item`: subject, payload,
        the core's epoch when the event was emitted: its header's). Once `stop` began, nothing
        reads it: a request waiting there (JetStream slow, the outbox full) ended never, holding
        its in-flight slot and its tenant's fair turn (review, 2026-12-05); it ends
        `wrong_shard` now (its client asks the shard's new leader)."""
        # The fast path only while nobody waits for room; waiters take turns (`_outbox_turn`, a
        # FIFO lock). A slot freed for the oldest waiter was taken by a newer event before that
        # waiter ran (asyncio's queue lets a newcomer put while room lasts), publishing events
        # out of their order: an eviction before the publication it follows (review, stop 68).
        # (`_outbox_waiting` counts them from before their first await: a lock just released
        # reads unlocked before its next waiter runs; review of stop 68)
        if not self._outbox_waiting and not self._outbox.full() and not self._stopped.is_set():
            self._outbox.put_nowait(item)
            return
        self._outbox_waiting += 1
        put: asyncio.Future[None] | None = None

        def queued() -> bool:
            return put is not None and put.done() and not put.cancelled()

        try:
            turn = asyncio.ensure_future(self._outbox_turn.acquire())
            try:
                taken = await self._unless_stopped(turn)
            except BaseException:  # cancelled as the turn came: the lock goes back
                if turn.done() and not turn.cancelled():
                    self._outbox_turn.release()
                raise
            if not taken:
                raise WrongShard("this shard's shell stopped", shard=self.core.shard)
            try:
                put = asyncio.ensure_future(self._outbox.put(item))
                await self._unless_stopped(put)
            finally:
                self._outbox_turn.release()
        finally:
            self._outbox_waiting -= 1
            if not queued():  # refused or cancelled: its core's change has no event (dropped)
                self._events_not_queued += 1
        if not queued():
            raise WrongShard("this shard's shell stopped", shard=self.core.shard)

    async def _unless_stopped(self, waiting: asyncio.Future[Any]) -> bool:
        """Wait for `waiting` unless `stop` begins first (then it is cancelled): whether it ended."""
        stopped = asyncio.ensure_future(self._stopped.wait())
        try:
            await asyncio.wait({waiting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            if not waiting.done():
                waiting.cancel()
        return waiting.done() and not waiting.cancelled()

    # ---- effects -----------------------------------------------------------------------------

    async def perform(self, effects: list[Effect]) -> None:
        """The effects of a core step, performed right after it: its events are queued under the
        epoch it ran under (read once, before any wait for room in the outbox)."""
        epoch = self.core.epoch
        for at, effect in enumerate(effects):
            if isinstance(effect, EmitEvent):
                subject = event_subject(Service.DIRECTORY, effect.kind)
                try:
                    await self._queue_event((subject, msgspec.msgpack.encode(effect.event), epoch))
                except BaseException:
                    # this one is counted (`_queue_event`); the events after it in the list are
                    # not queued either (review of the change: they went uncounted)
                    self._events_not_queued += sum(isinstance(e, EmitEvent) for e in effects[at + 1 :])
                    raise
            elif isinstance(effect, FreeSlots):
                if len(self._frees) >= FREES_INFLIGHT_MAX:
                    self.frees_skipped_busy += 1  # the core retries it on a later tick
                    continue
                task = asyncio.create_task(self._free(effect))
                self._frees.add(task)
                task.add_done_callback(self._frees.discard)

    async def _free(self, effect: FreeSlots) -> None:
        assert self._nc is not None
        message = FreeSlotsRequest(
            segment_id=effect.segment_id,
            incarnation=effect.incarnation,
            slots=list(effect.slots),
            epoch=self.core.epoch,
            shard=self.core.shard,
        )
        try:
            reply = await request(
                self._nc,
                segment_subject(effect.segment_id, "free"),
                message,
                segment_decoder,
                self.free_timeout_s,
            )
        except KvfError as err:
            self._log.info("free_failed", segment_id=effect.segment_id, code=err.code)
            return
        if not isinstance(reply, FreeSlotsReply):
            return
        freed = m.SlotsFreed(
            segment_id=effect.segment_id,
            incarnation=reply.incarnation,
            freed=reply.freed,
            epoch=self.core.epoch,
        )
        try:
            outcome = self._core_handle(freed, None)
        except KvfError as err:  # e.g. the segment restarted meanwhile: its slots died with it
            self._log.info("freed_rejected", segment_id=effect.segment_id, code=err.code)
            return
        await self.perform(outcome.effects)

    async def _publisher(self) -> None:
        assert self.publisher is not None
        while True:
            subject, payload, epoch = await self._outbox.get()
            self._publishing = True  # in order, never dropped: retried until JetStream takes it
            # its core's shard and epoch as it was emitted (module docstring)
            await self.publisher.publish(subject, payload, m.shard_epoch_header(self.core.shard, epoch))
            self._publishing = False

    async def _ticker(self) -> None:
        """The core's tick every `tick_ms` (the first one interval after the start), while this
        instance may act for the shard; an exception ends it, as before the shared ticker."""
        await every(self.tick_ms / 1000, self._tick, delay_first=True)

    async def _tick(self) -> None:
        late_s = self._tick_lateness_s()
        if self.may_act():
            # deaf while NATS is down, or when this tick comes a stall late: no segment's
            # heartbeat could be heard meanwhile (their silence is the loop's, not theirs)
            stalled = late_s >= LOOP_STALL_EXCUSED_S
            if stalled:
                self._log.warning("tick_after_loop_stall", late_s=round(late_s, 3))
            deaf = stalled or (self._nc is not None and not self._nc.is_connected)
            await self.perform(CORE_CALLS.timed("tick", lambda: self.core.tick(now_ms(), deaf=deaf)))
        self._last_tick_done_s = time.monotonic()

    def _tick_lateness_s(self) -> float:
        """How much later than `tick_ms` after the previous tick's end this tick runs: the time
        the event loop could run nothing (a stall: a long core call, a GC pass, a stopped
        process). 0 for the first tick."""
        if self._last_tick_done_s is None:
            return 0.0
        return max(0.0, time.monotonic() - self._last_tick_done_s - self.tick_ms / 1000)
