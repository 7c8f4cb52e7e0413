"""One prefix's lookup, sent as few directory requests as the shard map allows.

A prefix's chunk groups hash to many shards (8 chunks over 16 shards: up to 8). One request per
shard costs each of them a NATS round trip and the directory's per-request work, concurrently
on the same instance. So the shards an instance leads go to it in one `lookup_many` request;
each part is answered as that shard's `lookup` would be (authorized, leased, fenced by its
epoch), and a part that fails for a routing reason (`wrong_shard`, `unavailable`: the map moved)
is asked again alone through `DirectoryRouter.ask`, which refreshes the map. A shard alone on
its instance is asked alone. An instance that has no `lookup_many` endpoint (an older
directory: `no responders`) is remembered in `refused` and asked shard by shard from then on.

Pure routing, no state of its own: the caller (`AsyncKvClient._lookup_shards`) folds the hit,
keeps or gives back the leases. Leases granted by a part whose reply never arrives (a timeout)
expire at the directory, as for a single lookup.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Final

from kvfabric.format.errors import KvfError, Unavailable, error_from_wire
from kvfabric.proto import directory as m
from kvfabric.proto.common import TRACE_ID_HEADER
from kvfabric.runtime.directory_router import DirectoryRouter

__all__ = ["LOOKUP_MANY_VERB", "RELEASE_MANY_VERB", "ShardResult", "lookup_by_instance"]

LOOKUP_MANY_VERB: Final = "lookup_many"
RELEASE_MANY_VERB: Final = "lease_release_many"  # the hit's leases, given back the same way

ShardResult = m.DirectoryReply | BaseException  # a shard's reply, or why it has none


async def lookup_by_instance(
    router: DirectoryRouter,
    lookups: Mapping[int, m.Lookup],
    *,
    timeout_s: float,
    trace_id: str,
    refused: set[str],
) -> dict[int, ShardResult]:
    """Every shard's lookup (`lookups`: shard -> its `Lookup`, all of one holder, members and
    ttl), batched per leading instance; shard -> its reply or its error (never raises)."""
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
            holder_id=first.holder_id, parts=parts, members=first.members, lease_ttl_ms=first.lease_ttl_ms
        )
        try:
            reply = await router.ask_instance(instance, LOOKUP_MANY_VERB, message, timeout_s, headers=headers)
        except Unavailable as err:
            if "no responders" in err.message:
                refused.add(instance)  # a directory without `lookup_many`: shard by shard from now on
            return await singles(shards)
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
                if isinstance(error, Unavailable):  # wrong_shard, stopping: the map moved
                    again.append(shard)
                else:
                    out[shard] = error
        out.update(await singles(again))
        return out

    results: dict[int, ShardResult] = {}
    for part in await asyncio.gather(singles(alone), *(many(i, ss) for i, ss in by_instance.items())):
        results.update(part)
    return results
