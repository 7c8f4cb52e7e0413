"""The index follower: the directory's JetStream event stream into the routing index.

- At start, and whenever the index reports a gap (or `check_stream` sees events aged out,
  purged, or a recreated stream: `kvfabric.core.stream_bounds`): read the stream's last
  sequence S, list the directory (every shard's segments, and every shard's published groups of
  the router's share domain with their replicas, paged), `index.resync(listing, at_seq=S)`,
  then read the stream from S + 1 (replayed events converge: `kvfabric.core.routing_index`).
- Otherwise an ephemeral pull consumer (no acks) over every subject of the stream, so its
  sequences arrive contiguous; when it is lost (NATS restart) it is recreated after the last
  sequence applied (`index.last_seq + 1`): resume, not replay.
- A batch is applied one event a turn of the loop, and a lost segment's groups leave the index
  in slices after it (`apply_batch`): the router's loop serves routes meanwhile.
- A `shard_started` event (a shard's new core, a new leader's or a rebuild's: the events its
  predecessor left unpublished are gone without a gap) makes the index stale, not blank
  (`RoutingIndex.resync_wanted`: it keeps answering and following). Every `LEADERS_CHECK_S` the
  shard map is asked again too: a shard led under a newer epoch than at the last listing means
  a rebuild the events do not tell (what it adopted or lost; a segment that missed its report
  never goes `segment_down`), so the index is stale the same way (review, stop 67; a directory
  without `shard_started` events, or a marker not read yet). A stale index is listed again in
  a task beside the loop, which goes on applying events to the view served; once the listing
  is indexed (`resync_start`/`resync_add`: a view of its own, as of the stream's sequence S
  noted before the listing) the loop, between fetches, replays onto it the events S + 1 up to
  the served view's `last_seq` (`_catch_up`: a subscription of its own from S + 1, fetched
  as the replay would be, `resync_replay`), swaps it in (`resync_done`) and reads on where it
  was. `StaleResyncPacing` says when: markers 1 s apart at most (shards starting one at a
  time) wait for one another up to 5 s, and a stale listing starts at least 3 s after the last
  one ended; one failing for 60 s gives the stale view up (not synced: the gap path). Until
  2026-12-07 a marker made the index not synced: every shard start blanked every router's
  kvfabric counts for a whole listing (seconds at 400k groups), once per shard of a failover
  or cold start.
- Replayed before the swap, not after it (review, 2026-12-07): swapped in as of S, `last_seq`
  set back, the new view counted again the groups that an eviction or a `segment_down` after S
  had already taken out of the old view (each shard is listed at its own moment, so the
  listing may predate that event), until the replay reached it, and the router trusted it
  (synced, and its heard time from before the swap good for 5 s). The other fix, swapping at once and not
  reporting the index current until the replay passed the old view's sequence, would blank
  routing for the replay: the router's only way to distrust the index is to count no kvfabric
  tokens at all (`RoutingCore.index_usable`: synced and heard within `index_stale_ms`), and the
  heard time cannot be taken back. Caught up first, the view served never goes back (the core
  refuses a view behind it) and is trusted as before; the cost is that the loop applies
  nothing to it while the catch-up runs (the events of the listing's length, one a turn of the
  loop, as the replay did; heard is not told meanwhile, so a long one makes the router stop
  trusting the index, as any follower behind would). A catch-up that fails (a fetch timing
  out, a gap: events aged out) fails the listing: the view served is kept, and the listing
  tried again when paced.
- Each listing writes through its own build token (`RoutingIndex.resync_start`): a listing's
  task that `cancel_and_wait` reports still running (Python 3.11's `wait_for` can swallow a
  cancellation for a whole request timeout) cannot write into, swap in or drop the view of the
  gap resync that follows (review, 2026-12-07: it replaced the gap listing's view with its
  own, older one, or wrote into it, and that was swapped in); and a listing given up never starts a view (it
  checks it is still wanted at `resync_start`, with no wait between).
- Every event is applied with the (shard, epoch) its `Kvf-Shard-Epoch` header names
  (`kvfabric.proto.directory.shard_epoch_of`), the catch-up's replays too: the index fences the
  late events of a shard core a newer epoch replaced (landed after the new core's
  `shard_started`: a handover's drain runs while the lease is released), counted
  `index_events_fenced`, logged `event_fenced` (the first of each shard and epoch: a drained
  outbox's late events come by the thousand; `RoutingIndex`, "fenced"). A gap listing raises
  that fence to the shard map's epochs it listed under (markers among the lost events unseen):
  every shard's the router knows once the whole listing came (each at least its pages': a page
  may be a newer leader's). One past a shard's pages' epoch (the map refreshed during the
  listing) fences that shard's valid events after the listing too; made up for: `_listed_epochs`
  keeps the epochs known as the listing began, so `check_leaders` finds the shard moved and
  lists again, and the newer leader's marker, once read, asks for a listing.
- A fetch with events that leave at most one more fetch pending (`caught_up`), a fetch that
  answers with none when the stream, asked then, has nothing past the index (`_at_end`: nats-py
  raises the same timeout with the connection down, and a router cut off counted itself
  current; review, stop 68), and a resync tell the core the stream was heard from (`heard`: the
  shell feeds the core's `IndexHeard`, with the time); a resumed subscription does not, until
  it has caught up. Without that for `index_stale_ms` the router counts no kvfabric tokens: a
  follower far behind or cut off is not trusted.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from kvfabric.cluster.directory_router import DirectoryRouter
from kvfabric.core.routing_index import ListedGroup, ListedSegment, RoutingIndex, StaleResyncPacing
from kvfabric.format.errors import BadRequest, KvfError, Unavailable
from kvfabric.format.ids import NAMESPACE_BYTES, DomainDigest, domain_in_id
from kvfabric.proto import directory as m
from kvfabric.proto.subjects import Service, events_wildcard
from kvfabric.runtime.deadline import cancel_and_wait
from kvfabric.runtime.logs import get_logger

__all__ = ["EVENTS_STREAM", "IndexFollower", "caught_up"]

EVENTS_STREAM: Final = "KVF_DIRECTORY_EVENTS"  # owned by the directory
EVENTS_FETCH_MAX: Final = 512
EVENTS_FETCH_WAIT_S: Final = 0.5
RETRY_S: Final = 0.5  # the first wait after a failure; doubled up to RETRY_S_MAX while they last
RETRY_S_MAX: Final = 30.0
# A resync converts and indexes the listing this many groups a turn of the loop (routes are
# served between them): 400k groups in one call held the loop 3.1 s (review, 2026-12-06).
RESYNC_SLICE_GROUPS: Final = 2048
LISTING_PAGE_GROUPS: Final = 1000
# How often the shard map's leader epochs are compared with those of the last listing: a new
# leader's rebuild emits no event for what it adopted or lost, so the index lists again.
LEADERS_CHECK_S: Final = 5.0


class _Listing:
    """A stale index's listing under way: its task, its view's build token once started, and
    whether the follower gave it up (`_stop_building`)."""

    __slots__ = ("stopped", "task", "token")

    def __init__(self) -> None:
        self.task: asyncio.Task[tuple[int, dict[int, int]]]
        self.token: int | None = None
        self.stopped = False


def _retrieve(task: asyncio.Task[Any]) -> None:
    """A given-up listing's outcome retrieved (moot: no "exception never retrieved" warning)."""
    if not task.cancelled():
        task.exception()


def _origin(msg: Msg) -> tuple[int, int] | None:
    """The (shard, epoch) of the core that published `msg` (its `Kvf-Shard-Epoch` header; None:
    none, an older directory's event)."""
    return m.shard_epoch_of(getattr(msg, "headers", None))


def caught_up(batch: Sequence[Msg]) -> bool:
    """Whether a fetched batch leaves the follower near the stream's end: at most one more
    fetch's events pending after its last (JetStream's `num_pending`). Heard from but seconds
    behind (a stalled loop, a replay from far back, an eviction burst), the index was trusted
    all the same: its groups evicted in events not applied yet counted (review, stop 67)."""
    return not batch or (batch[-1].metadata.num_pending or 0) <= EVENTS_FETCH_MAX


class IndexFollower:
    def __init__(
        self,
        nc: NatsClient,
        index: RoutingIndex,
        *,
        domain_digest: DomainDigest,
        heard: Callable[[], Awaitable[None]],
        request_timeout_s: float,
        listing_pages_max: int,
    ) -> None:
        self.nc = nc
        self.index = index
        self.domain_digest = domain_digest
        self.heard = heard
        self.request_timeout_s = request_timeout_s
        self.listing_pages_max = listing_pages_max
        self.router = DirectoryRouter(nc)
        self.resync_failures = 0
        self.resync_seconds_last = 0.0
        self.clock: Callable[[], float] = time.monotonic  # seconds (tests set their own)
        self.pacing = StaleResyncPacing()
        self._listed_epochs: dict[int, int] = {}  # each shard's leader epoch when last listed
        self._leaders_checked_s = self.clock()
        self._building: _Listing | None = None  # a stale index's listing under way
        self.listings_left_running = 0  # given up, still running after `cancel_and_wait`
        self._log = get_logger("kvfabric.router.index_follower")

    def _now_ms(self) -> int:
        return int(self.clock() * 1000)

    async def run(self) -> None:
        try:
            await self._follow()
        finally:
            await self._stop_building()

    async def _follow(self) -> None:
        js = self.nc.jetstream(timeout=self.request_timeout_s)
        retry_s = RETRY_S
        while True:
            try:
                info = await js.stream_info(EVENTS_STREAM)
                # Asked even when not synced: it remembers the stream's creation time.
                resynced = self.index.check_stream(info.state.first_seq, info.state.last_seq, info.created)
                if resynced:
                    await self._stop_building()  # a gap: the stale listing is moot
                    await self.resync(info.state.last_seq)
                sub = await self._subscribe(js, self.index.last_seq + 1)
                try:
                    if resynced:  # current as of the listing; a resume is current once caught up
                        await self.heard()
                    while self.index.synced:
                        await self._stale_turn(js)  # (the index not synced after it: given up)
                        if not self.index.synced:
                            break
                        try:
                            batch = await sub.fetch(EVENTS_FETCH_MAX, timeout=EVENTS_FETCH_WAIT_S)
                        except TimeoutError:
                            # Nothing new, or nobody answered: nats-py raises the same when the
                            # connection is down, and a router cut off counted its index current
                            # for as long (review, stop 68). At the end only if the stream says so.
                            if await self._at_end(js):
                                await self.heard()
                                retry_s = RETRY_S
                            await self.check_leaders()
                            continue
                        retry_s = RETRY_S  # following again: the next failure waits the first wait
                        await self.apply_batch(batch)
                        if caught_up(batch):  # heard, and not behind: the index is current
                            await self.heard()
                        await self.check_leaders()
                finally:  # on a failed fetch too: one subscription leaked per retry (review, 2026-12-06)
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(sub.unsubscribe(), self.request_timeout_s)
            except asyncio.CancelledError:
                raise
            except (nats.errors.Error, nats.js.errors.Error, TimeoutError, KvfError) as exc:
                # Doubling: each failed resync lists every shard again (review, 2026-12-06).
                self._log.info(
                    "events_follow_retry",
                    error=type(exc).__name__,
                    last_seq=self.index.last_seq,
                    wait_s=retry_s,
                )
                await asyncio.sleep(retry_s)
                retry_s = min(retry_s * 2, RETRY_S_MAX)

    async def _at_end(self, js: Any) -> bool:
        """Whether the events stream, asked now, has nothing past what the index applied (False
        when it cannot be asked: the connection down, JetStream unreachable)."""
        if not self.nc.is_connected:
            return False
        try:
            info = await js.stream_info(EVENTS_STREAM)
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError):
            return False
        return bool(info.state.last_seq <= self.index.last_seq)

    async def apply_batch(self, batch: Sequence[Msg]) -> None:
        """A fetched batch into the index, one event a turn of the loop (routes are served
        between them: 512 commits of 256 groups at once held the loop ~1 s); stops at a gap
        (resync before anything else). Then a lost segment's groups leave the index in slices,
        routes served between them too (`RoutingIndex.sweep`; its replicas count for nothing
        meanwhile). Public for tests."""
        for msg in batch:
            self._on_message(msg.metadata.sequence.stream, msg.data, _origin(msg))
            if not self.index.synced:
                break
            await asyncio.sleep(0)
        while self.index.sweep():  # noqa: ASYNC110 (each turn sweeps a slice: work, no wait)
            await asyncio.sleep(0)

    async def check_leaders(self) -> None:
        """Every `LEADERS_CHECK_S`: the shard map asked again; a shard led under a newer epoch
        than at the last listing makes the index stale (`RoutingIndex.leader_changed`: list
        again, still answering). Not while a stale listing runs (its epochs are compared after
        it). A map nobody answers is asked again at the next check. Public for tests."""
        if self._building is not None or self.clock() - self._leaders_checked_s < LEADERS_CHECK_S:
            return
        self._leaders_checked_s = self.clock()
        try:
            await asyncio.wait_for(self.router.refresh(), self.request_timeout_s)
        except (KvfError, TimeoutError) as exc:
            self._log.info("shard_map_unanswered", error=type(exc).__name__)
            return
        moved = sorted(s for s, e in self.router.epochs.items() if e > self._listed_epochs.get(s, e))
        if moved:
            self._log.info("shard_leaders_changed", shards=moved)
            self.index.leader_changed()
            self.pacing.marked(self._now_ms())

    def _decode(self, seq: int, data: bytes) -> m.DirectoryEvent:
        try:
            return m.event_decoder.decode(data)
        except BadRequest as exc:
            # Undecodable (a newer directory): skip it, but in sequence.
            self._log.warning("event_undecodable", seq=seq, error=exc.message)
            return m.GroupsAccessed(groups=[])

    def _on_message(self, seq: int, data: bytes, origin: tuple[int, int] | None = None) -> None:
        event = self._decode(seq, data)
        result = self.index.apply(seq, event, origin)
        if result == "gap":
            self._log.warning("events_gap", seq=seq, last_seq=self.index.last_seq)
        elif result == "fenced":
            # A replaced shard core's late event (`kvfabric.core.shard_fence`): not applied. A
            # drained outbox's thousand or two of them: the first of each (shard, epoch) logged,
            # the rest counted (`index_events_fenced`).
            if origin is None and isinstance(event, m.ShardStarted):
                origin = (event.shard, event.epoch)
            if self.index.fence.first_fenced(origin):
                self._log.info(
                    "event_fenced",
                    seq=seq,
                    kind=type(event).__name__,
                    origin=origin,
                    fenced=self.index.counters["events_fenced"],
                )
        elif isinstance(event, m.ShardStarted) and result == "applied":
            self.pacing.marked(self._now_ms())
            self._log.info("shard_started_resync", seq=seq, shard=event.shard, epoch=event.epoch)

    async def _stale_turn(self, js: Any) -> None:
        """A stale index's listing, between fetches: started when `pacing` says so (in a task:
        this loop goes on following), caught up and swapped in once indexed (this loop then
        reads on where it was), given up when overdue (the index not synced)."""
        now_ms = self._now_ms()
        listing = self._building
        if listing is not None:
            if not listing.task.done():
                return
            self._building = None
            await self._swap(js, listing)
            return
        wanted = self.index.resync_wanted
        if wanted and self.pacing.overdue(now_ms):
            self._log.warning("stale_resync_overdue", last_seq=self.index.last_seq)
            self.index.unsync()
            return
        if self.pacing.due(now_ms, wanted):
            self.pacing.started(now_ms)
            listing = _Listing()
            listing.task = asyncio.create_task(self._list_stale(listing), name="router-index-listing")
            self._building = listing

    async def _swap(self, js: Any, listing: _Listing) -> None:
        """A stale listing that ended: the events after its sequence up to the view served
        replayed onto it, then swapped in; or, failed, dropped (tried again when paced)."""
        swapped = False
        try:
            if listing.task.cancelled():
                return  # (only a listing given up is cancelled: not this one; defensive)
            at_seq, listed_epochs = listing.task.result()
            token = listing.token
            assert token is not None  # for mypy: a listing that ended holds a view
            behind = self.index.last_seq - at_seq
            if await self._catch_up(js, token, at_seq):
                swapped = self.index.resync_done(token)
            if swapped:
                self._listed_epochs = listed_epochs
                self._log.info(
                    "stale_resync_swapped",
                    at_seq=at_seq,
                    replayed=max(0, behind),
                    groups=len(self.index.groups),
                )
            else:
                self._log.info("stale_resync_not_caught_up", at_seq=at_seq, last_seq=self.index.last_seq)
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError, KvfError) as exc:
            self._log.info("stale_resync_failed", error=type(exc).__name__, last_seq=self.index.last_seq)
        finally:  # (cancelled in a catch-up too: its view dropped)
            if swapped:
                self.pacing.listed(self._now_ms())
                while self.index.sweep():  # noqa: ASYNC110 (a replayed segment_down's replicas)
                    await asyncio.sleep(0)
            else:
                if listing.token is not None:
                    self.index.resync_abort(listing.token)
                self.pacing.failed(self._now_ms())

    async def _catch_up(self, js: Any, token: int, at_seq: int) -> bool:
        """The events after `at_seq` up to the served view's `last_seq` replayed onto the view
        built under `token`, one a turn of the loop, from a subscription of their own: nothing
        past the served view (this loop applies nothing meanwhile, so that is where the new
        view takes over). Bounded: that many events, a fetch of at most `EVENTS_FETCH_MAX`
        each, every fetch bringing some within the request timeout (else TimeoutError). False
        when they cannot all be replayed (a gap: aged out; the view no longer this listing's)."""
        seq = at_seq
        if seq >= self.index.last_seq:
            return True  # nothing the view served has that the listing's sequence does not cover
        sub = await self._subscribe(js, seq + 1)
        try:
            while seq < (until := self.index.last_seq):
                batch = await sub.fetch(min(EVENTS_FETCH_MAX, until - seq), timeout=self.request_timeout_s)
                before = seq
                for msg in batch:
                    at = msg.metadata.sequence.stream
                    if at > until:
                        break
                    replayed = self.index.resync_replay(token, at, self._decode(at, msg.data), _origin(msg))
                    if replayed not in {"applied", "duplicate", "fenced"}:
                        return False
                    seq = max(seq, at)
                    await asyncio.sleep(0)
                if seq == before:  # none new (nats-py raises it itself when none came in time)
                    raise TimeoutError
            return True
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(sub.unsubscribe(), self.request_timeout_s)

    async def _subscribe(self, js: Any, start: int) -> Any:
        """An ephemeral pull consumer over every subject of the stream, from sequence `start`."""
        config = ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=start,
            ack_policy=AckPolicy.NONE,
            inactive_threshold=30.0,
        )
        return await js.pull_subscribe(
            events_wildcard(Service.DIRECTORY), stream=EVENTS_STREAM, config=config
        )

    async def _list_stale(self, listing: _Listing) -> tuple[int, dict[int, int]]:
        """A stale index's listing into a view of its own: the stream's last sequence read
        first (every marker applied is at or before it, so covered), then the directory."""
        started = time.monotonic()
        js = self.nc.jetstream(timeout=self.request_timeout_s)
        try:
            info = await js.stream_info(EVENTS_STREAM)
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError):
            self.resync_failures += 1
            raise
        at_seq = int(info.state.last_seq)
        _, listed_epochs, _ = await self._list_into_index(at_seq, listing)
        self.resync_seconds_last = time.monotonic() - started
        return at_seq, listed_epochs

    async def _stop_building(self) -> None:
        """A stale listing under way given up: its view dropped, and its task cancelled. One
        that outlives `cancel_and_wait` (a cancellation swallowed) is left to end; it starts no
        view any more, and what it writes into one it started is ignored (its build token)."""
        listing, self._building = self._building, None
        if listing is None:
            return
        listing.stopped = True
        left = await cancel_and_wait([listing.task], self.request_timeout_s)
        if left:
            self.listings_left_running += 1
            self._log.warning("stale_listing_left_running", wait_s=self.request_timeout_s)
            listing.task.add_done_callback(_retrieve)
        elif not listing.task.cancelled():
            _retrieve(listing.task)  # (a listing that failed meanwhile is moot too)
        if listing.token is not None:
            self.index.resync_abort(listing.token)
        self.pacing.failed(self._now_ms())

    async def resync(self, at_seq: int) -> None:
        """List the directory and replace the index (events after `at_seq` replay on top)."""
        started = time.monotonic()
        token, listed_epochs, paged_epochs = await self._list_into_index(at_seq)
        # The leaders' epochs listed fence their predecessors' late events after `at_seq`:
        # markers among the events lost are not seen (`RoutingIndex`, "fenced"). Every shard's
        # known once the whole listing came (`paged_epochs`): a page may be a newer leader's,
        # found on the way. One past a shard's pages' epoch (the map refreshed during the
        # listing) fences its valid events too, made up for: `_listed_epochs` are those known as
        # the listing began, so `check_leaders` lists again (and the newer marker asks for one).
        self.index.fence.raise_to(paged_epochs)
        if not self.index.resync_done(token):
            # Replaced by another listing's view (which `_list_into_index` prevents): listed
            # again, as after a failed listing.
            raise Unavailable("the gap listing's view was replaced before its swap")
        self._listed_epochs = listed_epochs
        self.pacing.listed(self._now_ms())
        self.resync_seconds_last = time.monotonic() - started
        self._log.info(
            "index_resynced",
            at_seq=at_seq,
            groups=len(self.index.groups),
            seconds=round(self.resync_seconds_last, 3),
        )

    async def _list_into_index(
        self, at_seq: int, listing: _Listing | None = None
    ) -> tuple[int, dict[int, int], dict[int, int]]:
        """The directory listed into a new view of the index as of stream sequence `at_seq`
        (`resync_start`, `resync_add` a slice a turn of the loop): its build token, the leader
        epochs known as the groups' listing began and those known once its pages came (each at
        least its pages' epoch: `DirectoryRouter.epochs`). The caller swaps it in. A stale
        `listing` given up meanwhile starts no view (checked with no wait before
        `resync_start`)."""
        try:
            segments = await self.router.segments(self.request_timeout_s)
            # The leaders listed, as it begins: compared with the shard map's by `check_leaders`
            # (the lower the safer: a change during the listing shows at the next check).
            listed_epochs = dict(self.router.epochs)
            query = m.ListGroups(
                domain_digest=self.domain_digest, limit=LISTING_PAGE_GROUPS, with_objects=True
            )
            summaries = await self.router.list_groups(query, self.request_timeout_s, self.listing_pages_max)
            # The pages may come from a newer leader found on the way (a wrong_shard answer, the
            # map asked again): its epoch is the fence's (review, 2026-12-07: the copy above
            # admitted the late events of the core that leader replaced). Every shard's, as
            # known now: maybe past a shard's pages' epoch (`resync`).
            paged_epochs = dict(self.router.epochs)
        except KvfError:
            self.resync_failures += 1
            raise
        if listing is not None and listing.stopped:
            raise asyncio.CancelledError  # given up (a cancellation it swallowed): no view
        token = self.index.resync_start(
            [ListedSegment(s.segment_id, s.incarnation, s.up) for s in segments.segments], at_seq=at_seq
        )
        if listing is not None:
            listing.token = token
        for at in range(0, len(summaries), RESYNC_SLICE_GROUPS):
            groups = []
            for g in summaries[at : at + RESYNC_SLICE_GROUPS]:
                if g.state != "published" or len(g.namespace) != NAMESPACE_BYTES:
                    continue
                replicas = frozenset(r.segment_id for o in g.objects for r in o.replicas)
                if replicas:
                    copy_bytes = sum(o.size_bytes for o in g.objects)
                    domain = domain_in_id(g.namespace)
                    groups.append(ListedGroup(domain, g.group, g.chunk_index, copy_bytes, replicas))
            if not self.index.resync_add(token, groups):
                break  # its view given up or replaced: nothing more of it is written
            await asyncio.sleep(0)  # routes are answered between slices
        return token, listed_epochs, paged_epochs
