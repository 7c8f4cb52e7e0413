"""One prefix's lookup over the sharded directory, and the one rule that merges the shards' answers
(the client's `lookup`, the prefetch service's hints; issue 26).

**Routing** (`lookup_by_instance`). A prefix's chunk groups hash to many shards (8 chunks over 16
shards: up to 8). One request per shard costs each of them a NATS round trip and the directory's
per-request work, concurrently on the same instance. So the shards an instance leads go to it in
one `lookup_many` request; each part is answered as that shard's `lookup` would be (authorized,
leased, fenced by its epoch), and a part that fails for a routing reason (`wrong_shard`,
`unavailable`: the map moved; `stale_generation`: the leader's epoch moved past the map's) is
asked again alone through `DirectoryRouter.ask`, which refreshes the map. A shard alone on its
instance is asked alone. An instance that has no `lookup_many` endpoint (an older directory:
`no responders`, and still leading once its shards answered alone) is remembered in `refused`
and asked shard by shard from then on; one that was restarting or gone is not. Leases granted
by a part whose reply never arrives (a timeout) expire at the directory, as for a single lookup.
A lookup whose caller gives up (cancelled: its own timeout, the engine, the client closing) lets
its requests run to their deadline and gives back whatever they granted once they answer
(`lookup_prefix`; review, stop 65: those leases were left to expire, 30 s by default).

**Merging** (`merge_lookups`, pure; `lookup_prefix` runs both and gives leases back):
- the hit ends at the first chunk any shard misses (never skipping a gap);
- a shard that fails (no reply, an error, a reply that is no `LookupReply`) misses from its
  first chunk on: the chunks before it still hit, and the failure is kept (`PrefixHit.failure`);
  the lookup raises it only when nothing hit;
- the lease of a shard with a chunk inside the hit is kept (it protects what will be read); the
  others protect nothing and are given back at once; all of them when the lookup raises.

Which rule won: until issue 26 the prefetch service failed a whole hint when any shard failed.
The client's rule won: a failed shard says nothing about the chunks before its first one, the
engine's lookup would hit and load them, and so a prefetch hint now stages exactly what the
client will load (docs/design.md 3, invariants 1 and 6: fold to the longest complete prefix; a
failure means recompute for the rest of the prefix, not for all of it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from kvfabric.cluster.directory_router import DirectoryRouter
from kvfabric.format.errors import BadRequest, KvfError, StaleGeneration, Unavailable, error_from_wire
from kvfabric.format.ids import GroupId
from kvfabric.proto import directory as m
from kvfabric.proto.common import TRACE_ID_HEADER

__all__ = [
    "LOOKUP_MANY_VERB",
    "RELEASE_MANY_VERB",
    "Lease",
    "PrefixHit",
    "ShardResult",
    "lookup_by_instance",
    "lookup_prefix",
    "merge_lookups",
]

# Requests of lookups whose callers gave up, and the give-backs of what they granted: referenced
# here until done (the loop keeps only weak references to tasks).
_LATE: set[asyncio.Future[Any]] = set()

LOOKUP_MANY_VERB: Final = "lookup_many"
RELEASE_MANY_VERB: Final = "lease_release_many"  # the hit's leases, given back the same way

ShardResult = m.DirectoryReply | BaseException  # a shard's reply, or why it has none
Lease = tuple[int, int]  # (shard, lease id): a lease id means something only to its shard


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """The merged answer of every shard holding some of a prefix's chunks."""

    hit_chunks: int  # the prefix's chunks every shard found, from the first
    objects: list[m.ObjectLocation]  # what the shards found (callers keep those inside the hit)
    leases: list[Lease]  # the kept leases: shards with a chunk inside the hit
    expires_ms: int  # the earliest expiry of the kept leases (0: none kept)
    failure: BaseException | None  # the first failed shard's error (None: every shard answered)


async def lookup_by_instance(
    router: DirectoryRouter,
    lookups: Mapping[int, m.Lookup],
    *,
    timeout_s: float,
    trace_id: str,
    refused: set[str],
    budget_s: float | None = None,
    give_back_late: Callable[[list[Lease]], Awaitable[None]] | None = None,
) -> dict[int, ShardResult]:
    """Every shard's lookup (`lookups`: shard -> its `Lookup`, all of one holder, members and
    ttl), batched per leading instance; shard -> its reply or its error (never raises).
    `budget_s`: the shards not answered by then are failures (`TimeoutError`) at once, their
    requests left to end on their own and what leases they get given to `give_back_late`: one
    shard failing over (its router's refresh and retries, past the caller's deadline) turned the
    whole lookup into a miss, the shards that had answered thrown away (review, stop 70)."""
    headers = {TRACE_ID_HEADER: trace_id} if trace_id else None
    by_instance: dict[str, list[int]] = {}
    alone: list[int] = []
    for shard in lookups:
        route = router.route(shard)
        if route is None or route.instance in refused:
            alone.append(shard)
        else:
            by_instance.setdefault(route.instance, []).append(shard)
    for instance, shards in list(by_instance.items()):
        if len(shards) == 1:
            alone.extend(by_instance.pop(instance))

    async def single(shard: int) -> dict[int, ShardResult]:
        try:
            return {shard: await router.ask(shard, "lookup", lookups[shard], timeout_s, headers=headers)}
        except Exception as err:  # a shard's failure is its result
            return {shard: err}

    async def singles(shards: Sequence[int]) -> dict[int, ShardResult]:
        out: dict[int, ShardResult] = {}
        for part in await asyncio.gather(*(single(s) for s in shards)):
            out.update(part)
        return out

    async def many(instance: str, shards: list[int]) -> dict[int, ShardResult]:
        first = lookups[shards[0]]
        parts = []
        for shard in shards:
            route = router.route(shard)
            epoch = route.epoch if route is not None else 0
            parts.append(m.LookupPart(shard=shard, groups=lookups[shard].groups, epoch=epoch))
        message = m.LookupMany(
            holder_id=first.holder_id,
            parts=parts,
            members=first.members,
            lease_ttl_ms=first.lease_ttl_ms,
            count_hits=first.count_hits,
        )
        try:
            reply = await router.ask_instance(instance, LOOKUP_MANY_VERB, message, timeout_s, headers=headers)
        except Unavailable as err:
            alone_results = await singles(shards)
            # Shard by shard from now on only if the instance still leads after answering them
            # (a directory without `lookup_many`); one restarting or gone (the singles found
            # another leader, or none) is asked in batches again (review, 2026-12-05: a failover
            # turned batching off for the process's life).
            still_leads = any((r := router.route(s)) is not None and r.instance == instance for s in shards)
            if "no responders" in err.message and still_leads:
                refused.add(instance)
            return alone_results
        except Exception as err:  # e.g. Indeterminate: every part failed alike
            return dict.fromkeys(shards, err)
        if not isinstance(reply, m.LookupManyReply):
            return dict.fromkeys(shards, KvfError(f"unexpected lookup_many reply {type(reply).__name__}"))
        answered = {part.shard: part for part in reply.parts}
        out: dict[int, ShardResult] = {}
        again: list[int] = []
        for shard in shards:
            part = answered.get(shard)
            if part is None:
                again.append(shard)
            elif part.reply is not None:
                try:
                    router.saw(shard, part.reply)  # a replaced leader's view is never used
                    out[shard] = part.reply
                except KvfError as err:
                    out[shard] = err
            else:
                error = error_from_wire(part.error, part.message)
                if isinstance(error, StaleGeneration):
                    # the part carried the map's epoch and the leader's is newer (it lost the
                    # shard and won it back): refused before it ran; ask the map again
                    router.forget_if(shard, instance)
                    again.append(shard)
                elif isinstance(error, Unavailable):  # wrong_shard, stopping: the map moved
                    # forgotten too: asked alone through the same route, it was refused again
                    # before the refresh, a round trip and a retry wait later (review, stop 68)
                    router.forget_if(shard, instance)
                    again.append(shard)
                else:
                    out[shard] = error
        out.update(await singles(again))
        return out

    results: dict[int, ShardResult] = {}
    if budget_s is None:
        for part in await asyncio.gather(singles(alone), *(many(i, ss) for i, ss in by_instance.items())):
            results.update(part)
        return results
    asking = {asyncio.ensure_future(single(s)): [s] for s in alone}
    asking.update({asyncio.ensure_future(many(i, ss)): ss for i, ss in by_instance.items()})
    try:
        done, pending = await asyncio.wait(asking, timeout=budget_s)
    except asyncio.CancelledError:  # (the caller's own cut: every request still gives back)
        for task in asking:
            if give_back_late is not None:
                _give_back_when_answered(task, give_back_late)
        raise
    for task in done:
        results.update(task.result())  # (never raises: a shard's failure is its result)
    for task in pending:
        for shard in asking[task]:
            results[shard] = TimeoutError(f"shard {shard}: no lookup answer within {budget_s:.2f} s")
        if give_back_late is not None:
            _give_back_when_answered(task, give_back_late)
        else:
            _LATE.add(task)  # (ends by its own deadline)
            task.add_done_callback(_LATE.discard)
    return results


def _give_back_when_answered(
    asking: asyncio.Future[dict[int, ShardResult]], give_back: Callable[[list[Lease]], Awaitable[None]]
) -> None:
    """The caller gave up on `asking` (cancelled): its requests go on to their own deadline, and
    every lease their replies grant goes to `give_back` (nobody holds a hit for them)."""

    def answered(done: asyncio.Future[dict[int, ShardResult]]) -> None:
        _LATE.discard(done)
        if done.cancelled() or done.exception() is not None:
            return
        leases = [
            (shard, reply.lease_id)
            for shard, reply in done.result().items()
            if isinstance(reply, m.LookupReply) and reply.lease_id
        ]
        if leases:
            late = asyncio.ensure_future(give_back(leases))
            _LATE.add(late)
            late.add_done_callback(_LATE.discard)

    _LATE.add(asking)
    asking.add_done_callback(answered)


def merge_lookups(
    chunks: int, positions: Mapping[int, Sequence[int]], results: Mapping[int, ShardResult]
) -> tuple[PrefixHit, list[Lease]]:
    """Fold the shards' answers (`positions`: shard -> the indexes of its chunks in the prefix,
    ascending; `results`: shard -> its reply or error) into (the hit, the leases it does not
    need) by the rules in the module docstring."""
    hit_chunks = chunks
    objects: list[m.ObjectLocation] = []
    granted: list[tuple[int, int, int]] = []  # (shard, lease id, expires_ms)
    failure: BaseException | None = None
    for shard, indexes in positions.items():
        reply = results[shard]
        if not isinstance(reply, m.LookupReply):
            if failure is None:
                failure = (
                    reply
                    if isinstance(reply, BaseException)
                    else KvfError(f"unexpected lookup reply {type(reply).__name__}")
                )
            hit_chunks = min(hit_chunks, indexes[0])
            continue
        if reply.hit_chunks < len(indexes):
            hit_chunks = min(hit_chunks, indexes[reply.hit_chunks])
        objects.extend(reply.objects)
        if reply.lease_id:
            granted.append((shard, reply.lease_id, reply.lease_expires_ms))
    kept: list[Lease] = []
    unneeded: list[Lease] = []
    expires = 0
    for shard, lease_id, lease_expires in granted:
        if positions[shard][0] < hit_chunks:
            kept.append((shard, lease_id))
            expires = lease_expires if not expires else min(expires, lease_expires)
        else:
            unneeded.append((shard, lease_id))
    return PrefixHit(hit_chunks, objects, kept, expires, failure), unneeded


async def lookup_prefix(
    router: DirectoryRouter,
    groups: Sequence[GroupId],
    *,
    holder_id: str,
    members: Sequence[m.Member],
    lease_ttl_ms: int,
    timeout_s: float,
    trace_id: str,
    refused: set[str],
    give_back: Callable[[list[Lease]], Awaitable[None]],
    count_hits: bool = True,
    budget_s: float | None = None,
) -> PrefixHit:
    """Look up a prefix (`groups`: its chunk group ids, in order) on every shard holding some of
    it, one request per leading instance (`lookup_by_instance`), and merge the answers
    (`merge_lookups`). The leases not needed go to `give_back` (the caller's way of releasing
    them) before this returns; when nothing hit and a shard failed, every lease does and the
    first failure is raised. `BadRequest` for a group that is no chunk group id; the router's
    error when the shard map is unknown. `count_hits` False: no engine reads what this finds
    (`Lookup.count_hits`). `budget_s`: a shard not answered by then counts as failed
    (`lookup_by_instance`), so a caller with its own deadline keeps the shards that did."""
    await router.known_shards()
    positions: dict[int, list[int]] = {}
    for index, raw in enumerate(groups):
        try:
            shard = router.shard_of(raw)
        except BadRequest as exc:  # not a chunk group id: the caller's mistake
            raise BadRequest(f"a lookup names chunk group ids: {exc.message}") from None
        positions.setdefault(shard, []).append(index)
    lookups = {
        shard: m.Lookup(
            holder_id=holder_id,
            groups=[groups[i] for i in indexes],
            members=list(members),
            lease_ttl_ms=lease_ttl_ms,
            count_hits=count_hits,
        )
        for shard, indexes in positions.items()
    }
    asking = asyncio.ensure_future(
        lookup_by_instance(
            router,
            lookups,
            timeout_s=timeout_s,
            trace_id=trace_id,
            refused=refused,
            budget_s=budget_s,
            give_back_late=give_back,
        )
    )
    try:
        results = await asyncio.shield(asking)
    except asyncio.CancelledError:
        _give_back_when_answered(asking, give_back)
        raise
    hit, unneeded = merge_lookups(len(groups), positions, results)
    if hit.failure is not None and hit.hit_chunks == 0:
        await give_back(unneeded + hit.leases)
        raise hit.failure
    if unneeded:
        await give_back(unneeded)
    return hit
