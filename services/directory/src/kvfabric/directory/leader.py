"""Leader election for directory shards: `ShardLeadership`'s effects on JetStream KV.

Buckets (`kvfabric.directory.kv_buckets`: opened there, retried on a forming cluster):
- `KVF_DIRECTORY_LEADERS`: key `shard-<n>` = the leading instance id. The bucket's max age is
  the leader lease TTL, so a key not rewritten for `lease_ttl_ms` disappears and a standby's
  `create` wins. The revision of the winning `create` is the shard's **epoch**.
- `KVF_DIRECTORY_MEMBERS`: key `member-<instance id>`, rewritten while alive and purged at an
  orderly stop (for operators and for rebalancing, off by default: with `rebalance=False` every
  instance desires every shard, so leadership is sticky and moves only when a leader dies).

The core decides; this loop only performs effects and feeds results back. Clocks: monotonic
milliseconds (the core compares its own send times with its own now). Every KV operation runs
as a task of its own (at most one per shard, the core sees to that), so a slow or unanswered
one never delays another shard's renewal, and the loop keeps ticking meanwhile.

## Renewals across a JetStream stream-leader election (NATS cluster, R3 buckets)
When the nats-server that leads the leaders bucket's stream dies, nobody can write the bucket
until the other replicas elect a leader: nats-server waits a random 4-9 s of silence first
(server/raft.go `minElectionTimeoutDefault`, `maxElectionTimeoutDefault`). Meanwhile every
renewal goes unanswered (timeout, no responders). Two clocks decide what happens:
- the **bucket's TTL** (`max_age` = `lease_ttl_ms`, nats-server's clock): each replica ages the
  key out `lease_ttl_ms` after the write that renewed it; the new stream leader no longer has it,
  so the holder's next `update(last=revision)` is refused and anybody's `create` wins (a new
  epoch);
- the **holder's deadline** (this process's monotonic clock): `sent_ms` of the last successful
  write + `lease_ttl_ms - safety_margin_ms`; past it the holder does not act, whatever the KV
  says (`ShardLeadership`, Safety).
An unanswered renewal therefore never ends a term early and never extends it: the core retries
it every `renew_retry_ms` (each try waits at most the term's time left, at least
`RENEW_TIMEOUT_MIN_S`) and stops at the deadline. While the KV has no leader it is unavailable
to *everybody*: no standby can take a shard over either, so keeping the term until the deadline
costs nothing. A partition is the case to mind: the holder may be cut off from a KV that others
still reach; then the key ages out on the KV's clock no earlier than `lease_ttl_ms` after the
holder's last successful write was *received*, which is after it was sent, and the holder
stopped `safety_margin_ms` before that on its own clock: a takeover never overlaps the old term
(clock-rate drift over one TTL must stay under the margin).
So a lease rides out an election only when `lease_ttl_ms - safety_margin_ms` exceeds the longest
election (9 s) plus one renewal interval: on a NATS cluster (`KVF_DIRECTORY_KV_REPLICAS` > 1)
the default lease is 15 s with renewals every second (`kvfabric.directory.settings`); on a
single nats-server it stays 3 s (no election; an instance killed outright is taken over 3 s
later). The cost on a cluster is that: a SIGKILLed instance's shards wait up to 15 s for a
standby (misses, recomputed by the engine). An orderly stop (SIGTERM, a lost lease, a shard
that would not start) hands back what it holds once it stopped serving (`release_held`), so
that nobody waits a TTL: only an instance that dies outright (SIGKILL, OOM, its host lost)
costs the TTL.

## An orderly stop
`run` ends (cancelled, or an operation failed) by cancelling its KV operations and the members
listing and awaiting them, for at most `OPS_STOP_TIMEOUT_S`: none outlives the loop, so none
writes after `release_held` read the bucket (a renewal landing later would move a key past the
revision it is deleted at). Then `release_held(timeout_s)`, everything within `timeout_s`:
- the lease keys the core holds are deleted at their revisions (`last=revision`: only if
  nobody took them since);
- every other shard this process sent a `create` for (only their keys can hold its id: a create
  that reached the server while its answer was lost or cancelled, a renewal cancelled in
  flight, a release that failed) is read, and its key deleted at the revision read when it holds
  this instance's id: a key of another instance, or a newer one, is never deleted;
- its member key, once announced, is removed from the members stream (purged: a deleted key's
  tombstone is a message, and `bucket_keys` would list it as a live member), so rebalancing
  instances (`KVF_DIRECTORY_REBALANCE=1`) stop counting it at their next listing (every
  `LOOP_MS`) and take its shards at once, instead of after the members TTL.
What is not done by then lapses by TTL, as after a SIGKILL.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Final

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.js.kv import KeyValue

from kvfabric.core.leadership import (
    Acquire,
    Acquired,
    AcquireFailed,
    AnnounceMember,
    Effect,
    LeadershipConfig,
    MembersSeen,
    Release,
    Released,
    Renew,
    Renewed,
    RenewFailed,
    RenewUnanswered,
    ShardLeadership,
    StartLeading,
    StopLeading,
    Tick,
    key_of,
    member_key,
)
from kvfabric.directory.kv_buckets import KV_TIMEOUT_S, LEADERS_BUCKET, MEMBERS_BUCKET, open_bucket
from kvfabric.directory.kv_keys import KeyListingTruncated, bucket_keys
from kvfabric.format.clock import monotonic_ms
from kvfabric.runtime.deadline import cancel_and_wait
from kvfabric.runtime.logs import get_logger

__all__ = ["LeaderElection"]

LOOP_MS: Final = 100
RENEW_TIMEOUT_MIN_S: Final = 0.2  # a renewal near its deadline still waits this long for an answer
# `run`'s end: its KV operations and listing, once cancelled, are awaited this long (less than the
# service's TASKS_STOP_TIMEOUT_S, which bounds the whole loop's stop)
OPS_STOP_TIMEOUT_S: Final = 1.0
RELEASE_READS_MAX: Final = 64  # `release_held`: lease keys read at once (up to one per shard)
RELEASE_CANCEL_S: Final = 0.1  # `release_held`: kept of its timeout to cancel what is left and await it
_KV_ERRORS: Final = (nats.js.errors.Error, nats.errors.Error, TimeoutError)

OnStart = Callable[[int, int], Awaitable[None]]
OnStop = Callable[[int, int, str], Awaitable[None]]


class LeaderElection:
    """Runs one instance's `ShardLeadership` against the leaders and members buckets."""

    def __init__(
        self,
        nc: NatsClient,
        instance_id: str,
        config: LeadershipConfig,
        *,
        rebalance: bool = False,
        replicas: int = 1,
    ) -> None:
        self.nc = nc
        self.instance_id = instance_id
        self.config = config
        self.rebalance = rebalance
        self.replicas = replicas  # of the KV buckets it creates (3 on a NATS cluster: survive a node)
        self.core = ShardLeadership(config, instance_id)
        self._ops: set[asyncio.Task[None]] = set()  # KV operations in flight (one per shard at most)
        self._op_failed: BaseException | None = None  # raised by `run`: nothing may go unnoticed
        # Shards this process sent a `create` for: only their lease keys can hold its id
        # (`release_held` reads those it does not hold). Bounded by the shard count.
        self._asked: set[int] = set()
        self._announced = False  # a member key was (maybe) written: `release_held` removes it
        self._stopping = False  # `run` is ending: no KV operation starts any more
        self._leaders: KeyValue | None = None
        self._members: KeyValue | None = None
        self._log = get_logger("kvfabric.directory.leader").bind(instance=instance_id)

    async def open(self) -> None:
        config, replicas = self.config, self.replicas
        self._leaders = await open_bucket(self.nc, LEADERS_BUCKET, config.lease_ttl_ms / 1000, replicas)
        self._members = await open_bucket(self.nc, MEMBERS_BUCKET, config.members_ttl_ms / 1000, replicas)

    async def run(self, on_start: OnStart, on_stop: OnStop) -> None:
        """Forever: tick the core, perform its effects (StopLeading first), refresh members."""
        # The members listing runs beside the loop, one at a time: awaited in it (a stream
        # request of up to KV_TIMEOUT_S), it held up the ticks the renewals go out on, and one
        # slow listing before a renewal was due cost every shard's lease (review, stop 68).
        listing: asyncio.Task[set[str]] | None = None
        try:
            alone = MembersSeen(frozenset({self.instance_id}))
            await self._perform(self.core.step(alone, monotonic_ms()), on_start, on_stop)
            while True:
                if self._op_failed is not None:
                    raise self._op_failed
                if self.rebalance and listing is None:
                    listing = asyncio.create_task(self._live_members())
                elif listing is not None and listing.done():
                    seen = MembersSeen(frozenset(listing.result()))
                    listing = None
                    await self._perform(self.core.step(seen, monotonic_ms()), on_start, on_stop)
                # Read the clock again: answers that came meanwhile fed the core later times.
                await self._perform(self.core.step(Tick(), monotonic_ms()), on_start, on_stop)
                await asyncio.sleep(LOOP_MS / 1000)
        finally:
            # Awaited, not only cancelled: an operation left running could still write after
            # `release_held` read the bucket (module docstring, "An orderly stop"). One whose
            # answer comes meanwhile starts no other (`_perform`).
            self._stopping = True
            left = await _cancel_and_await([*self._ops, *([listing] if listing is not None else [])])
            if left:  # cancellations swallowed for good: each still ends by its own KV timeout
                self._log.warning("leader_ops_left_running", tasks=len(left))

    async def release_held(self, timeout_s: float) -> int:
        """After this instance stopped serving (its shells are stopped, `run` has ended): hand
        back what it holds in the KV, so that others take over at once instead of after a TTL
        (module docstring, "An orderly stop"): the lease keys the core holds (deleted at their
        revisions), any other lease key that holds this instance's id (read, deleted at the
        revision read), and its member key (purged). Returns how many lease keys were deleted
        within `timeout_s`; whatever is not done by then is cancelled and lapses by TTL."""
        assert self._leaders is not None
        leaders, mine = self._leaders, self.instance_id.encode()
        reads = asyncio.Semaphore(RELEASE_READS_MAX)

        async def release(shard: int, revision: int) -> int:
            try:
                await leaders.delete(key_of(shard), last=revision)
            except _KV_ERRORS:  # refused (not ours at that revision any more) or unanswered
                return 0
            return 1

        async def release_if_mine(shard: int) -> int:
            async with reads:
                try:
                    entry = await leaders.get(key_of(shard))
                except _KV_ERRORS:  # none (lapsed, deleted), or unanswered
                    return 0
            if entry.value != mine or not entry.revision:
                return 0  # another instance's: never deleted
            return await release(shard, entry.revision)

        held = self.core.held(monotonic_ms())
        leases = [asyncio.create_task(release(s, r)) for s, r in held.items()]
        leases += [asyncio.create_task(release_if_mine(s)) for s in sorted(self._asked - held.keys())]
        member = asyncio.create_task(self._leave_members()) if self._announced else None
        tasks: list[asyncio.Task[Any]] = [*leases, *([member] if member is not None else [])]
        loop = asyncio.get_running_loop()
        deadline_s = loop.time() + max(0.0, timeout_s)
        if tasks:
            await asyncio.wait(tasks, timeout=max(0.0, timeout_s - min(RELEASE_CANCEL_S, timeout_s / 2)))
            await cancel_and_wait(tasks, deadline_s - loop.time())
        released = sum(t.result() for t in leases if t.done() and not t.cancelled())
        left = member is not None and member.done() and not member.cancelled() and member.result()
        self._log.info("leader_stop_released", leases=released, held=len(held), member_left=bool(left))
        return released

    async def _leave_members(self) -> bool:
        """This instance's member key, removed from the members stream: its subject purged. A
        `kv.delete` would leave a tombstone, a message on that subject, which the members listing
        (`bucket_keys`, the stream's subjects) counts as a live member until it ages out."""
        subject = f"$KV.{MEMBERS_BUCKET}.{member_key(self.instance_id)}"
        try:
            await self.nc.jetstream(timeout=KV_TIMEOUT_S).purge_stream(
                f"KV_{MEMBERS_BUCKET}", subject=subject
            )
        except _KV_ERRORS:
            return False
        return True

    async def _live_members(self) -> set[str]:
        # From the stream's subjects (`kv_keys`: nats-py's `keys()` can end a listing early, and
        # a member missed here is handed fewer shards than its share).
        try:
            keys = await bucket_keys(self.nc.jetstream(timeout=KV_TIMEOUT_S), MEMBERS_BUCKET)
        except (nats.errors.Error, TimeoutError, KeyListingTruncated):
            return {self.instance_id}
        return {k.removeprefix("member-") for k in keys} | {self.instance_id}

    async def _perform(self, effects: list[Effect], on_start: OnStart, on_stop: OnStop) -> None:
        # Stopping comes first: nothing else may run while this instance acts on a lapsed lease.
        for effect in sorted(effects, key=lambda e: not isinstance(e, StopLeading)):
            if isinstance(effect, StopLeading):
                self._log.warning(
                    "leadership_lost", shard=effect.shard, epoch=effect.epoch, reason=effect.reason
                )
                await on_stop(effect.shard, effect.epoch, effect.reason)
            elif self._stopping:
                # `run` ended: a key a KV operation would release lapses, or `release_held`
                # reads it; a lease won now (an acquire answered with its cancel: Python 3.11's
                # `wait_for`) starts no shard, whose start task the service would never await
                # (review of the change): the core holds it, so `release_held` deletes it.
                continue
            elif isinstance(effect, StartLeading):
                self._log.info("leadership_won", shard=effect.shard, epoch=effect.epoch)
                await on_start(effect.shard, effect.epoch)
            else:  # a KV operation: a task of its own, its answer fed to the core when it comes
                task = asyncio.create_task(self._operate(effect, on_start, on_stop))
                self._ops.add(task)
                task.add_done_callback(self._op_done)

    async def _operate(self, effect: Effect, on_start: OnStart, on_stop: OnStop) -> None:
        await self._perform(await self._kv(effect), on_start, on_stop)

    def _op_done(self, task: asyncio.Task[None]) -> None:
        self._ops.discard(task)
        if not task.cancelled() and task.exception() is not None and self._op_failed is None:
            self._op_failed = task.exception()

    async def _kv(self, effect: Effect) -> list[Effect]:
        assert self._leaders is not None and self._members is not None
        value = self.instance_id.encode()
        sent = monotonic_ms()
        try:
            if isinstance(effect, Acquire):
                self._asked.add(effect.shard)  # before the send: it may land unanswered
                revision = await self._leaders.create(key_of(effect.shard), value)
                # When the answer came: a create answered after its term's deadline (this loop
                # stalled meanwhile, another instance may lead by now) is released, not started.
                return self.core.step(Acquired(effect.shard, revision, sent), monotonic_ms())
            if isinstance(effect, Renew):
                deadline_ms = self.core.deadline_ms(effect.shard) or sent  # None: draining
                wait_s = min(KV_TIMEOUT_S, max(RENEW_TIMEOUT_MIN_S, (deadline_ms - sent) / 1000))
                revision = await asyncio.wait_for(
                    self._leaders.update(key_of(effect.shard), value, last=effect.revision), wait_s
                )
                return self.core.step(Renewed(effect.shard, revision, sent), monotonic_ms())
            if isinstance(effect, Release):
                await self._leaders.delete(key_of(effect.shard), last=effect.revision)
                return self.core.step(Released(effect.shard), monotonic_ms())
            if isinstance(effect, AnnounceMember):
                self._announced = True
                await self._members.put(member_key(self.instance_id), b"")
                return []
        except (nats.js.errors.Error, nats.errors.Error, TimeoutError) as exc:
            if isinstance(effect, Acquire):
                return self.core.step(AcquireFailed(effect.shard), monotonic_ms())
            if isinstance(effect, Renew):
                if isinstance(exc, nats.js.errors.KeyWrongLastSequenceError):  # refused: not ours
                    self._log.warning("lease_renew_failed", shard=effect.shard, error=type(exc).__name__)
                    return self.core.step(RenewFailed(effect.shard), monotonic_ms())
                self._log.info("lease_renew_unanswered", shard=effect.shard, error=type(exc).__name__)
                return self.core.step(RenewUnanswered(effect.shard), monotonic_ms())
            if isinstance(effect, Release):
                return self.core.step(Released(effect.shard), monotonic_ms())  # it lapses by TTL anyway
            return []
        return []


async def _cancel_and_await(tasks: Iterable[asyncio.Task[Any]]) -> set[asyncio.Task[Any]]:
    """`cancel_and_wait` for `OPS_STOP_TIMEOUT_S`, not cut short by another cancel of the caller:
    the service's stop cancels the election loop again while it waits here (`cancel_and_wait`'s
    own re-cancels), and that cancel is already in progress. Returns the tasks left running."""
    tasks = list(tasks)
    loop = asyncio.get_running_loop()
    deadline_s = loop.time() + OPS_STOP_TIMEOUT_S
    while True:
        try:
            return await cancel_and_wait(tasks, deadline_s - loop.time())
        except asyncio.CancelledError:
            if loop.time() >= deadline_s:
                raise
