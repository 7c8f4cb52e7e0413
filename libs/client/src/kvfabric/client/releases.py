"""Giving read leases back: batched per shard and per instance, bounded, `busy` retried with a
budget (issue 20).

The directory never refuses a release for load: releases run in in-flight slots of their own, a
quarter of them per tenant (16 by default), and cost no rate token (docs/directory.md). A client
still keeps well below that share, so that a few engines of one tenant closing at once fit:

- **Batches.** One request gives back up to `RELEASE_BATCH_LEASES_MAX` (64) leases of one shard
  (`LeaseRelease.lease_ids`): a client closing with 1,000 leases sends about 16 requests.
- **Bound.** At most `RELEASES_CONCURRENT_MAX` release requests of one client are in flight (the
  caller passes one semaphore per client); the rest wait for a slot (never more than the leases
  held, which the directory bounds).
- **Busy.** A `busy` answer (the tenant's share is full: many engines closing, or a flood) is
  retried after a jittered backoff, `RELEASE_BUSY_WAIT_MS_MIN` doubling up to `_MAX`, at most
  `RELEASE_ATTEMPTS_MAX` attempts, holding the request's slot meanwhile (so the client as a whole
  slows down). Any other failure, or the budget spent, gives up: the lease expires at the
  directory after its TTL. Nothing here raises into the engine.
- **Per instance.** With `instance_of` and `ask_many`, the batches of shards one directory
  instance leads go to it in one `lease_release_many` (at most `RELEASE_MANY_LEASES_MAX` leases,
  one part per shard): a hit over 8 shards of one instance costs one request, not 8. A part that
  fails is asked again alone (its shard's request re-routes); an instance without the verb
  (`no responders`, and still leading once its shards answered alone) is put in `refused` and
  asked shard by shard from then on.
- **Older directories** ignore `lease_ids` and answer `not_found` for lease 0: the batch is then
  released one lease at a time. A single lease answered `not_found` is already gone (released or
  expired): done.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Final, TypeAlias

from kvfabric.client.busy import BUSY_WAIT_MS_MAX, BUSY_WAIT_MS_MIN, retry_busy
from kvfabric.format.errors import KvfError, NotFound, Unavailable
from kvfabric.proto import directory as m

__all__ = [
    "RELEASES_CONCURRENT_MAX",
    "RELEASE_ATTEMPTS_MAX",
    "RELEASE_BUSY_WAIT_MS_MAX",
    "RELEASE_BUSY_WAIT_MS_MIN",
    "Ask",
    "AskMany",
    "give_back",
    "release_batches",
]

RELEASES_CONCURRENT_MAX: Final = 4  # release requests of one client in flight (tenant share: 16)
RELEASE_ATTEMPTS_MAX: Final = 6  # per request, when answered `busy`
RELEASE_BUSY_WAIT_MS_MIN: Final = BUSY_WAIT_MS_MIN
RELEASE_BUSY_WAIT_MS_MAX: Final = BUSY_WAIT_MS_MAX  # 20, 40, 80, 160, 320 ms (+0-50 %): under 1 s

# (verb, message, timeout_s, trace_id, shard) -> reply: `AsyncKvClient._ask_directory`.
Ask: TypeAlias = Callable[[str, m.DirectoryRequest, float, str, int], Awaitable[m.DirectoryReply]]
# (instance, message, timeout_s, trace_id) -> reply: one `lease_release_many` to that instance.
AskMany: TypeAlias = Callable[[str, m.LeaseReleaseMany, float, str], Awaitable[m.DirectoryReply]]
Sleep: TypeAlias = Callable[[float], Awaitable[None]]


def release_batches(leases: Sequence[tuple[int, int]]) -> list[tuple[int, list[int]]]:
    """(shard, lease ids) per request: by shard in first-seen order, each shard's ids in order,
    at most `RELEASE_BATCH_LEASES_MAX` a request."""
    by_shard: dict[int, list[int]] = {}
    for shard, lease_id in leases:
        by_shard.setdefault(shard, []).append(lease_id)
    size = m.RELEASE_BATCH_LEASES_MAX
    return [(shard, ids[i : i + size]) for shard, ids in by_shard.items() for i in range(0, len(ids), size)]


async def give_back(
    ask: Ask,
    holder_id: str,
    leases: Sequence[tuple[int, int]],
    *,
    gate: asyncio.Semaphore,
    timeout_s: float,
    trace_id: str = "",
    sleep: Sleep = asyncio.sleep,
    instance_of: Callable[[int], str | None] | None = None,
    ask_many: AskMany | None = None,
    refused: set[str] | None = None,
) -> int:
    """Release `leases` ((shard, lease id)) of `holder_id` (see the module docstring); `gate`
    bounds the requests in flight. Returns how many leases were not given back (they expire)."""

    async def one(shard: int, lease_ids: list[int]) -> int:
        async with gate:
            return await _release(ask, holder_id, shard, lease_ids, timeout_s, trace_id, sleep)

    async def many(instance: str, batches: list[tuple[int, list[int]]]) -> int:
        assert ask_many is not None and refused is not None
        parts = [m.ReleasePart(shard=shard, lease_ids=ids) for shard, ids in batches]
        message = m.LeaseReleaseMany(holder_id=holder_id, parts=parts)
        again = batches
        no_verb = False
        async with gate:
            try:
                reply = await retry_busy(
                    lambda: ask_many(instance, message, timeout_s, trace_id),
                    attempts_max=RELEASE_ATTEMPTS_MAX,
                    sleep=sleep,
                )
            except Unavailable as err:
                no_verb = "no responders" in err.message
                reply = None
            except KvfError:
                return sum(len(ids) for _, ids in batches)  # e.g. a timeout: they expire
            if isinstance(reply, m.LeaseReleaseManyReply):
                failed = {part.shard for part in reply.parts if part.error}
                answered = {part.shard for part in reply.parts}
                again = [(s, ids) for s, ids in batches if s in failed or s not in answered]
        left = sum(await asyncio.gather(*(one(shard, ids) for shard, ids in again)))
        # Shard by shard from now on only if the instance still leads once those answered (a
        # directory without the verb); one restarting or gone is asked in batches again
        # (review, 2026-12-05: a failover turned batching off for the process's life).
        if no_verb and instance_of is not None and any(instance_of(s) == instance for s, _ in batches):
            refused.add(instance)
        return left

    alone: list[tuple[int, list[int]]] = []
    by_instance: dict[str, list[list[tuple[int, list[int]]]]] = {}
    for shard, ids in release_batches(leases):
        instance = instance_of(shard) if instance_of is not None and ask_many is not None else None
        if instance is None or refused is None or instance in refused:
            alone.append((shard, ids))
            continue
        requests = by_instance.setdefault(instance, [])
        for request in requests:  # the first request of the instance with room and no part of shard
            room = sum(len(i) for _, i in request) + len(ids) <= m.RELEASE_MANY_LEASES_MAX
            if room and all(s != shard for s, _ in request):
                request.append((shard, ids))
                break
        else:
            requests.append([(shard, ids)])
    calls = [one(shard, ids) for shard, ids in alone]
    for instance, requests in by_instance.items():
        for request in requests:
            calls.append(many(instance, request) if len(request) > 1 else one(*request[0]))
    return sum(await asyncio.gather(*calls))


async def _release(
    ask: Ask, holder_id: str, shard: int, lease_ids: list[int], timeout_s: float, trace_id: str, sleep: Sleep
) -> int:
    """One request for `lease_ids` (one shard); the number not given back."""
    if len(lease_ids) == 1:
        single = m.LeaseRelease(holder_id=holder_id, lease_id=lease_ids[0], shard=shard)
        return 0 if await _ask_single(ask, single, timeout_s, trace_id, sleep) else 1
    batch = m.LeaseRelease(holder_id=holder_id, lease_id=0, lease_ids=lease_ids, shard=shard)
    try:
        await _ask_busy_retried(ask, batch, timeout_s, trace_id, sleep)
    except NotFound:  # a directory from before batches: it saw only lease 0
        left = 0
        for lease_id in lease_ids:
            single = m.LeaseRelease(holder_id=holder_id, lease_id=lease_id, shard=shard)
            left += not await _ask_single(ask, single, timeout_s, trace_id, sleep)
        return left
    except KvfError:
        return len(lease_ids)
    return 0


async def _ask_single(
    ask: Ask, message: m.LeaseRelease, timeout_s: float, trace_id: str, sleep: Sleep
) -> bool:
    """Whether the lease is gone now (released, or `not_found`: released or expired before)."""
    try:
        await _ask_busy_retried(ask, message, timeout_s, trace_id, sleep)
    except NotFound:
        return True
    except KvfError:
        return False
    return True


async def _ask_busy_retried(
    ask: Ask, message: m.LeaseRelease, timeout_s: float, trace_id: str, sleep: Sleep
) -> m.DirectoryReply:
    return await retry_busy(
        lambda: ask("lease_release", message, timeout_s, trace_id, message.shard),
        attempts_max=RELEASE_ATTEMPTS_MAX,
        sleep=sleep,
    )
