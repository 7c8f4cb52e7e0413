"""A tenant's give-back (lease release, unpin, put abort, `lease_release_many`) as the host runs it.

A give-back never waits for a turn at `fair` and is never refused for load; the ids of it that
released nothing (the core's reply counts what was released) are charged to the tenant's
give-back budget (`FairGate.giveback`, which goes into debt). A tenant that spent it has its
next give-back run in slices of `GIVEBACK_SLICE_IDS` ids (one part of a `lease_release_many`):
when the first released nothing the request is `busy` (what it named later untouched);
otherwise the next slices run, one after another, until one releases nothing: the rest is not
run (an abort's other keys expire at their deadline; a `lease_release_many`'s parts not run are
absent from its reply, and its client releases them shard by shard). Before (review,
2026-12-05), the rest ran whole once the first slice released anything: one real key in front
of 4,031 empty ones passed the budget every time, at no charge past its floor. After a `busy`,
the tenant's give-backs are `busy` before they are decoded until a token has refilled
(`FairGate.giveback_refuse_early`, asked by `kvfabric.directory.shard_host`). So a give-back of
a tenant that gives back is never refused, and a flood of give-backs naming nothing costs, once
the budget is spent, a receive a request and one decoded slice per token refilled, and a
give-back that releases something costs at most one slice more than what it released.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Final, TypeVar

import msgspec

from kvfabric.directory.fair import FairGate
from kvfabric.format.errors import KvfError, NotFound, Unavailable
from kvfabric.proto import directory as m

__all__ = [
    "GIVEBACK_SLICE_IDS",
    "give_back",
    "giveback_ids",
    "giveback_merged",
    "giveback_released",
    "giveback_slices",
]

# A give-back of a tenant that spent its give-back budget: ids run before the rest (one batched
# lease release's worth); the rest only when these released something.
GIVEBACK_SLICE_IDS: Final = m.RELEASE_BATCH_LEASES_MAX

M = TypeVar("M", bound=msgspec.Struct)
# Runs one (part of a) give-back on its shard: request -> the core's reply.
Run = Callable[[M], Awaitable[msgspec.Struct]]


def giveback_ids(message: msgspec.Struct) -> int:
    """The ids a give-back names (at least 1: an empty one still cost a request)."""
    if isinstance(message, m.PutAbort):
        ids = len(message.keys)
    elif isinstance(message, m.LeaseRelease):
        ids = len(message.lease_ids)
    elif isinstance(message, m.LeaseReleaseMany):
        ids = sum(len(p.lease_ids) for p in message.parts)
    else:
        ids = 1
    return max(1, ids)


def giveback_released(reply: msgspec.Struct) -> int:
    """How many ids a give-back's reply says it released (aborted, ended)."""
    if isinstance(reply, m.PutAbortReply):
        return reply.aborted
    if isinstance(reply, m.LeaseReply):  # a batch lists what it released; a single one ended
        return len(reply.released) if reply.lease_id == 0 else 1
    if isinstance(reply, m.LeaseReleaseManyReply):
        return sum(len(p.released) for p in reply.parts)
    if isinstance(reply, m.PinReply):  # unpin: the pin ended
        return 1
    return 0


def giveback_slices(message: M) -> tuple[M, M | None]:
    """A give-back as its first `GIVEBACK_SLICE_IDS` ids (one part of a `lease_release_many`)
    and the rest (None when there is none)."""
    if isinstance(message, m.PutAbort) and len(message.keys) > GIVEBACK_SLICE_IDS:
        keys = message.keys
        return (
            msgspec.structs.replace(message, keys=keys[:GIVEBACK_SLICE_IDS]),
            msgspec.structs.replace(message, keys=keys[GIVEBACK_SLICE_IDS:]),
        )
    if isinstance(message, m.LeaseReleaseMany) and len(message.parts) > 1:
        parts = message.parts
        return msgspec.structs.replace(message, parts=parts[:1]), msgspec.structs.replace(
            message, parts=parts[1:]
        )
    return message, None


def giveback_merged(first: msgspec.Struct, rest: msgspec.Struct) -> msgspec.Struct:
    """The reply to a give-back run as `giveback_slices`."""
    if isinstance(first, m.PutAbortReply) and isinstance(rest, m.PutAbortReply):
        return msgspec.structs.replace(rest, aborted=first.aborted + rest.aborted)
    if isinstance(first, m.LeaseReleaseManyReply) and isinstance(rest, m.LeaseReleaseManyReply):
        return msgspec.structs.replace(rest, parts=[*first.parts, *rest.parts])
    raise Unavailable(f"unexpected give-back replies {type(first).__name__}, {type(rest).__name__}")


async def give_back(gate: FairGate | None, tenant: str, message: M, run: Run[M]) -> msgspec.Struct:
    """A tenant's give-back, never refused for load: charged only for the ids that released
    nothing; once the tenant's budget of those is spent, one slice first (module docstring).
    `gate` None: run at once (in-process tests)."""
    if gate is None:
        return await run(message)
    if not gate.giveback_spent(tenant):
        return await _charged(gate, tenant, message, run, spent=False)
    first, rest = giveback_slices(message)
    reply = await _charged(gate, tenant, first, run, spent=True)
    while rest is not None:  # slice by slice, until one releases nothing
        part, rest = giveback_slices(rest)
        part_reply = await _charged(gate, tenant, part, run, spent=False)
        reply = giveback_merged(reply, part_reply)
        if giveback_released(part_reply) == 0:
            break
    return reply


async def _charged(gate: FairGate, tenant: str, message: M, run: Run[M], *, spent: bool) -> msgspec.Struct:
    """`run(message)`, its ids that released nothing charged; when `spent`, `busy` instead
    of a reply that released nothing (a lease or pin not held: `not_found`, likewise)."""
    named = giveback_ids(message)
    try:
        reply = await run(message)
    except NotFound:
        gate.giveback_charge(tenant, named, 0)
        if spent:
            raise gate.giveback_busy(tenant) from None
        raise
    except KvfError:
        gate.giveback_charge(tenant, named, 0)
        raise
    released = giveback_released(reply)
    gate.giveback_charge(tenant, named, released)
    if spent and released == 0:
        raise gate.giveback_busy(tenant)
    if spent:
        gate.giveback_tried(tenant, released=True)
    return reply
