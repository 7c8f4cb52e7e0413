"""One directory instance: the shards it leads, each a `DirectoryShell` around its own core.

Requests arrive on this instance's subjects (`kvf.v1.directory.<verb>.<instance>`, tenants'
`kvf.v1.directory.t.<tenant>.<verb>.<instance>`), are decoded, and go to the shell of their
shard: the shard of their keys (all keys of one request must share it) or their `shard` field
(leases, pins, listings). A shard this instance does not lead (any more) → `wrong_shard`: the
caller refreshes its map (`kvfabric.cluster.directory_router`). `register` and `heartbeat` go to
every shard core here (each keeps the segment table it places on); registrations are written to
the durable segment registry first. `shard_map` (every instance, no queue group) answers with
the shards led here (`kvfabric.directory.shard_map`: a tenant's only into its own inbox, with a
grant here, at a bounded rate). `lookup_many` carries one prefix's lookups for several shards
led here, `lease_release_many` a hit's leases: each part runs exactly as that shard's single
request (`kvfabric.directory.shard_requests`, which also finds a request's shard). A tenant's
request other than a give-back waits for its turn at `fair` first (`kvfabric.directory.fair`:
tenants take turns by ids, one request of each running at a time by default; an empty bucket or
a full queue is `busy` before the request is decoded). A tenant's
give-back (lease release, unpin, put abort, lease_release_many) never waits and is never refused
for load: `kvfabric.directory.giveback` charges the ids that released nothing to the tenant's
give-back budget and, once it is spent, runs one slice first; until a token refills, such a
tenant's give-backs are `busy` before they are decoded (`FairGate.giveback_refuse_early`).

Shards come and go with leadership (`kvfabric.directory.leader`): `start_shard` rebuilds the
shard's index from the segments' reports (only keys of that shard) under the new epoch before it
serves, adopting them in bounded steps with the event loop yielded between (`_adopt`); `stop_shard`
(a handover) stops serving it at once — its KV key is released only after; the counters of a
shell stopped stay exported (`retired`, `kvfabric.directory.retired`).
A lapsed lease stops the whole instance (the caller exits), as before sharding; `stop` ends
every task of the host within `STOP_TIMEOUT_S` and returns the names of those still running
(the caller then exits at once: docs/design.md, liveness). Once the starts
of a round are done (`_settled`), what they built is frozen out of the cyclic GC's walk
(`kvfabric.runtime.gcpolicy.freeze_long_lived`; a no-op unless the process runs the policy).

A heartbeat from a registered segment that a shard core never saw (it registered while the
shard was being rebuilt, or did not answer that rebuild's report in time) registers it there
from the durable registry (`_introduce`). When it holds bytes, some may be of that shard and
are invisible to it (a miss where the cache holds the prompt, and slots no one frees): the
shard is rebuilt under the same epoch — stopped, then started from the segments' reports like
after a failover (fencing, grace period): at once, then with a per-shard backoff
(`MISSING_SEGMENT_REBUILD_S_MIN` doubling to `_MAX`). A rebuild asked for while the shard is
still starting (its shell serves before the start has ended) waits for that start, then runs:
the start asked the segments before the introduction. The old core stops acting before the new
one is built, so no two cores of one shard and epoch ever act together.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final, TypeVar

import msgspec
import nats.errors
from nats.aio.client import Client as NatsClient

from kvfabric.core import authz
from kvfabric.core.authz import GIVEBACK_VERBS, TENANT_VERBS
from kvfabric.core.directory import DirectoryConfig, DirectoryCore, Effect
from kvfabric.core.directory.rebuild import SegmentHolding
from kvfabric.core.quotas import TokenBucket
from kvfabric.directory import shard_requests
from kvfabric.directory.fair import FairGate, sender_wait_s
from kvfabric.directory.giveback import give_back
from kvfabric.directory.rebuild import gather_holdings
from kvfabric.directory.retired import RetiredCounters
from kvfabric.directory.segment_registry import SegmentRegistry
from kvfabric.directory.shard_map import ShardMapServer
from kvfabric.directory.shard_requests import check_release_many, fair_ids, reply_extra_ids, shard_of_request
from kvfabric.directory.shell import VERBS, DirectoryShell, now_ms
from kvfabric.directory.stalls import CORE_CALLS
from kvfabric.directory.suspects import SUSPECT_VERB, SUSPECTS_TENANT_PER_S, SuspectRelay
from kvfabric.format.errors import (
    BadRequest,
    Unauthorized,
    Unavailable,
    WrongShard,
)
from kvfabric.proto import directory as m
from kvfabric.runtime.deadline import cancel_and_wait
from kvfabric.runtime.gcpolicy import freeze_long_lived
from kvfabric.runtime.logs import get_logger
from kvfabric.runtime.service import RequestHandler, ServiceRuntime, TenantHandler

__all__ = ["BROADCAST_VERBS", "ShardHost"]

BROADCAST_VERBS: Final = frozenset({"register", "heartbeat"})
LIVENESS_VERBS: Final = frozenset({"heartbeat"})  # answered from the give-back lane (`attach`)
LOOKUP_MANY_VERB: Final = "lookup_many"  # one prefix's lookups for every shard led here
RELEASE_MANY_VERB: Final = "lease_release_many"  # one hit's leases for every shard led here
SETTLE_S: Final = 0.3
STOP_TIMEOUT_S: Final = 3.0  # `stop`: every task ended by then (handed-over shells drain first)
# Per shard, between rebuilds for a missing segment: 10 s, doubling up to 5 min (reset after
# 5 quiet minutes), so a segment that heartbeats but never answers a report in time can't keep
# a shard restarting and in its grace period (frees of adopted slots wait for its end).
MISSING_SEGMENT_REBUILD_S_MIN: Final = 10.0
MISSING_SEGMENT_REBUILD_S_MAX: Final = 300.0
MISSING_SEGMENT_DRAIN_S: Final = 1.0  # the stopped shell's queued events still go out
# A rebuild adopts this many objects a core call (`DirectoryCore.adopt_steps`: ~25 us an object,
# ~13 ms a step), the event loop yielded between: one call for a whole shard held the loop
# ~0.5 s per 20,000 objects, and from ~65,000 past the leader lease (review, stop 71).
ADOPT_STEP_OBJECTS: Final = 512


M = TypeVar("M", bound=msgspec.Struct)
# `lookup_many` / `release_many`: (request, the tenant's grant or None for a service) -> reply
_Many = Callable[[M, "authz.TenantGrant | None"], Awaitable[msgspec.Struct]]


class ShardHost:
    """The shards one instance leads, and its endpoints. See the module docstring."""

    def __init__(
        self,
        instance_id: str,
        shards: int,
        core_config: DirectoryConfig,
        *,
        registry: SegmentRegistry,
        make_shell: Callable[[DirectoryCore], DirectoryShell],
        may_act: Callable[[int, int], bool] | None = None,
        restart_shard: Callable[[int, int], Awaitable[None]] | None = None,
        grants: Mapping[str, authz.TenantGrant] | None = None,
        lookup_reply_min_ms: int = 0,
        fair: FairGate | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.instance_id = instance_id
        self._clock = clock  # seconds: the missing-segment rebuilds' backoff
        self.shards = shards
        self.core_config = core_config
        self.registry = registry
        self.make_shell = make_shell
        self.shells: dict[int, DirectoryShell] = {}
        # Whether this instance may act as the leader of (shard, epoch) now (the service's
        # `ShardLifecycleShell.may_act`); None: always (in-process tests).
        self.may_act: Callable[[int, int], bool] = may_act or (lambda shard, epoch: True)
        self.grants: Mapping[str, authz.TenantGrant] = grants or {}
        self.lookup_reply_min_ms = lookup_reply_min_ms
        # Tenants' requests (gives-back excepted) wait for their turn here, tenants taking turns
        # by ids (`kvfabric.directory.fair`); None: each runs at once (in-process tests).
        self.fair: FairGate | None = fair
        self._nc: NatsClient | None = None
        self._subs: list[object] = []
        self._starting: dict[int, asyncio.Event] = {}  # shard -> set once its start has ended
        self._wanted: dict[int, int] = {}  # shard -> newest epoch a start was asked for
        self._retiring: set[asyncio.Task[None]] = set()  # handed-over shells draining their events
        # Shells neither serving (in `shells`) nor stopped: draining after a handover, or still
        # starting. `stop` stops them too, also when it cancelled the task that owned one.
        self._loose_shells: set[DirectoryShell] = set()
        # tasks a retired shell's stop could not end (a publisher stuck on the events stream):
        # the host's stop reports them (review, stop 65: forgotten, the process did not exit 79)
        self._stuck_retired: set[asyncio.Task[Any]] = set()
        # Counters of the shells out of `shells`: still `draining` (counted as they are), then
        # folded into `retired`, so no exported counter goes down on a handover or a rebuild
        # (review, stop 71; `kvfabric.directory.retired`, its `lock` guards all three).
        self.retired = RetiredCounters(core_config.tenants_max)
        self.draining: set[DirectoryShell] = set()
        self._runtime: ServiceRuntime | None = None  # `attach`'s
        self._settling = False
        self._announced: list[int] = []
        self.metrics_port: int | None = None  # logged with `directory_started`
        self._rebuild_ms: dict[int, int] = {}
        # Starts a shard again after a rebuild for a missing segment; the service passes one that
        # retries and stops the instance when it can't (a led shard is never left unserved).
        self.restart_shard: Callable[[int, int], Awaitable[None]] = restart_shard or self.start_shard
        self._rebuild_last_s: dict[int, float] = {}  # shard -> when its last rebuild began
        self._rebuild_epoch: dict[int, int] = {}  # shard -> the term its last rebuild was for
        self._rebuild_wait_s: dict[int, float] = {}  # shard -> its backoff (doubles, capped)
        # shard -> its rebuild scheduled and not begun yet (covers every segment introduced
        # meanwhile); every rebuild task, begun or not, is in `_rebuilds` (`stop` cancels them).
        self._rebuild_pending: dict[int, asyncio.Task[None]] = {}
        self._rebuild_pending_epoch: dict[int, int] = {}  # shard -> the term its pending one is for
        self._rebuilds: set[asyncio.Task[None]] = set()
        self._stopping = False
        # One shard adopts at a time (`_adopt`): several shards' adoptions, one step each per
        # turn of the loop, held it a step times the shards (16 x 13-20 ms: renewals missed the
        # lease again; review, stop 71)
        self._adopting = asyncio.Lock()
        self.missing_segment_rebuilds = 0
        # One bucket per granted tenant that asked (bounded by the grants); refused answers.
        self._suspect_buckets: dict[str, TokenBucket] = {}
        self.suspects = SuspectRelay(lambda: self._nc, self._tenant_may_suspect)
        self._shard_map = ShardMapServer(self.shard_map, lambda tenant: tenant in self.grants)
        self._log = get_logger("kvfabric.directory.shard_host").bind(instance_id=instance_id)

    # ---- endpoints ---------------------------------------------------------------------------

    def attach(self, runtime: ServiceRuntime) -> None:
        self._runtime = runtime  # each shard shell's tasks are watched (`ServiceRuntime.watch`)
        # Releases, unpins and aborts only give resources back: their own in-flight lane
        # (`ServiceRuntime`), never refused because lookups or puts fill the service. Segments'
        # heartbeats share it: refused `busy` while writes filled the service (their handlers
        # waiting on a stuck events stream), they never reached the core, whose next tick
        # declared every segment down (review, 2026-12-06). A heartbeat emits an event only
        # where it introduces its segment to a shard (`_broadcast`: those shards go last).
        for verb, kind in VERBS.items():
            runtime.add_endpoint(
                verb,
                self._endpoint(verb),
                request=kind,
                decoder=m.request_decoder,
                instance=self.instance_id,
                gives_back=verb in GIVEBACK_VERBS or verb in LIVENESS_VERBS,
            )
        for verb in sorted(TENANT_VERBS):
            pad = self.lookup_reply_min_ms if verb == "lookup" else 0  # hits and misses alike
            runtime.add_tenant_endpoint(
                verb,
                self._tenant_endpoint(verb, VERBS[verb], fair=verb not in GIVEBACK_VERBS),
                reply_min_ms=pad,
                instance=self.instance_id,
                gives_back=verb in GIVEBACK_VERBS,
            )
        # A reader's corruption report, relayed to the segment (`kvfabric.directory.suspects`).
        runtime.add_endpoint(
            SUSPECT_VERB, self._on_suspect, request=m.ReplicaSuspect, decoder=m.request_decoder
        )
        # Never tarpitted (`kvfabric.runtime.tarpit`): a tenant's reports of corrupt replicas
        # protect every tenant (and are addressed to every instance, not to this one).
        runtime.add_tenant_endpoint(SUSPECT_VERB, self._on_tenant_suspect, tarpittable=False)
        # One prefix's lookups / one hit's releases for every shard led here (`lookup_many`).
        self._attach_many(runtime, LOOKUP_MANY_VERB, m.LookupMany, self.lookup_many, self.lookup_reply_min_ms)
        self._attach_many(
            runtime, RELEASE_MANY_VERB, m.LeaseReleaseMany, self.release_many, 0, gives_back=True
        )

    def _attach_many(
        self,
        runtime: ServiceRuntime,
        verb: str,
        kind: type[M],
        many: _Many[M],
        pad: int,
        *,
        gives_back: bool = False,
    ) -> None:
        runtime.add_endpoint(
            verb,
            self._many_endpoint(many),
            request=kind,
            decoder=m.request_decoder,
            instance=self.instance_id,
            gives_back=gives_back,
        )
        runtime.add_tenant_endpoint(
            verb,
            self._many_tenant_endpoint(kind, many, fair=not gives_back),
            reply_min_ms=pad,
            instance=self.instance_id,
            gives_back=gives_back,
        )

    def _decode(self, data: bytes, kind: type[M]) -> M:
        """A tenant's request, decoded by hand (the service plane's are decoded by the runtime:
        `request=` at registration): its fair turn, or its give-back's early refusal, is taken
        before decoding, so a tenant past its share costs no decode (`_tenant_admitted`)."""
        message = m.request_decoder.decode(data)
        if not isinstance(message, kind):
            raise BadRequest(f"this endpoint takes {kind.__name__}, got {type(message).__name__}")
        return message

    async def _tenant_admitted(self, tenant: str, *, fair: bool) -> authz.TenantGrant:
        """The tenant's grant once it may be decoded: refused `unauthorized` without one; a fair
        verb refused early when its queue is full or its bucket empty, a give-back when its
        tenant's give-backs are refusing (`kvfabric.directory.fair`) — before any decoding."""
        grant = self.grants.get(tenant)
        if grant is None:
            raise Unauthorized(f"tenant {tenant!r} has no share domains here")
        if self.fair is not None:
            if fair:
                await self.fair.refuse_early(tenant)
            else:
                await self.fair.giveback_refuse_early(tenant)
        return grant

    def _shell(self, message: msgspec.Struct) -> DirectoryShell:
        shard = shard_of_request(message, self.shards)
        shell = self.shells.get(shard)
        if shell is None:
            raise WrongShard(f"instance {self.instance_id} does not lead shard {shard}", shard=shard)
        return shell

    def _endpoint(self, verb: str) -> RequestHandler[msgspec.Struct]:
        async def handle(message: msgspec.Struct, headers: Mapping[str, str]) -> msgspec.Struct:
            if verb in BROADCAST_VERBS:
                return await self._broadcast(message)
            return await self._shell(message).handle(message)

        return handle

    def _tenant_endpoint(self, verb: str, kind: type[msgspec.Struct], *, fair: bool) -> TenantHandler:
        async def handle(data: bytes, headers: Mapping[str, str], tenant: str) -> msgspec.Struct:
            grant = await self._tenant_admitted(tenant, fair=fair)
            gate = self.fair if fair else None
            message = self._decode(data, kind)

            async def run(request: msgspec.Struct) -> msgspec.Struct:
                return await self._shell(request).handle_tenant(request, verb, grant)

            if not fair:
                return await give_back(self.fair, tenant, message, run)
            if gate is None:
                return await run(message)
            async with gate.turn(tenant, fair_ids(message), sender_wait_s(headers)):
                reply = await run(message)
                gate.charge_more(tenant, reply_extra_ids(message, reply))
                return reply

        return handle

    async def _on_suspect(self, message: m.ReplicaSuspect, headers: Mapping[str, str]) -> msgspec.Struct:
        return await self.suspects.handle(message, None)

    async def _on_tenant_suspect(
        self, data: bytes, headers: Mapping[str, str], tenant: str
    ) -> msgspec.Struct:
        grant = self.grants.get(tenant)
        if grant is None:
            raise Unauthorized(f"tenant {tenant!r} has no share domains here")
        return await self.suspects.handle(self._decode(data, m.ReplicaSuspect), grant)

    def _tenant_may_suspect(self, tenant: str) -> bool:
        now_s = time.monotonic()
        bucket = self._suspect_buckets.get(tenant)
        if bucket is None:  # one per granted tenant that reported (bounded by the grants)
            rate = SUSPECTS_TENANT_PER_S
            bucket = self._suspect_buckets[tenant] = TokenBucket.full(rate, rate, now_s)
        return bucket.take(1, now_s)

    def _many_endpoint(self, many: _Many[M]) -> RequestHandler[M]:
        async def handle(message: M, headers: Mapping[str, str]) -> msgspec.Struct:
            return await many(message, None)

        return handle

    def _many_tenant_endpoint(self, kind: type[M], many: _Many[M], *, fair: bool) -> TenantHandler:
        async def handle(data: bytes, headers: Mapping[str, str], tenant: str) -> msgspec.Struct:
            grant = await self._tenant_admitted(tenant, fair=fair)
            gate = self.fair if fair else None
            message = self._decode(data, kind)
            if not fair:  # lease_release_many: a give-back
                if isinstance(message, m.LeaseReleaseMany):
                    check_release_many(message)  # the whole request's bounds, before any slice
                return await give_back(self.fair, tenant, message, lambda request: many(request, grant))
            if gate is None:
                return await many(message, grant)
            ids = sum(len(p.groups) for p in message.parts) if isinstance(message, m.LookupMany) else 0
            # within the sender's own wait, as a single request's turn (review, stop 68: a
            # lookup_many waited up to TURN_WAIT_S_MAX, then leased groups for a client gone)
            async with gate.turn(tenant, ids, sender_wait_s(headers)):
                reply = await many(message, grant)
                gate.charge_more(tenant, reply_extra_ids(message, reply))
                return reply

        return handle

    async def _part(
        self,
        message: msgspec.Struct,
        verb: str,
        grant: authz.TenantGrant | None,
        shard: int,
        reply_bytes_max: int | None = None,
    ) -> msgspec.Struct:
        """One part of a multi-shard request, exactly as the single-shard request `message`
        (a lookup's reply within `reply_bytes_max`: `reply_room`)."""
        if shard_of_request(message, self.shards) != shard:
            raise BadRequest("a part must name keys of its own shard", shard=shard)
        shell = self._shell(message)
        if grant is None:
            return await shell.handle(message, reply_bytes_max=reply_bytes_max)
        return await shell.handle_tenant(message, verb, grant, reply_bytes_max=reply_bytes_max)

    async def release_many(
        self, message: m.LeaseReleaseMany, grant: authz.TenantGrant | None
    ) -> m.LeaseReleaseManyReply:
        """Each part exactly as the batched `LeaseRelease` of its shard (`shard_requests`)."""
        return await shard_requests.release_many(message, grant, self._part)

    async def lookup_many(self, message: m.LookupMany, grant: authz.TenantGrant | None) -> m.LookupManyReply:
        """Each part exactly as the `Lookup` of its shard (`shard_requests`)."""
        return await shard_requests.lookup_many(message, grant, self._part)

    async def _broadcast(self, message: msgspec.Struct) -> msgspec.Struct:
        """A segment's registration or heartbeat: every shard core here sees it."""
        if isinstance(message, m.RegisterSegment):
            await self._remember_segment(message)
        shells = [(s, sh) for s, sh in sorted(self.shells.items()) if sh.may_act()]
        if isinstance(message, m.Heartbeat):
            # The shards that know the segment first: introducing it elsewhere emits
            # `segment_up`, which waits while that shard's events outbox is full, and the
            # shards after it would not hear this heartbeat meanwhile (review, 2026-12-06).
            shells.sort(key=lambda item: message.segment_id not in item[1].core.segments)
        first: msgspec.Struct | None = None
        epochs: list[m.ShardEpoch] = []
        for shard, shell in shells:
            try:
                if isinstance(message, m.Heartbeat) and message.segment_id not in shell.core.segments:
                    introduced = await self._introduce(shell, message)
                    # (Not when a rebuild replaced the shell meanwhile: its start asks the registry.)
                    holds = message.used_bytes > 0 or message.disk_objects > 0
                    if introduced and holds and self.shells.get(shard) is shell:
                        self._rebuild_later(shard, shell.core.epoch, message.segment_id)
                reply = await shell.handle(msgspec.structs.replace(message, epoch=0))
            except WrongShard:
                # Stopped (handed over, rebuilt) while an earlier shard's step waited: the others
                # still hear it. One such shard failed the whole broadcast, the segment's
                # registration with it (review, stop 68).
                continue
            current = self.shells.get(shard) is shell
            if isinstance(message, m.RegisterSegment) and message.disk_objects > 0 and current:
                # A restarted segment brings its disk tier back: adopt what it holds (the rebuild
                # asks every registered segment, this one included, for its report).
                self._rebuild_later(shard, shell.core.epoch, message.segment_id)
            epochs.append(m.ShardEpoch(shard, shell.core.epoch))
            first = first or reply
        if isinstance(first, m.SegmentRegistered | m.HeartbeatAck):
            return msgspec.structs.replace(first, shard_epochs=sorted(epochs, key=lambda e: e.shard))
        if isinstance(message, m.RegisterSegment):
            c = self.core_config
            return m.SegmentRegistered(
                epoch=0,
                heartbeat_interval_ms=c.heartbeat_interval_ms,
                heartbeat_timeout_ms=c.heartbeat_timeout_ms,
            )
        return m.HeartbeatAck(epoch=0)

    async def _introduce(self, shell: DirectoryShell, heartbeat: m.Heartbeat) -> bool:
        """A shard core that never saw a registered segment (it registered while the shard was
        being rebuilt, or did not answer that rebuild's report): register it there from the
        durable registry, same incarnation, instead of answering `not_found` (which makes the
        segment restart empty and lose every shard's objects). The core holds nothing of it
        yet: what it stores of this shard is found by a rebuild (`_rebuild_later`)."""
        registration = await self.registry.get(heartbeat.segment_id)
        if registration is None or registration.incarnation != heartbeat.incarnation:
            return False  # not the registered process: the core answers not_found
        await shell.handle(msgspec.structs.replace(registration, epoch=0))
        self._log.info("segment_introduced", shard=shell.core.shard, segment_id=heartbeat.segment_id)
        return True

    def _rebuild_later(self, shard: int, epoch: int, segment_id: str) -> None:
        """Rebuild `shard` once its backoff allows (never dropped: the segment is known to the
        core from now on, so no later heartbeat would ask again). One rebuild per shard not yet
        begun covers every segment missed meanwhile: it asks all registered segments."""
        shell = self.shells.get(shard)
        if shell is not None and shell.core.epoch == epoch:
            # Until the rebuild replaces this core, the orphans it freed at adoption stay held
            # past its grace: the rebuild may find their groups whole (a rank on the late
            # segment). Without this a wait past the 30 s grace lost them (review, stop 65).
            held = shell.core.hold_orphans()
            if held:
                self._log.info("orphans_held_for_rebuild", shard=shard, epoch=epoch, orphans=held)
        pending = self._rebuild_pending.get(shard)
        if pending is not None and not pending.done() and self._rebuild_pending_epoch.get(shard) != epoch:
            # Asked for under an earlier term and not begun: it would find the epoch changed and
            # end, and this term's rebuild, swallowed here, would never run (the segment is known
            # to this core from now on), its orphans held for good (review, stop 66).
            pending.cancel()
            pending = None
        if self._stopping or (pending is not None and not pending.done()):
            return
        now_s = self._clock()
        if self._rebuild_epoch.get(shard, epoch) != epoch:  # another term: its backoff starts over
            self._rebuild_last_s.pop(shard, None)
        last_s = self._rebuild_last_s.get(shard)
        quiet = last_s is None or now_s - last_s > MISSING_SEGMENT_REBUILD_S_MAX
        if quiet:  # the first rebuild in a while: at once, and the next one after the shortest wait
            self._rebuild_wait_s[shard] = MISSING_SEGMENT_REBUILD_S_MIN
        delay_s = 0.0 if last_s is None else max(0.0, last_s + self._rebuild_wait_s[shard] - now_s)
        self._log.warning(
            "shard_rebuild_for_missing_segment",
            shard=shard,
            epoch=epoch,
            segment_id=segment_id,
            delay_s=round(delay_s, 1),
        )
        task = asyncio.create_task(
            self._rebuild(shard, epoch, delay_s, backoff=not quiet), name=f"directory-rebuild-{shard}"
        )
        self._rebuild_pending[shard] = task
        self._rebuild_pending_epoch[shard] = epoch
        self._rebuilds.add(task)  # owned here until done (stop() cancels it)

        def done(finished: asyncio.Task[None]) -> None:
            self._rebuilds.discard(finished)
            if self._rebuild_pending.get(shard) is finished:
                del self._rebuild_pending[shard]

        task.add_done_callback(done)

    async def _rebuild(self, shard: int, epoch: int, delay_s: float, *, backoff: bool) -> None:
        """The rebuild `_rebuild_later` scheduled; with `backoff`, the wait before the next one
        doubles (the first after a quiet spell is at once, the second `_MIN` later, ...)."""
        await asyncio.sleep(delay_s)
        # A start of this shard still running (its shell may already serve: the heartbeat that
        # introduced the segment reached it) asked the segments before that introduction, so
        # it may not cover it: wait for it to end, then rebuild (cancelled by `stop`).
        while (start := self._starting.get(shard)) is not None and not self._stopping:
            await start.wait()
        shell = self.shells.get(shard)
        if self._stopping or shell is None or shell.core.epoch != epoch:
            return  # handed over or lost: the next start asks every segment anyway
        if self._rebuild_pending.get(shard) is asyncio.current_task():
            # Begun: its start asks the segments from now on, and a segment introduced to the new
            # core during that start was missed by it; such a one schedules the next rebuild.
            del self._rebuild_pending[shard]
        self._rebuild_last_s[shard] = self._clock()
        self._rebuild_epoch[shard] = epoch
        if backoff:
            wait_s = self._rebuild_wait_s.get(shard, MISSING_SEGMENT_REBUILD_S_MIN)
            self._rebuild_wait_s[shard] = min(wait_s * 2, MISSING_SEGMENT_REBUILD_S_MAX)
        self.missing_segment_rebuilds += 1
        # The old core stops acting before the new one exists: no tick, request or free of it
        # overlaps the new core (same epoch: segments could not tell their frees apart), and its
        # queued events go out before the new core's.
        await self.stop_shard(shard, drain_s=MISSING_SEGMENT_DRAIN_S, background=False)
        if self.may_act(shard, epoch) and not self._stopping:
            await self.restart_shard(shard, epoch)

    async def _remember_segment(self, registration: m.RegisterSegment) -> None:
        """The next leader of any shard asks the segments in this registry what they hold: no
        registration is acknowledged before it is durable (the segment retries a failed one)."""
        try:
            await self.registry.put(registration)
        except (TimeoutError, nats.errors.Error) as exc:
            raise Unavailable(f"segment registry not writable: {type(exc).__name__}") from None

    # ---- the shard map (every instance answers; not a queue group) -----------------------------

    def shard_map(self) -> m.ShardMapReply:
        leaders = [
            m.ShardLeader(shard, self.instance_id, shell.core.epoch)
            for shard, shell in sorted(self.shells.items())
            if shell.may_act()
        ]
        return m.ShardMapReply(shards=self.shards, instance=self.instance_id, leaders=leaders)

    async def serve_shard_map(self, nc: NatsClient) -> None:
        self._nc = nc
        self._subs = await self._shard_map.subscribe(nc)

    @property
    def shard_map_rate_limited(self) -> int:
        """Tenants' shard_map requests left unanswered (`kvfabric.directory.shard_map`)."""
        return self._shard_map.rate_limited

    # ---- shards come and go --------------------------------------------------------------------

    async def start_shard(self, shard: int, epoch: int) -> None:
        """Rebuild `shard` from the segments under `epoch`, then serve it (see the docstring).
        A start asked for while one of the same shard runs is taken over by the running one
        (it starts the newest epoch asked for once it is done): a shard this instance leads is
        never left unserved."""
        self._wanted[shard] = epoch
        if shard in self._starting:
            return
        ended = self._starting[shard] = asyncio.Event()
        try:
            while True:
                wanted = self._wanted[shard]
                await self._start_once(shard, wanted)
                if self._wanted[shard] == wanted:
                    break
        finally:
            del self._starting[shard]
            self._wanted.pop(shard, None)
            ended.set()
        if not self._starting and not self._settling:
            self._settling = True  # shards won in one election round start together: wait for them
            asyncio.get_running_loop().call_later(SETTLE_S, self._settled)

    async def _start_once(self, shard: int, epoch: int) -> None:
        old = self.shells.get(shard)
        if old is not None and old.core.epoch == epoch:
            return
        if old is not None:
            await self.stop_shard(shard)  # a stale term of ours (we lost it, then won it again)
        if not self.may_act(shard, epoch):
            return
        began = time.monotonic()
        holdings = await gather_holdings(
            self._nc_required(), await self.registry.all(), epoch, shard=shard, shards=self.shards
        )
        # Ids start from the wall clock (256 a ms): a core rebuilt at the same epoch (a missing
        # segment, `_start_once` again) never reissues a ticket, lease or pin id of the one before,
        # which a late confirm or release could still name (review, 2026-12-05).
        core = DirectoryCore(self.core_config, epoch=epoch, shard=shard, first_id=max(1, now_ms() << 8))
        effects = await self._adopt(core, holdings, lambda: self.may_act(shard, epoch) and not self._stopping)
        shell = self.make_shell(core)
        shell.may_act = lambda: self.may_act(shard, epoch)
        if effects is None or not self.may_act(shard, epoch):  # lost (or handed over) while rebuilding
            self._log.info("shard_start_abandoned", shard=shard, epoch=epoch)
            return
        self._loose_shells.add(shell)  # until it serves or is stopped (a cancelled start)
        await shell.start(self._nc_required())
        if not self.may_act(shard, epoch):
            await shell.stop()
            self._loose_shells.discard(shell)
            self._log.info("shard_start_abandoned", shard=shard, epoch=epoch)
            return
        self.shells[shard] = shell
        self._loose_shells.discard(shell)
        self._rebuild_ms[shard] = round((time.monotonic() - began) * 1000)
        if self._runtime is not None:  # a ticker that raised ended for good while the shard
            for task in shell.tasks:  # served on (leases never expiring, frees never retried)
                self._runtime.watch(task, task.get_name())
        await shell.perform(effects)
        self._log.info(
            "shard_started",
            shard=shard,
            epoch=epoch,
            segments=len(holdings),
            groups_adopted=len(core.published),
            grace_until_ms=core.grace_until_ms,
        )

    async def _adopt(
        self, core: DirectoryCore, holdings: list[SegmentHolding], going_on: Callable[[], bool]
    ) -> list[Effect] | None:
        """`core` adopts `holdings` in steps of `ADOPT_STEP_OBJECTS` objects, each one timed core
        call (`CORE_CALLS`, "adopt"), the event loop yielded between: the leader leases' renewals
        and every other shard's requests go on (review, stop 71: in one call, a shard of ~65,000
        objects or more held the loop past the lease, lost every lease of the instance, and the
        next leader did the same). Steps, not a thread: a thread's pure-Python adoption would
        still hold the GIL most of the time, and could not be stopped when the shard is lost.
        Nothing else sees `core` until it is served (it is new, and installed after), so what
        runs between steps cannot touch it. Each step is given the time it runs at: the
        segments count as heard at the last. Returns the effects, or None once `going_on()`
        is false (the shard lost or the host stopping: the rest is not worth adopting). One
        shard adopts at a time (`_adopting`); its grace starts when its turn comes (each
        adoption's own, as when they were one call each)."""
        async with self._adopting:
            if not going_on():
                return None
            steps = core.adopt_steps(holdings, now_ms(), ADOPT_STEP_OBJECTS)
            step: Callable[[], None] = functools.partial(next, steps)
            try:
                while True:
                    try:
                        CORE_CALLS.timed("adopt", step)
                    except StopIteration as done:
                        effects: list[Effect] = done.value
                        return effects
                    await asyncio.sleep(0)
                    if not going_on():
                        return None
                    step = functools.partial(steps.send, now_ms())
            finally:
                steps.close()

    def _settled(self) -> None:
        """Logged when this instance's led shards stopped changing (tests and operators wait
        for it): `epoch` is the newest epoch among them."""
        self._settling = False
        if self._starting:
            return  # logged when those are done
        # The rebuilt shards' state is long-lived: out of the cyclic GC's walk (gcpolicy).
        freeze_long_lived("shards_rebuilt")
        led = sorted(self.shells)
        if led == self._announced:
            return
        self._announced = led
        cores = [self.shells[s].core for s in led]
        self._log.info(
            "directory_started",
            shards_led=len(led),
            shards=self.shards,
            epoch=max((c.epoch for c in cores), default=0),
            groups_adopted=sum(len(c.published) for c in cores),
            segments=max((len(c.segments) for c in cores), default=0),
            rebuild_ms=max((self._rebuild_ms.get(s, 0) for s in led), default=0),
            metrics_port=self.metrics_port,
            grace_until_ms=max((c.grace_until_ms for c in cores), default=0),
        )

    async def stop_shard(self, shard: int, *, drain_s: float = 0.0, background: bool = True) -> None:
        """Stop serving `shard` at once: the shell serves, ticks and frees nothing from now on.
        With `drain_s` > 0 its already queued events still go to JetStream, for up to `drain_s`:
        in the background on a handover (the caller releases the lease key meanwhile), or before
        returning (`background=False`: a rebuild, whose new core's events must come after)."""
        shell = self._unserve(shard)
        if shell is None:
            return
        shell.may_act = lambda: False
        if drain_s > 0 and background:
            task = asyncio.create_task(self._retire(shell, drain_s), name=f"directory-retire-{shard}")
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)
        else:
            await self._retire(shell, drain_s)
        self._log.info("shard_stopped", shard=shard, epoch=shell.core.epoch)

    async def _retire(self, shell: DirectoryShell, drain_s: float) -> None:
        self._loose_shells.add(shell)
        try:
            await shell.drain_events(drain_s)
            if stuck := await shell.stop():
                self._stuck_retired |= stuck
            self._loose_shells.discard(shell)  # not on a cancellation or failure: `stop` stops it
        finally:
            self._fold(shell)

    def _unserve(self, shard: int) -> DirectoryShell | None:
        """Take `shard`'s shell out of `shells`; its counters stay exported (`draining`)."""
        with self.retired.lock:
            shell = self.shells.pop(shard, None)
            if shell is not None:
                self.draining.add(shell)
        return shell

    def _fold(self, shell: DirectoryShell) -> None:
        """`shell` is done (drained and stopped, or given up on): its counters join `retired`."""
        with self.retired.lock:
            if shell in self.draining:
                self.draining.discard(shell)
                self.retired.fold(shell)

    async def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> list[str]:
        """Stop serving and end every task of the host within `timeout_s`: rebuilds cancelled,
        shells stopped, handed-over shells given what is left of half of it to drain. Returns the
        names of the tasks still running then (a caller that gets any exits the process);
        corruption reports being relayed are cancelled (the scrubber still finds the bytes)."""
        loop = asyncio.get_running_loop()
        deadline_s = loop.time() + timeout_s

        def left_s() -> float:
            return max(0.0, deadline_s - loop.time())

        self._stopping = True  # no rebuild starts (or restarts a shard) from now on
        stuck = await cancel_and_wait(list(self._rebuilds), left_s())
        stuck |= await cancel_and_wait(self.suspects.in_flight(), left_s())  # corruption reports in flight
        for sub in self._subs:
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                await asyncio.wait_for(sub.unsubscribe(), left_s())  # type: ignore[attr-defined]
        shells = [shell for shard in sorted(self.shells) if (shell := self._unserve(shard)) is not None]
        for shell in shells:
            shell.may_act = lambda: False
            self._log.info("shard_stopped", shard=shell.core.shard, epoch=shell.core.epoch)
        if self._retiring:
            await asyncio.wait(self._retiring, timeout=left_s() / 2)
        stuck |= await cancel_and_wait(self._retiring, left_s())
        for shell in [*shells, *self._loose_shells]:
            stuck |= await shell.stop(left_s())
            self._fold(shell)
        stuck |= await cancel_and_wait([t for t in self._stuck_retired if not t.done()], left_s())
        return sorted(task.get_name() for task in stuck)

    def _nc_required(self) -> NatsClient:
        if self._nc is None:
            raise Unavailable("directory host not started")
        return self._nc
