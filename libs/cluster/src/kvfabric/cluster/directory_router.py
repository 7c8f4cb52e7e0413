"""Where a directory request goes: the cached shard map, and calls routed by shard.

Every directory caller (engines' clients, segments, the eviction, repair and prefetch services,
kvctl, tests) talks to the directory through a `DirectoryRouter`:

- **The map.** Keys belong to virtual shards (`kvfabric.proto.shards`); each shard is led by one
  directory instance under an epoch (the revision of its leader lease in the JetStream KV bucket
  `KVF_DIRECTORY_LEADERS`, which *is* the durable shard map). The router asks every instance at
  once (`shard_map`, not a queue group: standbys answer too, with nothing) and assembles the map
  from what the leaders themselves say they lead: no KV rights needed (tenants have none), and
  no stale entry of a dead instance survives a refresh. It keeps the newest epoch per shard.
- **Refresh** when a reply says `wrong_shard`, when the instance is gone (`no responders`) or no
  longer leads (`unavailable`), or when a shard has no known leader. Concurrent refreshes share
  one round; at most `retries_max` attempts per call, `retry_wait_s` (+0–50 %) apart (a failover
  takes a lease TTL: callers then fall back — a miss, a recompute — rather than wait).
- **Fencing.** A request that carries `epoch = 0` is sent with the newest epoch known for its
  shard (so a replaced leader refuses it); a reply with an older epoch than one already seen
  comes from a replaced leader: `StaleGeneration`, never used. A leader that refuses such a
  request as stale (`stale_generation` on `directory_epoch`: its epoch moved past the map's,
  say it lost the shard and won it back) refused it before it ran: the route is forgotten and
  the request asked again with the refreshed map (review, 2026-12-05: the caller got
  `stale_generation` for that shard until something else refreshed the map).
- `ask(shard, ...)` for a keyed request, `ask_all(...)` for what every leading instance must see
  (segment registration and heartbeats, listings); its replies cover disjoint shard sets.
  `ask_instance(instance, ...)` for one request that covers several shards an instance leads
  (`lookup_many`): no retry; the caller fences each part (`saw`) and re-asks a failed part's shard.

Owns nothing but the map; the NATS connection belongs to the caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Final

import msgspec
import nats.errors
from nats.aio.client import Client as NatsClient

from kvfabric.cluster.requests import request
from kvfabric.format.errors import BadRequest, Indeterminate, KvfError, StaleGeneration, Unavailable
from kvfabric.format.invariant import invariant
from kvfabric.proto import directory as m
from kvfabric.proto.codec import encode
from kvfabric.proto.shards import shard_of
from kvfabric.proto.subjects import (
    Service,
    endpoint_subject,
    instance_subject,
    tenant_instance_subject,
    tenant_subject,
)

__all__ = ["DirectoryRouter", "ShardRoute", "merge_map"]

GATHER_S_DEFAULT: Final = 0.25  # how long a refresh waits for instances' parts of the map
RETRIES_MAX_DEFAULT: Final = 4
RETRY_WAIT_S_DEFAULT: Final = 0.25
REFRESH_MIN_INTERVAL_S: Final = 0.05  # failing calls share one refresh per interval


@dataclass(frozen=True, slots=True)
class ShardRoute:
    instance: str
    epoch: int


def merge_map(parts: list[m.ShardMapReply], shards: int, known: Mapping[int, int]) -> dict[int, ShardRoute]:
    """The shard map from instances' parts (pure): per shard, the claim with the newest epoch.
    Parts with another shard count are ignored (every instance must run with the same one: the
    directory refuses to start otherwise), as are claims older than an epoch already `known`
    for the shard (a deposed leader that has not noticed yet)."""
    routes: dict[int, ShardRoute] = {}
    for part in parts:
        if part.shards != shards:
            continue
        for leader in part.leaders:
            if not 0 <= leader.shard < shards or leader.epoch < known.get(leader.shard, 0):
                continue
            seen = routes.get(leader.shard)
            if seen is None or leader.epoch > seen.epoch:
                routes[leader.shard] = ShardRoute(leader.instance, leader.epoch)
    return routes


class DirectoryRouter:
    """The shard map of one caller and its routed requests (see the module docstring)."""

    def __init__(
        self,
        nc: NatsClient,
        *,
        tenant: str = "",
        gather_s: float = GATHER_S_DEFAULT,
        retries_max: int = RETRIES_MAX_DEFAULT,
        retry_wait_s: float = RETRY_WAIT_S_DEFAULT,
    ) -> None:
        invariant(retries_max >= 1, "retries_max must be positive", retries_max=retries_max)
        self.nc = nc
        self.tenant = tenant
        self.gather_s = gather_s
        self.retries_max = retries_max
        self.retry_wait_s = retry_wait_s
        self.shards = 0  # unknown until an instance answered
        self.routes: dict[int, ShardRoute] = {}
        self.epochs: dict[int, int] = {}  # newest epoch seen per shard (never decreases)
        self.refreshes = 0
        self._refreshing: asyncio.Task[None] | None = None
        self._refreshed_s = 0.0
        self._suspect = False  # `forget_all` was called: refresh before the next `ask_all`

    # ---- the map -------------------------------------------------------------------------------

    def shard_of(self, raw: bytes) -> int:
        """The shard of a group id, key, group key or chain hash. `Unavailable` while the shard
        count is unknown (call `known_shards` first): a guess would send keys to a wrong shard
        under that shard's epoch. `BadRequest` for bytes that hold no chain hash (a `ValueError`
        here was no `KvfError`: a caller that handles those lost the request unanswered)."""
        if not self.shards:
            raise Unavailable("the directory shard map is not known yet")
        try:
            return shard_of(raw, self.shards)
        except ValueError as exc:
            raise BadRequest(f"malformed key: {exc}", length=len(raw)) from None

    async def known_shards(self) -> int:
        """The shard count, asking the instances for the map first if it is not known yet;
        `Unavailable` when no instance answers."""
        if not self.shards:
            await self.refresh()
        if not self.shards:
            raise Unavailable("no directory instance answered the shard map")
        return self.shards

    @property
    def complete(self) -> bool:
        return self.shards > 0 and not self._suspect and len(self.routes) == self.shards

    def instances(self) -> list[str]:
        return sorted({route.instance for route in self.routes.values()})

    async def refresh(self) -> None:
        """Ask every instance which shards it leads; replace the map. Shared by concurrent calls."""
        if self._refreshing is None or self._refreshing.done():
            wait = REFRESH_MIN_INTERVAL_S - (time.monotonic() - self._refreshed_s)
            self._refreshing = asyncio.ensure_future(self._refresh(max(0.0, wait)))
        await asyncio.shield(self._refreshing)

    async def _refresh(self, delay_s: float) -> None:
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        subject = (
            tenant_subject(Service.DIRECTORY, self.tenant, "shard_map")
            if self.tenant
            else endpoint_subject(Service.DIRECTORY, "shard_map")
        )
        inbox = self.nc.new_inbox()
        parts: list[m.ShardMapReply] = []
        covered: set[int] = set()
        done = asyncio.Event()
        shards = 0

        async def collect(msg: object) -> None:
            nonlocal shards
            try:
                part = m.reply_decoder.decode(msg.data)  # type: ignore[attr-defined]
            except KvfError:
                return
            if not isinstance(part, m.ShardMapReply):
                return
            parts.append(part)
            shards = max(shards, part.shards)
            covered.update(leader.shard for leader in part.leaders)
            if shards and len(covered) >= shards:
                done.set()  # every shard has a leader: no need to wait for slower standbys

        # NATS's own errors (no connection, the reconnect buffer full during an outage) are
        # `Unavailable`, as a request's are: a caller's loop that retries on `KvfError` (the
        # segment's heartbeats) ended on them (review, 2026-12-06).
        try:
            sub = await self.nc.subscribe(inbox, cb=collect)
        except nats.errors.Error as exc:
            raise Unavailable(f"shard map not asked: {exc!r}") from exc
        try:
            await self.nc.publish(subject, encode(m.GetShardMap()), reply=inbox)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), self.gather_s)
        except nats.errors.Error as exc:
            raise Unavailable(f"shard map not asked: {exc!r}") from exc
        finally:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        self.refreshes += 1
        self._refreshed_s = time.monotonic()
        if not parts:
            return  # nobody answered: keep what we had (callers get `unavailable` from the leaders)
        self._suspect = False
        routes = merge_map(parts, shards, self.epochs)
        if shards == self.shards:
            # A shard no answer claimed keeps its route while its instance did not answer this
            # round (slower than `gather_s`, not gone: a gone one's requests find no responders
            # and forget it). Replacing the map whole dropped every shard of a loaded instance
            # at each refresh, its lookups and saves failing while it was healthy (review, stop 68).
            answered = {part.instance for part in parts}
            for shard, route in self.routes.items():
                if shard not in routes and route.instance not in answered:
                    routes[shard] = route
        self.shards = shards
        self.routes = routes
        for s, r in self.routes.items():
            self.epochs[s] = max(self.epochs.get(s, 0), r.epoch)

    def forget(self, shard: int) -> None:
        self.routes.pop(shard, None)

    def forget_if(self, shard: int, instance: str) -> None:
        """Forget `shard`'s route if it still names `instance` (a newer one stays)."""
        route = self.routes.get(shard)
        if route is not None and route.instance == instance:
            self.routes.pop(shard, None)

    def forget_all(self) -> None:
        """The map is suspect (an instance did not answer): the next `ask_all` refreshes it. The
        routes stay until an instance answers: a refresh nobody answered in time (a directory
        slow under load) must not leave no one to send to. (Emptying them here once made a
        segment's heartbeats stop for as long as refreshes came back empty, until the directory
        declared it down and it restarted empty.)"""
        self._suspect = True

    # ---- requests ------------------------------------------------------------------------------

    def _subject(self, verb: str, instance: str) -> str:
        if self.tenant:
            return tenant_instance_subject(Service.DIRECTORY, self.tenant, verb, instance)
        return instance_subject(Service.DIRECTORY, verb, instance)

    def route(self, shard: int) -> ShardRoute | None:
        """The shard's known leader (None until a refresh finds one)."""
        return self.routes.get(shard)

    def saw(self, shard: int, reply: object) -> None:
        """Fence a reply for `shard` that came by another way than `ask` (a part of a multi-shard
        reply): `StaleGeneration` when it is older than an epoch already seen."""
        self._saw(shard, reply)

    async def ask_instance(
        self,
        instance: str,
        verb: str,
        message: msgspec.Struct,
        timeout_s: float,
        *,
        headers: Mapping[str, str] | None = None,
    ) -> m.DirectoryReply:
        """One request to `instance` itself, no retry (a multi-shard request: the caller fences
        each shard's part with `saw` and asks a failed part's shard with `ask`, which refreshes
        the map as it needs)."""
        return await request(
            self.nc, self._subject(verb, instance), message, m.reply_decoder, timeout_s, headers=headers
        )

    async def ask_any(self, verb: str, message: msgspec.Struct, timeout_s: float) -> m.DirectoryReply:
        """One request any instance may answer (its queue group: `replica_suspect`), no retry."""
        subject = (
            tenant_subject(Service.DIRECTORY, self.tenant, verb)
            if self.tenant
            else endpoint_subject(Service.DIRECTORY, verb)
        )
        return await request(self.nc, subject, message, m.reply_decoder, timeout_s)

    def _saw(self, shard: int, reply: object) -> None:
        epoch = getattr(reply, "epoch", 0)
        newest = self.epochs.get(shard, 0)
        if epoch and epoch < newest:
            raise StaleGeneration("directory_epoch", epoch, newest)
        if epoch > newest:
            self.epochs[shard] = epoch

    async def ask(
        self,
        shard: int,
        verb: str,
        message: msgspec.Struct,
        timeout_s: float,
        *,
        headers: Mapping[str, str] | None = None,
    ) -> m.DirectoryReply:
        """One request to the leader of `shard`; see the module docstring for retries/fencing."""
        last: KvfError = Unavailable(f"no directory instance leads shard {shard}", shard=shard)
        for attempt in range(self.retries_max):
            if attempt:  # jittered: callers failing together (a failover) do not retry in step
                await asyncio.sleep(self.retry_wait_s * random.uniform(1.0, 1.5))
            route = self.routes.get(shard)
            if route is None:
                await self.refresh()
                route = self.routes.get(shard)
                if route is None:
                    continue
            outgoing = message
            stamped = getattr(message, "epoch", None) == 0 and route.epoch > 0
            if stamped:
                outgoing = msgspec.structs.replace(message, epoch=route.epoch)
            try:
                reply = await request(
                    self.nc,
                    self._subject(verb, route.instance),
                    outgoing,
                    m.reply_decoder,
                    timeout_s,
                    headers=headers,
                )
            except Indeterminate:
                # It may have run: the caller decides (an idempotent retry, a read). The leader
                # may be hung or cut off: ask the map again before the next request.
                if self.routes.get(shard) == route:
                    self.forget(shard)
                raise
            except Unavailable as err:  # wrong_shard, deposed, stopping, gone: ask the map again
                last = err
                if self.routes.get(shard) == route:
                    self.forget(shard)
                continue
            except StaleGeneration as err:
                current = err.details.get("current")
                newer = isinstance(current, int) and current > route.epoch
                if not (stamped and err.details.get("kind") == "directory_epoch" and newer):
                    raise  # the caller's own epoch (a ticket's): a real conflict
                last = Unavailable(f"shard {shard}'s leader moved to epoch {current}", shard=shard)
                if self.routes.get(shard) == route:
                    self.forget(shard)
                continue
            self._saw(shard, reply)
            return reply
        raise last

    async def ask_all(
        self, verb: str, message: msgspec.Struct, timeout_s: float
    ) -> list[m.DirectoryReply | KvfError]:
        """`message` to every instance that leads a shard, concurrently: replies (or errors) in
        `instances()` order. Refreshes first when the map is incomplete."""
        if not self.complete:
            await self.refresh()
        instances = self.instances()

        async def one(instance: str) -> m.DirectoryReply | KvfError:
            try:
                return await request(
                    self.nc, self._subject(verb, instance), message, m.reply_decoder, timeout_s
                )
            except KvfError as err:
                return err

        return list(await asyncio.gather(*(one(i) for i in instances)))

    # ---- per-shard fan-out (tools, repair, eviction) --------------------------------------------

    async def each_shard(
        self, verb: str, message_for: Callable[[int], msgspec.Struct], timeout_s: float
    ) -> list[tuple[int, m.DirectoryReply]]:
        """`message_for(shard)` to the leader of every shard, concurrently; (shard, reply) in shard
        order. Raises the first error (a listing missing a shard would be silently partial)."""
        shards = await self.known_shards()

        async def one(shard: int) -> tuple[int, m.DirectoryReply]:
            return shard, await self.ask(shard, verb, message_for(shard), timeout_s)

        return list(await asyncio.gather(*(one(s) for s in range(shards))))

    async def segments(self, timeout_s: float) -> m.SegmentList:
        """The segment table as every shard sees it, merged: placements (`reserved_bytes`) summed
        over shards; a segment is up only if every shard has it up."""
        merged: dict[str, m.SegmentInfo] = {}
        for _, reply in await self.each_shard("list_segments", lambda s: m.ListSegments(shard=s), timeout_s):
            if not isinstance(reply, m.SegmentList):
                raise Unavailable(f"unexpected list_segments reply {type(reply).__name__}")
            for info in reply.segments:
                seen = merged.get(info.segment_id)
                if seen is None:
                    merged[info.segment_id] = info
                elif seen.incarnation == info.incarnation:
                    merged[info.segment_id] = msgspec.structs.replace(
                        seen,
                        up=seen.up and info.up,
                        draining=seen.draining or info.draining,
                        reserved_bytes=seen.reserved_bytes + info.reserved_bytes,
                    )
                elif info.incarnation > seen.incarnation:
                    merged[info.segment_id] = info
        return m.SegmentList(epoch=0, segments=[merged[k] for k in sorted(merged)])

    async def shard_pages(
        self, shard: int, query: m.ListGroups, timeout_s: float, pages_max: int
    ) -> AsyncIterator[m.GroupList]:
        """The pages of `query` in one shard (its `after` and `shard` are set here), following
        `next_after`, at most `pages_max`."""
        after = b""
        for _ in range(pages_max):
            page = await self.ask(
                shard, "list_groups", msgspec.structs.replace(query, after=after, shard=shard), timeout_s
            )
            if not isinstance(page, m.GroupList):
                raise Unavailable(f"unexpected list_groups reply {type(page).__name__}")
            yield page
            if not page.next_after:
                return
            after = page.next_after

    async def list_groups(
        self, query: m.ListGroups, timeout_s: float, pages_max: int
    ) -> list[m.GroupSummary]:
        """Every group matching `query`, shard by shard (at most `pages_max` pages per shard)."""
        out: list[m.GroupSummary] = []
        for shard in range(await self.known_shards()):
            async for page in self.shard_pages(shard, query, timeout_s, pages_max):
                out.extend(page.groups)
        return out
