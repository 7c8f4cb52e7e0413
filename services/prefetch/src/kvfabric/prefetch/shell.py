"""The prefetch shell: hints and reads → `PrefetchCore` → segment-to-segment copies → core.

- `hint` (`PrefetchHint`): resolve the prefix as the client resolves its lookups
  (`kvfabric.cluster.lookups.lookup_prefix`: the shards holding some of its chunks asked
  concurrently, one `lookup_many` per leading instance, through a `DirectoryRouter` created in
  `start`). The hit is the longest prefix every shard found (a failing shard misses from its
  first chunk; the hint fails only when nothing hit); each shard with a chunk inside the hit
  grants a read lease, kept as (shard, lease id), that keeps the sources from being evicted
  while they are copied (released when the hint ends; the others at once, queued the same way,
  never in the hint's reply path: below; renewed before they expire for as long as the hint
  lives, below); then the core's
  `AddHint`; its answer (accepted / deduped / busy / refused) is the reply. At most `resolving_max` hints are
  resolved at once, of them at most a quarter (at least one) of one tenant's: more answer `busy`
  at once (a flood costs no directory traffic, and one tenant's flood took every slot: every other
  tenant's hints were refused; review, stop 68).
- Hint ids are per tenant: a hint, its leases and a cancel are named by (tenant, hint id), the
  tenant as the message names it (`PrefetchHint.tenant`, `CancelHint.tenant`); two tenants'
  `req-1` were one hint, and one cancel ended both (review, 2026-12-06).
- `cancel`: `core.cancel_hint(hint id, tenant)` (a cancel without a tenant, from an older
  sender, ends the one live hint with that id, none when two tenants hold it); its leases are
  released from the next tick. A hint id accepted again before the leases of its earlier hint
  were collected hands those to the releases first (they were overwritten and held until they
  expired).
- The core is stepped through a `CoreDriver` (`kvfabric.runtime.core_driver`) on the wall clock
  (hint deadlines are wall clock), never earlier than a time it already gave the core: every
  event that carries the time (`AddHint`, `Tick`, `CopyFinished`, `Read`, `ColdExtraReplicas`).
- Every `tick_ms`: the core's `Tick` → StartCopy tasks (`copy_replica`: ticket from the directory, the
  target segment reads from the source and confirms) → `copy_finished` → PublishReplica (the
  replica is already published by its confirm) / ReleaseCopy (nothing kept); leases of ended
  hints are released (`lease_release`), and the leases of live hints due are renewed
  (`lease_renew`, for at most `LEASE_TTL_MS_MAX` and never past the hint's deadline), each to the
  shard that granted it by a task of its own, never on the ticker. Each tick starts at most
  `REQUESTS_STARTED_PER_TICK_MAX` renewals; releases are started at a rate whatever `tick_ms`
  is: at most `RELEASES_BURST` (64) at once and `RELEASES_PER_S` (3200: 64 per 20 ms, a tick's
  worth at the default) over time, one token bucket on the monotonic clock for every path that
  starts them (the tick's own, each hint's leases given back between ticks, the rounds between
  ticks, `stop`'s rounds; each call had a budget of its own, up to 64 more per hint whose leases
  went back between two ticks, then one budget of 64 a tick was 64 a second at `tick_ms` 1000,
  320 in `stop`'s 5 s). No more on a shard than
  leave `RENEWALS_AT_ONCE` / `RELEASES_AT_ONCE` of them in flight there: a task is created only
  for a request sent at once (tasks = requests in flight); the rest wait in `HintLeases`:
  renewals for a later tick, earliest expiry first; releases, first queued first, for a round
  between ticks planned as soon as one can start (`_plan_release_round`: the budget refilled a
  batch, `RELEASE_ROUND_BATCH`; a release ended on its shard, one queued there; a retry due),
  not for the next tick (up to 60 s: one shard started 16 of 640 in a 1 s tick). Each release
  has its own deadline (`request_timeout_s` + `RELEASE_DEADLINE_SLACK_S`); a failed one is sent
  again 1 s later, at most 3 sends in all and never past its lease's expiry; at most
  `RELEASES_QUEUED_MAX` queued, more left to expire. The leases no hint keeps (a lookup's
  outside its hit, those of a hint that queued nothing, was busy or refused, or whose dedupe
  found no live hint) go through the same queue (`_give_back_leases`): they were released
  inline, one at a time in the hint's reply path and never retried, one hung shard delaying the
  reply by `request_timeout_s` per lease (review of the change, stop 71). A lease whose hint
  ends while its renewal is in flight, or after a renewal whose answer was lost (a timeout: the
  directory may have granted it), is released with the expiry asked, not its old one, and one
  whose renewals fail until its old expiry is then released, not dropped (it may still be held;
  review of the change).
  A renewal refused before any effect (`RENEW_REFUSALS`: bad_request, unauthorized, busy,
  rate_limited, quota_exceeded) was not granted: retried the same, but its lease keeps its old
  expiry (it was taken as maybe granted, as a timeout is: at worst an extra release).
  When to renew, which leases the directory has dropped
  (`not_found`, or past their expiry: no longer counted as held) and which releases to send or
  retry is decided by the pure `kvfabric.core.prefetch_leases.HintLeases`. A lookup's leases
  last 30 s and were never renewed while a hint lived to its deadline (known defect "leases of
  a hint are not renewed past 30 s"). Releases went in batches of 16 awaited whole (one
  unanswered release held the other 15 and everything queued behind them; a failed one was
  never retried), and thousands of renewals due on one shard were thousands of tasks created in
  one tick, waiting for that shard's 16 slots (review of stop 71).
- Promotion (issue 23): a disk replica (slot id from `SSD_SLOT_BASE`) is no copy in DRAM: the
  core sees it as the source `<segment>#ssd`, never as the segment itself, so a hint whose
  target holds an object only on its disk copies it into the target's arena (the directory's
  `replicate_begin` lists the disk replica as the source; the segment reads it from its own
  disk over TCP). The disk replica stays (it survives a restart); the arena copy is an ordinary
  replica from then on. Hot objects are seen the same way: one read from a disk replica only is
  served from `<segment>#ssd`, so the core may place its hot extra replica in that segment's own
  arena; a cold extra is dropped by its arena replica, never the segment's disk one.
- Hot objects: lookup hits reach the service as the directory's `accessed` events (live NATS
  subscription, no replay); for the hottest groups of each event (`hot_groups_per_event_max`)
  a `show_group` (to the shard of the group) gives the members and their replicas, fed to
  `core.read` (one call per object and event, its hits as `reads`). A group shown is remembered
  for `group_cache_ms` (at most `GROUP_CACHE_MAX` groups, the oldest forgotten; forgotten at
  once when this service adds or drops one of its replicas): a prefix read again and again costs
  one `show_group` per group and `group_cache_ms`, not one per event (issue 20: that was up to
  half again the directory's work per lookup).
- Every `scan_ms` `list_segments` of every shard, merged, gives free bytes, and extra replicas
  gone cold are dropped through the directory (`replica_corrupt` to the shard of the key, reason
  `cold_extra`, refused for a last live replica, or when the object would go below its
  replica target: it then stays, an ordinary replica, forgotten here).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Mapping
from typing import Final

import msgspec
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from kvfabric.cluster.directory_router import DirectoryRouter
from kvfabric.cluster.lookups import lookup_prefix
from kvfabric.cluster.replicas import DISK_SOURCE_SUFFIX, copy_replica
from kvfabric.core.prefetch import (
    Accepted,
    Busy,
    Deduped,
    Hint,
    HintObject,
    PrefetchCore,
    Refused,
    ReleaseCopy,
    StartCopy,
)
from kvfabric.core.prefetch_events import (
    AddHint,
    ColdExtraReplicas,
    CopyFinished,
    PrefetchEvent,
    PrefetchOutput,
    Read,
    Tick,
)
from kvfabric.core.prefetch_leases import HintLeases, LeaseKeeping, ReleaseLease, RenewLease
from kvfabric.core.quotas import TokenBucket
from kvfabric.core.step import reply_of
from kvfabric.format.clock import monotonic_ms, now_ms
from kvfabric.format.errors import (
    BadRequest,
    KvfError,
    NotFound,
    QuotaExceeded,
    RateLimited,
    Unauthorized,
    Unavailable,
)
from kvfabric.format.errors import Busy as BusyError
from kvfabric.format.ids import (
    CHAIN_SLICE,
    ChainHash,
    DomainDigest,
    GroupId,
    ObjectKey,
    chunk_index_in_id,
    domain_in_id,
    group_id_in_key,
    pack_group_id,
    pack_group_key,
    pack_object_key,
)
from kvfabric.format.invariant import invariant
from kvfabric.proto import directory as m
from kvfabric.proto import prefetch as p
from kvfabric.proto.segment import tier_of_slot
from kvfabric.proto.subjects import Service, check_segment_id, event_subject
from kvfabric.runtime.core_driver import CoreDriver
from kvfabric.runtime.deadline import stop_tasks
from kvfabric.runtime.logs import get_logger
from kvfabric.runtime.service import ServiceRuntime
from kvfabric.runtime.ticker import every

__all__ = ["PrefetchShell", "now_ms"]

LEASE_TTL_MS_MAX: Final = 30_000
READS_PER_HIT_MAX: Final = 16
GROUP_CACHE_MAX: Final = 4096  # groups whose shown members and holders are remembered
GROUP_CACHE_MS_DEFAULT: Final = 10_000  # how long a shown group is trusted (the default hot window)
ACCESS_PERIOD_MS_DEFAULT: Final = 100  # the directory's tick: how often it flushes `accessed` events

# a group's readable objects as shown: (object id, size in bytes, holders: the one read first)
_GroupObjects = tuple[tuple[bytes, int, tuple[str, ...]], ...]
WRITER_ID: Final = "prefetch"


def copy_writer_id(target: str) -> str:
    """The writer a copy onto `target` names. The directory aborts a writer's tickets by key, and
    the core runs at most one copy per (object, target) but may run copies of one object to two
    targets at once (two engine hosts' hints): with one writer for all, the failed one's abort took
    the other's ticket too, and that copy failed (review, 2026-12-06). ≤ 9 + 64 characters."""
    return f"{WRITER_ID}-{target}"


# Ended hints' leases are given back off the ticker, each by its own task, at most this many
# requests in flight per shard; at `stop` for at most `RELEASE_STOP_S` (a release given up
# expires on its own: TTL <= the hint's deadline). Live hints' leases are renewed off the ticker
# too, at most `RENEWALS_AT_ONCE` in flight per shard. Each tick starts at most
# `REQUESTS_STARTED_PER_TICK_MAX` renewals (`_renew_due`). Releases are started at a rate, not
# per tick: one token bucket (`_release_budget`) of `RELEASES_BURST` refilled at `RELEASES_PER_S`
# on the monotonic clock, whatever `tick_ms` is (1..60000), drawn by every path that starts
# them (`_start_releases`: the tick's own, each hint's leases given back between ticks, the
# rounds of `_pump_releases`, planned when one can start something (`_plan_release_round`), and
# of `stop`, `RELEASE_ROUND_S` apart at most). A budget of 64 a tick was 64 releases a second in
# all at `tick_ms` 1000 (a flow of give-backs filled the 4096 queue in a minute, then was
# dropped) and 320 at most in `stop`'s 5 s (review of the change).
RELEASES_AT_ONCE: Final = 16
RENEWALS_AT_ONCE: Final = 16
REQUESTS_STARTED_PER_TICK_MAX: Final = 64
RELEASES_BURST: Final = REQUESTS_STARTED_PER_TICK_MAX  # started at once at most (a full bucket)
RELEASE_ROUND_S: Final = 0.02  # a burst's refill: 64 per 20 ms, one tick's worth at the default
RELEASES_PER_S: Final = round(RELEASES_BURST / RELEASE_ROUND_S)  # 3200
# a round between ticks the budget holds back waits until it holds this many (or as many as
# wait): one round per token (every 0.31 ms) walked every shard each (review of the change)
RELEASE_ROUND_BATCH: Final = RELEASES_AT_ONCE
RELEASES_QUEUED_MAX: Final = 4096  # more ended leases than this waiting: left to expire (counted)
RELEASE_ATTEMPTS_MAX: Final = 3
RELEASE_DEADLINE_SLACK_S: Final = 0.5  # a release's deadline: the request's timeout and this
# One tenant's hints resolved at once: at most resolving_max // this (at least one)
RESOLVING_TENANT_SHARE_DIVISOR: Final = 4
RELEASE_STOP_S: Final = 5.0
# Errors the directory answers to a `lease_renew` before it has any effect (the request is
# malformed or not allowed, or refused for load before its handler ran): the renewal was not
# granted, the lease keeps its expiry. Every other failure (`indeterminate`: a timeout or a
# connection lost after it was sent; `unavailable`; `stale_generation`, which the router raises
# on a reply an older leader sent, perhaps after applying it; `internal`; an unknown code) may
# have been granted. `not_found` (no such lease) is handled on its own: the lease is lost.
RENEW_REFUSALS: Final = (BadRequest, Unauthorized, BusyError, RateLimited, QuotaExceeded)
# `accessed` events waiting for the callback (it asks the directory about groups it does not
# know: slow when the directory is): past these, nats-py drops them (a slow-consumer warning).
# Its defaults (524,288 messages, 128 MiB) let hot-replica decisions run on reads minutes old
# (review, 2026-12-06); a dropped event is a read not counted, decided again on the next.
ACCESSED_PENDING_MSGS_MAX: Final = 256
ACCESSED_PENDING_BYTES_MAX: Final = 16 << 20
SSD_SOURCE_SUFFIX: Final = DISK_SOURCE_SUFFIX  # a disk replica as a copy source (`copy_replica`)


class PrefetchShell:
    _runtime: ServiceRuntime | None = None  # set by attach

    def __init__(
        self,
        core: PrefetchCore,
        *,
        holder_id: str,
        tick_ms: int,
        scan_ms: int,
        resolving_max: int,
        hot_groups_per_event_max: int,
        request_timeout_s: float,
        copy_timeout_s: float,
        group_cache_ms: int = GROUP_CACHE_MS_DEFAULT,
        access_period_ms: int = ACCESS_PERIOD_MS_DEFAULT,
    ) -> None:
        self.core = core
        # wall-clock ms (read through this module's `now_ms`), never earlier than a time the core had
        self._driver: CoreDriver[PrefetchEvent, PrefetchOutput] = CoreDriver(
            core, self._perform, clock=lambda: now_ms()
        )
        self.holder_id = holder_id
        self.tick_ms = tick_ms
        self.scan_ms = scan_ms
        self.resolving_max = resolving_max
        self.hot_groups_per_event_max = hot_groups_per_event_max
        self.request_timeout_s = request_timeout_s
        self.copy_timeout_s = copy_timeout_s
        self.group_cache_ms = group_cache_ms
        # what an `accessed` event's hits are counted over: the directory's tick (its flush)
        self.access_period_ms = access_period_ms
        self._resolving = 0
        self._resolving_by: Counter[str] = Counter()  # hints being resolved, per tenant
        # (tenant, hint id) of hints being resolved -> cancelled meanwhile: a cancel that came
        # during the lookup found no live hint and was lost, the hint then holding its share,
        # copy slots and leases to its deadline (review, stop 70)
        self._resolving_names: dict[tuple[str, str], bool] = {}
        # The read leases protecting hints' sources, and when each is renewed (pure); `_leases` is
        # its (tenant, hint id) -> [(shard, lease id)], one per shard, as granted
        self._keeper = HintLeases(
            LeaseKeeping(
                lease_ttl_ms=LEASE_TTL_MS_MAX,
                release_attempts_max=RELEASE_ATTEMPTS_MAX,
                release_queue_max=RELEASES_QUEUED_MAX,
            )
        )
        self._leases: dict[tuple[str, str], list[tuple[int, int]]] = self._keeper.held
        # (domain digest, chain hash) -> (monotonic ms shown, its objects): hot reads without a
        # show_group per `accessed` event (at most GROUP_CACHE_MAX, insertion order = oldest first)
        self._groups: dict[tuple[bytes, bytes], tuple[int, _GroupObjects]] = {}
        self.groups_shown = 0  # show_group requests answered for `accessed` events
        self.groups_known = 0  # group reads served from `_groups`, no request
        self._router: DirectoryRouter | None = None
        self._lookup_many_refused: set[str] = set()  # instances without `lookup_many` (older directories)
        self._tasks: list[asyncio.Task[None]] = []
        self._copies: set[asyncio.Task[None]] = set()
        # Ended hints' leases being given back and live hints' being renewed: a task each, each
        # request sent as its task starts (none waits for a slot), counted per shard
        self._releases: set[asyncio.Task[None]] = set()
        self._releasing_on: Counter[int] = Counter()
        # releases any path may still start (`_start_releases`): `RELEASES_BURST` at most,
        # refilled at `RELEASES_PER_S` on the monotonic clock (this module's `monotonic_ms`);
        # the one round due next between ticks, when one can start a release (`_pump_releases`,
        # planned by `_plan_release_round`)
        self._release_budget = TokenBucket.full(RELEASES_PER_S, RELEASES_BURST, monotonic_ms() / 1000)
        self._release_pump: asyncio.TimerHandle | None = None
        self._stopping = False  # `stop` gives the leases back in rounds of its own: no pump
        self._renewals: set[asyncio.Task[None]] = set()
        self._renewing_on: Counter[int] = Counter()
        self._log = get_logger("kvfabric.prefetch")
        self.busy_resolving = 0
        self.busy_tenant_resolving = 0  # refused: the tenant's share of the resolving slots in use
        self.busy_before_lookup = 0  # refused: the core's queues (or the tenant's) full

    def attach(self, runtime: ServiceRuntime) -> None:
        self._runtime = runtime
        # Each decoded and checked by the runtime (`ServiceRuntime` typed endpoints).
        runtime.add_endpoint("hint", self._on_hint, request=p.PrefetchHint, decoder=p.prefetch_decoder)
        runtime.add_endpoint("cancel", self._on_cancel, request=p.CancelHint, decoder=p.prefetch_decoder)
        runtime.add_endpoint(
            "status", self._on_status, request=p.PrefetchStatusRequest, decoder=p.prefetch_decoder
        )

    async def start(self, nc: NatsClient) -> None:
        self._router = DirectoryRouter(nc)
        await nc.subscribe(
            event_subject(Service.DIRECTORY, "accessed"),
            cb=self._on_accessed,
            pending_msgs_limit=ACCESSED_PENDING_MSGS_MAX,
            pending_bytes_limit=ACCESSED_PENDING_BYTES_MAX,
        )
        ticker = self._driver.start_ticker(Tick(), self.tick_ms, then=self._release_ended)
        self._tasks = [
            asyncio.create_task(
                every(self.scan_ms / 1000, self.scan, self._scan_failed), name="prefetch-scan"
            )
        ]
        # A scan loop or ticker that dies of an exception (a bug) stops the service, which is
        # restarted (they died silently; review, 2026-12-05).
        if self._runtime is not None:
            self._runtime.watch(self._tasks[0], "prefetch_scan")
            self._runtime.watch(ticker, "prefetch_ticker")

    async def stop(self) -> None:
        await self._driver.stop()
        renewing = list(self._renewals)
        await stop_tasks([*self._tasks, *self._copies, *renewing], self._log)
        # Every lease given back, as the ticker would (bounded per shard and round, retried), for
        # at most RELEASE_STOP_S: the rest expire on their own.
        self._stopping = True
        if self._release_pump is not None:
            self._release_pump.cancel()
            self._release_pump = None
        self._keeper.give_back_all(self._now())
        loop = asyncio.get_running_loop()
        until = loop.time() + RELEASE_STOP_S
        # The ticker stopped: rounds at most `RELEASE_ROUND_S` apart, never `tick_ms` (up to 60
        # s), each drawing on the one rate (`_release_budget`): all of `RELEASES_QUEUED_MAX` in
        # ~1.3 s. Rounds of `tick_ms`, 64 each, gave back 320 at most in 5 s at `tick_ms` 1000.
        round_s = min(self.tick_ms / 1000, RELEASE_ROUND_S)
        while self._keeper.releases_pending and (left := until - loop.time()) > 0:
            self._start_releases()
            # (a retry may come due meanwhile; a release answered frees its shard's room)
            wait_s = min(left, round_s)
            if self._releases:
                await asyncio.wait(set(self._releases), timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
            else:  # only retries waiting
                await asyncio.sleep(wait_s)
        await stop_tasks(list(self._releases), self._log)

    # ---- hints -------------------------------------------------------------------------------

    async def _on_hint(self, hint: p.PrefetchHint, headers: Mapping[str, str]) -> msgspec.Struct:
        if not hint.groups or len(hint.groups) > p.HINT_GROUPS_MAX:
            raise BadRequest(f"a hint names 1..{p.HINT_GROUPS_MAX} chunk groups")
        try:
            check_segment_id(hint.target_segment)
        except ValueError as exc:  # a caller's mistake: bad_request, not an internal error
            raise BadRequest(str(exc)) from None
        named = (hint.tenant, hint.hint_id)
        if self.core.has_hint(hint.hint_id, hint.tenant) or named in self._resolving_names:
            # (the same hint sent again while it is being resolved: no second lookup)
            return p.HintReply(hint_id=hint.hint_id, status="deduped", reason="same hint id")
        if (full := self.core.busy_for(hint.tenant)) is not None:  # before any lookup or lease
            self.busy_before_lookup += 1
            return p.HintReply(hint_id=hint.hint_id, status="busy", reason=full)
        if self._resolving >= self.resolving_max:
            self.busy_resolving += 1
            return p.HintReply(hint_id=hint.hint_id, status="busy", reason="resolving_full")
        if self._resolving_by[hint.tenant] >= max(1, self.resolving_max // RESOLVING_TENANT_SHARE_DIVISOR):
            self.busy_tenant_resolving += 1  # (back off this tenant, not the service)
            return p.HintReply(hint_id=hint.hint_id, status="busy", reason="tenant_resolving_full")
        self._resolving += 1
        self._resolving_by[hint.tenant] += 1
        self._resolving_names[named] = False
        try:
            reply = await self._add(hint)
            if self._resolving_names[named] and self.core.has_hint(hint.hint_id, hint.tenant):
                self.core.cancel_hint(hint.hint_id, hint.tenant)  # cancelled while resolved
            return reply
        finally:
            del self._resolving_names[named]
            self._resolving -= 1
            self._resolving_by[hint.tenant] -= 1
            if not self._resolving_by[hint.tenant]:
                del self._resolving_by[hint.tenant]  # (no entry per tenant ever seen)

    def _now(self) -> int:
        """Wall-clock ms for the core's queries, never earlier than a time already given to it
        (the driver's clock: read right before each step, never across an await)."""
        return self._driver.now_ms()

    async def _add(self, hint: p.PrefetchHint) -> p.HintReply:
        now = now_ms()
        ttl = min(LEASE_TTL_MS_MAX, hint.deadline_ms - now)
        if ttl <= 0:
            return p.HintReply(hint_id=hint.hint_id, status="refused", reason="deadline_passed")
        hit_chunks, found, leases, expires_ms = await self._lookup(hint, ttl)
        # Two bounds of the leases' expiry. Renewals go by the early one, `held_until`: the TTL
        # from before the lookup was sent (no shard granted it earlier), or the directory's if it
        # says earlier (its cap). Releases go by the late one, `may_last`: the TTL from when the
        # answer came (a shard may have granted it as late as that; the directory's, if later:
        # the earliest of its shards', its clock ahead). Releases by the early one were given up
        # while the directory still held the lease, up to the lookup's time more (review of the
        # change). The late one may overestimate (by the lookup's time, or by the TTL asked past
        # a directory's shorter cap), costing at worst a failing release retried longer (3 sends
        # at most) or one sent for a lease already gone (`not_found`: done).
        held_until = min(now + ttl, expires_ms) if expires_ms else now + ttl
        may_last = max(self._now() + ttl, expires_ms)
        by_chunk = {chunk_index_in_id(GroupId(g)): GroupId(g) for g in hint.groups[:hit_chunks]}
        objects = tuple(
            HintObject(
                _object_key(by_chunk[o.chunk_index], o.member),
                o.size_bytes,
                tuple(_holder(r) for r in o.replicas),
            )
            for o in found
            if o.chunk_index in by_chunk
        )
        if not objects:
            self._give_back_leases(leases, may_last)
            return p.HintReply(hint_id=hint.hint_id, status="accepted", objects_queued=0)
        result = reply_of(
            await self._driver.feed(
                AddHint(Hint(hint.hint_id, hint.tenant, hint.target_segment, objects, hint.deadline_ms))
            )
        )
        assert isinstance(result, Accepted | Deduped | Busy | Refused)
        named = (hint.tenant, hint.hint_id)
        if isinstance(result, Accepted) and result.objects_queued:
            # Accepted: any earlier hint of this name has ended, its leases not yet collected:
            # given back now, started at once (`_start_releases`; they waited for the next tick,
            # up to 60 s; review of the change)
            self._keeper.give_back(named, self._now())
            self._keeper.keep(named, leases, held_until, self._now(), may_last)
            self._start_releases()
        elif isinstance(result, Deduped) and self.core.has_hint(hint.hint_id, hint.tenant):
            # Joined a live hint under this name (or a retry of it): its leases stay until this
            # name ends, so the hint holds leases while any of its names is live. They went back
            # at once, and a cancel of the first name then gave back the only leases the hint
            # still copied under (review, 2026-12-06).
            self._keeper.keep(named, leases, held_until, self._now(), may_last)
        else:  # queued nothing, busy, refused, or its dedupe found no live hint
            self._give_back_leases(leases, may_last)
        if isinstance(result, Accepted):
            return p.HintReply(hint_id=hint.hint_id, status="accepted", objects_queued=result.objects_queued)
        if isinstance(result, Deduped):
            return p.HintReply(hint_id=hint.hint_id, status="deduped", reason=str(result.same_as))
        if isinstance(result, Busy):
            return p.HintReply(hint_id=hint.hint_id, status="busy", reason=result.reason)
        return p.HintReply(hint_id=hint.hint_id, status="refused", reason=result.reason)

    async def _lookup(
        self, hint: p.PrefetchHint, ttl_ms: int
    ) -> tuple[int, list[m.ObjectLocation], list[tuple[int, int]], int]:
        """The hint's prefix looked up on every shard holding some of its chunks, one request per
        leading instance, merged as the client merges its own lookup
        (`kvfabric.cluster.lookups.lookup_prefix`): (the hit, i.e. the first chunk any shard
        misses, a failing shard missing from its first chunk; the objects found; the (shard,
        lease id) kept: shards with a chunk inside the hit; the earliest expiry the directory gave
        them, 0 if none). The other leases are given back at once (queued: `_release_leases`,
        never awaited in the hint's reply path); the first failure is raised only when nothing
        hit (every lease given back)."""
        hit = await lookup_prefix(
            self._dir(),
            hint.groups,
            holder_id=self.holder_id,
            members=hint.members,
            lease_ttl_ms=ttl_ms,
            timeout_s=self.request_timeout_s,
            trace_id="",
            refused=self._lookup_many_refused,
            give_back=self._release_leases,
            # no engine reads what a hint's lookup finds: counted as reads, each hint made its
            # prefix look twice as read (hot replicas, eviction frequency; review, stop 70)
            count_hits=False,
        )
        return hit.hit_chunks, hit.objects, hit.leases, hit.expires_ms

    async def _on_cancel(self, message: p.CancelHint, headers: Mapping[str, str]) -> msgspec.Struct:
        if self.core.cancel_hint(message.hint_id, message.tenant or None):
            return p.CancelReply(cancelled=True)
        resolving = [
            named
            for named in self._resolving_names
            if named[1] == message.hint_id and (not message.tenant or named[0] == message.tenant)
        ]
        if len(resolving) == 1:  # (an older sender's, without its tenant: only when one matches)
            self._resolving_names[resolving[0]] = True  # cancelled once added (`_on_hint`)
            return p.CancelReply(cancelled=True)
        return p.CancelReply(cancelled=False)

    async def _on_status(
        self, message: p.PrefetchStatusRequest, headers: Mapping[str, str]
    ) -> msgspec.Struct:
        return self.status()

    def status(self) -> p.PrefetchStatus:
        core = self.core
        gauges = {
            "bytes_in_flight": core.bytes_in_flight,
            "copies_in_flight": core.copies_in_flight,
            "objects_queued": core.objects_queued,
            "hint_ids_live": core.hint_ids_live,
            "leases_held": self._keeper.leases_held,
            "lease_renewals_queued": self._keeper.renewals_queued,  # due, waiting for room
            "lease_releases_pending": self._keeper.releases_pending,
            "busy_resolving": self.busy_resolving,
            "busy_tenant_resolving": self.busy_tenant_resolving,
            "busy_before_lookup": self.busy_before_lookup,
            "groups_shown": self.groups_shown,
            "groups_known": self.groups_known,
            "groups_remembered": len(self._groups),
        }
        return p.PrefetchStatus(gauges=gauges, counters={**core.counters, **self._keeper.counters})

    # ---- copies ------------------------------------------------------------------------------

    async def _perform(self, effect: PrefetchOutput) -> None:
        """One effect of `Tick` (StartCopy) or `CopyFinished` (PublishReplica, ReleaseCopy)."""
        if isinstance(effect, StartCopy):
            task = asyncio.create_task(self._copy(effect), name="prefetch-copy")
            self._copies.add(task)
            task.add_done_callback(self._copies.discard)
        elif isinstance(effect, ReleaseCopy) and effect.reason == "unwanted":
            # Published by its confirm although nobody waits for it any more: an ordinary
            # replica now, evicted like any other when it goes cold.
            self._log.info("copy_unwanted", copy_id=effect.copy_id)

    async def _release_ended(self) -> None:
        """After each `Tick`: the leases of hints that ended (completed, cancelled, expired or
        failed) are queued to be given back, then the releases and the renewals due are started
        (`_start_releases`, `_renew_due`), each by a background task never awaited here.
        Released one request at a time on the ticker, 10 ended hints under a hung leader held it
        for their timeouts: 1 tick in 5 s instead of ~250, no copy started, no hint expired
        (review, 2026-12-06)."""
        now = self._now()
        for named in [n for n in self._leases if not self.core.has_hint(n[1], n[0])]:
            self._keeper.give_back(named, now)
        self._start_releases()
        self._renew_due()
        self._plan_release_round()  # (a lapse may have queued a release)

    def _start_releases(self) -> None:
        """The releases `HintLeases` says may go: as many as the budget holds (`_release_budget`:
        `RELEASES_BURST` at once at most, `RELEASES_PER_S` over time, shared by every call: the
        tick's own, each hint's leases given back between ticks, the pump's and `stop`'s
        rounds) and as many on a shard as leave `RELEASES_AT_ONCE` in flight there, each by its
        own task with its own deadline. Those held back are started by a round between ticks
        (`_plan_release_round`), not at the next tick: by the budget, once it refilled a batch
        (`RELEASE_ROUND_BATCH`; at `tick_ms` 1000 the ticks alone started 64 a second); by their
        shard's room, as soon as a release there ends; a retry, when it comes due. One task gave
        them back in batches of 16 awaited whole: one release left unanswered held the 15 others
        of its batch and every one queued behind, and a failed one was never retried (held to its
        TTL; review of stop 71).
        Each call had a budget of its own: every hint whose leases went back between two ticks
        started up to 64 more; then one budget of 64 a tick capped every path at 64 per `tick_ms`
        (review of the change)."""
        now_s = monotonic_ms() / 1000
        startable = self._releases_startable(now_s)
        started = self._keeper.releases(self._now(), limit=startable, shard_room=self._release_room)
        invariant(len(started) <= startable <= RELEASES_BURST, "releases started within the budget")
        self._release_budget.charge(len(started), now_s)
        for release in started:
            self._releasing_on[release.shard] += 1
            task = asyncio.create_task(self._release(release), name=f"prefetch-release-{release.shard}")
            self._releases.add(task)
            task.add_done_callback(self._releases.discard)
        self._plan_release_round()

    def _releases_startable(self, now_s: float) -> int:
        """Whole releases the budget holds at `now_s` (the epsilon: 20 ms of 3200/s refills 64,
        not 63.999...)."""
        return int(self._release_budget.refill(now_s) + 1e-6)

    def _plan_release_round(self, ended_on: int | None = None) -> None:
        """The next round of releases between ticks (`_pump_releases`), due when one can start
        something: releases waiting with room on their shard (`HintLeases.releases_ready`,
        counted up to a batch, `RELEASE_ROUND_BATCH`) once the budget holds that batch (or as
        many as wait, if fewer); with none, when the first retry comes due
        (`next_release_retry_ms`), `RELEASE_ROUND_S` from now at the earliest; nothing else (no
        spin). Asked after each round, and whenever a release ends (`ended_on`, its shard: its
        room freed, or a retry queued), then only of that shard (`HintLeases.ready_on`; a round
        already due within `RELEASE_ROUND_S` stands, the budget's batch not cut short). A round
        already due at once stands (it plans the next); a later one is moved earlier. Only a
        round the budget cut short was due, and only if more were pending than tasks in the set
        (finished tasks stay there a loop pass): the releases held back by a shard's room (16 in
        flight) or a retry's wait, and those the count missed, waited for the next tick (at
        `tick_ms` 1000 on one shard, 16 of 640 started in it; a failed release waited up to 60 s,
        not 1). Then every release ended walked every shard, and a round was due at once
        whenever the budget held one token (refilled every 0.31 ms): a round per release, each
        walking every shard (4,096 leases on as many shards: 2.8 s of CPU, the loop held 230
        ms); and a retry's round, its wall-clock time not reached while the wall clock held after
        a step back, was due every ~1 ms (review of the change). `stop` runs rounds of its own."""
        if self._stopping:
            return
        loop = asyncio.get_running_loop()
        pending = self._release_pump
        if pending is not None and pending.when() <= loop.time():
            return  # due at once already: it plans the next
        now = self._now()
        if ended_on is None:
            ready = self._keeper.releases_ready(now, self._release_room, at_most=RELEASE_ROUND_BATCH)
        elif pending is not None and pending.when() <= loop.time() + RELEASE_ROUND_S:
            return  # a round soon stands (a release ended must not cut the budget's batch short)
        else:  # its room just freed: one can start there if one is queued
            ready = 1 if self._keeper.ready_on(ended_on, now) else 0
        if ready:
            # (whole tokens: the budget's clock is read in whole ms, hence the ms more)
            lack = min(ready, RELEASE_ROUND_BATCH) - self._release_budget.refill(monotonic_ms() / 1000)
            delay_s = 0.0 if lack <= 1e-6 else lack / RELEASES_PER_S + 0.001
        elif (retry_ms := self._keeper.next_release_retry_ms()) is not None:
            # (later than now: those due were queued; the floor: a wall clock held after a step
            # back never reaches it)
            delay_s = max(RELEASE_ROUND_S, (retry_ms - now) / 1000)
        else:
            return
        when = loop.time() + delay_s
        if pending is not None:
            if pending.when() <= when:
                return
            pending.cancel()
        self._release_pump = loop.call_at(when, self._pump_releases)

    def _pump_releases(self) -> None:
        """A round of releases between ticks (`_start_releases`), planned by
        `_plan_release_round`; it plans the next."""
        self._release_pump = None
        if not self._stopping:
            self._start_releases()

    async def _release(self, release: ReleaseLease) -> None:
        """One `lease_release`, its outcome told to `HintLeases` (never raises: a release left
        SENDING would hold its place in the queue until the service stops)."""
        request = m.LeaseRelease(holder_id=self.holder_id, lease_id=release.lease_id, shard=release.shard)
        try:
            await asyncio.wait_for(
                self._directory(release.shard, "lease_release", request),
                self.request_timeout_s + RELEASE_DEADLINE_SLACK_S,  # the request's own timeout first
            )
        except NotFound:  # expired or dropped at the directory already: nothing to give back
            self._keeper.release_done(release.lease)
        except Exception as exc:  # retried after a while, within its lease's life
            code = getattr(exc, "code", "timeout" if isinstance(exc, TimeoutError) else repr(exc))
            self._log.info("lease_release_failed", shard=release.shard, attempt=release.attempt, error=code)
            self._keeper.release_failed(release.lease, self._now())
        else:
            self._keeper.release_done(release.lease)
        finally:
            self._releasing_on[release.shard] -= 1
            if not self._releasing_on[release.shard]:
                del self._releasing_on[release.shard]
            # its shard's room freed, or a retry queued: the next round, if one can start there
            self._plan_release_round(ended_on=release.shard)

    def _renew_due(self) -> None:
        """The renewals `HintLeases` says may start (a third of their TTL left, their hint's
        deadline later; at most `REQUESTS_STARTED_PER_TICK_MAX` this tick, earliest expiry first,
        and as many on a shard as leave `RENEWALS_AT_ONCE` in flight there), each by its own
        task, sent at once; the others due wait for a later tick (one that waits past its expiry
        is counted, `lease_renewals_late_total`). One task renewed them in batches of 16 awaited
        whole, so one hung shard's renewals held every other shard's past their margin (review,
        stop 71); then a task each, waiting for its shard's 16 slots: thousands due on one shard
        were thousands of tasks created in one tick (review of stop 71). Now a shard's slowness
        delays only its own, and the tasks are at most the requests in flight."""
        for renewal in self._keeper.due(
            self._now(), self._hint_deadline, limit=REQUESTS_STARTED_PER_TICK_MAX, shard_room=self._renew_room
        ):
            self._renewing_on[renewal.shard] += 1
            task = asyncio.create_task(self._renew(renewal), name=f"prefetch-renew-{renewal.shard}")
            self._renewals.add(task)
            task.add_done_callback(self._renewals.discard)

    def _release_room(self, shard: int) -> int:
        return RELEASES_AT_ONCE - self._releasing_on[shard]

    def _renew_room(self, shard: int) -> int:
        return RENEWALS_AT_ONCE - self._renewing_on[shard]

    def _hint_deadline(self, named: tuple[str, str]) -> int | None:
        return self.core.hint_deadline(named[1], named[0])

    async def _renew(self, renewal: RenewLease) -> None:
        """One `lease_renew`, its answer told to `HintLeases` (never raises: a renewal left
        RENEWING would never be renewed again, nor found lapsed)."""
        try:
            await self._send_renewal(renewal)
        finally:
            self._renewing_on[renewal.shard] -= 1
            if not self._renewing_on[renewal.shard]:
                del self._renewing_on[renewal.shard]

    async def _send_renewal(self, renewal: RenewLease) -> None:
        # counted as sent here (`sending`), not when due: one whose hint ended meanwhile is
        # given back, not renewed, and was counted all the same (review, stop 71)
        ttl_ms = self._keeper.sending(renewal, self._now())  # (cut to the deadline from now)
        if not ttl_ms:
            return
        request = m.LeaseRenew(
            holder_id=self.holder_id,
            lease_id=renewal.lease_id,
            lease_ttl_ms=ttl_ms,
            shard=renewal.shard,
        )
        try:
            reply = await self._directory(renewal.shard, "lease_renew", request)
        except NotFound:  # expired or dropped at the directory (a new leader, say)
            self._keeper.renew_failed(renewal.lease, lost=True, now_ms=self._now())
        except RENEW_REFUSALS as exc:  # refused before any effect: not granted, retried
            self._log.info("lease_renew_failed", shard=renewal.shard, error=exc.code, granted=False)
            self._keeper.renew_failed(renewal.lease, lost=False, now_ms=self._now(), refused=True)
        except Exception as exc:  # retried after a while, before its expiry
            # (not `lost`: the directory may have granted it, its answer lost; the lease is then
            # given back, or released at its lapse, with the expiry asked: `HintLeases`)
            self._log.info("lease_renew_failed", shard=renewal.shard, error=getattr(exc, "code", repr(exc)))
            self._keeper.renew_failed(renewal.lease, lost=False, now_ms=self._now())
        else:
            expires_ms = reply.expires_ms if isinstance(reply, m.LeaseReply) else 0
            self._keeper.renewed(renewal.lease, expires_ms, self._now())

    async def _copy(self, start: StartCopy) -> None:
        assert isinstance(start.object_id, bytes)
        busy = False
        try:
            outcome = await asyncio.wait_for(
                copy_replica(
                    self._dir(),
                    key=ObjectKey(start.object_id),  # the core's object ids are object keys
                    destination=start.target,
                    writer_id=copy_writer_id(start.target),
                    request_id=f"prefetch-{start.copy_id}",
                    timeout_s=self.copy_timeout_s,
                    preferred_source=start.source,
                ),
                2 * self.copy_timeout_s + 1,  # the copy's own requests time out first (and abort)
            )
        except (KvfError, TimeoutError) as exc:
            self._log.info("copy_failed", copy_id=start.copy_id, error=getattr(exc, "code", "timeout"))
            outcome = "failed"
            # no copy slot free there (repair's copies, say): nothing was tried (review, stop 68)
            busy = isinstance(exc, BusyError)
        self._forget_group_of(start.object_id)  # a new holder, or a copy's ticket given back
        ok = outcome in ("copied", "already_there")
        await self._driver.feed(CopyFinished(start.copy_id, ok, made=outcome == "copied", busy=busy))

    # ---- hot objects -------------------------------------------------------------------------

    async def _on_accessed(self, msg: Msg) -> None:
        try:
            event = m.event_decoder.decode(msg.data)
        except BadRequest:
            return
        if not isinstance(event, m.GroupsAccessed):
            return
        hottest = sorted(event.groups, key=lambda h: -h.hits)[: self.hot_groups_per_event_max]
        for hit in hottest:
            # (over the directory's flush period: this service's own tick, 5x shorter, read one
            # hit as 50/s and the filter skipped nothing; review, stop 70. An event flushed early,
            # full, reads low: its groups come again in the next.)
            if hit.hits * 1000 / max(1, self.access_period_ms) < self.core.config.cold_reads_per_s:
                continue  # not worth a directory query
            known = self._known_group(hit.domain, hit.group)
            if known is None:
                known = await self._show_group(hit.domain, hit.group)
                if known is None:
                    continue  # the directory did not answer: asked again on the next event
            for object_id, size_bytes, holders in known:  # each step reads the clock: after the await
                await self._driver.feed(
                    Read(
                        object_id,
                        size_bytes=size_bytes,
                        served_from=holders[0],
                        replicas=holders,
                        reads=min(hit.hits, READS_PER_HIT_MAX),
                        domain=bytes(hit.domain),
                    )
                )

    def _known_group(self, domain: bytes, group: bytes) -> _GroupObjects | None:
        """The members of a group shown less than `group_cache_ms` ago (None: ask again)."""
        entry = self._groups.get((domain, group))
        if entry is None:
            return None
        shown_ms, objects = entry
        if monotonic_ms() - shown_ms >= self.group_cache_ms:
            del self._groups[(domain, group)]
            return None
        self.groups_known += 1
        return objects

    async def _show_group(self, domain: bytes, group: bytes) -> _GroupObjects | None:
        """`show_group` of the group read (domain digest, chain hash), to the shard of the group:
        its readable objects as (object id, size, holders), remembered for `group_cache_ms`
        (at most `GROUP_CACHE_MAX` groups, the oldest forgotten). None when the directory did not
        answer; an empty tuple (remembered too) when it holds nothing of this domain."""
        # the 48-byte group key: its chain hash names the shard
        try:
            key = pack_group_key(DomainDigest(domain), ChainHash(group))
            router = await self._routed()
            shown = await self._directory(router.shard_of(key), "show_group", m.ShowGroup(group=key))
        except (KvfError, ValueError):  # ValueError: a malformed event names no chain hash
            return None
        self.groups_shown += 1
        # Two domains may hold this chain hash: the one read is named by the event.
        mine = (
            [g for g in shown.groups if domain_in_id(g.namespace) == domain]
            if isinstance(shown, m.GroupList)
            else []
        )
        objects: _GroupObjects = ()
        if mine:
            summary = mine[0]
            group_id = pack_group_id(summary.namespace, summary.chunk_index, summary.group)
            objects = tuple(
                # lookups list arena replicas first: the first holder is the one read
                (_object_key(group_id, obj.member), obj.size_bytes, tuple(_holder(r) for r in obj.replicas))
                for obj in summary.objects
                if obj.replicas
            )
        if self.group_cache_ms > 0:
            self._groups[(domain, group)] = (monotonic_ms(), objects)
            while len(self._groups) > GROUP_CACHE_MAX:
                del self._groups[next(iter(self._groups))]  # the oldest shown
        return objects

    def _forget_group_of(self, object_id: bytes) -> None:
        """A replica of `object_id` was added or dropped by this service: its group is shown again
        on its next read (the holders changed)."""
        group_id = group_id_in_key(ObjectKey(object_id))
        self._groups.pop((domain_in_id(group_id), group_id[CHAIN_SLICE]), None)

    async def scan(self) -> None:
        """Every `scan_ms` (`every`): the segments' free room into the core, cold extra replicas dropped."""
        segments = await self._dir().segments(self.request_timeout_s)
        self.core.set_segments(
            {
                s.segment_id: max(0, s.capacity_bytes - s.reserved_bytes)
                for s in segments.segments
                if s.up and not s.draining
            }
        )
        cold_extras = reply_of(await self._driver.feed(ColdExtraReplicas()))
        assert isinstance(cold_extras, list)
        for cold in cold_extras:
            # each on its own: one that fails (a directory error) no longer ends the scan before
            # the others (review, 2026-12-05); it is tried again at the next scan
            try:
                await self._drop_extra(cold.object_id, cold.segment)
            except KvfError as exc:
                self._log.info("cold_extra_drop_failed", code=exc.code, segment=cold.segment)

    def _scan_failed(self, exc: KvfError) -> None:
        self._log.info("scan_failed", code=exc.code)

    async def _drop_extra(self, object_id: object, segment: str) -> None:
        assert isinstance(object_id, bytes)
        shard = (await self._routed()).shard_of(object_id)  # the group's and the key's
        group_id = group_id_in_key(ObjectKey(object_id))
        try:
            shown: msgspec.Struct | None = await self._directory(
                shard, "show_group", m.ShowGroup(group=group_id)
            )
        except NotFound:  # its group is gone (evicted): so is the extra (review, 2026-12-05: this
            shown = None  # ended every later scan before its other cold extras were dropped)
        replica = None
        if isinstance(shown, m.GroupList) and shown.groups:
            for obj in shown.groups[0].objects:
                if _object_key(group_id, obj.member) == object_id:
                    replica = next((r for r in obj.replicas if _holder(r) == segment), None)  # arena
        if replica is not None:
            await self._directory(
                shard,
                "replica_corrupt",
                m.ReplicaCorrupt(
                    segment_id=replica.segment_id,
                    incarnation=replica.incarnation,
                    key=ObjectKey(object_id),
                    slot=replica.slot,
                    slot_generation=replica.slot_generation,
                    reason="cold_extra",
                ),
            )
        self._forget_group_of(object_id)
        self.core.replica_removed(object_id, segment)

    # ---- directory ---------------------------------------------------------------------------

    def _give_back_leases(self, leases: list[tuple[int, int]], expires_ms: int | None) -> None:
        """Read leases no hint keeps, each held until `expires_ms` (None: unknown, one
        `LEASE_TTL_MS_MAX` from now at most), given back like an ended hint's: queued in
        `HintLeases` and started at once within the same bounds (`_start_releases`: each to the
        shard that granted it by its own task and deadline, retried, within its shard's room and
        what the budget holds (`_release_budget`); the rest in a later round between ticks,
        `_plan_release_round`).
        They were released inline, one at a time in the hint's reply path, never retried and
        outside the per-shard bound: one hung shard delayed the reply by `request_timeout_s`
        per lease (review of the change, stop 71)."""
        self._keeper.release(leases, expires_ms, self._now())
        self._start_releases()

    async def _release_leases(self, leases: list[tuple[int, int]]) -> None:
        """The lookup's `give_back` (`lookup_prefix`: the leases outside the hit, every lease of a
        lookup that hit nothing, and those granted after it gave up): queued, never awaited
        (`_give_back_leases`); their expiry unknown here, at most one `LEASE_TTL_MS_MAX` (what a
        hint's lookup asks) from now."""
        self._give_back_leases(leases, None)

    def _dir(self) -> DirectoryRouter:
        if self._router is None:
            raise Unavailable("prefetch not started")
        return self._router

    async def _routed(self) -> DirectoryRouter:
        """The router, its shard count known (else every key would map to shard 0)."""
        router = self._dir()
        await router.known_shards()
        return router

    async def _directory(self, shard: int, verb: str, message: msgspec.Struct) -> m.DirectoryReply:
        return await self._dir().ask(shard, verb, message, self.request_timeout_s)


def _holder(replica: m.Replica) -> str:
    """What the core calls a replica's place: its segment, or `<segment>#ssd` for a disk replica
    (a hint's target that holds only that still wants a DRAM copy: a promotion)."""
    if tier_of_slot(replica.slot) == "ssd":
        return replica.segment_id + SSD_SOURCE_SUFFIX
    return replica.segment_id


def _object_key(group_id: GroupId, member: m.Member) -> ObjectKey:
    return pack_object_key(group_id, member.tp_rank, member.pp_stage, member.layer_group)
