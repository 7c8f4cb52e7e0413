"""Requests by shard: the one shard a keyed request is for, and a multi-shard request
(`lookup_many`, `lease_release_many`) checked whole, then run as its per-shard parts.

All keys of one request must share a shard (`shard_of_request`; a request that names no key
says its `shard`). `lookup_many` carries one prefix's lookups for several shards led by one
instance, `lease_release_many` one hit's leases: each part runs exactly as that shard's
single request (`Lookup`, batched `LeaseRelease`: authorized, charged, leased, fenced by its
epoch) through the host's `PartRunner`, and fails on its own. A lookup part's hit is cut short
where the whole reply would no longer fit (`kvfabric.directory.reply_room`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Final

import msgspec

from kvfabric.core import authz
from kvfabric.core.directory import LIST_SCAN_GROUPS_MAX
from kvfabric.directory.reply_room import ManyReplyRoom, part_error
from kvfabric.format.errors import BadRequest, BatchTooLarge, KvfError, Unavailable
from kvfabric.proto import directory as m
from kvfabric.proto.shards import shard_of

# Between two parts of a `lookup_many` / `lease_release_many`, the loop is yielded this many
# times (as between a lookup's slices, `kvfabric.directory.shell.LOOKUP_SLICE_YIELDS`): a part of
# up to 128 groups is one core call, and 16 of them back to back held the loop for ~70 ms while
# every other tenant's request waited (review, 2026-12-05).
PART_YIELDS: Final = 8


async def _between_parts() -> None:
    for _ in range(PART_YIELDS):
        await asyncio.sleep(0)


__all__ = [
    "PartRunner",
    "check_lookup_many",
    "check_release_many",
    "keys_of",
    "lookup_many",
    "release_many",
    "reply_extra_ids",
    "shard_of_request",
]

# Runs one part on its shard: (request, verb, the tenant's grant or None for a service, shard,
# reply_bytes_max or None) -> that shard's reply.
PartRunner = Callable[
    [msgspec.Struct, str, "authz.TenantGrant | None", int, "int | None"], Awaitable[msgspec.Struct]
]


def keys_of(message: msgspec.Struct) -> list[bytes]:
    """The keys a request names (empty when it names none: it says its `shard`)."""
    if isinstance(message, m.PutBegin):
        return [o.key for o in message.objects]
    if isinstance(message, m.PutCommit | m.PutAbort):
        return list(message.keys)
    if isinstance(message, m.ConfirmReplicas):
        return [c.key for c in message.confirms]
    if isinstance(message, m.Lookup | m.Pin | m.Evict):
        return list(message.groups)
    if isinstance(message, m.SlotsFreed):
        return [f.key for f in message.freed]
    if isinstance(message, m.ReplicateBegin | m.ReplicaCorrupt):
        return [message.key]
    if isinstance(message, m.ReplicateBeginMany | m.ReplicaCorruptMany):
        return [item.key for item in message.items]
    if isinstance(message, m.ShowGroup):
        return [message.group]
    return []


def fair_ids(message: msgspec.Struct) -> int:
    """The ids a tenant request costs at fair admission (beside its fixed cost): those it names;
    a listing, the groups it may examine (its `limit`, or for a `below_target` one the scan
    bound, at most `LIST_SCAN_GROUPS_MAX`). A listing was charged as naming none, while one call
    examined up to 1,000 groups, ~60x cheaper per CPU ms than a lookup (review, 2026-12-05)."""
    if isinstance(message, m.ListGroups):
        return min(
            LIST_SCAN_GROUPS_MAX, LIST_SCAN_GROUPS_MAX if message.below_target else max(0, message.limit)
        )
    return len(keys_of(message))


def reply_extra_ids(message: msgspec.Struct, reply: msgspec.Struct) -> int:
    """Ids a tenant's answered request costs beyond `fair_ids`: a lookup's replicas answered past
    one per group named. A group of 255 members x 3 replicas costs ~1.9 ms of core work and
    signing (a read token per replica) and a 110 KB reply, where a one-member group costs
    0.02 ms, both charged one id (review, 2026-12-06). A long lookup's objects arrive encoded
    (`msgspec.Raw`, `DirectoryShell._lookup_in_slices`): each counts as one (its members are
    charged, its replicas, at most `replicas_max`, are not: decoding them back would cost more
    than they do)."""
    if isinstance(reply, m.LookupReply):
        answered = _replicas_answered(reply)
    elif isinstance(reply, m.LookupManyReply):
        answered = sum(_replicas_answered(p.reply) for p in reply.parts if p.reply is not None)
    else:
        return 0
    if isinstance(message, m.LookupMany):
        named = sum(len(p.groups) for p in message.parts)
    else:
        named = fair_ids(message)
    return max(0, answered - named)


def _replicas_answered(reply: m.LookupReply) -> int:
    return sum(len(o.replicas) if isinstance(o, m.ObjectLocation) else 1 for o in reply.objects)


def shard_of_request(message: msgspec.Struct, shards: int) -> int:
    """The one shard a keyed request is for (`shard` field when it names no key)."""
    explicit = getattr(message, "shard", None)
    if explicit is not None:
        if not 0 <= explicit < shards:
            raise BadRequest(f"shard must be in 0..{shards - 1}", shard=explicit)
        return int(explicit)
    keys = keys_of(message)
    if not keys:
        return 0
    try:
        found = {shard_of(k, shards) for k in keys}
    except ValueError as exc:
        raise BadRequest(f"malformed key: {exc}") from None
    if len(found) != 1:  # a caller bug, not a stale map: not retryable
        raise BadRequest("a request must name keys of one shard", shards=sorted(found)[:8])
    return found.pop()


def check_lookup_many(message: m.LookupMany) -> None:
    """The bounds of a `LookupMany` (before any part runs): `batch_too_large`, `bad_request`."""
    groups = sum(len(part.groups) for part in message.parts)
    if len(message.parts) > m.LOOKUP_MANY_PARTS_MAX or groups > m.LOOKUP_BATCH_GROUPS_MAX:
        raise BatchTooLarge(
            "lookup_many is over its limits",
            parts=len(message.parts),
            parts_max=m.LOOKUP_MANY_PARTS_MAX,
            groups=groups,
            groups_max=m.LOOKUP_BATCH_GROUPS_MAX,
        )
    shards = [part.shard for part in message.parts]
    if len(set(shards)) != len(shards):
        raise BadRequest("lookup_many names a shard twice")
    if any(not part.groups for part in message.parts):
        raise BadRequest("a lookup part names no group")


def check_release_many(message: m.LeaseReleaseMany) -> None:
    """The bounds of a `LeaseReleaseMany` (before any part runs): `batch_too_large`, `bad_request`."""
    leases = sum(len(part.lease_ids) for part in message.parts)
    if leases > m.RELEASE_MANY_LEASES_MAX or any(
        len(p.lease_ids) > m.RELEASE_BATCH_LEASES_MAX for p in message.parts
    ):
        raise BatchTooLarge(
            "lease_release_many is over its limits",
            leases=leases,
            leases_max=m.RELEASE_MANY_LEASES_MAX,
            part_leases_max=m.RELEASE_BATCH_LEASES_MAX,
        )
    shards = [part.shard for part in message.parts]
    if len(set(shards)) != len(shards):
        raise BadRequest("lease_release_many names a shard twice")
    if any(not part.lease_ids for part in message.parts):
        raise BadRequest("a release part names no lease")


async def release_many(
    message: m.LeaseReleaseMany, grant: authz.TenantGrant | None, part: PartRunner
) -> m.LeaseReleaseManyReply:
    """Each part exactly as the batched `LeaseRelease` of its shard; a part's failure is its own."""
    check_release_many(message)
    replies: list[m.ReleasePartReply] = []
    for n, each in enumerate(message.parts):
        if n:
            await _between_parts()
        release = m.LeaseRelease(
            holder_id=message.holder_id,
            lease_id=0,
            lease_ids=each.lease_ids,
            shard=each.shard,
            epoch=each.epoch,
        )
        try:
            reply = await part(release, "lease_release", grant, each.shard, None)
        except KvfError as err:
            replies.append(m.ReleasePartReply(shard=each.shard, error=err.code, message=err.message))
            continue
        if not isinstance(reply, m.LeaseReply):
            raise Unavailable(f"unexpected lease_release reply {type(reply).__name__}")
        replies.append(m.ReleasePartReply(shard=each.shard, released=reply.released))
    return m.LeaseReleaseManyReply(parts=replies)


async def lookup_many(
    message: m.LookupMany, grant: authz.TenantGrant | None, part: PartRunner
) -> m.LookupManyReply:
    """Each part exactly as the `Lookup` of its shard (authorized and charged per shard for a
    tenant), one after another on this loop, yielding it between parts (`PART_YIELDS`); a
    part's failure is its own (`LookupPartReply`).
    Each part's hit is cut short where the whole reply would no longer fit (`reply_room`)."""
    check_lookup_many(message)
    replies: list[m.LookupPartReply] = []
    room = ManyReplyRoom(len(message.parts))
    for n, each in enumerate(message.parts):
        if n:
            await _between_parts()
        lookup = m.Lookup(
            holder_id=message.holder_id,
            groups=each.groups,
            members=message.members,
            lease_ttl_ms=message.lease_ttl_ms,
            epoch=each.epoch,
            count_hits=message.count_hits,
        )
        try:
            reply = await part(lookup, "lookup", grant, each.shard, room.for_part())
        except KvfError as err:
            answer = part_error(each.shard, err)
        else:
            if not isinstance(reply, m.LookupReply):
                raise Unavailable(f"unexpected lookup reply {type(reply).__name__}")
            answer = m.LookupPartReply(shard=each.shard, reply=reply)
        room.took(answer)
        replies.append(answer)
    return m.LookupManyReply(parts=replies)
