"""The eviction-policy shell: directory events → `EvictionCore` → evict requests → core.

Four tasks (five with admission) around one synchronous core (each core call is atomic on the
event loop):

- **follower**: reads the directory's JetStream event stream from its first message with an
  ephemeral pull consumer (no acks; batches of `EVENTS_FETCH_MAX`, so memory stays bounded and a
  slow policy just lags; at the stream's end it waits `EVENTS_LINGER_S` after a short batch, so
  events a save apart share one pull request), one event a turn of the loop. An event whose
  `Kvf-Shard-Epoch` header names an epoch below one already seen for its shard (a replaced
  core's, landed after its successor's `shard_started`: a handover's drain runs while the lease
  is released) is dropped, counted `events_fenced` (`kvfabric.core.shard_fence`; logged the
  first of each shard and epoch), a stale marker too; an adoption that makes up for stream events
  lost (a gap, `check_stream`, the start's) raises that fence to the shard epochs it lists under
  (a marker lost with them is never seen); a marker's or a confirming one does not (the
  follower reads on meanwhile: an old core's valid events before its successor's marker). Each
  event goes through `apply` (`GroupRecords`,
  `group_records.py`: the per-group records kept beside the core). `published` → `core.insert`
  (object = chunk group, pools = the segments holding its bytes, tenant = its share domain,
  parent = the previous chunk; a put_commit's groups come as one `GroupsPublished`, a republish or an older
  directory's as one `GroupPublished` each);
  `accessed` → `core.seen` + `core.access`; `evicted`/`invalidated` → `core.removed`;
  `segment_down` → `core.drop_pool_steps` (`apply_in_steps`: a lost segment's groups go in
  steps of about a thousand, the loop running between steps, no later event applied until all
  are dropped: at once, 300,000 groups stalled the loop ~0.7 s); `segment_up` → the pool's
  capacity. When the consumer is lost (NATS restart) it is recreated after the last sequence
  applied: events are applied in order, each once. A `GroupsPublished` stored in the stream
  at most `INFLOW_EVENT_AGE_MAX_MS` before it is applied is a writer's: its bytes are the
  core's inflow (`EvictionCore.tick`); a backlog's, a republish's and an adopted group's own
  event are not.
- **segments**: every `segments_refresh_ms`, `list_segments` of every directory shard, merged,
  re-reads the capacities of the segments up.
- **adopter**: once the follower has replayed the stream at start, and whenever the stream
  has lost events this policy never applied (aged out, purged, recreated: `check_stream` at
  (re)subscribe, a gap in the sequences while subscribed; a directory shard's `shard_started`:
  its previous core may have stopped with events unpublished, which left no gap), once the
  follower has applied what the stream held then, every published group not tracked is
  adopted from the directory's listing (`adopt_listed`: ranked as last used before the policy
  started, no parent), so a cluster older than the stream's retention is still evicted; and
  what it tracks is reconciled with that listing (a resync): a group listed on other pools
  moves to them, one that whole listings have missed for `MISSED_FORGET_MS` (evicted,
  invalidated, lost in the gap; a listing may come from a new directory leader whose rebuild
  missed a segment, for minutes) goes, and a segment not up in the segment listing taken after
  it loses its pools once they are empty; what an event applied since the adoption began says
  stands (`adopt_listed`). While groups are missed, another adoption comes once the oldest
  miss is that old (`_adoption_wanted`), so they go without waiting for another loss. The lost
  events' hits and recency are gone.
- **ticker**: every `tick_ms`, the core's `Tick` (stepped through its `CoreDriver`,
  `kvfabric.runtime.core_driver`, on the wall clock, never backwards) returns victim batches
  (tails before heads), which the driver has performed in order (`_perform`); each
  goes to the directory as one `evict` request per run of consecutive groups of one shard (the
  directory is sharded: requests go through a `DirectoryRouter`, created in `start`), in the
  batch's order (so tails go before their heads, across shards too). Per group the directory answers
  `evicting` (gone: `core.removed`), `leased`/`pinned` (it stays: `core.refused`, which cools it
  down) or `not_found`/`not_published` (gone). A request without an answer is indeterminate: its
  groups are treated as refused (cooled down, retried later) and any eviction that did happen
  arrives as an `evicted` event; the other shards' requests of the batch still go, except for
  the ancestors of a group that stayed (leased, pinned, unanswered): those are not asked but
  cooled down (counted `waits_for_tail`); within one request the directory keeps a group one of
  whose tails (`Evict.tails`) stayed, answered `tail_stays`.
- **demotion** (issue 23; `tiers.py`): a watermark batch of a segment's arena pool goes first
  through `demote_or_drop` (its hits since published): each group to demote is looked up
  (`show_group`) and its arena replicas on that segment are sent to the segment's
  `demote.<segment_id>`, several groups per request (`demote_request_fits`: up to 64 groups,
  64 objects, 64 MiB; the segment batches its directory steps per request), which copies them
  into its disk tier and has the directory drop the arena replicas. Each group's outcome is its
  own objects' results (`group_outcome`). A demoted group moves to the pool `<segment>#ssd`
  (capacity from the segment's reply, pressed at `ssd_high_watermark`), whose victims are
  evicted (dropped from their last tier; `evict` tier "ssd": a head copied there that is still
  in an arena loses only its disk replica, `disk_dropped`, `_disk_dropped`, unless an ancestor
  of it in the batch goes whole: then no lookup would reach it in the arena). A copy kept
  under a lease (`copied`) or a failure
  (of its objects, or of the whole request) cools the group down like a refused eviction; a
  full disk (`no_capacity`) stops demotion for that batch (counted, logged `demotion_stopped`)
  and the groups it refused and those not yet sent are dropped instead, so the arena still
  gets its room; a segment without a disk tier is remembered and its victims dropped. Before
  the victims go, their ancestors on no disk are copied there (`_heads_on_disk`: `keep_arena`,
  the arena replica stays), so the disk tier holds whole prefixes and a power cycle, which loses
  the arena, leaves every disk object findable (docs/ssd-tier.md, "Whole prefixes on disk"). The
  victims themselves go heads first (`heads_first`), and one whose parent, a victim sent in an
  earlier request, is not on disk after it waits (`waits_for_head`, cooled down). While a
  writer fills the arena (the core's measured inflow, at least `ROOM_WRITER_MIN_BYTES_PER_S`),
  only the victims the disk takes in half the time until the arena is full at that rate
  (`_room_until_ms`, at the disk speed of the demote requests before) are demoted; the rest
  are dropped first (`_split_for_room`), and a request that would still end past that time is
  not sent, its victims and those after it dropped (`dropped_for_room`; `demote_cut_for_room`
  turns both off): the writer's saves are not refused while the disk lags.

- **admission** (issue 25 item 4; `KVF_EVICTION_ADMISSION=predicted`, policy `density`): once
  caught up, every `admission_publish_ms` the core's admission filter (`build_filter`: per pool
  past its low watermark, the largest group admitted per length class; protected domains) is
  published on `kvf.v1.eviction.admission_filter`; every directory instance applies the latest
  while fresh at `put_begin` and never waits for it (`kvfabric.core.eviction_admission`).

Time: every time the core is given comes from the driver (`self._driver.now_ms()`: the wall
clock, never earlier than a time already given), so the core's "time never goes backwards"
holds across the follower and the ticker. Only the ticker goes through `feed`; the other call
sites call the core's methods directly, for these reasons: the follower's `apply` is the hot
path (every directory event, up to `ACCESS_PER_EVENT_MAX` accesses each) and synchronous (one
event atomic on the event loop, a `segment_down` one step at a time: `apply_in_steps`; tests
call it with their own times), so a `feed` (an await and
the driver's lock per event) would add latency for no change in meaning; and what a victim
batch's answers do to the core (`refused`, `removed`, a demoted group's move) happens while
the driver performs that Tick's effects, which must never feed the same driver (it would wait
for itself: `kvfabric.runtime.core_driver`). The adopter's own times, never given to the core
(when a listing first missed each tracked group, `GroupRecords._missed`, and when the latest
adoption began), are on the monotonic clock instead (`_missed_clock_ms`): they are compared
only with each other, and a wall clock stepped forward must not make a miss
`MISSED_FORGET_MS` old at once.

The policy's state is rebuilt from the stream at every start; the groups published by events
the stream no longer holds come from the directory's listing (the adopter;
docs/eviction-policy.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import deque
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Final, Protocol

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from kvfabric.cluster.directory_router import DirectoryRouter
from kvfabric.cluster.requests import request as nats_request
from kvfabric.core.eviction import EvictBatch, EvictionCore
from kvfabric.core.eviction_admission import bloom_has, filter_parts, length_class, with_bloom
from kvfabric.core.eviction_events import EvictionEvent, EvictionOutput, Tick
from kvfabric.core.shard_fence import ShardEpochFence
from kvfabric.core.stream_bounds import StreamBounds
from kvfabric.eviction_policy.decisions import DECISIONS_GROUPS_DEFAULT, DecisionLog
from kvfabric.eviction_policy.group_records import (
    MISSED_FORGET_MS,
    GroupRecords,
    group_id_of,
    published_of_summary,
)
from kvfabric.eviction_policy.heads import HeadsOffDisk, heads_off_disk, with_ancestor_in
from kvfabric.eviction_policy.tiers import (
    DEMOTE_ON_DISK,
    DEMOTE_REQUEST_BYTES_MAX,
    DEMOTE_REQUEST_OBJECTS_MAX,
    SSD_POOL_SUFFIX,
    DemoteOutcome,
    copy_outcome,
    demote_or_drop,
    demote_request_fits,
    disk_full_capacity,
    group_outcome,
    heads_first,
    is_ssd_pool,
    on_disk_whole,
    ssd_pool,
    ssd_pool_capacity,
)
from kvfabric.format.clock import monotonic_ms, now_ms
from kvfabric.format.errors import BadRequest, Conflict, Indeterminate, KvfError, NotFound, Unavailable
from kvfabric.format.ids import (
    GROUP_ID_BYTES,
    DomainDigest,
    GroupId,
    ObjectKey,
    chunk_index_in_id,
    domain_in_id,
    group_key_of_id,
)
from kvfabric.format.key import ChunkGroupId, KVKey
from kvfabric.proto import directory as m
from kvfabric.proto import eviction as e
from kvfabric.proto.codec import encode
from kvfabric.proto.segment import DemoteObject, DemoteReply, DemoteRequest, segment_decoder, tier_of_slot
from kvfabric.proto.subjects import Service, endpoint_subject, events_wildcard, segment_subject
from kvfabric.runtime.core_driver import CoreDriver
from kvfabric.runtime.deadline import stop_tasks
from kvfabric.runtime.logs import get_logger
from kvfabric.runtime.service import ServiceRuntime
from kvfabric.runtime.ticker import every

__all__ = ["EVENTS_STREAM", "EvictionShell", "group_id_of", "now_ms"]

EVENTS_STREAM: Final = "KVF_DIRECTORY_EVENTS"  # owned by the directory
EVENTS_FETCH_MAX: Final = 512  # events per fetch: the follower's memory bound
EVENTS_FETCH_WAIT_S: Final = 1.0
EVENTS_LINGER_S: Final = 0.05  # at the stream's end, events gather this long into one pull
# A put_commit's event older than this when applied is a backlog (a replay, a stalled follower),
# not a writer's rate: its bytes are not the core's inflow (docs/eviction-policy.md).
INFLOW_EVENT_AGE_MAX_MS: Final = 1_000
# An inflow below this is no writer the disk could lag behind (a decayed estimate of one gone).
ROOM_WRITER_MIN_BYTES_PER_S: Final = 1 << 20
# ... and one that has written at every tick for this long: a burst that ends sooner (a batch of
# prompts) leaves the disk time to catch up, its victims are all demoted (as the power-cycle
# test's 160 saves are).
ROOM_WRITER_SUSTAINED_MS: Final = 2_000
ROOM_MS_MAX: Final = 3_600_000
RETRY_S: Final = 0.5
DEMOTE_PAUSE_MS: Final = 30_000  # a segment's demotion after a demote request got no answer
FOLLOW_RETRY_S_MAX: Final = 15.0  # the event follower's backoff, doubling from RETRY_S
ADOPT_PAGE_GROUPS: Final = 1_000  # groups per `list_groups` page when adopting a listing
ADOPT_PAGES_MAX: Final = 1_000_000  # pages per shard (each bounded by the directory's reply size)
# groups moved between the naming sets, or forgotten, a turn of the loop (`_pop_steps`)
ADOPT_FORGET_STEP: Final = 1_000
ADOPT_RETRY_S: Final = 2.0  # a failed listing is tried again after this, doubling up to ...
ADOPT_RETRY_MAX_S: Final = 120.0
# While groups are missed (`GroupRecords._missed`), the adoption that confirms them gone comes once
# the oldest miss is `MISSED_FORGET_MS` old, but no sooner than this after the latest adoption
# began: one kept missed past that (a victim under way, a listing cut short) is looked at again
# then, not in a loop of listings.
MISSED_CONFIRM_GAP_MS: Final = 120_000
# Adoption waits for the follower to apply the stream (before the listing, and past it) as long
# as it applies an event at least this often.
ADOPT_FOLLOWER_STALL_S: Final = 60.0
# `show_group` requests of one demotion pass in flight (a batch's victims and their ancestors are
# listed concurrently, not one round trip after another; the directory bounds each tenant's too).
SHOW_IN_FLIGHT_MAX: Final = 8


class _Fetcher(Protocol):
    """What the follower uses of a JetStream pull subscription."""

    async def fetch(self, batch: int = 1, timeout: float | None = 5) -> list[Msg]: ...  # noqa: ASYNC109


class EvictionShell(GroupRecords):
    """Owns the core and the follower, segments and ticker tasks of one policy instance; its
    per-group records and `apply` are `GroupRecords` (`group_records.py`)."""

    def __init__(
        self,
        core: EvictionCore,
        *,
        tick_ms: int,
        segments_refresh_ms: int,
        request_timeout_s: float,
        demote: bool = True,
        demote_min_hits: int = 0,
        demote_cut_for_room: bool = True,
        ssd_high_watermark: float = 0.9,
        demote_timeout_s: float = 30.0,
        admission_publish_ms: int = 0,
        decisions_max: int = DECISIONS_GROUPS_DEFAULT,
    ) -> None:
        self.core = core
        # The core's time is the wall clock, as before (read through this module's `now_ms`).
        self._driver: CoreDriver[EvictionEvent, EvictionOutput] = CoreDriver(
            core, self._perform, clock=lambda: now_ms()
        )
        self.admission_publish_ms = admission_publish_ms  # 0: no admission filter published
        self.admission_published = 0
        self.admission_filter_bytes = 0  # the last one's encoded size
        self._admission: e.AdmissionFilter | None = None  # the last one built (`explain`)
        self._decisions = DecisionLog(decisions_max)
        self._adopted: set[bytes] = set()  # see `GroupRecords`
        self._events_fresh = True  # see `GroupRecords`: tests apply events as they come
        self._gone_while_adopting: set[bytes] | None = None  # see `GroupRecords`
        self._down_while_adopting: set[str] | None = None
        self._up_while_adopting: set[str] | None = None  # see `GroupRecords`
        # which adoption last named each tracked group: see `GroupRecords`
        self._named: set[bytes] = set()
        self._unnamed: set[bytes] = set()
        # group key -> when the first listing missing it began (`_missed_clock_ms`, as the two below)
        self._missed: dict[bytes, int] = {}
        self._doomed: dict[bytes, int] = {}
        self._missed_oldest_ms = 0
        self._adoption_began_ms = 0  # the latest adoption's (`_confirm_due_ms`)
        self._adopt_after_seq = 0  # the stream's end when events were found lost
        self._stream_bounds = StreamBounds()  # the events stream's creation time, as last seen
        # The stream lost events the policy never applied. Set from the start: once the stream
        # is replayed, the listing's groups it did not tell of are adopted (a stream recreated
        # before this policy started, sequences from 1 again, lost events nothing in it shows).
        self._adopt_wanted = asyncio.Event()
        self._adopt_wanted.set()
        # The adoption asked for makes up for events the stream lost (a gap, `check_stream`, the
        # start's): its listing raises the fence (`adopt_listed`). Not for a marker's or a
        # confirming one. Taken by the adoption that clears `_adopt_wanted`.
        self._adopt_fences = True
        self._started_ms = 0  # what adopted groups rank as last used (before any replayed event)
        self._past_seq = 0  # `_past` is set once the follower applied this sequence
        self._past = asyncio.Event()
        self.groups_adopted = 0
        self.adoptions = 0
        self.groups_relisted = 0  # tracked groups a listing moved to other pools (`_relisted`)
        self.groups_unlisted = 0  # tracked groups two listings missed: gone (`_missed_twice_gone`)
        self.segments_unlisted = 0  # segments not up in the listing: their pools gone
        self.demote = demote
        self.demote_min_hits = demote_min_hits
        self.demote_cut_for_room = demote_cut_for_room  # drop what the disk cannot take in time
        self.ssd_high_watermark = ssd_high_watermark
        self.demote_timeout_s = demote_timeout_s
        # group key -> (tenant, chunk index, pool -> bytes, group bytes): see `GroupRecords`
        self._held: dict[bytes, tuple[bytes, int, dict[str, int], int]] = {}
        self._hits: dict[bytes, int] = {}  # group key -> hits since published (demote_or_drop)
        # group key -> the keys naming it as parent: a group moved to a disk pool loses its parent
        # in the core (the core's leaves are per object, not per pool), so the shell keeps
        # the prefix order across tiers itself (`_with_disk_tails`).
        self._children: dict[bytes, set[bytes]] = {}
        self._parent: dict[bytes, bytes] = {}
        self._held_back: dict[bytes, tuple[dict[str, int], int]] = {}  # see `GroupRecords._stays`
        self._lost_until: dict[bytes, int] = {}  # see `GroupRecords`
        self._lost_links: deque[tuple[int, list[bytes]]] = deque()
        self._dropping: set[str] = set()  # pools of a lost segment being dropped (see `GroupRecords`)
        self._down_incarnation: dict[str, int] = {}  # see `GroupRecords`
        self._disk_pools: set[str] = set()  # `<segment>#ssd` pools holding or having held groups
        self._no_disk: set[str] = set()  # segments that answered "no disk tier"
        # segments whose demote request got no answer (a hung disk): no demotion there until then
        # (monotonic ms of the policy's clock); their victims are dropped meanwhile
        self._demote_paused_until: dict[str, int] = {}
        self.demotions: dict[str, int] = {}  # outcome -> groups (status, metrics)
        # per segment, the disk speed its demote requests had (absent: none yet; each disk its own)
        self._demote_bytes_per_ms: dict[str, float] = {}
        self.tick_ms = tick_ms
        self.segments_refresh_ms = segments_refresh_ms
        self.request_timeout_s = request_timeout_s
        self._group_ids: dict[bytes, GroupId] = {}  # domain + chain hash -> 90-byte group id (tracked)
        self._capacity: dict[str, int] = {}
        self._up_incarnation: dict[str, int] = {}
        self._nc: NatsClient | None = None
        self._router: DirectoryRouter | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._runtime: ServiceRuntime | None = None
        self._log = get_logger("kvfabric.eviction_policy")
        self.last_seq = 0  # stream sequence of the last event applied
        self.events_applied = 0
        self.events_stale = 0  # applied past INFLOW_EVENT_AGE_MAX_MS: not counted as inflow
        # Per shard, the highest epoch an event's header named: a replaced core's late events
        # are dropped, counted (`_decoded`).
        self._shard_epochs = ShardEpochFence()
        self.events_fenced = 0
        self.evict_requests_failed = 0
        self.caught_up = asyncio.Event()  # set once the follower has read to the stream's end

    def attach(self, runtime: ServiceRuntime) -> None:
        self._runtime = runtime  # its background tasks are watched (`ServiceRuntime.watch`)
        runtime.add_endpoint(
            "status", self._status, request=e.EvictionStatusRequest, decoder=e.eviction_decoder
        )
        runtime.add_endpoint(
            "explain", self._explain, request=e.EvictionExplainRequest, decoder=e.eviction_decoder
        )

    async def start(self, nc: NatsClient) -> None:
        self._nc = nc
        self._router = DirectoryRouter(nc)
        self._started_ms = self._driver.now_ms() - 1
        self._tasks = [
            asyncio.create_task(self._follow(), name="eviction-follow"),
            asyncio.create_task(self._adopter(), name="eviction-adopter"),
            asyncio.create_task(
                every(self.segments_refresh_ms / 1000, self._refresh_segments, self._refresh_failed),
                name="eviction-segments-refresh",
            ),
            asyncio.create_task(self._ticker(), name="eviction-ticker"),
        ]
        if self.admission_publish_ms:
            self._tasks.append(asyncio.create_task(self._publish_admission(), name="eviction-admission"))
        if self._runtime is not None:
            for task, name in zip(
                self._tasks,
                ("follow", "adopter", "refresh_segments", "ticker", "publish_admission"),
                strict=False,
            ):
                self._runtime.watch(task, name)

    async def stop(self) -> None:
        await self._driver.stop()
        await stop_tasks(self._tasks, self._log)

    # ---- events ------------------------------------------------------------------------------

    async def _follow(self) -> None:
        assert self._nc is not None
        js = self._nc.jetstream(timeout=self.request_timeout_s)
        retry_s = RETRY_S
        while True:
            sub = None
            try:
                info = await js.stream_info(EVENTS_STREAM)
                end_seq = info.state.last_seq
                self.check_stream(info.state.first_seq, end_seq, info.created)
                config = ConsumerConfig(
                    deliver_policy=(DeliverPolicy.BY_START_SEQUENCE if self.last_seq else DeliverPolicy.ALL),
                    opt_start_seq=self.last_seq + 1 if self.last_seq else None,
                    ack_policy=AckPolicy.NONE,
                    inactive_threshold=30.0,
                )
                sub = await js.pull_subscribe(
                    events_wildcard(Service.DIRECTORY), stream=EVENTS_STREAM, config=config
                )
                if self.last_seq >= end_seq:
                    self.caught_up.set()
                retry_s = RETRY_S  # subscribed: a later failure starts the backoff again
                await self._read_events(sub, end_seq)
            except asyncio.CancelledError:
                raise
            except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
                self._log.info(
                    "events_follow_retry", error=type(exc).__name__, last_seq=self.last_seq, retry_s=retry_s
                )
                await asyncio.sleep(retry_s)
                retry_s = min(FOLLOW_RETRY_S_MAX, retry_s * 2)  # doubling (it retried every 0.5 s)
            finally:
                if sub is not None:  # each retry subscribes anew: the old one goes (review)
                    with contextlib.suppress(Exception):
                        await sub.unsubscribe()

    def check_stream(self, first_seq: int, end_seq: int, created: object = None) -> bool:
        """The stream's bounds (and creation time) as the follower (re)subscribes. True when
        events this policy never applied are gone: aged out or purged, or the stream recreated
        with its sequences restarted (`kvfabric.core.stream_bounds`). The groups they published
        are adopted from the directory's listing, once the follower has applied what the stream
        holds now (`_adopter`); the follower goes on from the stream's first event (public for
        tests)."""
        created_before = self._stream_bounds.created
        if not self._stream_bounds.lost(self.last_seq, first_seq, end_seq, created):
            return False
        self._log.warning(
            "events_lost",
            first_seq=first_seq,
            end_seq=end_seq,
            last_applied=self.last_seq,
            recreated=None not in (created, created_before) and created != created_before,
        )
        self.last_seq = max(first_seq - 1, 0)  # (so a reconnect does not find them lost again)
        self._events_lost(end_seq, lost=True)
        return True

    def _events_lost(self, end_seq: int, *, lost: bool) -> None:
        """Adopt the listing once the follower has applied `end_seq`; a waiter on the follower
        (`_reach`) looks again (the sequences may have moved back). `lost`: stream events are
        gone (a gap, `check_stream`), not only a core's unpublished ones (a `shard_started`,
        which is in the fence itself): the adoption's listing raises the fence
        (`adopt_listed`)."""
        self._adopt_after_seq = end_seq
        self._adopt_fences = self._adopt_fences or lost
        self._adopt_wanted.set()
        self._past.set()

    async def _read_events(self, sub: _Fetcher, end_seq: int) -> None:
        """Fetch and apply events until cancelled or the consumer fails (raises). At the stream's
        end a pull is answered as soon as one event is there, so a directory publishing one event
        a save cost one pull request (and its reply) an event (issue 20): after a batch short of
        `EVENTS_FETCH_MAX` the follower waits `EVENTS_LINGER_S`, and one pull takes what gathered."""
        while True:
            try:
                batch = await sub.fetch(EVENTS_FETCH_MAX, timeout=EVENTS_FETCH_WAIT_S)
            except TimeoutError:  # nats-py raises a bare asyncio one too (fetch deadline)
                self.caught_up.set()  # nothing new for a while: we are at the end
                continue
            for msg in batch:
                event = self._decoded(msg)
                if event is None:
                    continue
                # A segment lost is dropped in steps (a third of a million groups took ~0.7 s
                # in one go); the loop runs between them. No other event is applied meanwhile,
                # and the event counts as applied (`_reach`) once it is whole.
                now = self._driver.now_ms()
                self._events_fresh = _fresh(msg, now)
                self.events_stale += not self._events_fresh
                for _ in self.apply_in_steps(event, now):
                    await asyncio.sleep(0)
                self._applied(msg.metadata.sequence.stream)
                # One event a turn of the loop: 512 commits of 256 groups held it ~2 s at once.
                await asyncio.sleep(0)
            if self.last_seq >= end_seq:
                self.caught_up.set()
            if len(batch) < EVENTS_FETCH_MAX:
                await asyncio.sleep(EVENTS_LINGER_S)

    def _on_message(self, msg: Msg) -> None:
        """One event message applied whole (`_read_events` applies it in steps)."""
        event = self._decoded(msg)
        if event is not None:
            self.apply(event, self._driver.now_ms())
            self._applied(msg.metadata.sequence.stream)

    def _decoded(self, msg: Msg) -> msgspec.Struct | None:
        """The event to apply from `msg`, after the follower's check for a gap before it. None:
        applied already (a redelivery), undecodable, or a replaced shard core's (its header's
        epoch below one seen for its shard: fenced, counted `events_fenced`); the last two taken
        as applied. The caller marks the event `_applied` once it is whole."""
        seq = msg.metadata.sequence.stream
        if seq <= self.last_seq:
            return None  # a redelivery after a consumer restart: applied already
        if self.last_seq and seq > self.last_seq + 1:
            # The stream holds the directory's events only: a gap is events aged out ahead of
            # a follower that lags (it stayed subscribed, so `check_stream` did not run).
            self._log.warning("events_lost", first_seq=seq, last_applied=self.last_seq)
            self._events_lost(seq, lost=True)
        try:
            event: msgspec.Struct = m.event_decoder.decode(msg.data)
        except BadRequest as exc:
            self._log.warning("event_undecodable", seq=seq, error=exc.message)
            self._applied(seq)
            return None
        origin = m.shard_epoch_of(getattr(msg, "headers", None))
        if origin is None and isinstance(event, m.ShardStarted):
            origin = (event.shard, event.epoch)
        if not self._shard_epochs.admit(origin):
            # A replaced shard core's late event (landed after its successor's `shard_started`:
            # a handover's drain runs while the lease is released): not applied, a stale marker
            # asks for no adoption (`kvfabric.core.shard_fence`).
            # A drained outbox's thousand or two: the first of each (shard, epoch) logged, the
            # rest counted.
            self.events_fenced += 1
            if self._shard_epochs.first_fenced(origin):
                self._log.info(
                    "event_fenced",
                    seq=seq,
                    kind=type(event).__name__,
                    origin=origin,
                    fenced=self.events_fenced,
                )
            self._applied(seq)
            return None
        if isinstance(event, m.ShardStarted):
            # A shard's new core: what the one before it left unpublished is gone with no gap in
            # the sequences (and its rebuild told nothing of what it adopted): a loss, as above.
            self._log.info("events_lost", shard_started=event.shard, epoch=event.epoch, seq=seq)
            self._events_lost(seq, lost=False)
        return event

    def _applied(self, seq: int) -> None:
        """Stream sequence `seq` is applied whole (a waiter on the follower, `_reach`, looks)."""
        self.last_seq = seq
        if seq >= self._past_seq:
            self._past.set()

    # ---- adoption ----------------------------------------------------------------------------

    async def _adopter(self) -> None:
        """When the stream has lost events the policy never applied (`_follow`), and once the
        follower has applied what the stream held then (`_reach`): adopt every published group
        the policy does not track from the directory's listing (`adopt_listed`), retried until
        it succeeds (any failure: logged). Without this, a policy started after the stream's
        retention (`KVF_DIRECTORY_EVENTS_MAX_AGE_S`) never evicts what was published before it:
        its segments fill for good. Also when groups whole listings missed are due for the
        listing that confirms them gone (`_adoption_wanted`). The adoption raises the fence when
        a request it answers was for stream events lost (`_adopt_fences`, `adopt_listed`)."""
        while True:
            await self._adoption_wanted()
            await self.caught_up.wait()
            self._adopt_wanted.clear()
            fences, self._adopt_fences = self._adopt_fences, False  # (the requests it answers)
            await self._reach(self._adopt_after_seq)  # (stalled: adopt all the same, the safe side)
            retry_s = ADOPT_RETRY_S
            while True:
                try:
                    await self.adopt_listed(fences=fences)
                    break
                except KvfError as exc:
                    self._log.info("adoption_retry", code=exc.code, retry_s=retry_s)
                except Exception as exc:  # (not cancellation): the adopter must not die
                    self._log.error("adoption_failed", error=repr(exc), retry_s=retry_s)
                # A listing is every shard's groups: a failure that repeats must not re-list
                # them every 2 s.
                await asyncio.sleep(retry_s)
                retry_s = min(retry_s * 2, ADOPT_RETRY_MAX_S)

    async def _adoption_wanted(self) -> None:
        """Returns once an adoption is wanted: events were lost (`_adopt_wanted`), or groups
        whole listings missed are due for the listing that confirms them gone
        (`_confirm_due_ms`). Without the latter a group truly gone (its `evicted` among lost
        events) and a dead segment's pool stayed, bytes counted, until some unrelated loss."""
        while not self._adopt_wanted.is_set():
            due = self._confirm_due_ms()
            if due is None:
                await self._adopt_wanted.wait()
                return
            left_ms = due - self._missed_clock_ms()
            if left_ms <= 0:
                self._log.info("adoption_confirming", missed=len(self._missed))
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._adopt_wanted.wait(), left_ms / 1000)

    def _confirm_due_ms(self) -> int | None:
        """When the adoption that confirms the missed groups gone is due (`_missed_clock_ms`):
        once the oldest miss is `MISSED_FORGET_MS` old (no sooner: it would keep it missed), and
        `MISSED_CONFIRM_GAP_MS` after the latest adoption began. None with none missed."""
        if not self._missed and not self._doomed:
            return None
        return max(self._missed_oldest_ms + MISSED_FORGET_MS, self._adoption_began_ms + MISSED_CONFIRM_GAP_MS)

    @staticmethod
    def _missed_clock_ms() -> int:
        """The clock of the missed groups' times (`GroupRecords._missed`, `_missed_oldest_ms`,
        `_adoption_began_ms`, `_confirm_due_ms`): this process's monotonic clock (read through
        this module's `monotonic_ms`), not the driver's wall clock. Only compared with its own
        readings: on the wall clock, a step forward (NTP, a host's clock set) made groups missed
        seconds before look `MISSED_FORGET_MS` old, forgotten by the next listing that missed
        them (review, 2026-12-07). The decisions recorded keep the driver's time."""
        return monotonic_ms()

    async def _reach(self, seq: int) -> bool:
        """Wait until the follower has applied stream sequence `seq`, as long as it keeps
        applying events (none for `ADOPT_FOLLOWER_STALL_S`: False, it is stuck or cut off)."""
        while self.last_seq < seq:
            before = self.last_seq
            self._past_seq = seq
            self._past.clear()
            try:
                await asyncio.wait_for(self._past.wait(), ADOPT_FOLLOWER_STALL_S)
            except TimeoutError:
                if self.last_seq == before:
                    return False
            if self.last_seq < before:  # the stream was recreated: `seq` names another event
                return False
        return True

    async def adopt_listed(self, *, fences: bool = False) -> int:
        """Every shard's published groups, page by page (the loop runs between pages); each one
        not tracked goes into the core as if published then, ranked as last used before this
        policy started (its history is lost: it goes before anything the policy saw used), with
        no parent (a listing does not say it). A page may be older than events the follower
        applied meanwhile: a group forgotten (evicted, invalidated, lost) since the adoption
        began is not taken from it, nor a replica on a segment gone down since (or still being
        dropped as it began: its pools dropped already would hold it for good), nor one of a
        segment incarnation seen down here before, and not heard up again since
        (`GroupRecords._down_incarnation`: the
        directory's sweep of it may come after the page; counted, its bytes stayed on the dead
        segment for good, for an adopted group as for a relisted one). An adopted
        group whose own `published` event the follower reaches afterwards is taken again from
        it (`GroupRecords._published`); once the follower has read past the stream's end as of
        the listing, none can come. `fences`, when the adoption makes up for stream events
        lost (a gap, `check_stream`, the start's: `_events_lost`): the shard epochs the listing
        reads under (those the router knows as it begins, each page's) raise the follower's
        fence (`_shard_epochs`): the events lost may have held a new core's `shard_started`,
        and its predecessor's late events (an `evicted` of a group the new core holds) must not
        be applied after it. Not otherwise (a `shard_started`'s adoption: its marker is in the
        fence already; a confirming one): the follower reads on meanwhile, and an old core's
        events that precede its successor's marker in the stream, valid, were dropped as late
        (review, 2026-12-07: a group's `published` dropped, the group adopted ranked coldest;
        its `evicted` dropped, the group counted until whole listings missed it for
        `MISSED_FORGET_MS`).

        A resync, not only an addition: what the lost events removed is removed too. A tracked
        group a page names, and no event applied since the adoption began named, moves to the
        pools listed (`_relisted`: a replica of a segment lost in the gap goes). Once every
        shard is listed whole (no shard cut at `ADOPT_PAGES_MAX` pages), a tracked group that
        neither this listing nor any event applied since it began named is missed (kept, with
        its rank), and one that whole listings have missed since one that began at least
        `MISSED_FORGET_MS` before this one, no event naming it meanwhile, is gone
        (`_forget_missed`; one named by an event is as the event says: the listing may have
        been read before it). Not sooner: a new directory leader whose rebuild missed a segment
        lists none of its groups until that segment's own rebuild, which backs off up to 5
        minutes, and a failover's `shard_started` markers ask for adoptions seconds apart.
        Then the segment listing, taken after the groups', tells which segments are not up:
        their pools go once they hold nothing (`_dead_segment_dropped`). Nothing here copies
        the groups tracked (`GroupRecords._named`: sets swapped and popped in steps). Returns
        the groups adopted (public for tests)."""
        router = self._dir()
        query = m.ListGroups(limit=ADOPT_PAGE_GROUPS, with_objects=True)
        adopted = relisted = unlisted = missed = down = 0
        whole = True  # every shard listed to its last page
        await self._begin_naming()
        # (no await from the swap above to here: what is named from now on is named since the
        # adoption began, `began` on `_missed_clock_ms`) A segment still being dropped
        # (`GroupRecords._segment_down`, in steps) is down too: its pools already dropped would
        # take a listed replica back, on a dead segment.
        began = self._adoption_began_ms = self._missed_clock_ms()
        self._gone_while_adopting = set()
        self._down_while_adopting = {p for p in self._dropping if not is_ssd_pool(p)}
        self._up_while_adopting = set()
        try:
            shards = await router.known_shards()
            # Events lost: the leaders listed fence their predecessors' late events (`_decoded`),
            # a marker lost with them is never seen (the router's gap listing does the same,
            # `kvfabric.router.index_follower`). The epochs known as it begins (the shard map's,
            # the replies'), then each page's own, before its groups are taken.
            if fences:
                self._shard_epochs.raise_to(router.epochs)
            for shard in range(shards):
                last: m.GroupList | None = None
                async for page in router.shard_pages(shard, query, self.request_timeout_s, ADOPT_PAGES_MAX):
                    if fences:
                        self._shard_epochs.raise_to({shard: page.epoch})
                    last = page
                    at = self._driver.now_ms()
                    for summary in page.groups:
                        event = published_of_summary(
                            summary, without=self._down_while_adopting, down=self._down_incarnation
                        )
                        if event is None:
                            continue
                        key = group_key_of_id(self._group_id_of(event))
                        if key in self._gone_while_adopting:
                            continue
                        if key in self.core:
                            relisted += self._relisted(key, event, at)
                            continue
                        self._published(event, at, listed_ms=self._started_ms)
                        adopted += 1
                whole = whole and (last is None or not last.next_after)
            self.groups_adopted += adopted
            self.groups_relisted += relisted
            if whole:
                unlisted, missed = await self._forget_missed(began)
                down = await self._drop_unlisted_segments(router)
        finally:
            self._gone_while_adopting = self._down_while_adopting = self._up_while_adopting = None
        self.adoptions += 1
        self._log.info(
            "adopted",
            groups=adopted,
            relisted=relisted,
            unlisted=unlisted,
            missed=missed,
            segments_down=down,
            whole=whole,
            tracked=len(self.core),
        )
        await self._forget_adopted()
        return adopted

    async def _begin_naming(self) -> None:
        """An adoption begins: every tracked group not missed is not named by it yet (`_unnamed`
        gets `_named`, which is empty then). A swap, as a rule; after a listing cut short or
        failed (its unnamed groups left in `_unnamed`), the smaller set is moved into the larger
        first, `ADOPT_FORGET_STEP` a turn of the loop (events meanwhile name groups into
        `_named`, which is moved too: the adoption has not begun). The set emptied is bound
        anew (`_pop_steps`). Returns with no await after the swap: the caller's adoption begins
        there."""
        if len(self._named) < len(self._unnamed):
            await self._pop_steps(self._named, self._unnamed.add)
            self._named = set()  # (empty, no await since `_pop_steps` found it so)
        else:
            await self._pop_steps(self._unnamed, self._named.add)
            self._unnamed, self._named = self._named, set()

    async def _forget_missed(self, began_ms: int) -> tuple[int, int]:
        """After a whole listing that began at `began_ms` (`_missed_clock_ms`, as the times in
        `_missed`): the groups missed before (`_missed`) that neither it nor an event since
        named are judged (`_doomed`, `_missed_twice_gone`):
        gone if first missed `MISSED_FORGET_MS` before `began_ms`, else missed still, with
        their first miss (victims under way and groups being dropped with their segment are
        missed still too); those only this listing missed (`_unnamed`) are missed since
        `began_ms`. All by popping, `ADOPT_FORGET_STEP` a turn of the loop, events applied in
        between (an event that names a group takes it out of these); each container emptied
        is bound anew. Returns (groups gone, groups missed now)."""
        gone = await self._forget_doomed(began_ms)  # the rest of a pass cut short (cancelled)
        self._doomed, self._missed = self._missed, {}
        self._missed_oldest_ms = began_ms  # (lowered by those judged missed still)
        gone += await self._forget_doomed(began_ms)

        def missed_now(key: bytes) -> None:
            self._missed[key] = began_ms  # (one int object for all of them)

        await self._pop_steps(self._unnamed, missed_now)
        self._unnamed = set()  # (empty, no await since `_pop_steps` found it so)
        self.groups_unlisted += gone
        return gone, len(self._missed)

    async def _forget_doomed(self, began_ms: int) -> int:
        """`_doomed` emptied, `ADOPT_FORGET_STEP` a turn of the loop, each judged against the
        whole listing that began at `began_ms` (`_missed_twice_gone`), then bound anew (a dict
        emptied by pops keeps its table): how many went."""
        gone = 0
        while self._doomed:
            now = self._driver.now_ms()
            for _ in range(min(ADOPT_FORGET_STEP, len(self._doomed))):
                key, first_ms = self._doomed.popitem()
                gone += self._missed_twice_gone(key, first_ms, began_ms, now)
            await asyncio.sleep(0)
        self._doomed = {}  # (empty, no await since the check above)
        return gone

    @staticmethod
    async def _pop_steps(source: set[bytes], into: Callable[[bytes], None]) -> None:
        """Every key of `source` popped into `into`, `ADOPT_FORGET_STEP` a turn of the loop, until
        it is empty (keys events add meanwhile too; those they take out are not popped).
        Returns with `source` empty and no await since it found it so: the caller binds its
        attribute to a fresh set at once (a set emptied by pops keeps its table: an emptied
        `_unnamed` held 134 MB at 3,000,000 groups; review, 2026-12-07)."""
        while source:
            for _ in range(min(ADOPT_FORGET_STEP, len(source))):
                into(source.pop())
            await asyncio.sleep(0)

    async def _drop_unlisted_segments(self, router: DirectoryRouter) -> int:
        """The segments the directory's segment listing (taken now, after the groups') does not
        have up, whose pools the policy still has: dropped if they hold nothing here
        (`_dead_segment_dropped`). Returns how many. A segment listing that fails drops none
        (logged): the groups are reconciled already, and such a pool holds no bytes, only its
        capacity (the next adoption looks again); the groups' listing is not redone for it."""
        try:
            reply = await router.segments(self.request_timeout_s)
        except KvfError as exc:
            self._log.info("adoption_segments_failed", code=exc.code)
            return 0
        listed = {s.segment_id: s for s in reply.segments}
        known = {p.removesuffix(SSD_POOL_SUFFIX) for p in (*self._capacity, *self._disk_pools)}
        at = self._driver.now_ms()
        dropped = 0
        for segment_id in sorted(known):
            info = listed.get(segment_id)
            if info is not None and info.up:
                continue
            incarnation = info.incarnation if info is not None else self._up_incarnation.get(segment_id, 0)
            dropped += self._dead_segment_dropped(segment_id, incarnation, at, listed=info is not None)
        self.segments_unlisted += dropped
        return dropped

    async def _forget_adopted(self) -> None:
        """Once the follower has applied the stream up to its end as of now, no `published` event
        of an adopted group can come any more: the set of them is emptied. (Early, when the
        stream cannot be asked or the follower is stuck (`_reach`): an adopted group published
        meanwhile then keeps its listed rank, the safe side: it goes early, never stays for
        good.)"""
        if self._nc is None:  # (a test's shell, not started)
            return
        js = self._nc.jetstream(timeout=self.request_timeout_s)
        with contextlib.suppress(nats.errors.Error, nats.js.errors.Error, TimeoutError):
            await self._reach((await js.stream_info(EVENTS_STREAM)).state.last_seq)
        self._adopted.clear()

    @staticmethod
    def _group_id_of(event: m.GroupPublished) -> GroupId:
        return group_id_of(event.namespace, event.chunk_index, event.group)

    # ---- segments ----------------------------------------------------------------------------

    async def _refresh_segments(self) -> None:
        """Every `segments_refresh_ms` (`every`): each up segment's capacity."""
        reply = await self._dir().segments(self.request_timeout_s)
        for seg in reply.segments:
            if seg.up:
                self._set_capacity(seg.segment_id, seg.capacity_bytes)

    def _refresh_failed(self, exc: KvfError) -> None:
        self._log.info("segments_refresh_failed", code=exc.code)

    # ---- eviction ----------------------------------------------------------------------------

    async def _ticker(self) -> None:
        await self.caught_up.wait()  # never judge pressure on a half-replayed history
        ticker = self._driver.start_ticker(Tick(), self.tick_ms)
        if self._runtime is not None:
            self._runtime.watch(ticker, "eviction_ticker")

    async def _perform(self, effect: EvictionOutput) -> None:
        """One effect of the core's `Tick`, in order (the driver performs them)."""
        if isinstance(effect, EvictBatch):
            await self._evict(effect)

    async def _evict(self, batch: EvictBatch) -> None:
        chains = [v for v in batch.victims if isinstance(v, bytes)]
        pool = batch.pool
        at, pool_name = self._driver.now_ms(), "" if pool is None else str(pool)
        for victim, why in zip(batch.victims, batch.victim_reasons or [""] * len(batch.victims), strict=True):
            if isinstance(victim, bytes):
                self._decisions.record(victim, at, "chosen", why, pool_name, batch.reason)
        # A head chosen because its tail was chosen too, in another pool's batch of this tick,
        # whose tail was refused meanwhile (leased): no leaf any more, it stays (review,
        # 2026-12-05: it was evicted, its tail left where no lookup reaches it).
        staying = {c for c in chains if self.core.keeps_children(c)}
        for chain in staying:
            self._decisions.record(chain, at, "kept", "its_tail_stays", pool_name, batch.reason)
            self._stays(chain, at)
        if staying:  # (counted as refusals: `evict_refused_total`)
            chains = [c for c in chains if c not in staying]
            if not chains:
                return
        if (
            self.demote
            and batch.reason == "watermark"
            and isinstance(pool, str)
            and not is_ssd_pool(pool)
            and pool not in self._no_disk
            and self._demote_paused_until.get(pool, 0) <= at
        ):
            chosen = [
                c for c in chains if demote_or_drop(self._hits.get(c, 0), self.demote_min_hits) == "demote"
            ]
            room_until_ms = self._room_until_ms(pool)
            judged = room_until_ms is not None and pool in self._demote_bytes_per_ms  # (`_split_for_room`)
            chosen, first = self._split_for_room(pool, chosen, room_until_ms)
            if first:  # a writer needs their room before the disk could take them: dropped now
                self._dropped_for_room(pool, first, set())
                dropped = set(first)
                await self._drop(batch, [c for c in chains if c in dropped], at, pool_name)
                chains = [c for c in chains if c not in dropped]
                room_until_ms = self._room_until_ms(pool)  # their room is free now
            handled = await self._demote_groups(pool, chosen, room_until_ms, judged)
            chains = [c for c in chains if c not in handled]  # dropped: not chosen, or the disk is full
            if not chains:
                return
        await self._drop(batch, chains, at, pool_name)

    def _split_for_room(
        self, pool: str, chosen: list[bytes], room_until_ms: int | None
    ) -> tuple[list[bytes], list[bytes]]:
        """(to demote, to drop first): with a writer filling the arena (`_room_until_ms`) and the
        disk's speed known from the demote requests before, only the victims the disk takes in
        half the time left (at least the first), heads first; the rest (their tails, never an
        ancestor of one demoted) are dropped before the demotion starts, so the writer gets
        their room at once."""
        speed = self._demote_bytes_per_ms.get(pool, 0.0)
        if room_until_ms is None or not speed:
            return chosen, []  # no writer, or no speed known yet: `_demote_groups` cuts if need be
        ordered = heads_first(chosen, self._parent)
        left_ms = max(0, room_until_ms - self._driver.now_ms())
        budget = left_ms * speed / 2
        taken, keep = 0, 0
        for chain in ordered:
            nbytes = self._held[chain][2].get(pool, 0) if chain in self._held else 0
            if keep and taken + nbytes > budget:  # the first always goes: the speed stays known
                break
            taken += nbytes
            keep += 1
        return ordered[:keep], ordered[keep:]

    async def _drop(self, batch: EvictBatch, chains: list[bytes], at: int, pool_name: str) -> None:
        """Evict these victims of `batch` (in its order: tails before heads) from every tier."""
        pool = batch.pool
        # A disk pool's victim the records know in an arena too (a head copied to disk) loses
        # only its disk replicas (`evict` tier "ssd"); the rest, and the disk tails a dropped
        # head takes with it, are evicted whole.
        keep_arena = (
            {c for c in chains if c in self._held and any(not is_ssd_pool(p) for p in self._held[c][2])}
            if is_ssd_pool(pool)
            else set()
        )
        chains = self._with_disk_tails(chains)
        victims = set(batch.victims)
        for tail in chains:  # the disk tails a dropped head takes with it
            if tail not in victims:
                self._decisions.record(tail, at, "chosen", "tail_of_victim", pool_name, batch.reason)
        # One whose ancestor goes whole (a victim, or a disk tail of one) goes whole too: in the
        # arena without it, no lookup would reach it. (Even when that ancestor then stays,
        # leased: the tail is asked first, so it goes then.)
        if keep_arena:
            whole = set(chains) - keep_arena
            keep_arena -= with_ancestor_in(list(keep_arena), self._parent, whole)
        statuses: dict[str, int] = {}
        try:
            by_shard = await self._by_shard(chains, keep_arena)
        except KvfError as exc:  # no shard map: nothing was asked, the whole batch cools down
            self.evict_requests_failed += 1
            self._log.info("evict_failed", code=exc.code, victims=len(chains))
            self._refused(chains, "no_answer")
            return
        # A group that stays (leased, pinned, no answer) keeps its ancestors: a later run does
        # not ask them (cooled down instead), so such a tail does not outlive its head (on disk:
        # a power cycle would leave it unfindable). Within a run the directory does the same
        # (`Evict.tails`, `tail_stays`).
        stays_above: set[bytes] = set()
        for shard, tier, shard_chains in by_shard:
            held_back = [c for c in shard_chains if c in stays_above]
            if held_back:
                statuses["waits_for_tail"] = statuses.get("waits_for_tail", 0) + len(held_back)
                self._refused(held_back, "waits_for_tail")
            ask = [c for c in shard_chains if c not in stays_above]
            if not ask:
                continue
            for chain in await self._evict_shard(shard, ask, batch.reason, statuses, tier):
                for ancestor in self._ancestors(chain):
                    if ancestor in stays_above:
                        break
                    stays_above.add(ancestor)
        self._log.info("evicted", reason=batch.reason, pool=str(batch.pool), **statuses)

    def _ancestors(self, chain: bytes) -> Iterator[bytes]:
        """`chain`'s parent, its parent's, ... as the records know them, nearest first (each
        once: a cycle of chain hashes cannot be made, but a walk never trusts that)."""
        seen = {chain}
        ancestor = self._parent.get(chain)
        while ancestor is not None and ancestor not in seen:
            yield ancestor
            seen.add(ancestor)
            ancestor = self._parent.get(ancestor)

    async def _by_shard(
        self, chains: list[bytes], keep_arena: Collection[bytes] = ()
    ) -> list[tuple[int, m.EvictTier, list[bytes]]]:
        """The victims (group keys) as runs of one shard and one `evict` tier each ("ssd" for
        those in `keep_arena`, else "all"), at most `EVICT_BATCH_GROUPS_MAX` a run, by level
        (`_levels`): a tail in another run is asked before its head, in an earlier level, and
        one refused there keeps its head in the later one (`_evict`); a tail in the head's own
        run comes before it in the run, which names it (`Evict.tails`). One run per shard and
        tier a level: runs of consecutive victims of one shard were one request
        per victim, ~960 for 1,024 unrelated leaves over 16 shards, one after another (a shard
        that timed out held the batch 73 x its timeout; review, stop 68)."""
        router = self._dir()
        await router.known_shards()
        victims = [c for c in chains if c in self._group_ids]  # (forgotten meanwhile: gone)
        where: dict[bytes, tuple[int, m.EvictTier]] = {
            c: (router.shard_of(self._group_ids[c]), "ssd" if c in keep_arena else "all") for c in victims
        }
        levels = self._levels(victims, where)
        runs: dict[tuple[int, int, m.EvictTier], list[list[bytes]]] = {}
        for chain in victims:  # (in the batch's order: a run's tails before their heads)
            shard, tier = where[chain]
            key = (levels[chain], shard, tier)
            parts = runs.setdefault(key, [[]])
            if len(parts[-1]) >= m.EVICT_BATCH_GROUPS_MAX:  # (a disk batch's tails, added without
                parts.append([])  # bound, made one the directory refused whole; review 2026-12-05)
            parts[-1].append(chain)
        return [
            (shard, tier, part)
            for (_, shard, tier), parts in sorted(runs.items(), key=lambda item: item[0][0])
            for part in parts
        ]

    def _levels(
        self, victims: list[bytes], where: Mapping[bytes, tuple[int, m.EvictTier]]
    ) -> dict[bytes, int]:
        """Each victim's level: 0 with no descendant among `victims`, else the highest of its
        nearest ones' levels, plus 1 for one in another run (`where`: shard and tier). Kahn's
        order over the victims' own tree: O(victims + the records walked to each one's nearest
        victim ancestor, each walked once)."""
        among = set(victims)
        nearest: dict[bytes, bytes | None] = {}  # record -> its nearest ancestor among victims

        def up(chain: bytes) -> bytes | None:
            walked: dict[bytes, None] = {}  # (a cycle of chain hashes cannot be made: not trusted)
            ancestor = self._parent.get(chain)
            found: bytes | None = None
            while ancestor is not None and ancestor not in walked and ancestor != chain:
                if ancestor in among:
                    found = ancestor
                    break
                if ancestor in nearest:
                    found = nearest[ancestor]
                    break
                walked[ancestor] = None
                ancestor = self._parent.get(ancestor)
            for record in walked:
                nearest[record] = found
            return found

        above = {v: up(v) for v in victims}
        below = dict.fromkeys(victims, 0)  # victims with this one as their nearest
        for parent in above.values():
            if parent is not None:
                below[parent] += 1
        levels = dict.fromkeys(victims, 0)
        ready = [v for v in victims if below[v] == 0]
        while ready:
            victim = ready.pop()
            parent = above[victim]
            if parent is not None:
                hop = 0 if where[parent] == where[victim] else 1
                levels[parent] = max(levels[parent], levels[victim] + hop)
                below[parent] -= 1
                if below[parent] == 0:
                    ready.append(parent)
        return levels

    async def _evict_shard(
        self,
        shard: int,
        chains: list[bytes],
        reason: str,
        statuses: dict[str, int],
        tier: m.EvictTier = "all",
    ) -> list[bytes]:
        """One `evict` request; returns the groups that stay (leased, pinned, or no answer).
        Groups forgotten while earlier requests of the batch were out (an `evicted` event, a lost
        segment's step) are gone: not asked."""
        chains = [c for c in chains if c in self._group_ids]
        if not chains:
            return []
        groups = [self._group_ids[c] for c in chains]
        # each group's tails in this request, so that one that stays keeps its head here too
        position = {c: i for i, c in enumerate(chains)}
        tails: list[list[int]] = [[] for _ in chains]
        for j, chain in enumerate(chains):
            head = position.get(self._parent.get(chain, b""))
            if head is not None and head > j:
                tails[head].append(j)
        request = m.Evict(groups=groups, reason=reason, tier=tier, tails=tails if any(tails) else [])
        try:
            reply = await self._dir().ask(shard, "evict", request, self.request_timeout_s)
        except KvfError as exc:
            self.evict_requests_failed += 1
            self._log.info("evict_failed", code=exc.code, victims=len(chains), shard=shard)
            reply = None
        if not isinstance(reply, m.EvictReply):
            self._refused(chains, "no_answer")
            return chains
        at = self._driver.now_ms()
        stayed = []
        for chain, result in zip(chains, reply.results, strict=True):
            statuses[result.status] = statuses.get(result.status, 0) + 1
            if result.status in m.EVICT_STAYS:
                stayed.append(chain)
            if not self.core.is_evicting(chain):
                continue  # an event overtook the reply (e.g. its segment went down)
            if result.status in m.EVICT_STAYS:
                self._decisions.record(chain, at, "stays", result.status)
                self._stays(chain, at, pinned=result.status == "pinned")
            elif result.status == "disk_dropped":  # in its arena pools only now
                self._disk_dropped(chain, at)
            else:
                self._decisions.record(chain, at, "evicted", result.status, cause=reason)
                self._forget(chain)
        return stayed

    # ---- admission ----------------------------------------------------------------------------

    async def admission_filter(self, at_ms: int) -> bytes:
        """The encoded admission filter of the core now (public for tests). The core is read on
        the loop (limits, domains, a copy of the ghost's recent ids: a few ms); the bloom of up to
        65,536 ids (100-440 ms of hashing on the shared VM) is built on a worker thread, so the
        event follower and the evict ticker keep running meanwhile."""
        capacities = {p: c for p, c in self._capacity.items() if not is_ssd_pool(p)}
        message, recent = filter_parts(self.core, capacities, at_ms, self.last_seq)
        self._admission = await asyncio.to_thread(with_bloom, message, recent)
        data = encode(self._admission)
        self.admission_filter_bytes = len(data)
        return data

    async def _publish_admission(self) -> None:
        await self.caught_up.wait()  # a half-replayed history would refuse on stale pressure
        await every(self.admission_publish_ms / 1000, self._publish_admission_once)

    async def _publish_admission_once(self) -> None:
        nc = self._nc
        assert nc is not None
        subject = endpoint_subject(Service.EVICTION, e.ADMISSION_FILTER_VERB)
        try:
            await nc.publish(subject, await self.admission_filter(self._driver.now_ms()))
            self.admission_published += 1
        except nats.errors.Error as exc:  # the directory's filter goes stale: it admits
            self._log.info("admission_publish_failed", error=type(exc).__name__)

    # ---- demotion ------------------------------------------------------------------------------

    def _room_until_ms(self, pool: str) -> int | None:
        """When `pool`'s arena would be full at its writers' measured inflow (the core's), if
        nothing of it were freed; None without a writer. Demotion copies at the disk's speed
        while the victims' bytes stay in the arena: past this time a writer faster than the disk
        would have its saves refused, so what the disk cannot take in time is dropped instead
        (`_split_for_room`, `_demote_groups`: `dropped_for_room`). None too when
        `demote_cut_for_room` is off."""
        inflow = self.core.inflow(pool)
        capacity = self._capacity.get(pool, 0)
        if (
            inflow < ROOM_WRITER_MIN_BYTES_PER_S
            or not capacity
            or not self.demote_cut_for_room
            or self.core.writing_for_ms(pool, self._driver.now_ms()) < ROOM_WRITER_SUSTAINED_MS
        ):
            return None  # no writer, or a burst the disk catches up with once it ends
        free = max(0, capacity - self.core.used_bytes(pool))
        return self._driver.now_ms() + int(min(free * 1000 / inflow, ROOM_MS_MAX))

    def _arena_in_danger(self, pool: str) -> bool:
        """Is a writer filling `pool`'s arena (the core's inflow), and is it (as the events
        applied so far tell) past halfway from its high watermark to full? A demotion under way
        is then too slow for that writer, however long it has written (`demote_cut_for_room`)."""
        capacity = self._capacity.get(pool, 0)
        if (
            not capacity
            or not self.demote_cut_for_room
            or self.core.inflow(pool) < ROOM_WRITER_MIN_BYTES_PER_S
        ):
            return False  # nobody writes: a full arena waits for its demotions
        return self.core.used_bytes(pool) >= capacity * (1 + self.core.config.high_watermark) / 2

    def _out_of_room(self, room_until_ms: int | None, next_request_bytes: int, pool: str) -> bool:
        """Would a demote request of `next_request_bytes` end past `room_until_ms` (at the speed
        `pool`'s earlier requests had; at once before any)? Or is `pool`'s arena in danger now?"""
        if self._arena_in_danger(pool):
            return True
        if room_until_ms is None:
            return False
        speed = self._demote_bytes_per_ms.get(pool, 0.0)
        takes_ms = next_request_bytes / speed if speed else 0.0
        return self._driver.now_ms() + takes_ms >= room_until_ms

    def _demote_timed(self, segment_id: str, nbytes: int, took_ms: int) -> None:
        """A demote request of `nbytes` to `segment_id` took `took_ms`: the speed `_out_of_room`
        expects of that segment's disk (each request weighs half)."""
        if nbytes <= 0:
            return
        speed = nbytes / max(took_ms, 1)
        known = self._demote_bytes_per_ms.get(segment_id)
        self._demote_bytes_per_ms[segment_id] = speed if not known else (known + speed) / 2

    def _dropped_for_room(self, segment_id: str, chains: list[bytes], handled: set[bytes]) -> None:
        """The victims not dealt with yet are dropped, not demoted: the arena needs their room
        before the disk could take them."""
        rest = [c for c in chains if c not in handled]
        if not rest:
            return
        at = self._driver.now_ms()
        for chain in rest:
            self._decisions.record(chain, at, "not_demoted", "dropped_for_room", ssd_pool(segment_id))
        self.demotions["dropped_for_room"] = self.demotions.get("dropped_for_room", 0) + len(rest)
        self._log.info(
            "demotion_cut",
            segment_id=segment_id,
            dropped=len(rest),
            disk_mb_per_s=round(self._demote_bytes_per_ms.get(segment_id, 0.0) / 1000, 1),
            reason="writer faster than disk",
        )

    async def _demote_groups(
        self, segment_id: str, chains: list[bytes], room_until_ms: int | None = None, judged: bool = False
    ) -> set[bytes]:
        """Demote these victims of `segment_id`'s arena, several groups per demote request (up to
        `DEMOTE_REQUEST_GROUPS_MAX` groups, `DEMOTE_REQUEST_OBJECTS_MAX` objects and
        `DEMOTE_REQUEST_BYTES_MAX` bytes), heads before their tails (`heads_first`); returns the
        ones dealt with (moved to its disk pool, or cooled down). The others are to be dropped:
        a full disk stops demotion for the rest of the batch (and drops the groups it refused),
        a segment without disk tier for good. Each group's outcome is its own objects'
        (`group_outcome`). A victim whose parent, a victim of this batch, went in an earlier
        request and is not on disk after it (failed, an error, or waiting for its own head)
        waits for it (cooled down, `waits_for_head`): in the batch's own order (tails first) a
        tail reached the disk in one request and its head failed in a later one, leaving the
        tail on disk without its head (and a head a full disk refused took its tail, written
        for nothing, with it). A head and its tail in one request are not ordered: the segment
        writes a request's objects in concurrent batches (docs/ssd-tier.md). A request that would
        end past `room_until_ms` (`_room_until_ms`: a writer would find the arena full; at the
        disk speed of the requests before, `_out_of_room`) is not sent: the victims not dealt
        with are dropped (`dropped_for_room`; heads first, so what is dropped is never an
        ancestor of what reached the disk in this batch). `judged`: `_split_for_room` chose
        these to fit already, so the first request goes whatever it weighs (the disk's speed
        stays measured); the later ones are checked."""
        began = self._driver.now_ms()
        handled: set[bytes] = set()
        outcomes: dict[bytes, str] = {}  # victim -> its outcome, once its request has answered
        pending: list[tuple[bytes, list[DemoteObject]]] = []
        objects_n = bytes_n = 0  # what `pending` names
        sent = False
        # The first request before anything is asked (its listings take time too): at most
        # a request's bytes of what the records hold of these victims in this arena.
        held = sum(self._held[c][2].get(segment_id, 0) for c in chains if c in self._held)
        if not judged and self._out_of_room(room_until_ms, min(held, DEMOTE_REQUEST_BYTES_MAX), segment_id):
            self._dropped_for_room(segment_id, chains, handled)
            return handled
        with contextlib.suppress(KvfError):  # else each lookup fails alone: its group cools down
            await self._dir().known_shards()  # the lookups' shards (`shard_of` needs the map)
        if not await self._heads_on_disk(segment_id, chains, handled):
            return handled  # the disk is full: the rest is dropped
        chains = heads_first(chains, self._parent)
        listings = await self._show_many([c for c in chains if c not in handled and self.core.is_evicting(c)])
        for chain in chains:
            if chain in handled:
                continue  # an ancestor could not be copied: cooled down
            if not self.core.is_evicting(chain) or chain not in listings:
                handled.add(chain)  # an event overtook us (removed, segment down)
                continue
            listing = listings[chain]
            if isinstance(listing, NotFound):
                # The directory has no such group (dropped without an event applied here: a gap,
                # a failover's rebuild): forgotten, as an evict answered `not_found` is. Cooled
                # down instead, it was chosen again every 5 s for good, its bytes counted in the
                # arena's pool (review, stop 68).
                outcomes[chain] = "gone"
                self.demotions["gone"] = self.demotions.get("gone", 0) + 1
                handled.add(chain)
                self._decisions.record(chain, self._driver.now_ms(), "evicted", "not_found")
                self._forget(chain)
                continue
            if isinstance(listing, KvfError):
                outcomes[chain] = f"error_{listing.code}"
                self._demote_outcome(chain, outcomes[chain], handled, segment_id)
                continue
            objects, nbytes = _arena_objects(segment_id, listing)
            if not objects:
                # No arena replica there any more. On that segment's disk: an earlier demotion
                # moved it (one whose answer never came). On no disk there: the replica simply
                # went (drained, scrubbed, a cold extra, its segment lost) after it was chosen:
                # not demoted (it was moved to the disk pool, bytes counted on a disk that never
                # had them, and the directory's republish held back meanwhile set aside as older
                # than the move). It stays, and the republish held back meanwhile applies
                # (`_stays`); with none held back, this fresh listing does (`_listed_where`): the
                # republish may have been among lost events, and then nothing fixed the records
                # (chosen again each cooldown, `not_found` each time, its bytes counted here).
                outcome = "demoted" if _on_disk_there(segment_id, listing) else "not_found"
                outcomes[chain] = outcome
                if outcome == "demoted":
                    self._moved(chain, segment_id, self._driver.now_ms())
                    self._demote_outcome(chain, outcome, handled, segment_id)
                    continue
                told = chain in self._held_back
                self._demote_outcome(chain, outcome, handled, segment_id)
                if not told:
                    self._listed_where(chain, [obj for _, obj in listing], self._driver.now_ms())
                continue
            if not demote_request_fits(len(pending), objects_n, bytes_n, len(objects), nbytes):
                if (sent or not judged) and self._out_of_room(room_until_ms, bytes_n, segment_id):
                    self._dropped_for_room(segment_id, chains, handled)
                    return handled
                if not await self._send_demotes(segment_id, pending, handled, outcomes, bytes_n):
                    return handled
                pending, objects_n, bytes_n, sent = [], 0, 0, True
            # its head in an earlier request (answered by now), and not on disk after it
            if outcomes.get(self._parent.get(chain, b""), "demoted") not in DEMOTE_ON_DISK:
                outcomes[chain] = "waits_for_head"
                self._demote_outcome(chain, "waits_for_head", handled, segment_id)
                continue
            pending.append((chain, objects))
            objects_n += len(objects)
            bytes_n += nbytes
        if pending and (sent or not judged) and self._out_of_room(room_until_ms, bytes_n, segment_id):
            self._dropped_for_room(segment_id, chains, handled)
            return handled
        if pending and not await self._send_demotes(segment_id, pending, handled, outcomes, bytes_n):
            return handled
        if handled:
            took_ms = self._driver.now_ms() - began
            self._log.info(
                "demoted", segment_id=segment_id, groups=len(handled), took_ms=took_ms, **self.demotions
            )
        return handled

    async def _show(self, gid: bytes) -> list[tuple[ObjectKey, m.ObjectLocation]]:
        """A group's objects (object key, where its replicas are), from `show_group`."""
        router = self._dir()
        listing = await router.ask(
            router.shard_of(gid), "show_group", m.ShowGroup(group=gid), self.request_timeout_s
        )
        out: list[tuple[ObjectKey, m.ObjectLocation]] = []
        if isinstance(listing, m.GroupList):
            group = ChunkGroupId.from_bytes(gid)
            for summary in listing.groups:
                for obj in summary.objects:
                    key = KVKey(
                        chunk_group=group,
                        tp_rank=obj.member.tp_rank,
                        pp_stage=obj.member.pp_stage,
                        layer_group=obj.member.layer_group,
                    ).object_key()
                    out.append((key, obj))
        return out

    async def _show_many(
        self, chains: list[bytes]
    ) -> dict[bytes, list[tuple[ObjectKey, m.ObjectLocation]] | KvfError]:
        """`_show` of every chain, at most `SHOW_IN_FLIGHT_MAX` at once: per chain its listing,
        or the `KvfError` it got (`NotFound` for a chain the records no longer hold). Each chain's
        group id is read now: the event follower may forget a chain while earlier listings are
        in flight, and the caller re-checks each chain when it uses the listing. Every request
        ends before this returns (any other error is raised once all have)."""
        gate = asyncio.Semaphore(SHOW_IN_FLIGHT_MAX)
        gids = {c: self._group_ids.get(c) for c in chains}

        async def one(chain: bytes) -> list[tuple[ObjectKey, m.ObjectLocation]] | KvfError:
            gid = gids[chain]
            if gid is None:
                return NotFound("the group is no longer held")
            async with gate:
                try:
                    return await self._show(gid)
                except KvfError as exc:
                    return exc

        answers = await asyncio.gather(*(one(c) for c in chains), return_exceptions=True)
        out: dict[bytes, list[tuple[ObjectKey, m.ObjectLocation]] | KvfError] = {}
        for chain, answer in zip(chains, answers, strict=True):
            if isinstance(answer, BaseException) and not isinstance(answer, KvfError):
                raise answer
            out[chain] = answer
        return out

    # ---- whole prefixes on disk ------------------------------------------------------------------

    def _ancestors_off_disk(self, chains: list[bytes]) -> HeadsOffDisk:
        """The victims' ancestors that the records do not know whole on a disk, other than
        victims (of this batch, demoted with it or dropped with their disk tails, or of another
        of this tick), each walked once (`heads_off_disk`: a walk per victim to its root was
        O(victims × prefix depth) on the loop, 1.25 s for 1,024 tails of a 2,048-chunk prefix)."""

        def to_copy(ancestor: bytes) -> bool:
            _, _, pools, group_bytes = self._held[ancestor]
            on_disk = on_disk_whole(pools, group_bytes)  # a partial demotion is no head on disk
            return not on_disk and not self.core.is_evicting(ancestor)

        victims = [c for c in chains if self.core.is_evicting(c)]
        return heads_off_disk(victims, self._parent, self._held.__contains__, to_copy)

    async def _copy_heads(
        self, seg: str, part: list[tuple[bytes, list[DemoteObject]]]
    ) -> tuple[list[str], str]:
        """One request copying `part`'s heads to `seg`'s disk: each one's outcome, and the error
        code when it got no answer ("" otherwise). No answer (a hung disk): as for the victims'
        own requests (`_send_demotes`), demotion there pauses (review, stop 65: each part waited
        its whole timeout, batch after batch, every tail then waiting for its head, so the pause
        the victims' requests set was never reached and no other pool was evicted)."""
        try:
            return await self._demote_request(seg, [objects for _, objects in part], copy_outcome), ""
        except Conflict:  # "this segment has no disk tier"
            self._no_disk.add(seg)
            return ["no_disk"] * len(part), ""
        except (Indeterminate, Unavailable) as exc:
            self._demote_paused_until[seg] = self._driver.now_ms() + DEMOTE_PAUSE_MS
            self._log.warning(
                "demotion_paused", segment_id=seg, code=exc.code, pause_ms=DEMOTE_PAUSE_MS, heads=True
            )
            return [f"error_{exc.code}"] * len(part), exc.code
        except KvfError as exc:
            return [f"error_{exc.code}"] * len(part), ""

    async def _heads_on_disk(self, segment_id: str, chains: list[bytes], handled: set[bytes]) -> bool:
        """Before the victims of `segment_id`'s arena go to its disk: their ancestors not on any
        disk (a tail demoted before its head; a shared hot head never leaves DRAM) are copied
        there with `keep_arena` (the arena replica stays), each on a segment holding its arena
        replica, so the disk tier holds whole prefixes and a power cycle (the arena lost) leaves
        every disk object findable. A victim whose ancestor's copy failed is cooled down (into
        `handled`); one whose ancestor's segment has no disk tier (or a full one), or whose
        ancestor no one segment holds whole in its arena (`spread`), is demoted as before,
        counted `head_not_copied`. False: this segment's disk is full (demotion stops)."""
        heads = self._ancestors_off_disk(chains)
        if not heads.needed:
            return True
        copies: dict[str, list[tuple[bytes, list[DemoteObject]]]] = {}  # segment -> (ancestor, objects)
        sizes: dict[bytes, int] = {}  # ancestor -> its bytes copied
        outcome: dict[bytes, str] = {}  # ancestor -> its copy's outcome
        listings = await self._show_many(heads.needed)
        for ancestor in heads.needed:
            listing = listings[ancestor]
            if isinstance(listing, NotFound):  # the directory has no such head: nothing to copy,
                outcome[ancestor] = "gone"  # its tails demoted as for a head not copied (they
                if ancestor in self._group_ids:  # waited for it for good; review, stop 68)
                    self._forget(ancestor)
                continue
            if isinstance(listing, KvfError):
                outcome[ancestor] = f"error_{listing.code}"
                continue
            if self._learn_disk_copies(ancestor, listing):
                outcome[ancestor] = "on_disk"  # a copy the records missed (a replayed stream)
                continue
            where = self._copy_sources(segment_id, listing)
            if where is None:  # no one segment holds all its arena replicas (members placed apart)
                outcome[ancestor] = "spread"
                continue
            seg, objects = where
            if seg in self._no_disk:
                outcome[ancestor] = "no_disk"
                continue
            copies.setdefault(seg, []).append((ancestor, objects))
            sizes[ancestor] = _disk_bytes_after_copy(seg, listing)
        for seg, groups in copies.items():
            unanswered = ""  # a request there got no answer: its other parts are not sent
            for part in _request_parts(groups, sizes):  # each within the demote request's bounds
                if unanswered:
                    results = [f"error_{unanswered}"] * len(part)
                else:
                    results, unanswered = await self._copy_heads(seg, part)
                for (ancestor, _), result in zip(part, results, strict=True):
                    outcome[ancestor] = result
                    if result == "copied":
                        self._copied(ancestor, seg, sizes[ancestor])
        for ancestor in heads.needed:
            result = outcome[ancestor]
            self.demotions[f"head_{result}"] = self.demotions.get(f"head_{result}", 0) + 1
        for chain, verdict in heads.verdicts(outcome).items():
            # Not copied (that disk cannot hold it, or no one segment can copy it whole: a copy
            # per member's segment is not built): demoted as before. Cooling them down instead
            # left a spread head's tails in DRAM for good (review of 434d328).
            if verdict == "not_copied":
                self.demotions["head_not_copied"] = self.demotions.get("head_not_copied", 0) + 1
            elif verdict == "waits" and chain not in handled and self.core.is_evicting(chain):
                self._demote_outcome(chain, "waits_for_head", handled, segment_id)  # tried again later
        if any(outcome[ancestor] == "no_capacity" for ancestor, _ in copies.get(segment_id, [])):
            self._log.warning("demotion_stopped", segment_id=segment_id, reason="disk tier full")
            return False
        return True

    def _learn_disk_copies(self, chain: bytes, listing: list[tuple[ObjectKey, m.ObjectLocation]]) -> bool:
        """Whether the group has a disk replica of every object; the disk bytes the records
        lack are added (a copy made before this policy replayed the stream)."""
        disk: dict[str, int] = {}
        for _, obj in listing:
            segments = {r.segment_id for r in obj.replicas if tier_of_slot(r.slot) == "ssd"}
            if not segments:
                return False
            for seg in segments:
                disk[seg] = disk.get(seg, 0) + obj.size_bytes
        if not listing:
            return False
        for seg, nbytes in disk.items():
            self._copied(chain, seg, nbytes)
        return True

    @staticmethod
    def _copy_sources(
        segment_id: str, listing: list[tuple[ObjectKey, m.ObjectLocation]]
    ) -> tuple[str, list[DemoteObject]] | None:
        """Where a group's objects on no disk are copied to disk from: one segment holding an
        arena replica of each (`segment_id` first), with those replicas (`keep_arena`); objects
        with a disk replica already (a partial demotion's moved members) are not copied again.
        None: no segment holds them all."""
        todo = [(key, obj) for key, obj in listing if not _on_a_disk(obj)]
        holders: list[str] = []
        for _, obj in todo:
            for r in obj.replicas:
                if tier_of_slot(r.slot) == "dram" and r.segment_id not in holders:
                    holders.append(r.segment_id)
        holders.sort(key=lambda seg: seg != segment_id)
        for seg in holders:
            objects: list[DemoteObject] = []
            for key, obj in todo:
                arena = [r for r in obj.replicas if r.segment_id == seg and tier_of_slot(r.slot) == "dram"]
                if not arena:
                    break
                objects.append(DemoteObject(key, arena[0].slot, arena[0].slot_generation, keep_arena=True))
            else:
                if objects:
                    return seg, objects
        return None

    async def _send_demotes(
        self,
        segment_id: str,
        pending: list[tuple[bytes, list[DemoteObject]]],
        handled: set[bytes],
        outcomes: dict[bytes, str],
        nbytes: int = 0,
    ) -> bool:
        """One demote request for these groups (`nbytes` in all: timed, `_demote_timed`), each
        then dealt with by its own outcome (also into `outcomes`): "demoted" moves it to the disk
        pool, "copied" (a lease kept its arena replicas) or a failure cools it down;
        "no_capacity" leaves it to be dropped. False: demotion stops for this batch."""
        started = self._driver.now_ms()
        try:
            results = await self._demote_request(segment_id, [objects for _, objects in pending])
            self._demote_timed(segment_id, nbytes, self._driver.now_ms() - started)
        except Conflict:  # "this segment has no disk tier"
            self._no_disk.add(segment_id)
            self._log.info("demotion_off", segment_id=segment_id, reason="no disk tier")
            return False
        except (Indeterminate, Unavailable) as exc:
            # No answer (a hung disk, the segment gone quiet): each of its requests waited the
            # whole timeout, one batch after another, while no other pool was evicted (review,
            # 2026-12-05). Demotion there pauses; its victims are dropped meanwhile.
            self._demote_paused_until[segment_id] = self._driver.now_ms() + DEMOTE_PAUSE_MS
            self._log.warning(
                "demotion_paused", segment_id=segment_id, code=exc.code, pause_ms=DEMOTE_PAUSE_MS
            )
            results = [f"error_{exc.code}"] * len(pending)
            for (chain, _), outcome in zip(pending, results, strict=True):
                outcomes[chain] = outcome
                self._demote_outcome(chain, outcome, handled, segment_id)
            return False
        except KvfError as exc:
            results = [f"error_{exc.code}"] * len(pending)
        at = self._driver.now_ms()
        for (chain, _), outcome in zip(pending, results, strict=True):
            outcomes[chain] = outcome
            if outcome == "no_capacity":
                self.demotions[outcome] = self.demotions.get(outcome, 0) + 1
                self._decisions.record(chain, at, "not_demoted", outcome, ssd_pool(segment_id))
                continue  # not handled: dropped
            if outcome == "demoted":
                self._moved(chain, segment_id, at)
            self._demote_outcome(chain, outcome, handled, segment_id)
        if "no_capacity" in results:
            self._log.warning("demotion_stopped", segment_id=segment_id, reason="disk tier full")
            return False
        return True

    def _demote_outcome(self, chain: bytes, outcome: str, handled: set[bytes], segment_id: str) -> None:
        self.demotions[outcome] = self.demotions.get(outcome, 0) + 1
        handled.add(chain)
        what = "demoted" if outcome == "demoted" else "not_demoted"
        self._decisions.record(chain, self._driver.now_ms(), what, outcome, ssd_pool(segment_id))
        if outcome != "demoted" and self.core.is_evicting(chain):
            self._stays(chain, self._driver.now_ms())  # leased (copied) or failed: later again

    async def _demote_request(
        self,
        segment_id: str,
        groups: list[list[DemoteObject]],
        outcome_of: Callable[[Collection[str]], DemoteOutcome] = group_outcome,
    ) -> list[str]:
        """The groups' objects to `demote.<segment_id>` in one request (in parts of
        `DEMOTE_REQUEST_OBJECTS_MAX` only for one group alone larger than that): each group's
        outcome. The disk pool's capacity from the reply."""
        flat = [obj for objects in groups for obj in objects]
        statuses: list[str] = []
        nc = self._nc
        assert nc is not None
        for at in range(0, len(flat), DEMOTE_REQUEST_OBJECTS_MAX):
            part = flat[at : at + DEMOTE_REQUEST_OBJECTS_MAX]
            if "no_capacity" in statuses:  # the disk is full: the rest would not fit either
                statuses += ["no_capacity"] * len(part)
                continue
            reply = await nats_request(
                nc,
                segment_subject(segment_id, "demote"),
                DemoteRequest(objects=part),
                segment_decoder,
                self.demote_timeout_s,
            )
            if not isinstance(reply, DemoteReply) or len(reply.results) != len(part):
                return ["failed"] * len(groups)
            statuses += [r.status for r in reply.results]
            pool = ssd_pool(segment_id)
            capacity = ssd_pool_capacity(
                reply.ssd_capacity_bytes, self.ssd_high_watermark, self.core.config.high_watermark
            )
            if any(r.status == "no_capacity" for r in reply.results):
                capacity = min(
                    capacity, disk_full_capacity(self.core.used_bytes(pool), self.core.config.high_watermark)
                )
            self._set_capacity(pool, capacity)
        outcomes: list[str] = []
        at = 0
        for objects in groups:
            outcomes.append(outcome_of(statuses[at : at + len(objects)]))
            at += len(objects)
        return outcomes

    def _refused(self, chains: list[bytes], why: str) -> None:
        """No answer (`why`: no_answer), or held back above a tail that stays (waits_for_tail):
        indeterminate, so cooled down and retried later (an eviction that did happen arrives as
        an `evicted` event)."""
        at = self._driver.now_ms()
        for chain in chains:
            if self.core.is_evicting(chain):
                self._decisions.record(chain, at, "stays", why)
                self._stays(chain, at)

    def _dir(self) -> DirectoryRouter:
        if self._router is None:
            raise Unavailable("eviction policy not started")
        return self._router

    # ---- explain -----------------------------------------------------------------------------

    async def _explain(self, message: e.EvictionExplainRequest, headers: Mapping[str, str]) -> msgspec.Struct:
        return self.explain(message.group_id)

    def explain(self, group_id: bytes) -> e.EvictionExplain:
        """Why the policy holds, held or dropped the chunk group `group_id` (90 bytes): what
        `kvctl eviction explain` prints (public for tests)."""
        if len(group_id) != GROUP_ID_BYTES:
            raise BadRequest(f"group_id must be {GROUP_ID_BYTES} bytes, got {len(group_id)}")
        key = bytes(group_key_of_id(GroupId(group_id)))
        features = self.core.explain(key) or {}
        return e.EvictionExplain(
            policy=self.core.config.policy,
            tracked=key in self.core,
            features={name: _feature(value) for name, value in features.items() if name != "policy"},
            decisions=self._decisions.of(key),
            decisions_kept=self._decisions.groups_max > 0,
            admission=self._admission_of(GroupId(group_id), key),
        )

    def _admission_of(self, group_id: GroupId, key: bytes) -> e.AdmissionExplain | None:
        """What the last admission filter built says of a group of this id, first named."""
        built = self._admission
        if built is None:
            return None
        cls = length_class(chunk_index_in_id(group_id))
        return e.AdmissionExplain(
            generated_ms=built.generated_ms,
            length_class=cls,
            protected=domain_in_id(group_id) in built.protected_domains,
            seen=bloom_has(built.seen_bloom, built.seen_bloom_hashes, key),
            limits={p.segment_id: p.group_bytes_max[cls] for p in built.pools},
        )

    # ---- status ------------------------------------------------------------------------------

    async def _status(self, message: e.EvictionStatusRequest, headers: Mapping[str, str]) -> msgspec.Struct:
        return self.status()

    def status(self) -> e.EvictionStatus:
        core = self.core
        pools = [
            e.PoolUsage(
                segment_id=str(pool),
                capacity_bytes=capacity,
                used_bytes=core.used_bytes(pool),
                evicting_bytes=core.evicting_bytes(pool),
            )
            for pool, capacity in sorted({**dict.fromkeys(self._disk_pools, 0), **self._capacity}.items())
        ]
        tenants = []
        for tenant in sorted(t for t in core.tenants() if isinstance(t, bytes)):
            quota = core.quotas.get(tenant)
            tenants.append(
                e.TenantUsage(
                    domain_digest=DomainDigest(tenant),  # the core's tenants: share domain digests
                    used_bytes=core.tenant_bytes(tenant),
                    hard_bytes=(quota.hard_bytes or 0) if quota else 0,
                    guaranteed_bytes=quota.guaranteed_bytes if quota else 0,
                )
            )
        return e.EvictionStatus(
            policy=core.config.policy,
            high_watermark=core.config.high_watermark,
            low_watermark=core.config.low_watermark,
            objects=len(core),
            events_applied=self.events_applied,
            pools=pools,
            tenants=tenants,
            counters={
                **core.counters,
                **{f"demote_{k}_total": v for k, v in dict(self.demotions).items()},
                "admission_filters_published_total": self.admission_published,
                "admission_filter_bytes": self.admission_filter_bytes,
                "groups_adopted_total": self.groups_adopted,
                "groups_relisted_total": self.groups_relisted,
                "groups_unlisted_total": self.groups_unlisted,
                "segments_unlisted_total": self.segments_unlisted,
                "adoptions_total": self.adoptions,
                "events_stale_total": self.events_stale,
            },
        )


def _fresh(msg: Msg, now_ms: int) -> bool:
    """Was `msg` stored in the stream at most `INFLOW_EVENT_AGE_MAX_MS` before `now_ms`? (No
    stream metadata: not known fresh.)"""
    try:
        stored_ms = msg.metadata.timestamp.timestamp() * 1000
    except (AttributeError, ValueError, TypeError, nats.errors.Error):
        return False
    return now_ms - stored_ms <= INFLOW_EVENT_AGE_MAX_MS


def _feature(value: object) -> str | int | float | bool:
    """One of the core's `explain` values as the wire carries it (a tenant's digest as hex, a
    class tuple as text)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "inf" (a density class not computed yet): JSON has no infinity
    if isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, bytes):
        return value.hex()
    return str(value)


def _on_a_disk(obj: m.ObjectLocation) -> bool:
    return any(tier_of_slot(r.slot) == "ssd" for r in obj.replicas)


def _on_disk_there(segment_id: str, listing: list[tuple[ObjectKey, m.ObjectLocation]]) -> bool:
    """Does `segment_id`'s disk tier hold a replica of one of the group's objects?"""
    return any(
        r.segment_id == segment_id and tier_of_slot(r.slot) == "ssd"
        for _, obj in listing
        for r in obj.replicas
    )


def _disk_bytes_after_copy(segment_id: str, listing: list[tuple[ObjectKey, m.ObjectLocation]]) -> int:
    """A group's bytes on `segment_id`'s disk once its objects on no disk are copied there: those
    and the ones on that disk already (not those on another segment's disk)."""
    return sum(
        obj.size_bytes
        for _, obj in listing
        if not _on_a_disk(obj)
        or any(r.segment_id == segment_id and tier_of_slot(r.slot) == "ssd" for r in obj.replicas)
    )


def _request_parts(
    groups: list[tuple[bytes, list[DemoteObject]]], sizes: dict[bytes, int]
) -> list[list[tuple[bytes, list[DemoteObject]]]]:
    """Head copies cut into demote requests as the victims' are (`demote_request_fits`: at most
    64 groups, 64 objects, 64 MiB each): one request of every copy could run past the demote
    timeout (256 MiB of 4 MiB objects; review of 434d328)."""
    parts: list[list[tuple[bytes, list[DemoteObject]]]] = []
    part: list[tuple[bytes, list[DemoteObject]]] = []
    objects_n = bytes_n = 0
    for ancestor, objects in groups:
        if not demote_request_fits(len(part), objects_n, bytes_n, len(objects), sizes[ancestor]):
            parts.append(part)
            part, objects_n, bytes_n = [], 0, 0
        part.append((ancestor, objects))
        objects_n += len(objects)
        bytes_n += sizes[ancestor]
    if part:
        parts.append(part)
    return parts


def _arena_objects(
    segment_id: str, listing: list[tuple[ObjectKey, m.ObjectLocation]]
) -> tuple[list[DemoteObject], int]:
    """A victim group's arena replicas on `segment_id` (from its `show_group` listing), and
    their bytes."""
    objects: list[DemoteObject] = []
    nbytes = 0
    for key, obj in listing:
        for r in obj.replicas:
            if r.segment_id == segment_id and tier_of_slot(r.slot) == "dram":
                objects.append(DemoteObject(key, r.slot, r.slot_generation))
                nbytes += obj.size_bytes
    return objects, nbytes
